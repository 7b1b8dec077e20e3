"""``zero_compile``: the public entry point."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
import types
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch.fx import GraphModule
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

from .checkpoint import save_load as checkpoint
from .capture.step_graph import (CHECKPOINTED_META, CaptureError, capture_step_graph, fakes_like_dynamo,
                      has_dynamic_shapes)
from .capture.hints import capture_hint
from .analysis.collective_counter import CollectiveCounter
from .analysis.cost_model import Estimate, estimate, hardware_for
from .inspection.dump import GraphDump
from .inspection.explain import Compilation, Explanation, explain_graph
from .config import DEFAULT_PERSISTENCE_THRESHOLD, ZeroConfig, describe_backend
from .compiler.lower import lower
from .materialize import PretrainedWeights, materialize
from .passes import build_pipeline, run_pipeline
from .passes.predicates import LOSS_SCALE_META, grad_slots
from .plan import ShardPlan, plan_for_module
from .runtime.failures import failed_after_update, failed_before_update, is_communication_failure
from .runtime.gloo_all_gather import use_gloo_single_tensor_all_gather
from .runtime.process_group import check_devices_match_backend, current_world
from .runtime.rank_agreement import GraphSignature, RankAgreement, call_signature, graph_signature
from .runtime.precision import LossScaler, MixedPrecision, cast_at_model_edge
from .runtime.sharded_state import ShardedState
from .runtime.update import OptimizerUpdate
from .analysis.traffic import TrafficReport, traffic_report

log = logging.getLogger("zero_fx")

RECOMPILES_WARNED_AT = 4
"""The compilation of a step that logs a warning: shapes change more than a few times."""


def zero_compile(
    fn: Optional[Callable] = None,
    *,
    stage: int = 3,
    backend: Any = "inductor",
    model: Optional[torch.nn.Module] = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
    disable_passes: Sequence[str] = (),
    elementwise_optimizer: Optional[bool] = None,
    bucket_bytes: Optional[int] = None,
    prefetch: int = 1,
    pin_schedule: bool = True,
    memory_budget_bytes: Optional[int] = None,
    persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD,
    keep_resident: Optional[Callable[[str, torch.nn.Parameter], bool]] = None,
    passes: Sequence = (),
    dump_dir: Optional[str] = None,
    check_ranks: bool = True,
    mixed_precision: Optional[MixedPrecision] = None,
    accumulation_steps: int = 1,
    max_grad_norm: Optional[float] = None,
    init_fn: Optional[Callable[[torch.nn.Module], None]] = None,
    recompute: Any = None,
    activation_memory_budget: Optional[float] = None,
):
    """Compile a whole training step (forward, ``loss.backward()``, ``opt.step()``) with ZeRO.

    Use as ``@zero_compile`` or ``@zero_compile(stage=3, backend="aot_eager")``::

        @zero_compile(stage=3)
        def train_step(model, opt, x, y):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

    On the first call the model is sharded over the default process group (or
    a world of one if none is initialised) and the step is captured as one
    graph, rewritten with the stage's collectives, and compiled:

    - stage 0 keeps model and optimizer as they are and all-reduces gradients;
    - stages 1-2 keep whole parameters; the optimizer is rebound to flat 1/N
      slices; gradients are reduce-scattered (stage 1 at the end of backward,
      stage 2 as each is produced); the updated slices are all-gathered back
      into the parameters after the optimizer step;
    - stage 3 also frees the parameters' storage: each is all-gathered right
      before its forward use and again before its backward use.

    Args:
        stage: ZeRO stage: 0 = DDP (gradients all-reduced, nothing sharded),
            1 = optimizer states sharded, 2 = + gradients, 3 = + parameters.
        backend: "inductor" (default), "aot_eager", "eager", or a callable
            ``compiler(gm, example_inputs) -> callable`` for the rewritten graph.
        model, optimizer: name them when the step closes over them instead of
            taking them as arguments.
        disable_passes: names of zero_fx passes to skip, for debugging.
        elementwise_optimizer: declare that an optimizer zero_fx does not know
            updates each element independently.
        bucket_bytes: byte cap of one fused collective; None: the stage's
            default (25 MiB; 16 MiB in stage 3), 0: one per parameter.
        prefetch: buckets each all-gather is issued ahead of its use, and each
            reduction waited after its issue; 0: no overlap.
        pin_schedule: Inductor: hold its generated program to that schedule (control
            dependencies; ``explain()`` says whether it runs it). False lets
            Inductor re-sort collectives; for comparison only.
        memory_budget_bytes: stage 3: cap on gathered bytes alive at once.
        persistence_threshold, keep_resident: stage 3: parameters of at most
            this many elements (default 16384), or those ``keep_resident(name,
            param)`` picks, are gathered once per step and kept resident.
        passes: your own FX passes, run among ours: ``zero_fx.before("reduce_grads",
            fn)``, ``zero_fx.after("gather_params", fn)``, or a bare ``fn`` (after our
            rewrites, before ``check_invariants``). ``fn(gm) -> gm`` (or None after
            editing ``gm`` in place).
        dump_dir: write the graph before and after each pass (text, HTML), the
            memory plot and ``explain()`` there at each compilation; default: the
            ``ZERO_FX_DUMP`` environment variable, else no dumps.
        check_ranks: before each call's first collective, check that every rank
            is about to run the same graph (one 8-byte all-gather); a mismatch
            raises ``RanksDisagreeError`` naming the ranks instead of hanging.
        mixed_precision: ``zero_fx.MixedPrecision(param_dtype=torch.bfloat16)``: compute
            and all-gather in bf16, keep fp32 masters and optimizer state; float16
            adds dynamic loss scaling.
        accumulation_steps: calls per optimizer step: ``opt.step()`` takes effect on
            every K-th call, with the mean gradient of the K micro-batches.
        max_grad_norm: clip the gradient to this global norm before each optimizer
            step; ``step.last_grad_norm`` is the norm before clipping.
        init_fn: a model built on the meta device is initialized on the first call one
            module at a time, each rank keeping its shards; ``init_fn(module)`` is the
            model's own init after its modules are built (nanoGPT's ``self.apply(
            self._init_weights)``). README, "Models too big for one device".
        recompute: recompute forward values in the backward instead of keeping them:
            ``"blocks"`` keeps only each repeated block's input (activation
            checkpointing), ``"auto"`` keeps what fits ``activation_memory_budget``
            (a fraction of the activations, or bytes), a policy ``fn(node) -> "save" |
            "recompute"`` decides per op. Dropout replays its mask. README, "Activation
            recompute".

    Inspect a compiled step with ``step.explain()``, ``step.traffic()``,
    ``step.estimate()`` and ``step.graphs``; see the README, "Inspecting a
    compiled step".

    The step must call ``loss.backward()`` once, ``opt.step()`` once and
    ``opt.zero_grad()``; the optimizer steps after the compiled graph, on the
    shards. Returned tensors are detached (the backward has already run).
    Outside the step, stage 3's parameters hold no values: run the model in
    ``with step.gathered_parameters():``.
    """
    config = ZeroConfig(
        stage=stage,
        backend=backend,
        disable_passes=disable_passes,
        elementwise_optimizer=elementwise_optimizer,
        bucket_bytes=bucket_bytes,
        prefetch=prefetch,
        pin_schedule=pin_schedule,
        memory_budget_bytes=memory_budget_bytes,
        persistence_threshold=persistence_threshold,
        keep_resident=keep_resident,
        passes=passes,
        dump_dir=dump_dir,
        check_ranks=check_ranks,
        mixed_precision=mixed_precision,
        accumulation_steps=accumulation_steps,
        max_grad_norm=max_grad_norm,
        init_fn=init_fn,
        recompute=recompute,
        activation_memory_budget=activation_memory_budget,
    )

    def wrap(step_fn: Callable) -> "CompiledStep":
        return CompiledStep(step_fn, config, model=model, optimizer=optimizer)

    return wrap(fn) if fn is not None else wrap


class CompiledStep:
    """A training step compiled by ``zero_compile``. Call it like the original function."""

    def __init__(self, fn: Callable, config: ZeroConfig, *,
                 model: Optional[torch.nn.Module], optimizer: Optional[torch.optim.Optimizer]):
        functools.update_wrapper(self, fn)
        self.config = config
        self._fn = fn
        self._model = model
        self._optimizer = optimizer
        self.state: Optional[ShardedState] = None
        self.plan: Optional[ShardPlan] = None
        self._scaler: Optional[LossScaler] = None
        self._update: Optional[OptimizerUpdate] = None
        """Made with the state, on the first call."""
        self.graphs: list[GraphModule] = []
        """The rewritten graph of each compilation, for inspection."""
        self.compilations: list[Compilation] = []
        """Each compilation so far: its wall time and why it happened."""
        self._optimizer_calls: list[str] = []
        self._broken = ""
        """Why the step refuses calls (a failure left the state inconsistent); "" if it does not."""
        self._observers: list[TorchDispatchMode] = []
        # Dynamo caches compiled frames per code object: each compiled step gets
        # its own copy of `_traced_step`, or steps would share (and exhaust)
        # one cache and recompile whenever another step ran in between.
        traced = types.MethodType(_with_own_code(CompiledStep._traced_step), self)
        self._compiled = torch.compile(traced, backend=self._compile_graph,
                                       fullgraph=True, dynamic=False)

    # -- the call --------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        model, optimizer = self._find_model_and_optimizer(args, kwargs)
        if self.state is None:
            self._shard(model, optimizer)
        elif model is not self.state.model or optimizer is not self.state.optimizer:
            raise ValueError("this compiled step was first called with another model or optimizer; "
                             "decorate a separate function for each model")
        if self._broken:
            raise RuntimeError(self._broken)
        if self.state.gathered:
            raise RuntimeError("the step was called inside `with step.gathered_parameters():`; "
                               "train outside that block (it is for evaluation)")
        self.state.check_unchanged()
        self._optimizer_calls.clear()
        with _optimizer_calls_deferred(optimizer, self._record_step, self._record_zero_grad), \
                torch._dynamo.config.patch(trace_autograd_ops=True):
            try:
                out = self._compiled(*args, **kwargs)
            except torch._dynamo.exc.BackendCompilerFailed as err:
                # our own errors while compiling (bad input, a user pass) are the user's to read
                inner = getattr(err, "inner_exception", None)
                if isinstance(inner, (CaptureError, ValueError, TypeError)):
                    raise inner from None
                if capture_hint(str(inner)):
                    raise _capture_failed(inner) from err
                raise
            except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as err:
                raise _capture_failed(err) from err
            except RuntimeError as err:
                if is_communication_failure(err):
                    raise failed_before_update(self.plan.rank, err) from err
                raise
        self._run_deferred_optimizer_calls()
        return out

    def _traced_step(self, *args, **kwargs):
        out = self._fn(*args, **kwargs)
        # The backward has consumed the graph; what is returned is a value, not a node.
        return tree_map_only(torch.Tensor, torch.Tensor.detach, out)

    # Same function objects on every call, so dynamo's guards on them hold.
    def _record_step(self, *args, **kwargs):
        self._optimizer_calls.append("step")

    def _record_zero_grad(self, *args, **kwargs):
        self._optimizer_calls.append("zero_grad")

    def _run_deferred_optimizer_calls(self) -> None:
        calls = self._optimizer_calls
        if calls.count("step") != 1:
            raise CaptureError(
                f"the step called opt.step() {calls.count('step')} times; zero_fx needs exactly one"
            )
        if "zero_grad" not in calls:
            raise CaptureError(
                "the step never calls opt.zero_grad(); call it after opt.step() (to accumulate "
                "gradients over several calls, use zero_compile(accumulation_steps=K))"
            )
        with _entered(self._observers):
            try:
                ready = self._update.accumulate()
            except RuntimeError as err:
                if not is_communication_failure(err):
                    raise
                self._update.discard()
                raise failed_before_update(self.plan.rank, err) from err
            if not ready:
                return
            try:
                self._update.apply()
            except RuntimeError as err:
                if not is_communication_failure(err):
                    raise
                failure = failed_after_update(self.plan.rank, err)
                self._broken = str(failure)
                raise failure from err

    # -- first call: find, plan, shard ---------------------------------------
    def _find_model_and_optimizer(self, args, kwargs):
        leaves = tree_leaves((args, kwargs), is_leaf=lambda x: isinstance(
            x, (torch.nn.Module, torch.optim.Optimizer)))
        model = self._model if self._model is not None else _the_one(
            leaves, torch.nn.Module, "model", "model=")
        optimizer = self._optimizer if self._optimizer is not None else _the_one(
            leaves, torch.optim.Optimizer, "optimizer", "optimizer=")
        return model, optimizer

    def _shard(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               pretrained: Optional[PretrainedWeights] = None) -> None:
        world = current_world()
        check_devices_match_backend(model.parameters())
        # "gloo", or e.g. "cpu:gloo,cuda:nccl": [Note: gloo's coalesced all-gather corrupts the heap]
        if "gloo" in world.backend:
            use_gloo_single_tensor_all_gather()
        _claim(model, optimizer, self.__name__)
        self.plan = plan_for_module(model, world_size=world.size, rank=world.rank,
                                    stage=self.config.stage, group_name=world.group_name,
                                    **self.config.plan_options(hardware_for(model)))
        try:  # a meta model, or pretrained weights: this rank's values (the model is unchanged on error)
            masters = materialize(model, self.plan, init_fn=self.config.init_fn, pretrained=pretrained)
        except Exception:
            _claim(model, optimizer, None)
            raise
        self.state = ShardedState(model, optimizer, self.plan, world, masters=masters,
                                  elementwise_optimizer=self.config.elementwise_optimizer)
        precision = self.config.mixed_precision
        if precision is not None:
            cast_at_model_edge(model, precision)
        self._scaler = (LossScaler(precision, next(model.parameters()).device)
                        if precision is not None and precision.scales_loss else None)
        self._update = OptimizerUpdate(self.state,
                                       accumulation_steps=self.config.accumulation_steps,
                                       max_grad_norm=self.config.max_grad_norm, scaler=self._scaler)
        self._pipeline = build_pipeline(self.plan, disable=self.config.disable_passes,
                                        extra=self.config.passes)
        self._agreement = RankAgreement(
            world.size if self.config.check_ranks and not world.simulated else 1)
        if self.plan.replicated:
            log.info("zero_fx: stage 0 over %d rank(s): %d parameters, %d elements, replicated",
                     world.size, len(self.plan.params), self.plan.total_numel)
        else:
            log.info("zero_fx: stage %d over %d rank(s): %d parameters, %d elements "
                     "(%d padding), %d elements per rank", self.plan.stage, world.size,
                     len(self.plan.params), self.plan.total_numel, self.plan.padding_numel,
                     self.plan.shard_numel)

    # -- the dynamo backend ------------------------------------------------------
    def _compile_graph(self, dynamo_gm: GraphModule, example_inputs: list):
        start = time.perf_counter()
        reason = _recompile_reason() if self.compilations else "first call"
        if self.compilations:
            log.info("zero_fx: recompiling %s (compilation %d): %s", self.__name__,
                     len(self.compilations), reason)
        if len(self.compilations) + 1 == RECOMPILES_WARNED_AT:
            log.warning(
                "zero_fx: %s is compiling for the %dth time (this time: %s). Every new input shape "
                "compiles once (each takes seconds to minutes, and dynamo gives up at "
                "torch._dynamo.config.recompile_limit); pad or bucket batches to a few fixed "
                "shapes. step.explain() lists every compilation and its reason.",
                self.__name__, RECOMPILES_WARNED_AT, reason)
        names = [self.state.param_name(t) if isinstance(t, torch.Tensor) else None
                 for t in example_inputs]
        gm = capture_step_graph(dynamo_gm, example_inputs, names)
        dump = (GraphDump(self.config.dump_dir, self.__name__, self.plan.rank,
                          len(self.compilations), self.plan) if self.config.dump_dir else None)
        gm = run_pipeline(gm, self._pipeline_for(gm), observe=dump.observe if dump else None)
        dynamic = has_dynamic_shapes(dynamo_gm)
        extra_inputs = self._extra_inputs(gm)
        inputs = self.state.graph_inputs(names, example_inputs) + extra_inputs
        lowered = lower(gm, fakes_like_dynamo(inputs) if dynamic else inputs,
                        self.config.backend, dynamic=dynamic, pin_schedule=self.config.pin_schedule,
                        resident=self.plan.resident)
        if lowered.order.difference:
            log.warning("zero_fx: %s", lowered.order)
        signature = graph_signature(gm, self.plan) if self._agreement.group else None
        self.graphs.append(gm)
        self.compilations.append(Compilation(seconds=time.perf_counter() - start, reason=reason,
                                             order=lowered.order, memory=lowered.memory,
                                             program=lowered.program))
        log.info("zero_fx: compiled %s with %s in %.1f s", self.__name__,
                 describe_backend(self.config.backend), self.compilations[-1].seconds)
        if dump:
            dump.finish(self.explain())
        return _StepRunner(lowered.run, names, grad_slots(gm), self.state, self._observers,
                           self._agreement, signature, extra_inputs)

    def _pipeline_for(self, gm: GraphModule):
        """Our passes; with ``recompute="blocks"`` when the model checkpoints activations
        itself and the user chose no recompute ([Note: torch.utils.checkpoint in a captured
        step] in inline_checkpoints.py)."""
        if not gm.meta.get(CHECKPOINTED_META) or self.plan.recompute is not None:
            return self._pipeline
        log.info("zero_fx: the model checkpoints %d region(s) with torch.utils.checkpoint; "
                 "zero_fx recomputes them with recompute='blocks'", gm.meta[CHECKPOINTED_META])
        return build_pipeline(dataclasses.replace(self.plan, recompute="blocks"),
                              disable=self.config.disable_passes, extra=self.config.passes)

    def _extra_inputs(self, gm: GraphModule) -> list[torch.Tensor]:
        """The graph's inputs after the step's own: the loss scale, if ``scale_loss`` added it."""
        takes_scale = any(n.meta.get(LOSS_SCALE_META) for n in gm.graph.find_nodes(op="placeholder"))
        if self._scaler is not None and not takes_scale:
            raise CaptureError("fp16 loss scaling needs a scalar loss: call loss.backward() on a "
                               "0-dimensional loss, without gradient=")
        return [self._scaler.scale] if takes_scale else []

    @property
    def compile_seconds(self) -> list[float]:
        """Wall time of each compilation: capture, passes and lowering."""
        return [c.seconds for c in self.compilations]

    # -- inspection -------------------------------------------------------------
    @contextlib.contextmanager
    def observing(self, mode: TorchDispatchMode) -> Iterator[TorchDispatchMode]:
        """Run the step's tensor work (the compiled graph, then the optimizer) under ``mode``.

        Dynamo will not run compiled code under a Python dispatch mode, so a
        mode entered around the call would never see the graph; this enters it
        inside, around the graph and around the optimizer step. It sees what
        dispatches through Python: everything under aot_eager and eager; under
        Inductor, the collectives (fallback kernels) and the optimizer, but not
        the graph's fused kernels or the buffers its generated code allocates.
        """
        self._observers.append(mode)
        try:
            yield mode
        finally:
            self._observers.remove(mode)

    def counting_collectives(self) -> "contextlib.AbstractContextManager[CollectiveCounter]":
        """``with step.counting_collectives() as counted: step(...)``, then read ``counted.numel``.

        Counts under every backend, Inductor included (it calls collectives as
        fallback kernels, through the dispatcher)."""
        return self.observing(CollectiveCounter())

    def traffic(self) -> TrafficReport:
        """The collectives one call of the step issues (the latest compilation); print it for a table."""
        if not self.graphs:
            raise RuntimeError("the step has not been compiled yet; call it once first")
        return traffic_report(self.graphs[-1], self.plan)

    def estimate(self, hardware="cpu-gloo") -> Estimate:
        """The cost model's step time, exposed communication and peak memory for the latest
        compilation on ``hardware`` (a preset name in ``zero_fx.analysis.cost_model.PRESETS`` or a
        ``Hardware``); print it. See [Note: the cost model] in zero_fx/analysis/cost_model.py."""
        if not self.graphs:
            raise RuntimeError("the step has not been compiled yet; call it once first")
        return estimate(self.graphs[-1], self.plan, hardware)

    def explain(self, hardware="cpu-gloo") -> Explanation:
        """What zero_fx did to this step (latest compilation): the plan, every collective
        with where it is issued and waited, each gathered parameter's lifetime, the
        estimated memory over the step and what is alive at its peak, and the
        compilations so far with their reasons. Print it. Times: the cost model on
        ``hardware`` (a preset name or a ``Hardware``)."""
        if not self.graphs:
            raise RuntimeError("the step has not been compiled yet; call it once first")
        title = (f"zero_fx explain: {self.__name__}, stage {self.plan.stage} over "
                 f"{self.plan.world_size} rank(s) (this is rank {self.plan.rank}), backend "
                 f"{describe_backend(self.config.backend)}")
        return explain_graph(self.graphs[-1], self.plan, hardware=hardware, title=title,
                             compilations=self.compilations)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """A copy of the model's parameters as the optimizer holds them (fp32 masters under
        mixed precision), gathered from every rank (call on all ranks)."""
        return self._sharded_state().full_parameters()

    def gathered_parameters(self) -> "contextlib.AbstractContextManager[None]":
        """``with step.gathered_parameters(): model(x)``: run the model outside the step
        (evaluation, generation). In stage 3 the parameters are all-gathered (compute dtype)
        for the block and freed after it, changes discarded; enter it on every rank. Stages
        0-2 keep whole parameters and need nothing."""
        return self._sharded_state().gathered_parameters()

    def save_checkpoint(self, path: str, extra: Any = None) -> None:
        """Write a sharded checkpoint of the model, optimizer, counters, RNG state and
        ``extra`` (anything picklable: your step number, scheduler state) to the folder
        ``path``; every rank writes its part in parallel. A collective: call on every rank.
        Atomic: a crash during the save leaves the previous checkpoint (or none), never a
        half-written one that loads. See the README, "Checkpoints"."""
        state = self._sharded_state()
        if self._update.micro_step:
            raise RuntimeError(
                f"save_checkpoint after call {self._update.micro_step} of "
                f"{self.config.accumulation_steps} of an accumulation window: the summed gradients "
                "are not saved, so save right after an optimizer step")
        checkpoint.save(state, path, self._update.counters(), extra)

    def load_checkpoint(self, path: str, model: Optional[torch.nn.Module] = None,
                        optimizer: Optional[torch.optim.Optimizer] = None) -> Any:
        """Load a checkpoint written by ``save_checkpoint`` (at any world size and stage) and
        return its ``extra``. Before the step's first call, pass the model and optimizer to
        shard (the same objects the step is then called with). A collective."""
        if self.state is None:
            if model is None or optimizer is None:
                raise ValueError("load_checkpoint before the step's first call needs the model and "
                                 "optimizer to shard: step.load_checkpoint(path, model, optimizer)")
            self._shard(model, optimizer)
        elif (model is not None and model is not self.state.model) or (
                optimizer is not None and optimizer is not self.state.optimizer):
            raise ValueError("this compiled step already shards another model or optimizer")
        counters, extra = checkpoint.load(self.state, path)
        self._update.restore_counters(counters)
        return extra

    def full_state_dict(self, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
        """The model's whole ``state_dict()`` (fp32 masters, or ``dtype``; tied names;
        buffers) for plain PyTorch's ``model.load_state_dict``. A collective: call it on
        every rank (each gets the whole dict)."""
        return checkpoint.full_state_dict(self._sharded_state(), dtype)

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps taken so far (with ``accumulation_steps=K``, one per K calls;
        steps skipped for an fp16 overflow not counted)."""
        return self._update.optimizer_steps if self._update is not None else 0

    @property
    def last_grad_norm(self) -> Optional[torch.Tensor]:
        """The global gradient norm of the latest optimizer step, before clipping (a float32
        scalar, equal on all ranks); None unless ``max_grad_norm`` or loss scaling is set."""
        return self._update.last_grad_norm if self._update is not None else None

    @property
    def loss_scale(self) -> Optional[float]:
        """The current fp16 loss scale; None without loss scaling."""
        return self._scaler.scale.item() if self._scaler is not None else None

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because the fp16 gradients overflowed."""
        return self._scaler.skipped_steps if self._scaler is not None else 0

    def _sharded_state(self) -> ShardedState:
        if self.state is None:
            raise RuntimeError("the step has not run yet, so nothing is sharded")
        return self.state


class _StepRunner:
    """What dynamo calls: feeds shards for parameters, hands gradient shards to the state."""

    def __init__(self, compiled, param_names, slots, state: ShardedState, observers: list,
                 agreement: RankAgreement, signature: Optional[GraphSignature],
                 extra_inputs: list):
        self.compiled = compiled
        self.extra_inputs = extra_inputs
        """Inputs the graph takes after the step's own (the loss scale), read on every call."""
        self.agreement = agreement
        self.signature = signature
        """What the ranks compare before each call ([Note: checking that ranks agree]);
        None: no check."""
        self.param_names = param_names
        self.slots = slots
        self.state = state
        self.observers = observers
        """Dispatch modes to run the graph under (the CompiledStep's list, which it edits)."""

    def __call__(self, *args):
        inputs = self.state.graph_inputs(self.param_names, args) + self.extra_inputs
        if self.signature is not None:
            others = [a for a, name in zip(args, self.param_names) if name is None]
            self.agreement.check(call_signature(self.signature, others))
        with _entered(self.observers):
            outs = list(self.compiled(*inputs))
        for index, name in self.slots.items():
            if outs[index] is not None:
                self.state.receive_grad(name, outs[index])
            outs[index] = None  # dynamo assigns this to the full parameter's .grad
        return outs


