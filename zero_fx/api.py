"""``zero_compile``: the public entry point."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import logging
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, TypeVar, Union

import torch

from .compiled_step import CompiledStep
from .config import (DEPRECATED_OPTIONS, DebugOptions, ZeroConfig, old_names_in_errors,
                     translate_deprecated)
from .inspection.explain import Explanation, GraphBreakExplanation
from .config import DEFAULT_RESIDENT_MAX_NUMEL, BackendName, Compiler
from .config.policies import (FLAT_NAMES, MixedPrecision, OffloadPolicy, QuantizationPolicy,
                       RecomputePolicy, SchedulePolicy, flattened)


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
    optimizer: Optional[Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]] = None,
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
    optimizer_update: str = "auto",
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
            taking them as arguments; ``optimizer=[muon, adamw]`` for several, each stepped
            once per call (docs/optimizers.md).

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
            updates each element independently, so every rank steps its flat shard;
            otherwise such an optimizer steps whole tensors, each on its owner rank
            ([Note: update rules] in zero_fx/runtime/optimizer.py).
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
        optimizer_update: ``"auto"`` (the default) steps the optimizer inside the graph,
            each bucket of shards right after its gradients are reduced (which frees them
            there), where the step allows it, and after the graph otherwise; ``"graph"``
            requires the former, ``"eager"`` always does the latter. ``step.explain()``
            says which ran and why.
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
    called in the step ([Note: the optimizer's companions] in runtime/update/companions.py).
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


def explain(step: "CompiledStep", hardware="cpu-gloo"
            ) -> Union[Explanation, GraphBreakExplanation]:
    """``step.explain(hardware)``: what zero_fx did to a compiled step."""
    if not isinstance(step, CompiledStep):
        raise TypeError(f"explain takes a step decorated with @zero_compile, got "
                        f"{type(step).__name__}")
    return step.explain(hardware)
