"""``CompiledStep``: what ``zero_compile`` returns, the step the user calls. It holds the
pipeline's stages together (shard, compile, run, update); what the user reads of it is in
``step_inspection`` (explain, traffic, estimate) and ``step_state`` (parameters,
checkpoints, counters)."""

from __future__ import annotations

import functools
import types
import warnings
import weakref
from typing import Callable, Optional

import torch
from torch.fx import GraphModule
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from .capture import host_effects
from .capture.graph_breaks import GraphBreakWarning, break_error, graph_break_of
from .capture.hints import capture_failed, capture_hint
from .capture.experts.routed_experts import (ExpertsRewrite, route_experts_with_fixed_shapes,
                                     unrecognised_experts_error)
from .capture.dynamic_shapes import ChangingSizes
from .capture.step_calls import trace_ended, trace_started
from .capture.step_graph import CaptureError
from .base.compat import hf_install_output_hooks, optimizer_read_plainly
from .compiler.backend import Compilation, StepCompiler
from . import evaluation
from .config import ZeroConfig
from .materialize import PretrainedWeights
from .passes.check_invariants import InvariantError
from .plan import ShardPlan
from .runtime.update.deferred_optimizer import DeferredOptimizerCalls
from .runtime.eager_fallback import EagerFallback, why_not_eager
from .runtime.distributed.failures import is_communication_failure
from .runtime.sharded_state import ShardedState
from .runtime.update.optimizer_set import same_optimizers
from .runtime.sharding import Sharded, find_model_and_optimizer, shard
from .step_inspection import StepInspection
from .step_state import StepState


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


# [Note: the Python state a step reads]
# What the step reads that is not a tensor input of the graph, and how each reaches the
# compiled step. Each is read at run time, an input, or a guard that recompiles (logged
# with dynamo's reason, step.explain() lists them); none is baked in silently.
#
# - Every hyperparameter of every param group (lr, betas, weight decay, momentum, ...):
#   read by torch.optim's own step when it runs, in the graph or after it. Set between
#   calls (by hand or a scheduler): nothing recompiles, the groups are not guarded
#   ([Note: the optimizer as dynamo reads it] in base/compat.py). Set inside the step before
#   opt.step(): dynamo writes them after the graph, so the update runs after the graph
#   and reads them there; set after opt.step(): the update steps with the groups as the
#   call found them ([Note: hyperparameters written inside the step] in
#   capture/step_calls.py). Computed from an int argument that changes (nanoGPT's
#   get_lr(it)): the int is a symbol after its first change ([Note: a changing int
#   argument] in capture/dynamic_shapes.py).
# - Flags dynamo's optimizer tracing would leave in the groups (capturable): none is left.
# - Each parameter's requires_grad: a guard ([Note: the trainable parameters are guarded]
#   in _traced_step: a change recompiles); the update steps and refreshes exactly the
#   shards that hold a gradient ([Note: what the update refreshes] in
#   runtime/sharded_state.py).
# - zero_grad's set_to_none: recorded per call; set_to_none=False keeps zero gradients
#   for every parameter eager holds a .grad for ([Note: zero_grad(set_to_none=False)] in
#   runtime/update/update.py).
# - Accumulation: every shard any call of the window gave a gradient steps at the window's
#   end (OptimizerUpdate._step_what_the_graph_left).
# - The module's training mode (module.training): a guard, read by dynamo's trace.
# - Buffers written in place by the forward (BatchNorm's running statistics, spectral
#   norm's _u and _v, an EMA): inputs of the graph, written back by it after each call,
#   per rank as in DDP. Nothing of zero_fx runs the forward, or a parametrization, outside
#   the step ([Note: recognition runs no parametrization] in capture/experts/moe_blocks.py).
# - Parametrizations: run inside the traced forward, on the gathered parameter.
# - Parameters with no elements: in the plan and the buckets, moving nothing ([Note:
#   parameters with no elements] in passes/common/collective_code.py).
# - A float argument that changes: specialised by dynamo, one compilation per value.
# tests/test_step_state.py trains each against eager, comparing after every call.