def explain(step: "CompiledStep", hardware="cpu-gloo") -> Explanation:
    """``step.explain(hardware)``: what zero_fx did to a compiled step."""
    if not isinstance(step, CompiledStep):
        raise TypeError(f"explain takes a step decorated with @zero_compile, got "
                        f"{type(step).__name__}")
    return step.explain(hardware)


def _recompile_reason() -> str:
    """Why dynamo compiles again: the guard that failed, in dynamo's words."""
    try:  # dynamo records it in its (private) metrics context before calling the backend
        from torch._dynamo.utils import get_metrics_context

        reason = get_metrics_context()._metrics.get("recompile_reason")
    except (ImportError, AttributeError):
        reason = None
    return reason or "unknown (dynamo did not say; TORCH_LOGS=recompiles prints its guards)"


_OWNER_ATTRIBUTE = "_zero_fx_sharded_by"
"""Set on model parameters and optimizers once sharded: the name of the step that did it.
(An attribute, not a weak dictionary: looking a tensor up there compares tensors.)"""


def _claim(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step_name: Optional[str]) -> None:
    """One model and one optimizer belong to one compiled step: a second step would shard
    what is already sharded (in stage 3, parameters whose storage is gone). None: release them."""
    if step_name is None:
        for obj in (optimizer, *model.parameters()):
            obj.__dict__.pop(_OWNER_ATTRIBUTE, None)
        return
    for name, param in model.named_parameters():
        owner = getattr(param, _OWNER_ATTRIBUTE, None)
        if owner is not None:
            raise ValueError(
                f"parameter {name!r} is already sharded by the compiled step {owner!r}; a model "
                f"(and its optimizer) belong to one @zero_compile step: call that step, or build "
                f"a new model for {step_name!r}")
    owner = getattr(optimizer, _OWNER_ATTRIBUTE, None)
    if owner is not None:
        raise ValueError(f"this optimizer already steps on the shards of {owner!r}; give "
                         f"{step_name!r} its own optimizer over its own model")
    for param in model.parameters():
        setattr(param, _OWNER_ATTRIBUTE, step_name)
    setattr(optimizer, _OWNER_ATTRIBUTE, step_name)


