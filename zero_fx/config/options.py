"""Configuration of a compiled step: ``ZeroConfig``, its options flat as users write them and
grouped as policies (policies.py, beside it); the checks that read the stage are in
checks.py, the names of 0.1 in renamed_options.py."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from ..analysis.cost_model import node_seconds
from ..analysis.hardware import hardware as preset_hardware
from .checks import (GRADIENT_FORMATS, MESH_DIM_NAMES, OFFLOAD_MODES,  # noqa: F401
                     RECOMPUTE_MODES, WEIGHT_FORMATS, check_expert_parallel, check_mesh,
                     check_offload, check_quantization, check_recompute, check_schedule,
                     check_secondary_partition, weight_formats)
from ..passes.pipeline import pass_names
from ..passes.recompute_activations import ActivationBudget
from ..plan.build import PlanOptions
from ..plan.layout import BLOCKS, StageConsequences
from .policies import (DUMP_ENV, FLAT_FIELDS, FLAT_NAMES, FLOAT_DTYPES, DebugOptions,  # noqa: F401
                       MixedPrecision, OffloadPolicy, QuantizationPolicy, RecomputePolicy,
                       SchedulePolicy, grouped)
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


POLICY_FIELDS = {keyword: cls for keyword, (cls, _) in FLAT_NAMES.items()}
"""The fields of ``ZeroConfig`` that hold a policy given by flat options too."""


@dataclass(frozen=True)
class ZeroConfig(StageConsequences):
    """How ``zero_compile`` shards and compiles a training step: ``zero_compile(config=
    ZeroConfig(...))``, or the same options as keywords of ``zero_compile``.

    The options that belong together are stored as one policy each (policies.py, where
    each of their options is documented): ``schedule``, ``offload``, ``quantization``,
    ``recompute`` (and ``mixed_precision``, ``debug``). Each is given whole
    (``offload=OffloadPolicy(...)``) or by its flat options (``offload="optimizer",
    offload_step="overlap"``: ``policies.FLAT_NAMES``), which the door gathers into the
    policy; ``config.offload.step`` reads it back, and so does ``config.offload_step``.

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
    schedule: SchedulePolicy = field(default_factory=SchedulePolicy)
    """How the collectives are fused and when they are issued and waited for: buckets,
    prefetch, overlap, the gathered bytes' cap (``SchedulePolicy``)."""
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
    recompute: RecomputePolicy = field(default_factory=RecomputePolicy)
    """What the backward recomputes instead of keeping from the forward, and the activation
    budget (``RecomputePolicy``)."""
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
    offload: OffloadPolicy = field(default_factory=OffloadPolicy)
    """What lives in host memory and where and when the optimizer steps (``OffloadPolicy``)."""
    quantization: QuantizationPolicy = field(default_factory=QuantizationPolicy)
    """What the collectives move quantized (``QuantizationPolicy``: ZeRO++'s qwZ, qgZ)."""
    secondary_partition: Union[None, bool, int] = None
    """Stage 3: the forward's gathers also keep a copy of each parameter sharded within the
    node, and the backward gathers from it within the node only (ZeRO++'s hpZ; [Note: the
    secondary partition] in zero_fx/plan/secondary.py): the number of ranks per node, or
    True for torchrun's ``LOCAL_WORLD_SIZE`` (on a ("replicate", "shard") mesh: its "shard"
    dimension, and the primary shards then span the whole mesh). Costs ``Ψ / n``
    parameters per rank between the forward and the backward. None: every gather spans the
    shard group."""
    saved_steps: bool = True
    """Write each compiled step's rewritten graph under ``$ZERO_FX_CACHE_DIR`` (default
    ``~/.cache/zero_fx``), and in a later process (a restart) load it in place of the capture
    and our passes when its fingerprint matches ([Note: saved steps] in
    zero_fx/compiler/saved_steps.py). False: neither written nor read;
    ``ZERO_FX_SAVED_STEPS=0`` turns them off for a whole process."""
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
        for name, cls in POLICY_FIELDS.items():
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"{name} must be a zero_fx.{cls.__name__}(...), got "
                                f"{type(getattr(self, name)).__name__}")
        check_schedule(self.schedule, BLOCKS)
        value = self.resident_max_numel
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"resident_max_numel must be an int >= 0, got {value!r}")
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
        if self.dynamic_shapes not in DYNAMIC_SHAPES:
            raise ValueError(f"dynamic_shapes must be 'auto' (one dynamic graph once sizes "
                             f"change) or 'static' (one graph per shape); got {self.dynamic_shapes!r}")
        check_recompute(self.recompute)
        check_mesh(self.mesh, self.stage)
        check_expert_parallel(self.expert_parallel, self.stage, self.mesh,
                              self.expert_capacity_factor)
        check_offload(self.offload, self.stage)
        check_quantization(self.quantization, self.stage, self.accumulation_steps)
        check_secondary_partition(self.secondary_partition, self.stage, self.mesh,
                                  self.expert_parallel)
        if self.init_fn is not None and not callable(self.init_fn):
            raise TypeError(f"init_fn must be a callable init_fn(module), got {type(self.init_fn).__name__}")

    def plan_options(self, hardware: str = "cpu-gloo") -> PlanOptions:
        """What the shard plan takes from this config: stage, residency, buckets, schedule,
        precision, accumulation, recompute (``"auto"`` ranks ops with the cost model's
        ``hardware`` preset), offload and quantization."""
        schedule, offload, quantization = self.schedule, self.offload, self.quantization
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
        policy = self.recompute
        budget = policy.budget_fraction if policy.budget_bytes is None else policy.budget_bytes
        if policy.mode != "auto" and budget is None:
            return policy.mode
        return ActivationBudget(DEFAULT_ACTIVATION_BUDGET if budget is None else budget,
                                seconds=functools.partial(node_seconds, hw=preset_hardware(preset)))

    def __getattr__(self, name: str):
        """A flat option's value, read from its policy (``config.offload_step`` is
        ``config.offload.step``: ``policies.FLAT_FIELDS``)."""
        where = FLAT_FIELDS.get(name)
        if where is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(getattr(self, where[0]), where[1])

    def replaced(self, **options) -> "ZeroConfig":
        """This config with ``options`` changed, flat ones too (``config.replaced(
        offload_step="sync")`` changes ``offload.step``): ``dataclasses.replace`` takes
        fields only."""
        changes, policies = {}, {}
        for name, value in options.items():
            keyword, field_name = FLAT_FIELDS.get(name, (None, None))
            if keyword is None or isinstance(value, POLICY_FIELDS[keyword]):
                changes[name] = value
            else:
                policies.setdefault(keyword, {})[field_name] = value
        for keyword, fields in policies.items():
            changes[keyword] = dataclasses.replace(changes.get(keyword, getattr(self, keyword)),
                                                   **fields)
        return dataclasses.replace(self, **changes)

    @property
    def offload_policy(self) -> OffloadPolicy:
        """``offload`` (the name this policy was read back by before the config stored it)."""
        return self.offload

    @property
    def recompute_policy(self) -> RecomputePolicy:
        """``recompute`` (the name this policy was read back by before the config stored it)."""
        return self.recompute

    # -- the names of 0.1, for one release (DEPRECATED_OPTIONS) ---------------------------
    @property
    def prefetch(self) -> int:
        warn_renamed("prefetch", "prefetch_buckets (and reduce_overlap_buckets)", stacklevel=2)
        return self.schedule.prefetch_buckets

    @property
    def memory_budget_bytes(self) -> Optional[int]:
        warn_renamed("memory_budget_bytes", "max_gathered_bytes", stacklevel=2)
        return self.schedule.max_gathered_bytes

    @property
    def persistence_threshold(self) -> int:
        warn_renamed("persistence_threshold", "resident_max_numel", stacklevel=2)
        return self.resident_max_numel

    @property
    def activation_memory_budget(self) -> Union[float, int, None]:
        warn_renamed("activation_memory_budget",
                      "activation_budget_fraction or activation_budget_bytes", stacklevel=2)
        policy = self.recompute
        return policy.budget_fraction if policy.budget_bytes is None else policy.budget_bytes

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
        _dataclass_init(self, *args, **grouped(translate_deprecated(kwargs, stacklevel=2)))


ZeroConfig.__init__ = _init_accepting_policies_and_old_names