class CompiledStep(StepInspection, StepState):
    """A training step compiled by ``zero_compile``. Call it like the original function.

    Its life cycle lives with the pipeline's stages: the first call shards
    (``runtime.sharding``), each compilation captures, rewrites and lowers
    (``compiler.backend``), each call runs the program (``runtime.step_runner``) and then
    the deferred optimizer update (``runtime.update.deferred_optimizer``). This class holds them
    together and answers the user."""

    def __init__(self, fn: Callable, config: ZeroConfig, *,
                 model: Optional[torch.nn.Module], optimizer: Optional[torch.optim.Optimizer],
                 given: frozenset = frozenset()):
        functools.update_wrapper(self, fn)
        self.config = config
        self._given = given
        """The options given as keywords (an evaluation step's are checked against its
        training step's: [Note: evaluation steps] in zero_fx/evaluation.py)."""
        self.function = fn
        """The step as the user wrote it, undecorated."""
        self.model = model
        """The model named with ``zero_compile(model=...)``; None when the step takes it as an
        argument (the sharded state's ``state.model`` is the one it trains)."""
        self.optimizer = optimizer
        """The optimizer named with ``zero_compile(optimizer=...)``; None when the step takes
        it as an argument."""
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
        self._trainable: tuple[bool, ...] = ()
        """Each parameter's ``requires_grad`` as this call found it ([Note: the trainable
        parameters are guarded] in ``_traced_step``)."""
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
        if evaluation.takes_no_optimizer(args, kwargs, self.optimizer):
            return self._evaluate(args, kwargs)
        if self._compiler is not None and self._compiler.forward_only:
            raise ValueError(f"{self.__name__} was first called without an optimizer, as an "
                             "evaluation step; decorate a separate function to train")
        model, optimizer = find_model_and_optimizer(args, kwargs, self.model, self.optimizer)
        if self.state is None:
            self.shard_model(model, optimizer)
        elif model is not self.state.model or not same_optimizers(optimizer,
                                                                  self.state.optimizer):
            raise ValueError("this compiled step was first called with another model or optimizer; "
                             "decorate a separate function for each model")
        optimizer = self.state.optimizer
        if self._deferred.broken:
            raise RuntimeError(self._deferred.broken)
        self._deferred.confirm(self._sharded.update, self.plan.rank)  # earlier calls' fences, NCCL
        if self.state.gathered:
            raise RuntimeError("the step was called inside `with step.gathered_parameters():`; "
                               "train outside that block (it is for evaluation)")
        self.state.check_unchanged()
        self._trainable = tuple(p.requires_grad for p in self.state.params.values())
        args, kwargs = self._sizes.marked(args, kwargs)  # [Note: one dynamic graph for every length]
        host_effects.discard_recorded()
        update = self._sharded.update
        with self._deferred.deferring(optimizer) as real_steps, update.running_graph(real_steps):
            try:
                out = self._run(args, kwargs)
            except RuntimeError as err:
                if is_communication_failure(err):
                    raise self._deferred.error_in_graph(update, self.plan.rank, err) from err
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
            model, sharded = evaluation.training_sharding(args, kwargs, self.model, self.__name__)
            if sharded is None:  # before training: the model is whole, as built
                return evaluation.run_before_training(self.function, args, kwargs,
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
        elif evaluation.find_model(args, kwargs, self.model) is not self.state.model:
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
        return self._fallback(self.function, args, kwargs, self._observers)

    def _start_eager_fallback(self, err: BaseException) -> None:
        self._fallback = self._graph_broke(err)

    def _run_compiled(self, args: tuple, kwargs: dict, on_break: Optional[Callable] = None):
        """The compiled step, called; our errors while compiling raised as themselves; a
        graph break handed to ``on_break`` (None: raised as a CaptureError)."""
        with torch._dynamo.config.patch(**DYNAMO_CONFIG), host_effects.recording(), \
                optimizer_read_plainly(), self._sizes.ints_traced_as_symbols(args, kwargs):
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
        # [Note: the trainable parameters are guarded]
        # Which parameters get a gradient is fixed in the graph. Dynamo guards each
        # parameter's requires_grad itself in 2.13 and 2.15, but 2.11 did not see a frozen
        # parameter unfrozen (model.requires_grad_(True) after training some layers frozen):
        # the graph of the frozen call ran again, and the layer never moved. Branching on
        # each flag, as the call found it, makes each one a guard of dynamo's on every
        # release: a change compiles again, with the flag named as the reason.
        for trainable in self._trainable:
            if trainable:
                pass
        out = self.function(*args, **kwargs)
        trace_ended()
        # The backward has consumed the graph; what is returned is a value, not a node.
        return tree_map_only(torch.Tensor, torch.Tensor.detach, out)

    def shard_model(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    pretrained: Optional[PretrainedWeights] = None) -> None:
        """Shard ``model`` and ``optimizer`` now, as the first call would (``pretrained``: the
        weights ``load_pretrained`` reads into the shards)."""
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

    [Note: compiled graphs die with their step]
    Dynamo stores each graph it compiles as a global of the compiled frame
    (``__compiled_fn_<n>_<uuid>``). Its guards keep those
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
