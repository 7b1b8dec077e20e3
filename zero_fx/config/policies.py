"""The options that belong together, as frozen policies (FSDP2's ``MixedPrecisionPolicy``,
``OffloadPolicy``): mixed precision, the collectives' schedule, offload, quantized
communication and recompute.

``zero_compile`` and ``ZeroConfig`` take each policy whole (``schedule=SchedulePolicy(...)``,
``offload=OffloadPolicy(...)``, ``quantization=QuantizationPolicy(...)``,
``recompute=RecomputePolicy(...)``, ``mixed_precision=MixedPrecision(...)``) or its fields
by their flat option names (``bucket_bytes=``, ``offload="optimizer"``, ...), which
``FLAT_NAMES`` lists; a ``ZeroConfig`` gives them back grouped (``config.schedule``,
``config.offload_policy``, ``config.quantization``, ``config.recompute_policy``). Each
field means what its flat option means (``ZeroConfig``'s docstrings); the values are
checked, against the stage and each other, when the ``ZeroConfig`` is built.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence, Union

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class MixedPrecision:
    """How a compiled step computes, communicates and scales (``zero_compile(mixed_precision=...)``).

    Like FSDP2's ``MixedPrecisionPolicy``; see [Note: mixed precision] in runtime/update/precision.py.
    """

    param_dtype: torch.dtype = torch.bfloat16
    """Forward and backward compute, and all-gathers move, this dtype."""
    reduce_dtype: Optional[torch.dtype] = None
    """Gradients are reduced in this dtype; None: ``param_dtype``. ``torch.float32``
    reduces more precisely, at twice the reduce traffic of bf16."""
    output_dtype: Optional[torch.dtype] = None
    """Cast the model's floating-point outputs to this dtype (e.g. float32 logits for
    the loss); None: leave them in ``param_dtype``."""
    cast_forward_inputs: bool = True
    """Cast the model's floating-point inputs to ``param_dtype``."""
    loss_scale: Union[str, float, None] = "auto"
    """"dynamic": GradScaler's dynamic loss scaling; a number: a static scale; None:
    no scaling; "auto": dynamic for float16, none otherwise."""
    initial_scale: float = 2.0 ** 16
    growth_interval: int = 2000
    """Dynamic scaling doubles the scale after this many steps without an overflow."""

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and dtype not in FLOAT_DTYPES:
                raise ValueError(f"MixedPrecision.{name} must be a floating dtype "
                                 f"({', '.join(map(str, FLOAT_DTYPES))}), got {dtype!r}")
        scale = self.loss_scale
        if not (scale is None or scale in ("auto", "dynamic")
                or (isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0)):
            raise ValueError(f'MixedPrecision.loss_scale must be "auto", "dynamic", a positive '
                             f"number or None, got {scale!r}")
        if self.initial_scale <= 0 or self.growth_interval < 1:
            raise ValueError("MixedPrecision.initial_scale must be > 0 and growth_interval >= 1")

    @property
    def scales_loss(self) -> bool:
        if self.loss_scale == "auto":
            return self.param_dtype == torch.float16
        return self.loss_scale is not None

    @property
    def dynamic_scaling(self) -> bool:
        return self.scales_loss and self.loss_scale in ("auto", "dynamic")

    def plan_options(self) -> dict:
        """What the shard plan records of this policy."""
        return {"compute_dtype": self.param_dtype,
                "reduce_dtype": self.reduce_dtype or self.param_dtype,
                "loss_scaled": self.scales_loss}


@dataclass(frozen=True)
class SchedulePolicy:
    """How the collectives are fused and when they are issued and waited for
    (``zero_compile(schedule=...)``; FSDP2's units and prefetch, DeepSpeed's bucket sizes)."""

    bucket_bytes: Union[int, str, None] = None
    """``ZeroConfig.bucket_bytes``: bytes per fused collective, ``"blocks"``, or None (the
    stage's default)."""
    prefetch_buckets: int = 1
    """``ZeroConfig.prefetch_buckets``: stage 3's all-gathers issued this many buckets early."""
    reduce_overlap_buckets: int = 1
    """``ZeroConfig.reduce_overlap_buckets``: each reduction waited for this many later."""
    max_gathered_bytes: Optional[int] = None
    """``ZeroConfig.max_gathered_bytes``: stage 3's cap on gathered bytes alive at once."""


@dataclass(frozen=True)
class OffloadPolicy:
    """What lives in host memory and where the optimizer steps (``zero_compile(offload=
    OffloadPolicy(...))``; FSDP2's ``CPUOffloadPolicy``, DeepSpeed's ``offload_optimizer``)."""

    mode: Optional[str] = None
    """``ZeroConfig.offload``: None, ``"optimizer"``, ``"parameters"`` or ``"auto"``."""
    device_memory: Optional[int] = None
    """``ZeroConfig.device_memory``: the device's budget ``"auto"`` chooses by."""
    update: str = "auto"
    """``ZeroConfig.offload_update``: ``"host"``, ``"device"`` or ``"auto"``."""
    step: str = "sync"
    """``ZeroConfig.offload_step``: ``"sync"`` or ``"overlap"`` (the delayed update)."""


@dataclass(frozen=True)
class QuantizationPolicy:
    """What the collectives move quantized (``zero_compile(quantization=...)``; ZeRO++'s
    qwZ and qgZ)."""

    weights: Union[None, str, Mapping[str, Optional[str]]] = None
    """``ZeroConfig.quantize_weights``: stage 3's gathers, ``"int8"``, ``"fp8"`` or per phase."""
    gradients: Optional[str] = None
    """``ZeroConfig.quantize_gradients``: the reductions, ``"int8"`` or ``"int4"``."""
    block: int = 256
    """``ZeroConfig.quantize_block``: elements per block (one fp32 scale each)."""


