"""``zero_compile``: the public entry point."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import inspect
import logging
import types
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Sequence, TypeVar, Union

import torch
from torch.fx import GraphModule
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from .analysis.collective_counter import CollectiveCounter
from .analysis.cost_model import Estimate, estimate
from .analysis.traffic import TrafficReport, traffic_report
from .capture import host_effects
from .capture.graph_breaks import GraphBreakWarning, break_error, graph_break_of
from .capture.hints import capture_failed, capture_hint
from .capture.routed_experts import (ExpertsRewrite, RoutedExperts,
                                     route_experts_with_fixed_shapes, unrecognised_experts_error)
from .capture.dynamic_shapes import ChangingSizes
from .capture.step_calls import trace_started
from .capture.step_graph import CaptureError
from .compat import hf_install_output_hooks
from .checkpoint import save_load as checkpoint
from .compiler.backend import Compilation, StepCompiler
from . import evaluation
from .config import (DEPRECATED_OPTIONS, DebugOptions, ZeroConfig, describe_backend,
                     old_names_in_errors, translate_deprecated)
from .config import DEFAULT_RESIDENT_MAX_NUMEL, BackendName, Compiler
from .policies import (FLAT_NAMES, MixedPrecision, OffloadPolicy, QuantizationPolicy,
                       RecomputePolicy, SchedulePolicy, flattened)
from .formatting import ranks_phrase
from .inspection.explain import Explanation, GraphBreakExplanation, explain_graph
from .materialize import PretrainedWeights
from .passes.check_invariants import InvariantError
from .plan import ShardPlan
from .runtime.deferred_optimizer import DeferredOptimizerCalls
from .runtime.eager_fallback import EagerFallback, why_not_eager
from .runtime.failures import is_communication_failure
from .runtime.sharded_state import ShardedState
from .runtime.sharding import Sharded, find_model_and_optimizer, shard


if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger("zero_fx")

_F = TypeVar("_F", bound=Callable)


def _called_as_written(declared: _F) -> _F:
    """``zero_compile`` with ``declared``'s signature, types and docstring (what editors, type
    checkers and ``help()`` show), given its keywords as the caller wrote them: an option
    given with its default value is still given ([Note: options given as keywords])."""
    signature = inspect.signature(declared)

    @functools.wraps(declared)
    def zero_compile(*args, **keywords):
        signature.bind(*args, **keywords)  # a TypeError for what the signature refuses
        return _zero_compile(*args, **keywords)

    return zero_compile  # type: ignore[return-value]


@_called_as_written
def zero_compile(
    fn: Optional[Callable] = None,
    *,
    config: Optional[ZeroConfig] = None,
    model: Optional[torch.nn.Module] = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
    stage: int = 3,
    backend: Union[BackendName, Compiler] = "inductor",
    regional: bool = True,
    dynamic_shapes: str = "auto",
    on_graph_break: str = "eager",
    schedule: Optional[SchedulePolicy] = None,
    bucket_bytes: Union[int, str, None] = None,
    prefetch_buckets: int = 1,
    reduce_overlap_buckets: int = 1,
    max_gathered_bytes: Optional[int] = None,
    resident_max_numel: int = DEFAULT_RESIDENT_MAX_NUMEL,
    keep_resident: Optional[Callable[[str, torch.nn.Parameter], bool]] = None,
    elementwise_optimizer: Optional[bool] = None,
    passes: Sequence = (),
    mixed_precision: Optional[MixedPrecision] = None,
    accumulation_steps: int = 1,
    max_grad_norm: Optional[float] = None,
    init_fn: Optional[Callable[[torch.nn.Module], None]] = None,
    recompute: Union[None, str, Callable[[torch.fx.Node], str], RecomputePolicy] = None,
    activation_budget_fraction: Optional[float] = None,
    activation_budget_bytes: Optional[int] = None,
    mesh: Optional["DeviceMesh"] = None,
    expert_parallel: int = 1,
    expert_capacity_factor: Optional[float] = None,
    offload: Union[None, str, OffloadPolicy] = None,
    device_memory: Optional[int] = None,
    offload_update: str = "auto",
    offload_step: str = "sync",
    quantization: Optional[QuantizationPolicy] = None,
    quantize_weights: Union[None, str, Mapping[str, Optional[str]]] = None,
    quantize_gradients: Optional[str] = None,
    quantize_block: int = 256,
    secondary_partition: Union[None, bool, int] = None,
    debug: DebugOptions = DebugOptions(),
    **deprecated: Any,
) -> Union["CompiledStep", Callable[[Callable], "CompiledStep"]]:
    """Compile a whole training step (forward, ``loss.backward()``, ``opt.step()``) with ZeRO.

    Use as ``@zero_compile``, ``@zero_compile(stage=3, backend="aot_eager")`` or
    ``@zero_compile(config=ZeroConfig(...))``::

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
        config: a ``ZeroConfig`` holding the options below. Keyword options given with it
            override the fields it leaves at their defaults; a keyword for a field the
            config sets to something else raises ``ValueError``.
        model, optimizer: name them when the step closes over them instead of
            taking them as arguments.

    Options (keywords, or fields of ``ZeroConfig``; the FSDP2 and DeepSpeed settings
    closest to each are in the docs' comparison):
        stage: ZeRO stage: 0 = DDP (gradients all-reduced, nothing sharded),
            1 = optimizer states sharded, 2 = + gradients, 3 = + parameters.
        backend: "inductor" (default), "aot_eager", "eager", or a callable
            ``compiler(gm, example_inputs) -> callable`` for the rewritten graph.
        regional: compile each distinct run of compute between collectives once
            (a 48-block model compiles about as fast as a 12-block one) and run the
            step's graph, with its collectives, as Python; False: one whole-step
            program (Inductor, pinned). Applies to "inductor" and "aot_eager", and to
            "eager", which then runs each run of compute as traced.
        dynamic_shapes: "auto" (default): a call whose input sizes differ from the first
            call's compiles one graph with those sizes symbolic, reused for every later
            size (at most two compilations for changing lengths); "static": one graph per
            shape.
        bucket_bytes: byte cap of one fused collective; None: the stage's default
            (25 MiB; one repeated block per bucket in stage 3), 0: one per parameter.
        prefetch_buckets: stage 3: each all-gather is issued this many buckets ahead of
            its use (default 1); 0: where it is used.
        reduce_overlap_buckets: each gradient reduction is waited for this many
            reductions after its issue, overlapping the backward (default 1); 0: at once.
        max_gathered_bytes: stage 3: cap on the bytes of gathered parameters alive at
            once; prefetching stops where it would pass it. None: no cap.
        resident_max_numel, keep_resident: stage 3: parameters of at most this many
            elements (default 16384), or those ``keep_resident(name, param)`` picks,
            stay resident: gathered once per step and kept (``explain()`` lists them).
        elementwise_optimizer: declare that an optimizer zero_fx does not know
            updates each element independently.
        passes: your own FX passes, run among ours: ``zero_fx.before("reduce_grads",
            fn)``, ``zero_fx.after("gather_params", fn)``, or a bare ``fn`` (after our
            rewrites, before ``check_invariants``). ``fn(gm) -> gm`` (or None after
            editing ``gm`` in place). A pass that breaks an invariant raises
            ``InvariantError`` naming it.
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
            self._init_weights)``).
        recompute: recompute forward values in the backward instead of keeping them:
            ``"blocks"`` keeps only each repeated block's input (activation
            checkpointing), ``"auto"`` keeps what fits the activation budget, a policy
            ``fn(node) -> "save" | "recompute"`` decides per op. Dropout replays its mask.
        activation_budget_fraction, activation_budget_bytes: ``recompute="auto"``'s budget,
            as a fraction in (0, 1] of the activations or as bytes (one of the two;
            either alone implies ``recompute="auto"``; default: half).
        mesh: a ``DeviceMesh`` over every rank. 2-D, ``init_device_mesh(device, (replicas,
            shards), mesh_dim_names=("replicate", "shard"))``: hybrid sharding, sharded
            within each shard group (a node) and replicated across them, the gradient
            shards all-reduced across replicas. 1-D or None: flat.
        expert_parallel: stages 1-3, mixture-of-experts models: split each block's routed
            experts over this many consecutive ranks (a divisor of the world size, of the
            shard group's on a hybrid mesh, and of the experts per block); tokens travel to
            their experts' ranks by all-to-all and back, and each expert is sharded over the
            ranks holding it (stage 3; stages 1-2 keep it whole there). 1 (default): every
            rank runs every expert.
        expert_capacity_factor: with ``expert_parallel``: each expert takes at most this
            many times an even spread's rows, dropping the rest (zero output, GShard's
            capacity factor), which bounds the received rows' buffer to about this many
            times the rows a rank sends. None (default): no row dropped, the buffer sized
            for the worst case, ``expert_parallel`` times larger.
        offload: stages 1-3: ``"optimizer"`` keeps the fp32 masters and the optimizer's
            state in host memory and steps the optimizer there; ``"parameters"`` (stage 3)
            the shards too; ``"auto"`` the least of these whose step fits ``device_memory``
            bytes (default: the GPU's capacity), read from the rewritten step.
            ``offload_update``: where the offloaded optimizer steps, ``"host"``,
            ``"device"`` (its state streamed bucket by bucket) or ``"auto"`` (the device
            where two buckets of state fit). ``offload_step="overlap"``: the host's
            optimizer step overlaps the next call, whose parameters are one step stale.
            docs/offload.md.
        on_graph_break: a step dynamo cannot trace as one graph (a branch on a tensor's
            value, a call it cannot trace): ``"eager"`` (default) runs it as plain PyTorch
            on the sharded state, warning once and naming the line in ``explain()``;
            ``"error"`` raises ``CaptureError`` naming the line.
        debug: ``zero_fx.DebugOptions(dump_dir=..., disable_passes=..., check_ranks=...,
            pin_schedule=...)``: graph dumps (default: the ``ZERO_FX_DUMP`` environment
            variable), passes to skip, the ranks' agreement check before each call's
            first collective (on by default; a mismatch raises ``RanksDisagreeError``
            instead of hanging), and Inductor schedule pinning with ``regional=False``.
        quantize_weights: stage 3: the all-gathers move the parameters block-quantized,
            ``"int8"`` or ``"fp8"`` (or ``{"forward": ..., "backward": ...}``), masters and
            shards in full precision (ZeRO++'s qwZ). ``quantize_gradients``: the reductions
            move ``"int8"`` or ``"int4"`` blocks by all-to-all, summed in fp32 (qgZ).
            ``quantize_block``: elements per block, one fp32 scale each (default 256).
            docs/quantization.md.
        secondary_partition: stage 3: the forward's gathers also keep a copy sharded within
            the node, which the backward gathers from (ZeRO++'s hpZ): the ranks per node, or
            True for torchrun's ``LOCAL_WORLD_SIZE``.

    The options that belong together can be given as one policy each instead (zero_fx/
    policies.py): ``schedule=SchedulePolicy(bucket_bytes=..., prefetch_buckets=...,
    reduce_overlap_buckets=..., max_gathered_bytes=...)``, ``offload=OffloadPolicy(mode=...,
    device_memory=..., update=..., step=...)``, ``quantization=QuantizationPolicy(weights=...,
    gradients=..., block=...)``, ``recompute=RecomputePolicy(mode=..., budget_fraction=...,
    budget_bytes=...)``; a policy and one of its flat options together is an error.

    The names of 0.1 (``zero_fx.config.DEPRECATED_OPTIONS``) still work for one release,
    with a ``FutureWarning``: ``memory_budget_bytes`` -> ``max_gathered_bytes``;
    ``persistence_threshold`` -> ``resident_max_numel``; ``activation_memory_budget`` ->
    ``activation_budget_fraction`` / ``activation_budget_bytes``; ``prefetch`` ->
    ``prefetch_buckets`` and ``reduce_overlap_buckets``; ``pin_schedule``,
    ``disable_passes``, ``dump_dir``, ``check_ranks`` -> ``debug=DebugOptions(...)``
    (``**deprecated`` takes them).

    Inspect a compiled step with ``step.explain()``, ``step.traffic()``,
    ``step.estimate()`` and ``step.graphs``.

    The step must call ``loss.backward()`` (more than once sums the gradients, as eager
    does, reduced once after the last), ``opt.step()`` once and
    ``opt.zero_grad()`` (checked before anything compiles; ``CaptureError`` otherwise);
    the optimizer steps after the compiled graph, on the shards, and so do an LR
    scheduler's ``step()``, ``GradScaler`` and ``clip_grad_norm_``/``clip_grad_value_``
    called in the step ([Note: the optimizer's companions] in runtime/companions.py).
    ``print``, logging calls and ``.item()`` run after the graph, with its values
    ([Note: host effects after the graph] in capture/host_effects.py). Returned tensors are
    detached (the backward has already run). Outside the step, stage 3's parameters hold
    no values: run the model in ``with step.gathered_parameters():``, or decorate an
    evaluation step: a function that takes the model and no optimizer runs forward only,
    on the shards of the model's training step, with that step's options
    ([Note: evaluation steps] in zero_fx/evaluation.py).
    """


def _zero_compile(fn: Optional[Callable] = None, *, config: Optional[ZeroConfig] = None,
                  model: Optional[torch.nn.Module] = None,
                  optimizer: Optional[torch.optim.Optimizer] = None, **options: Any):
    """``zero_compile`` with the options the caller gave, as written.

    [Note: options given as keywords]
    ``zero_compile`` lists every option with its default, but what it passes on is the
    keywords the caller wrote: an option given with the value of its default still
    counts as given. Next to ``config=``, a keyword repeating the default for a field the
    config sets otherwise is an error, not a silent no-op; an evaluation step's given
    options are checked against its training step's ([Note: evaluation steps] in
    zero_fx/evaluation.py).
    """
    config = _config_from(config, options)

    def wrap(step_fn: Callable) -> "CompiledStep":
        return CompiledStep(step_fn, config, model=model, optimizer=optimizer,
                            given=frozenset(flattened(options)))

    return wrap(fn) if fn is not None else wrap


def _config_from(config: Optional[ZeroConfig], options: dict) -> ZeroConfig:
    """``config`` with the keyword ``options`` (new or renamed names) applied: a keyword may
    set a field the config leaves at its default, or repeat the config's value."""
    known = {f.name for f in dataclasses.fields(ZeroConfig)} | set(FLAT_NAMES)
    unknown = [name for name in options if name not in known and name not in DEPRECATED_OPTIONS]
    if unknown:
        near = difflib.get_close_matches(unknown[0], [*known, *DEPRECATED_OPTIONS], n=1)
        raise TypeError(f"zero_compile got an unknown option {unknown[0]!r}"
                        + (f" (did you mean {near[0]!r}?)" if near else "")
                        + f"; the options are ZeroConfig's fields: {', '.join(sorted(known))}")
    with old_names_in_errors(options):
        return _configured(config, flattened(translate_deprecated(options, stacklevel=4)))


def _configured(config: Optional[ZeroConfig], options: dict) -> ZeroConfig:
    if config is None:
        return ZeroConfig(**options)
    if not isinstance(config, ZeroConfig):
        raise TypeError(f"config must be a zero_fx.ZeroConfig(...), got {type(config).__name__}")
    default = ZeroConfig()
    changes = {}
    for name, value in options.items():
        if name == "debug":
            value = _merged_debug(config.debug, value, default.debug)
        elif not _same(getattr(config, name), getattr(default, name)) and not _same(
                getattr(config, name), value):
            raise ValueError(f"{name} is set both in config= ({getattr(config, name)!r}) and as a "
                             f"keyword ({value!r}); set it in one place")
        changes[name] = value
    return dataclasses.replace(config, **changes) if changes else config


def _merged_debug(configured: DebugOptions, given: Any, default: DebugOptions) -> DebugOptions:
    if not isinstance(given, DebugOptions):
        raise TypeError(f"debug must be a zero_fx.DebugOptions(...), got {type(given).__name__}")
    changes = {}
    for f in dataclasses.fields(DebugOptions):
        value, ours = getattr(given, f.name), getattr(configured, f.name)
        if _same(value, getattr(default, f.name)) or _same(value, ours):
            continue
        if not _same(ours, getattr(default, f.name)):
            raise ValueError(f"debug {f.name} is set both in config= ({ours!r}) and as a keyword "
                             f"({value!r}); set it in one place")
        changes[f.name] = value
    return dataclasses.replace(configured, **changes) if changes else configured


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # values without a plain ==, a tensor or a mesh: only identity counts
        return False


DYNAMO_CONFIG = dict(
    trace_autograd_ops=True,
    side_effect_replay_policy="silent",
    capture_scalar_outputs=True,
    allow_rnn=True,
)
"""Dynamo's settings while it traces a step. ``trace_autograd_ops``: ``loss.backward()``
lands in the same graph as the forward. ``capture_scalar_outputs``: ``.item()`` is a value
of the graph ([Note: .item() as a graph output] in capture/scalar_outputs.py).
``allow_rnn``: ``nn.LSTM``/``nn.GRU``/``nn.RNN`` are traced into the one graph (dynamo
otherwise breaks the graph at them; [Note: RNNs in the step] in capture/step_graph.py).
``side_effect_replay_policy``: dynamo otherwise
records the user's stack at every side effect it replays, for its info log (each
parameter's ``.grad`` the backward sets): 2.3 of 12.7 s of its trace of a 48-block GPT-2."""


class CompiledStep:
    """A training step compiled by ``zero_compile``. Call it like the original function.

    Its life cycle lives with the pipeline's stages: the first call shards
    (``runtime.sharding``), each compilation captures, rewrites and lowers
    (``compiler.backend``), each call runs the program (``runtime.step_runner``) and then
    the deferred optimizer update (``runtime.deferred_optimizer``). This class holds them
    together and answers the user."""

    def __init__(self, fn: Callable, config: ZeroConfig, *,
                 model: Optional[torch.nn.Module], optimizer: Optional[torch.optim.Optimizer],
                 given: frozenset = frozenset()):
        functools.update_wrapper(self, fn)
        self.config = config
        self._given = given
        """The options given as keywords (an evaluation step's are checked against its
        training step's: [Note: evaluation steps] in zero_fx/evaluation.py)."""
        self._fn = fn
        self._model = model
        self._optimizer = optimizer
        self.state: Optional[ShardedState] = None
        self._experts = ExpertsRewrite([], [])
        self._sharded: Optional[Sharded] = None
        """What the first call set up (plan, state, update, scaler, rank agreement)."""
        self._compiler: Optional[StepCompiler] = None
        self.graphs: list[GraphModule] = []
        """The rewritten graph of each compilation, for inspection."""
        self.compilations: list[Compilation] = []
        """Each compilation so far: its wall time and why it happened."""
        self._deferred = DeferredOptimizerCalls(getattr(fn, "__globals__", None))
        self._fallback: Optional[EagerFallback] = None
        """Set at the step's first graph break: runs every later call eagerly."""
        self._observers: list[TorchDispatchMode] = []
        self._sizes = ChangingSizes(config.dynamic_shapes)  # [Note: one dynamic graph for every length]
        # Dynamo caches compiled frames per code object: each compiled step gets
        # its own copy of `_traced_step`, or steps would share (and exhaust)
        # one cache and recompile whenever another step ran in between.
        traced_step = _with_own_code(CompiledStep._traced_step)
        # [Note: compiled graphs die with their step] in _with_own_code
        weakref.finalize(self, _drop_what_dynamo_installed, traced_step.__globals__,
                         frozenset(traced_step.__globals__))
        traced = types.MethodType(traced_step, self)
        self._compiled = torch.compile(traced, backend=_weakly_bound(self._compile_graph),
                                       fullgraph=True, dynamic=False)

    # -- the call --------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if evaluation.takes_no_optimizer(args, kwargs, self._optimizer):
            return self._evaluate(args, kwargs)
        if self._compiler is not None and self._compiler.forward_only:
            raise ValueError(f"{self.__name__} was first called without an optimizer, as an "
                             "evaluation step; decorate a separate function to train")
        model, optimizer = find_model_and_optimizer(args, kwargs, self._model, self._optimizer)
        if self.state is None:
            self._shard(model, optimizer)
        elif model is not self.state.model or optimizer is not self.state.optimizer:
            raise ValueError("this compiled step was first called with another model or optimizer; "
                             "decorate a separate function for each model")
        if self._deferred.broken:
            raise RuntimeError(self._deferred.broken)
        self._deferred.confirm(self._sharded.update, self.plan.rank)  # earlier calls' fences, NCCL
        if self.state.gathered:
            raise RuntimeError("the step was called inside `with step.gathered_parameters():`; "
                               "train outside that block (it is for evaluation)")
        self.state.check_unchanged()
        args, kwargs = self._sizes.marked(args, kwargs)  # [Note: one dynamic graph for every length]
        host_effects.discard_recorded()
        with self._deferred.deferring(optimizer):
            try:
                out = self._run(args, kwargs)
            except RuntimeError as err:
                if is_communication_failure(err):
                    raise self._deferred.error_before_update(
                        self._sharded.update, self.plan.rank, err) from err
                raise
        try:
            self._deferred.run(self._sharded.update, self.plan.rank, self._observers)
        except BaseException:
            host_effects.discard_recorded()
            raise
        host_effects.run_recorded()  # [Note: host effects after the graph]
        return out

    def _evaluate(self, args: tuple, kwargs: dict):
        """A step without an optimizer: forward only, on the shards of the training step of
        its model ([Note: evaluation steps] in zero_fx/evaluation.py)."""
        if self.state is None:
            model, sharded = evaluation.training_sharding(args, kwargs, self._model, self.__name__)
            if sharded is None:  # before training: the model is whole, as built
                return evaluation.run_before_training(self._fn, args, kwargs,
                                                      self.__name__)
            self.config = evaluation.evaluation_config(self.config, self._given, sharded,
                                                       self.__name__)
            self._sharded, self.state = sharded, sharded.state
            self._experts = route_experts_with_fixed_shapes(model)  # the training step's
            self._compiler = StepCompiler(self.__name__, self.config, sharded, graphs=self.graphs,
                                          compilations=self.compilations,
                                          observers=self._observers, explain=self.explain,
                                          forward_only=True)
        elif not self._compiler.forward_only:
            raise ValueError(f"{self.__name__} was first called with an optimizer, as a training "
                             "step; decorate a separate function to evaluate")
        elif evaluation.find_model(args, kwargs, self._model) is not self.state.model:
            raise ValueError(f"{self.__name__} was first called with another model; decorate a "
                             "separate function for each model")
        self._sharded.update.settle()  # the latest update ([Note: the delayed update])
        self.state.check_unchanged()
        args, kwargs = self._sizes.marked(args, kwargs)
        host_effects.discard_recorded()
        out = self._run_compiled(args, kwargs)
        host_effects.run_recorded()
        return out

    def _run(self, args: tuple, kwargs: dict):
        """The compiled step; after a graph break, the step run eagerly ([Note: eager sharded
        execution] in runtime/eager_fallback.py)."""
        if self._fallback is None:
            out = self._run_compiled(args, kwargs, on_break=self._start_eager_fallback)
            if self._fallback is None:
                return out
        return self._fallback(self._fn, args, kwargs, self._observers)

    def _start_eager_fallback(self, err: BaseException) -> None:
        self._fallback = self._graph_broke(err)

    def _run_compiled(self, args: tuple, kwargs: dict, on_break: Optional[Callable] = None):
        """The compiled step, called; our errors while compiling raised as themselves; a
        graph break handed to ``on_break`` (None: raised as a CaptureError)."""
        with torch._dynamo.config.patch(**DYNAMO_CONFIG), host_effects.recording():
            try:
                return self._compiled(*args, **kwargs)
            except torch._dynamo.exc.BackendCompilerFailed as err:
                # our own errors while compiling (bad input, a user pass) are the user's to read
                inner = getattr(err, "inner_exception", None)
                if isinstance(inner, InvariantError):
                    # an AssertionError dynamo wrapped: the user's to read, with its own
                    # traceback (the pass that broke the graph) and the check's as its cause
                    raise inner.with_traceback(inner.__traceback__) from inner.__cause__
                if isinstance(inner, (CaptureError, ValueError, TypeError)):
                    raise inner from None
                if capture_hint(str(inner)):
                    raise self._capture_failed(inner) from err
                raise
            except torch._dynamo.exc.InternalTorchDynamoError as err:
                # PyTorch's tracer failing inside: the failures met on real models (a size the
                # data decides reaching the backward) said as capture errors; others as they are
                if not capture_hint(str(err)):
                    raise
                raise self._capture_failed(err) from err
            except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError,
                    GuardOnDataDependentSymNode) as err:
                # the last: a Python branch or loop on a value (`for e in t.unique().tolist()`)
                if on_break is None:
                    raise self._capture_failed(err) from err
                on_break(err)

    def _graph_broke(self, err: BaseException) -> EagerFallback:
        """Dynamo could not trace the step as one graph: the eager run that replaces it, or
        the error (``on_graph_break="error"``, or a failure that is not a graph break)."""
        graph_break = graph_break_of(err)
        if graph_break is None:
            raise self._capture_failed(err) from err
        if self.config.on_graph_break == "error":
            raise break_error(self._capture_failed(err), graph_break) from err
        refused = why_not_eager(self.state)
        if refused is not None:
            raise CaptureError(f"{break_error(self._capture_failed(err), graph_break)}\n"
                               f"It cannot run eagerly either: {refused}") from err
        fallback = EagerFallback(self.state, graph_break, self._sharded.agreement)
        warnings.warn(f"zero_fx: {self.__name__} breaks the graph ({graph_break}); it runs "
                      f"eagerly on the sharded state from now on, uncompiled and without overlap "
                      f"(step.explain() says what that costs; on_graph_break=\"error\" raises "
                      f"instead)", GraphBreakWarning, stacklevel=6)
        return fallback

    def _capture_failed(self, err: BaseException) -> CaptureError:
        """PyTorch could not capture the step: with the mixture-of-experts blocks the rewrite
        left alone named first, when there are any (their loops are the likely cause)."""
        error = capture_failed(err)
        if self._experts.unrecognised and capture_hint(str(err)):
            return unrecognised_experts_error(self._experts, error)
        return error

    def _traced_step(self, *args, **kwargs):
        trace_started()  # the optimizer calls this trace makes, checked before compiling
        out = self._fn(*args, **kwargs)
        # The backward has consumed the graph; what is returned is a value, not a node.
        return tree_map_only(torch.Tensor, torch.Tensor.detach, out)

    def _shard(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               pretrained: Optional[PretrainedWeights] = None) -> None:
        hf_install_output_hooks(model)  # before the capture, which cannot take their lock
        self._experts = route_experts_with_fixed_shapes(
            model, expert_parallel=self.config.expert_parallel > 1)
        self._sharded = shard(model, optimizer, self.config, self.__name__, pretrained,
                              moe_blocks=self._experts.blocks,
                              left_alone=self._experts.unrecognised)
        self.state = self._sharded.state
        self._compiler = StepCompiler(self.__name__, self.config, self._sharded,
                                      graphs=self.graphs, compilations=self.compilations,
                                      observers=self._observers, explain=self.explain)

    @property
    def plan(self) -> Optional[ShardPlan]:
        """The shard plan (None before the first call); ``offload="auto"`` settles its offload
        mode at the first compilation."""
        return self._sharded.plan if self._sharded is not None else None

    def _compile_graph(self, dynamo_gm: GraphModule, example_inputs: list):
        """The dynamo backend: ``StepCompiler`` (compiler/backend.py), made on the first call."""
        return self._compiler(dynamo_gm, example_inputs)

    @property
    def moe_blocks(self) -> list[RoutedExperts]:
        """The mixture-of-experts blocks given a fixed-shape forward on the first call
        ([Note: routed experts with fixed shapes] in zero_fx/capture/routed_experts.py)."""
        return self._experts.blocks

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
        return self.observing(CollectiveCounter(self._tensor_parallel_group))

    def _tensor_parallel_group(self) -> str:
        """The "tp" group's name ("" before the first call, or without tensor parallelism)."""
        parallel = self.plan.tensor_parallel if self._sharded is not None else None
        return parallel.group_name if parallel is not None else ""

    def traffic(self) -> TrafficReport:
        """The collectives one call of the step issues (the latest compilation); print it for a table."""
        if not self.graphs:
            raise RuntimeError("the step has not been compiled yet; call it once first")
        return traffic_report(self.graphs[-1], self.plan,
                              tuple(block.experts for block in self.moe_blocks))

    def estimate(self, hardware="cpu-gloo") -> Estimate:
        """The cost model's step time, exposed communication and peak memory for the latest
        compilation on ``hardware`` (a preset name in ``zero_fx.analysis.cost_model.PRESETS`` or a
        ``Hardware``); print it. See [Note: the cost model] in zero_fx/analysis/cost_model.py."""
        if not self.graphs:
            raise RuntimeError("the step has not been compiled yet; call it once first")
        return estimate(self.graphs[-1], self.plan, hardware)

    def explain(self, hardware="cpu-gloo") -> Union[Explanation, GraphBreakExplanation]:
        """What zero_fx did to this step (latest compilation): the plan, every collective
        with where it is issued and waited, each gathered parameter's lifetime, the
        estimated memory over the step and what is alive at its peak, and the
        compilations so far with their reasons. Print it. Times: the cost model on
        ``hardware`` (a preset name or a ``Hardware``). A step that broke the graph and runs
        eagerly: where it broke, why, and what running eagerly costs."""
        if not self.graphs and self._fallback is None:
            raise RuntimeError("the step has not been compiled yet; call it once first")
        plan = self.plan
        of_group = " of its shard group" if plan.replicas > 1 else ""
        title = (f"zero_fx explain: {self.__name__}, stage {plan.stage} over "
                 f"{ranks_phrase(plan.world_size, plan.replicas)} (this is rank {plan.rank}"
                 f"{of_group}), backend {describe_backend(self.config.backend)}")
        if self._fallback is not None:
            fallback = self._fallback
            return GraphBreakExplanation(title, plan, fallback.graph_break, fallback.costs(),
                                         fallback.calls)
        return explain_graph(self.graphs[-1], self.plan, hardware=hardware, title=title,
                             compilations=self.compilations, moe_blocks=self.moe_blocks,
                             offload_choice=self._sharded.offload_choice)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """A copy of the model's parameters as the optimizer holds them (fp32 masters under
        mixed precision), gathered from every rank (call on all ranks)."""
        return self._sharded_state().full_parameters()

    def gathered_parameters(self) -> "contextlib.AbstractContextManager[None]":
        """``with step.gathered_parameters(): model(x)``: run the model outside the step.
        In stage 3 the parameters are all-gathered (compute dtype) for the block and freed
        after it, changes discarded; enter it on every rank. Stages 0-2 keep whole
        parameters and need nothing.

        To evaluate or generate without holding the whole model, decorate the evaluation
        with ``zero_compile`` too, taking the model and no optimizer: it runs on this step's
        shards, gathering block by block as training does ([Note: evaluation steps] in
        zero_fx/evaluation.py).

        Cost: in stage 3 every rank holds the whole model on its device for the block (the
        bytes of every parameter in the compute dtype, logged at INFO on entry), on top of
        its shards and optimizer state: the memory stage 3 saves during training. For the
        values alone (to save or export them) use ``full_state_dict(cpu_offload=True)``,
        which holds one bucket at a time and puts the dict in rank 0's host memory."""
        return self._sharded_state().gathered_parameters()

    def save_checkpoint(self, path: str, extra: Any = None) -> None:
        """Write a sharded checkpoint of the model, optimizer, counters, RNG state and
        ``extra`` (anything picklable: your step number, scheduler state) to the folder
        ``path``; every rank writes its part in parallel. A collective: call on every rank.
        Atomic: a crash during the save leaves the previous checkpoint (or none), never a
        half-written one that loads. See the README, "Checkpoints"."""
        state = self._sharded_state()
        update = self._sharded.update
        if update.micro_step:
            raise RuntimeError(
                f"save_checkpoint after call {update.micro_step} of "
                f"{self.config.accumulation_steps} of an accumulation window: the summed gradients "
                "are not saved, so save right after an optimizer step")
        self._confirm_collectives()
        checkpoint.save(state, path, update.counters(), extra)

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
        self._sharded.update.settle()  # an update still running would overwrite what loads
        counters, extra = checkpoint.load(self.state, path)
        self._sharded.update.restore_counters(counters)
        return extra

    def full_state_dict(self, dtype: Optional[torch.dtype] = None, *,
                        cpu_offload: Optional[bool] = None) -> dict[str, torch.Tensor]:
        """The model's whole ``state_dict()`` (fp32 masters, or ``dtype`` for floating-point
        tensors; tied names; buffers) for plain PyTorch's ``model.load_state_dict``. A
        collective: call it on every rank.

        ``cpu_offload=True`` (the default when training on a GPU): rank 0 gets the dict in
        CPU memory and every other rank an empty dict ``{}`` (as FSDP2's
        ``StateDictOptions(full_state_dict=True, cpu_offload=True)``); the parameters are
        gathered one bucket at a time and copied to rank 0's host, so the device holds one
        bucket beyond what training holds. Write the file on rank 0:
        ``if rank == 0: torch.save(sd, path)``. ``cpu_offload=False`` (the default on the
        CPU): every rank gets the whole dict, on the training device."""
        state = self._sharded_state()
        self._confirm_collectives()
        return checkpoint.full_state_dict(state, dtype, cpu_offload=cpu_offload)

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps taken so far (with ``accumulation_steps=K``, one per K calls;
        steps skipped for an fp16 overflow not counted)."""
        return self._sharded.update.optimizer_steps if self._sharded is not None else 0

    @property
    def last_grad_norm(self) -> Optional[torch.Tensor]:
        """The global gradient norm of the latest optimizer step, before clipping (a float32
        scalar, equal on all ranks); None unless ``max_grad_norm`` or loss scaling is set."""
        return self._sharded.update.last_grad_norm if self._sharded is not None else None

    @property
    def loss_scale(self) -> Optional[float]:
        """The current fp16 loss scale; None without loss scaling."""
        scaler = self._sharded.scaler if self._sharded is not None else None
        return scaler.scale.item() if scaler is not None else None

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because the fp16 gradients overflowed."""
        scaler = self._sharded.scaler if self._sharded is not None else None
        return scaler.skipped_steps if scaler is not None else 0

    def _confirm_collectives(self) -> None:
        """Before writing anything durable: every earlier call's collectives have completed
        (NCCL: waits for the fences; [Note: failures on NCCL]), and the step is not broken."""
        if self._deferred.broken:
            raise RuntimeError(self._deferred.broken)
        self._deferred.confirm(self._sharded.update, self.plan.rank, everything=True)

    def _sharded_state(self) -> ShardedState:
        """The state, with any update still running on the host finished ([Note: the delayed
        update] in runtime/update.py)."""
        if self.state is None:
            raise RuntimeError("the step has not run yet, so nothing is sharded")
        self._sharded.update.settle()
        return self.state



def explain(step: "CompiledStep", hardware="cpu-gloo"
            ) -> Union[Explanation, GraphBreakExplanation]:
    """``step.explain(hardware)``: what zero_fx did to a compiled step."""
    if not isinstance(step, CompiledStep):
        raise TypeError(f"explain takes a step decorated with @zero_compile, got "
                        f"{type(step).__name__}")
    return step.explain(hardware)


def _weakly_bound(method):
    """``method`` called through a weak reference to its object: Dynamo keeps every backend
    it is given until ``torch._dynamo.reset()`` (``eval_frame.cached_backends``), and a
    step's bound method would keep the step, its graphs and its state alive with it."""
    method_ref = weakref.WeakMethod(method)

    def backend(gm: GraphModule, example_inputs: list):
        return method_ref()(gm, example_inputs)

    return backend


def _with_own_code(fn):
    """A copy of ``fn`` with its own code object and its own globals.

    [Note: compiled graphs die with their step] Dynamo stores each graph it compiles as a
    global of the compiled frame (``__compiled_fn_<n>_<uuid>``). Its guards keep those
    globals alive for as long as any object they match by identity lives, and some live as
    long as the process (the modules the step reads). In the module's own dict, every step
    ever compiled, its graphs and through them the model's state, would stay alive. In a
    dict of their own, emptied of what Dynamo put there when the step is collected
    (``_drop_what_dynamo_installed``), they go with the step."""
    return types.FunctionType(fn.__code__.replace(), dict(fn.__globals__), fn.__name__,
                              fn.__defaults__, fn.__closure__)


def _drop_what_dynamo_installed(step_globals: dict, module_names: frozenset) -> None:
    """Drops the values of the globals Dynamo installed for a collected step. The names
    stay: Dynamo deletes each one itself once its guards go, and a missing name is an error
    it prints."""
    for name in step_globals.keys() - module_names:
        step_globals[name] = None