def _with_own_code(fn):
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)


def _the_one(leaves, cls, what: str, keyword: str):
    found = [x for x in leaves if isinstance(x, cls)]
    unique = list({id(x): x for x in found}.values())
    if len(unique) == 1:
        return unique[0]
    if not unique:
        raise ValueError(f"no {what} among the step's arguments; pass it as an argument or name "
                         f"it with @zero_compile({keyword}...)")
    raise ValueError(f"{len(unique)} different {what}s among the step's arguments; name the one "
                     f"to shard with @zero_compile({keyword}...)")


@contextlib.contextmanager
def _entered(modes: list):
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        yield


@contextlib.contextmanager
def _optimizer_calls_deferred(optimizer, step, zero_grad):
    """Inside the traced step ``opt.step()`` and ``opt.zero_grad()`` only record that they ran."""
    saved = {k: optimizer.__dict__[k] for k in ("step", "zero_grad") if k in optimizer.__dict__}
    optimizer.step, optimizer.zero_grad = step, zero_grad
    try:
        yield
    finally:
        del optimizer.step, optimizer.zero_grad
        optimizer.__dict__.update(saved)


def _capture_failed(err: BaseException) -> CaptureError:
    """PyTorch could not capture the step as one graph: its message, and ours on what to do."""
    advice = capture_hint(str(err)) or "Move the unsupported code out of the decorated step."
    return CaptureError(f"zero_fx captures the whole step as one graph, and PyTorch could not: "
                        f"{_without_user_stack(str(err))}\n{advice}")


def _without_user_stack(message: str) -> str:
    """Dynamo's message up to its user stack and debugging tips (the traceback chained to
    the CaptureError shows the stack; the message keeps the cause and the line it names)."""
    kept = []
    for line in message.splitlines():
        if line.startswith(("User Stack", "For more information", "For extended logs",
                            "If you suspect", "For more debugging help")):
            break
        if line.strip():
            kept.append(line)
    return "\n".join(kept)