@dataclass(frozen=True)
class RecomputePolicy:
    """What the backward recomputes instead of keeping (``zero_compile(recompute=
    RecomputePolicy(...))``; FSDP2's ``checkpoint_wrapper``, torch's activation budget)."""

    mode: Union[None, str, Callable[[torch.fx.Node], str]] = None
    """``ZeroConfig.recompute``: None, ``"blocks"``, ``"auto"`` or ``fn(node)``."""
    budget_fraction: Optional[float] = None
    """``ZeroConfig.activation_budget_fraction``: ``"auto"``'s budget as a fraction."""
    budget_bytes: Optional[int] = None
    """``ZeroConfig.activation_budget_bytes``: ``"auto"``'s budget in bytes."""


DUMP_ENV = "ZERO_FX_DUMP"
"""Set to a folder to dump every compiled step's graphs there (see ``DebugOptions.dump_dir``)."""


@dataclass(frozen=True)
class DebugOptions:
    """Options for debugging and comparing a compiled step (``zero_compile(debug=...)``);
    the defaults are what training wants."""

    dump_dir: Optional[str] = None
    """Write the graph before and after each pass (text and HTML), the memory
    plot and ``explain()`` under this folder at each compilation. ``None``: the
    environment variable ``ZERO_FX_DUMP``, if set; otherwise no dumps."""
    disable_passes: Sequence[str] = field(default_factory=tuple)
    """Names of our passes to skip (see ``zero_fx.passes.PASS_ORDER``)."""
    check_ranks: bool = True
    """Before each call's first collective, check that all ranks are about to run the
    same graph (one 8-byte all-gather; a mismatch raises ``RanksDisagreeError`` instead
    of hanging: [Note: checking that ranks agree] in zero_fx/runtime/distributed/rank_agreement.py).
    False skips the check."""
    pin_schedule: bool = True
    """``regional=False`` with Inductor only (it does nothing under the default
    ``regional=True``): hold Inductor's generated program to our collective schedule with
    control dependencies ([Note: pinning the schedule through Inductor] in
    zero_fx/compiler/pin_schedule.py); ``explain()`` says whether the program runs it.
    False lets Inductor re-sort the collectives: for comparison only."""
    keep_collectives_at_world_one: bool = False
    """At a world of one rank, issue every collective a world of N ranks would, on the process
    group of one, so that its backend (NCCL on one GPU, gloo) runs each kind zero_fx emits:
    the all-gathers and reduce-scatters of stages 1-3 (bucketed, prefetched and overlapped as
    at N ranks), stage 0's all-reduce, the quantized gathers and reductions, the routed
    experts' exchanges (an expert-parallel group of one, stages 1-3), NCCL's AVG reductions,
    the clipping norm's all-reduce, the ranks' check and NCCL's fences. Over one rank each
    is an identity, so the values are those of the step without it, but for quantized
    collectives, whose values pass through the quantized blocks as at N ranks. Needs a
    process group (``zero_fx.init_distributed()`` or ``init_process_group`` with world size
    1): without one it is an error. At more than one rank it changes nothing. [Note:
    collectives kept at a world of one] in zero_fx/runtime/distributed/process_group.py."""

    def __post_init__(self):
        object.__setattr__(self, "disable_passes", tuple(self.disable_passes))
        if self.dump_dir is None and os.environ.get(DUMP_ENV):
            object.__setattr__(self, "dump_dir", os.environ[DUMP_ENV])


FLAT_NAMES = {
    "schedule": (SchedulePolicy, {"bucket_bytes": "bucket_bytes",
                                  "prefetch_buckets": "prefetch_buckets",
                                  "reduce_overlap_buckets": "reduce_overlap_buckets",
                                  "max_gathered_bytes": "max_gathered_bytes"}),
    "offload": (OffloadPolicy, {"mode": "offload", "device_memory": "device_memory",
                                "update": "offload_update", "step": "offload_step"}),
    "quantization": (QuantizationPolicy, {"weights": "quantize_weights",
                                          "gradients": "quantize_gradients",
                                          "block": "quantize_block"}),
    "recompute": (RecomputePolicy, {"mode": "recompute",
                                    "budget_fraction": "activation_budget_fraction",
                                    "budget_bytes": "activation_budget_bytes"}),
}
"""The keyword each policy is given by -> (its class, its field -> the flat option that
sets that field alone)."""


def policy_from(options, keyword: str):
    """The policy given by ``keyword``, read from ``options``' flat fields (a ``ZeroConfig``)."""
    cls, names = FLAT_NAMES[keyword]
    return cls(**{field: getattr(options, flat) for field, flat in names.items()})


def flattened(options: dict) -> dict:
    """``options`` (``ZeroConfig``'s keywords) with each policy given whole replaced by its
    flat options. Raises ``ValueError`` when a policy and one of its flat options are both
    given."""
    flat = dict(options)
    for keyword, (cls, names) in FLAT_NAMES.items():
        policy = options.get(keyword)
        if policy is None and keyword not in names.values():  # schedule=None: not given
            flat.pop(keyword, None)
            continue
        if not isinstance(policy, cls):
            if keyword in options and keyword not in names.values():
                raise TypeError(f"{keyword} must be a zero_fx.{cls.__name__}(...), got "
                                f"{type(policy).__name__}")
            continue
        del flat[keyword]
        for field, name in names.items():
            if name in flat and name != keyword:
                raise ValueError(f"{name} is set both as a keyword and in {keyword}="
                                 f"{cls.__name__}(...): set it in one place")
            flat[name] = getattr(policy, field)
    return flat
