"""Configuration of a compiled step: ``ZeroConfig``, its options flat as users write them and
grouped as policies (policies.py, beside it); the checks that read the stage are in
checks.py, the names of 0.1 in renamed_options.py."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from ..analysis.cost_model import node_seconds
from ..analysis.hardware import hardware as preset_hardware
from .checks import (GRADIENT_FORMATS, MESH_DIM_NAMES, OFFLOAD_MODES, WEIGHT_FORMATS,  # noqa: F401
                     check_expert_parallel, check_mesh, check_offload, check_offload_update,
                     check_quantization, check_secondary_partition, weight_formats)
from ..passes.pipeline import pass_names
from ..passes.recompute_activations import ActivationBudget
from ..plan.build import PlanOptions
from ..plan.layout import BLOCKS, StageConsequences
from .policies import (DUMP_ENV, FLOAT_DTYPES, DebugOptions, MixedPrecision,  # noqa: F401
                       OffloadPolicy, QuantizationPolicy, RecomputePolicy, SchedulePolicy,
                       flattened, policy_from)
from .renamed_options import (DEPRECATED_OPTIONS, RENAMED_OPTIONS_KEPT_THROUGH,  # noqa: F401
                              old_names_in_errors, translate_deprecated, warn_renamed)

BackendName = str
Compiler = Callable[[torch.fx.GraphModule, list], Callable]

NAMED_BACKENDS = ("inductor", "aot_eager", "eager")

MiB = 1 << 20
DEFAULT_BUCKET_BYTES = {0: 25 * MiB, 1: 25 * MiB, 2: 25 * MiB, 3: BLOCKS}
"""Bucketing per stage. 25 MiB is DDP's gradient bucket. Stage 3's all-gather buckets
are working memory (with prefetch, two are alive at once on top of the shards): one
repeated block of the model per bucket ([Note: buckets by block] in plan/layout.py)."""
RECOMPUTE_MODES = (None, "blocks", "auto")
OPTIMIZER_UPDATES = ("auto", "graph", "eager")
DYNAMIC_SHAPES = ("auto", "static")
"""The values of ``ZeroConfig.dynamic_shapes``."""
DEFAULT_ACTIVATION_BUDGET = 0.5
"""``recompute="auto"`` without an activation budget: keep half the activations."""
DEFAULT_RESIDENT_MAX_NUMEL = 1 << 14
"""Stage 3 keeps parameters of at most this many elements resident: norm
weights and biases of models up to a 16K hidden size, never a weight matrix of
a real model. (DeepSpeed's ``stage3_param_persistence_threshold`` is 1e5.)"""
DEFAULT_PERSISTENCE_THRESHOLD = DEFAULT_RESIDENT_MAX_NUMEL
"""The old name of ``DEFAULT_RESIDENT_MAX_NUMEL``."""


@dataclass(frozen=True)
class ZeroConfig(StageConsequences):
    """How ``zero_compile`` shards and compiles a training step: ``zero_compile(config=
    ZeroConfig(...))``, or the same options as keywords of ``zero_compile``.

    The options that belong together can also be given, and are read back, as one policy
    each (policies.py): ``schedule=SchedulePolicy(...)``, ``offload=OffloadPolicy(...)``,
    ``quantization=QuantizationPolicy(...)``, ``recompute=RecomputePolicy(...)`` set the
    fields named in ``policies.FLAT_NAMES``; ``config.schedule``, ``config.offload_policy``,
    ``config.quantization`` and ``config.recompute_policy`` give them back.

    The options renamed after 0.1 (``DEPRECATED_OPTIONS``) are still accepted here and by
    ``zero_compile`` for one release, with a ``FutureWarning`` naming the new option."""

    stage: int = 3
    """ZeRO stage: 0 = DDP, 1 = shard optimizer states, 2 = + gradients, 3 = + parameters."""
    backend: Union[BackendName, Compiler] = "inductor"
    """Lowers the rewritten graph: "inductor", "aot_eager", "eager" (run the rewritten aten
    graph without compiling it: by regions, each run of compute as traced; with
    ``regional=False``, the whole graph as is), or a callable
    ``compiler(gm, example_inputs) -> callable``."""
    elementwise_optimizer: Optional[bool] = None
    """Declare that an optimizer zero_fx does not know updates each element
    independently (so it may step on flat shards). ``None``: known torch.optim
    optimizers only."""
    bucket_bytes: Union[int, str, None] = None
    """Fuse all-gathers, reduce-scatters and all-reduces up to this many bytes per
    launch; ``"blocks"``: one launch per repeated block of the model ([Note: buckets by
    block] in plan/layout.py). ``None``: the stage's default (``DEFAULT_BUCKET_BYTES``:
    blocks in stage 3, 25 MiB below); 0: one collective per parameter."""
    prefetch_buckets: int = 1
    """Stage 3: each all-gather is issued this many buckets ahead of the compute that
    needs it (within ``max_gathered_bytes``). 0: issued where it is used."""
    reduce_overlap_buckets: int = 1
    """Every stage: each gradient reduction (reduce-scatter, all-reduce) is waited for
    this many reductions after it is issued, so it runs during the backward. 0: waited
    right after it is issued."""
    regional: bool = True
    """"inductor" and "aot_eager": compile each distinct run of compute between
    collectives once and run the step's graph itself as Python, so compile time grows
    with the number of distinct runs, not with depth ([Note: regional compilation] in
    zero_fx/compiler/regions.py); "eager": the same outer graph, each run as traced. False
    compiles (or runs) the whole step as one program (see ``DebugOptions.pin_schedule``).
    Dynamic shapes always compile the whole step."""
    on_graph_break: str = "eager"
    """What a step dynamo cannot trace as one graph does (a branch on a tensor's value, a
    call it cannot trace): ``"eager"`` runs it as plain PyTorch on the sharded state, with
    a warning and ``explain()`` naming the break ([Note: eager sharded execution] in
    zero_fx/runtime/eager_fallback.py); ``"error"`` raises ``CaptureError`` naming the
    line, for one graph or nothing."""
    dynamic_shapes: str = "auto"
    """What a call with new input sizes (another sequence length or batch size) compiles.
    ``"auto"``: the first call compiles for its sizes; a call whose sizes differ compiles one
    graph with those sizes symbolic (dynamo's automatic dynamic shapes), which every later
    size then reuses: at most two compilations ([Note: one dynamic graph for every length]
    in zero_fx/capture/dynamic_shapes.py). ``"static"``: one graph per distinct shape, each
    specialised to its sizes (for steps whose lengths you bucket to a few values yourself).
    Sizes marked with ``torch._dynamo.mark_dynamic`` are symbolic from the first call either
    way."""
    max_gathered_bytes: Optional[int] = None
    """Stage 3: the most bytes of gathered (full) parameters alive at once; prefetching
    stops where it would exceed it. ``None``: bounded by ``prefetch_buckets`` only."""
    resident_max_numel: int = DEFAULT_RESIDENT_MAX_NUMEL
    """Stage 3: parameters with at most this many elements stay resident: gathered once
    per step and kept through forward and backward (no backward gather). 0: none."""
    keep_resident: Optional[Callable[[str, torch.nn.Parameter], bool]] = None
    """Stage 3: ``keep_resident(name, param)`` true keeps that parameter resident too."""
    passes: Sequence = field(default_factory=tuple)
    """The user's FX passes, run among ours: ``zero_fx.before(name, fn)``,
    ``zero_fx.after(name, fn)``, or a bare ``fn`` (right before ``check_invariants``).
    Each takes the GraphModule and returns it, or None after editing it in place."""
    mixed_precision: Optional[MixedPrecision] = None
    """Compute and gather in a lower precision, keep fp32 masters ([Note: mixed
    precision] in zero_fx/runtime/update/precision.py). None: everything in the parameters' dtype."""
    accumulation_steps: int = 1
    """Calls of the step per optimizer step ([Note: gradient accumulation] in
    zero_fx/runtime/update/update.py)."""
    max_grad_norm: Optional[float] = None
    """Clip the gradient to this global 2-norm before each optimizer step
    (``clip_grad_norm_`` semantics). None: no clipping."""
    optimizer_update: str = "auto"
    """Where the optimizer steps: ``"graph"``, in the graph, each bucket as soon as its
    reduction lands; ``"eager"``, after the graph, on every shard at once; ``"auto"``, in
    the graph where the step allows it, else after ([Note: the update in the graph] in
    zero_fx/runtime/update/graph_update.py)."""
    init_fn: Optional[Callable[[torch.nn.Module], None]] = None
    """A model built on the meta device: its own initialization after its modules are built,
    ``init_fn(module)`` for every module, children first ([Note: replaying construction] in
    zero_fx/materialize/events.py). None: each module's ``reset_parameters()`` (and
    HuggingFace models' ``_init_weights``)."""
    recompute: Union[None, str, Callable[[torch.fx.Node], str]] = None
    """What the backward recomputes instead of keeping from the forward ([Note: recompute as
    a graph pass] in passes/recompute_activations.py): None (keep what eager keeps);
    ``"blocks"``: keep only each repeated block's input (full activation checkpointing);
    ``"auto"``: keep what fits ``activation_budget_fraction`` or ``activation_budget_bytes``,
    the rest chosen by the cost model's recompute time per byte; or a policy
    ``fn(node) -> "save" | "recompute"`` asked for every forward op. Random ops (dropout)
    are never recomputed: their results are kept, so a recomputed dropout applies the
    forward's mask."""
    activation_budget_fraction: Optional[float] = None
    """``recompute="auto"``: keep this fraction, in (0, 1], of the bytes the backward would
    keep without recompute (as torch's partitioner knob ``activation_memory_budget``).
    Setting it alone means ``recompute="auto"``; default with ``"auto"``:
    ``DEFAULT_ACTIVATION_BUDGET``."""
    activation_budget_bytes: Optional[int] = None
    """``recompute="auto"``: keep at most this many bytes of activations for the backward.
    Setting it alone means ``recompute="auto"``. Not with ``activation_budget_fraction``."""
    mesh: Any = None
    """A ``DeviceMesh`` over every rank: 2-D ``(replicas, shards)`` with ``mesh_dim_names=
    ("replicate", "shard")`` shards within each shard group and all-reduces the gradient
    shards across replicas ([Note: hybrid sharding] in zero_fx/runtime/distributed/process_group.py);
    1-D, or None: flat sharding over every rank. Stage 0 ignores the shard dimension."""
    expert_parallel: int = 1
    """Stage 3, mixture-of-experts models: split each block's routed experts over this many
    ranks, tokens travelling to their experts' ranks and back ([Note: expert parallelism]
    in zero_fx/plan/expert_parallel.py). 1: every rank runs every expert."""
    expert_capacity_factor: Optional[float] = None
    """With ``expert_parallel``: each expert takes at most this many times its share of an
    even spread of the rows, the rest dropped (zero output, as GShard's capacity factor), so
    that a rank's buffer of received rows is about this many times the rows it sends
    ([Note: expert capacity] in zero_fx/capture/experts/expert_exchange.py). None: every row, in a
    buffer sized for the worst case."""
    offload: Optional[str] = None
    """Stages 1-3: ``"optimizer"`` keeps the fp32 masters and the optimizer's state in host
    memory (pinned on CUDA), steps the optimizer there, and gives the device the
    parameters' shards in the compute dtype ([Note: optimizer offload] in
    zero_fx/runtime/offload.py). Stage 3: ``"parameters"`` keeps those shards in host memory
    too, each bucket copied to the device right before its all-gather. ``"auto"``: the least
    of these whose step fits ``device_memory`` ([Note: choosing what to offload] in
    zero_fx/runtime/offload_choice.py). None: everything on the training device."""
    device_memory: Optional[int] = None
    """With ``offload``: the bytes of device memory a rank's step may fill, which
    ``offload="auto"`` and ``offload_update="auto"`` choose by. None: the training GPU's
    capacity (on the CPU, where host and device are one memory, nothing is offloaded and the
    optimizer steps on the host without it)."""
    offload_update: str = "auto"
    """With ``offload``: where the optimizer steps. ``"host"``: in host memory (ZeRO-Offload);
    ``"device"``: on the device, its state streamed in and out bucket by bucket ([Note: the
    update streamed through the device] in zero_fx/runtime/update/streamed_update.py); ``"auto"``:
    on the device where the device's budget (``device_memory``, or the GPU's capacity) has
    room for two buckets of state beside what stays on the device between steps, else on the
    host."""
    offload_step: str = "sync"
    """With ``offload``: ``"overlap"`` runs each optimizer step on the host while the next
    call's forward and backward run, which then read parameters one step stale
    (ZeRO-Offload's delayed parameter update, [Note: the delayed update] in
    zero_fx/runtime/update/update.py); ``"sync"``: every call reads the latest parameters."""
    quantize_weights: Union[None, str, Mapping[str, Optional[str]]] = None
    """Stage 3: the all-gathers move the parameters block-quantized, dequantized before
    use (ZeRO++'s qwZ; [Note: quantized blocks on the wire] in passes/common/quantized_code.py):
    ``"int8"`` or ``"fp8"`` (e4m3) for every gather, or ``{"forward": ..., "backward":
    ...}`` to choose each phase's apart (None in it: that phase's gathers as they are).
    The masters, the optimizer and the shards stay in full precision: only the copy on the
    wire is quantized. None: gathers move the parameters' own dtype."""
    quantize_gradients: Optional[str] = None
    """Stages 1-3: each gradient reduction moves ``"int8"`` or ``"int4"`` blocks by
    all-to-all, summed in fp32 on arrival (ZeRO++'s qgZ; [Note: reductions as
    all-to-alls] in passes/common/quantized_code.py); with hybrid sharding, the all-reduce across
    replicas too where that moves fewer bytes. None: reductions in the gradients' dtype."""
    quantize_block: int = 256
    """Elements per quantized block (one fp32 scale each, 4 bytes): a multiple of 8.
    Smaller blocks follow the values more closely and move more scales."""
    secondary_partition: Union[None, bool, int] = None
    """Stage 3: the forward's gathers also keep a copy of each parameter sharded within the
    node, and the backward gathers from it within the node only (ZeRO++'s hpZ; [Note: the
    secondary partition] in zero_fx/plan/secondary.py): the number of ranks per node, or
    True for torchrun's ``LOCAL_WORLD_SIZE`` (on a ("replicate", "shard") mesh: its "shard"
    dimension, and the primary shards then span the whole mesh). Costs ``Ψ / n``
    parameters per rank between the forward and the backward. None: every gather spans the
    shard group."""
    debug: DebugOptions = field(default_factory=DebugOptions)
    """Dumps, disabled passes, the ranks' agreement check, Inductor schedule pinning and
    collectives kept at a world of one (``DebugOptions``)."""

    def __post_init__(self):
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(
                f"stage must be 0, 1, 2 or 3 (0 = DDP, 1 = optimizer states, 2 = + gradients, "
                f"3 = + parameters); got {self.stage!r}"
            )
        if isinstance(self.backend, str) and self.backend not in NAMED_BACKENDS:
            raise ValueError(
                f"backend must be one of {NAMED_BACKENDS} or a callable compiler(gm, example_inputs); "
                f"got {self.backend!r}"
            )
        if not isinstance(self.backend, str) and not callable(self.backend):
            raise TypeError(f"backend must be a name or a callable, got {type(self.backend).__name__}")
        if not isinstance(self.debug, DebugOptions):
            raise TypeError(f"debug must be a zero_fx.DebugOptions(...), got "
                            f"{type(self.debug).__name__}")
        if self.on_graph_break not in ("eager", "error"):
            raise ValueError(f'on_graph_break must be "eager" (run a step that breaks the graph '
                             f'eagerly) or "error" (raise CaptureError); got {self.on_graph_break!r}')
        object.__setattr__(self, "passes", tuple(self.passes))
        pass_names(disable=self.debug.disable_passes, extra=self.passes)  # raises on a bad name or entry
        for name in ("bucket_bytes", "max_gathered_bytes"):
            value = getattr(self, name)
            if name == "bucket_bytes" and value == BLOCKS:
                continue
            if value is not None and (not isinstance(value, int) or value < 0):
                also = f", {BLOCKS!r}" if name == "bucket_bytes" else ""
                raise ValueError(f"{name} must be a number of bytes >= 0{also} or None, got {value!r}")
        for name in ("prefetch_buckets", "reduce_overlap_buckets", "resident_max_numel"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.keep_resident is not None and not callable(self.keep_resident):
            raise TypeError("keep_resident must be a callable (name, param) -> bool")
        if self.mixed_precision is not None and not isinstance(self.mixed_precision, MixedPrecision):
            raise TypeError("mixed_precision must be a zero_fx.MixedPrecision(param_dtype=...), got "
                            f"{type(self.mixed_precision).__name__}")
        if (not isinstance(self.accumulation_steps, int) or isinstance(self.accumulation_steps, bool)
                or self.accumulation_steps < 1):
            raise ValueError(f"accumulation_steps must be an int >= 1, got {self.accumulation_steps!r}")
        if self.max_grad_norm is not None and not (
                isinstance(self.max_grad_norm, (int, float)) and self.max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a number > 0 or None, got {self.max_grad_norm!r}")
        if self.optimizer_update not in OPTIMIZER_UPDATES:
            raise ValueError(f"optimizer_update must be one of {', '.join(map(repr, OPTIMIZER_UPDATES))}"
                             f", got {self.optimizer_update!r}")
        if self.recompute not in RECOMPUTE_MODES and not callable(self.recompute):
            raise ValueError(f"recompute must be None, 'blocks', 'auto' or a policy "
                             f"fn(node) -> 'save' | 'recompute'; got {self.recompute!r}")
        if self.dynamic_shapes not in DYNAMIC_SHAPES:
            raise ValueError(f"dynamic_shapes must be 'auto' (one dynamic graph once sizes "
                             f"change) or 'static' (one graph per shape); got {self.dynamic_shapes!r}")
        self._check_activation_budget()
        check_mesh(self.mesh, self.stage)
        check_expert_parallel(self.expert_parallel, self.stage, self.mesh,
                              self.expert_capacity_factor)
        check_offload(self.offload, self.stage, self.device_memory)
        check_offload_update(self.offload_update, self.offload, self.offload_step)
        if self.offload_step not in ("sync", "overlap"):
            raise ValueError(f"offload_step must be 'sync' or 'overlap', got {self.offload_step!r}")
        if self.offload_step == "overlap" and self.offload is None:
            raise ValueError("offload_step='overlap' overlaps the host's optimizer step with the "
                             "next call: it needs offload='optimizer' or 'parameters'")
        if self.offload_step == "overlap" and self.offload == "auto":
            raise ValueError("offload_step='overlap' makes every call read parameters one step "
                             "stale, and with offload='auto' whether it applies would depend on "
                             "memory: choose offload='optimizer' or 'parameters' with it")
        check_quantization(self.quantize_weights, self.quantize_gradients, self.quantize_block,
                           self.stage, self.accumulation_steps)
        check_secondary_partition(self.secondary_partition, self.stage, self.mesh,
                                  self.expert_parallel)
        if self.init_fn is not None and not callable(self.init_fn):
            raise TypeError(f"init_fn must be a callable init_fn(module), got {type(self.init_fn).__name__}")

    def _check_activation_budget(self) -> None:
        fraction, nbytes = self.activation_budget_fraction, self.activation_budget_bytes
        if fraction is None and nbytes is None:
            return
        name = "activation_budget_fraction" if fraction is not None else "activation_budget_bytes"
        if fraction is not None and nbytes is not None:
            raise ValueError("set activation_budget_fraction or activation_budget_bytes, not both")
        if self.recompute not in (None, "auto"):
            raise ValueError(f"{name} goes with recompute='auto', not recompute={self.recompute!r}")
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                     or not 0 < fraction <= 1):
            raise ValueError(f"activation_budget_fraction must be a fraction in (0, 1] of the "
                             f"activations; got {fraction!r} (a number of bytes is "
                             f"activation_budget_bytes)")
        if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int)
                                   or nbytes < 1):
            raise ValueError(f"activation_budget_bytes must be a number of bytes >= 1; got "
                             f"{nbytes!r} (a fraction of the activations is "
                             f"activation_budget_fraction)")

    def plan_options(self, hardware: str = "cpu-gloo") -> PlanOptions:
        """What the shard plan takes from this config: stage, residency, buckets, schedule,
        precision, accumulation, recompute (``"auto"`` ranks ops with the cost model's
        ``hardware`` preset), offload and quantization."""
        schedule, offload, quantization = self.schedule, self.offload_policy, self.quantization
        return PlanOptions(
            stage=self.stage,
            recompute=self._recompute_for_plan(hardware),
            resident_max_numel=self.resident_max_numel,
            keep_resident=self.keep_resident,
            bucket_bytes=(DEFAULT_BUCKET_BYTES[self.stage] if schedule.bucket_bytes is None
                          else schedule.bucket_bytes),
            prefetch=schedule.prefetch_buckets,
            reduce_overlap_buckets=schedule.reduce_overlap_buckets,
            memory_budget_bytes=schedule.max_gathered_bytes,
            accumulation_steps=self.accumulation_steps,
            # "auto" is resolved when the model is sharded (runtime/offload_choice.py)
            offload=None if offload.mode == "auto" else offload.mode,
            offload_step=offload.step,
            quantize_weights=weight_formats(quantization.weights),
            quantize_gradients=quantization.gradients,
            quantize_block=quantization.block,
            **(self.mixed_precision.plan_options() if self.mixed_precision else {}),
        )

    def _recompute_for_plan(self, preset: str):
        budget = (self.activation_budget_fraction if self.activation_budget_bytes is None
                  else self.activation_budget_bytes)
        if self.recompute != "auto" and budget is None:
            return self.recompute
        return ActivationBudget(DEFAULT_ACTIVATION_BUDGET if budget is None else budget,
                                seconds=functools.partial(node_seconds, hw=preset_hardware(preset)))

    # -- the options grouped as policies (policies.py) ----------------------------------
    @property
    def schedule(self) -> SchedulePolicy:
        """Buckets, prefetch, overlap and the gathered bytes' cap, as one policy."""
        return policy_from(self, "schedule")

    @property
    def offload_policy(self) -> OffloadPolicy:
        """``offload``, ``device_memory``, ``offload_update`` and ``offload_step``, as one policy."""
        return policy_from(self, "offload")

    @property
    def quantization(self) -> QuantizationPolicy:
        """The ``quantize_*`` options, as one policy."""
        return policy_from(self, "quantization")

    @property
    def recompute_policy(self) -> RecomputePolicy:
        """``recompute`` and its activation budget, as one policy."""
        return policy_from(self, "recompute")

    # -- the names of 0.1, for one release (DEPRECATED_OPTIONS) ---------------------------
    @property
    def prefetch(self) -> int:
        warn_renamed("prefetch", "prefetch_buckets (and reduce_overlap_buckets)", stacklevel=2)
        return self.prefetch_buckets

    @property
    def memory_budget_bytes(self) -> Optional[int]:
        warn_renamed("memory_budget_bytes", "max_gathered_bytes", stacklevel=2)
        return self.max_gathered_bytes

    @property
    def persistence_threshold(self) -> int:
        warn_renamed("persistence_threshold", "resident_max_numel", stacklevel=2)
        return self.resident_max_numel

    @property
    def activation_memory_budget(self) -> Union[float, int, None]:
        warn_renamed("activation_memory_budget",
                      "activation_budget_fraction or activation_budget_bytes", stacklevel=2)
        return (self.activation_budget_fraction if self.activation_budget_bytes is None
                else self.activation_budget_bytes)

    @property
    def pin_schedule(self) -> bool:
        warn_renamed("pin_schedule", "debug.pin_schedule", stacklevel=2)
        return self.debug.pin_schedule

    @property
    def disable_passes(self) -> tuple:
        warn_renamed("disable_passes", "debug.disable_passes", stacklevel=2)
        return self.debug.disable_passes

    @property
    def dump_dir(self) -> Optional[str]:
        warn_renamed("dump_dir", "debug.dump_dir", stacklevel=2)
        return self.debug.dump_dir

    @property
    def check_ranks(self) -> bool:
        warn_renamed("check_ranks", "debug.check_ranks", stacklevel=2)
        return self.debug.check_ranks


def describe_backend(backend: Any) -> str:
    return backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend))


_dataclass_init = ZeroConfig.__init__


@functools.wraps(_dataclass_init)
def _init_accepting_policies_and_old_names(self, *args, **kwargs):
    with old_names_in_errors(kwargs):
        _dataclass_init(self, *args, **flattened(translate_deprecated(kwargs, stacklevel=2)))


ZeroConfig.__init__ = _init_accepting_policies_and_old_names
