"""The options that belong together, as frozen policies (FSDP2's ``MixedPrecisionPolicy``,
``OffloadPolicy``): mixed precision, the collectives' schedule, offload, quantized
communication and recompute. Each option is documented here, in its policy.

``ZeroConfig`` stores each policy as one field (``config.schedule``, ``config.offload``,
``config.quantization``, ``config.recompute``, ``config.mixed_precision``), and the code
reads them there (``config.offload.step``). ``zero_compile`` and ``ZeroConfig`` take each
policy whole (``offload=OffloadPolicy(...)``) or its fields by their flat option names
(``bucket_bytes=``, ``offload="optimizer"``, ``offload_step="overlap"``), which
``FLAT_NAMES`` lists and ``grouped`` translates at the door, as the renamed options are.
A ``ZeroConfig`` still answers a flat name (``config.offload_step``) with its policy's
field. The values are checked, against the stage and each other, when the ``ZeroConfig``
is built (checks.py).
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
    """Fuse all-gathers, reduce-scatters and all-reduces up to this many bytes per
    launch; ``"blocks"``: one launch per repeated block of the model ([Note: buckets by
    block] in plan/layout.py). ``None``: the stage's default (``DEFAULT_BUCKET_BYTES``:
    blocks in stage 3, 25 MiB below); 0: one collective per parameter. Flat name:
    ``bucket_bytes``."""
    prefetch_buckets: int = 1
    """Stage 3: each all-gather is issued this many buckets ahead of the compute that
    needs it (within ``max_gathered_bytes``). 0: issued where it is used. Flat name:
    ``prefetch_buckets``."""
    reduce_overlap_buckets: int = 1
    """Every stage: each gradient reduction (reduce-scatter, all-reduce) is waited for
    this many reductions after it is issued, so it runs during the backward. 0: waited
    right after it is issued. Flat name: ``reduce_overlap_buckets``."""
    max_gathered_bytes: Optional[int] = None
    """Stage 3: the most bytes of gathered (full) parameters alive at once; prefetching
    stops where it would exceed it. ``None``: bounded by ``prefetch_buckets`` only. Flat
    name: ``max_gathered_bytes``."""


@dataclass(frozen=True)
class OffloadPolicy:
    """What lives in host memory and where the optimizer steps (``zero_compile(offload=
    OffloadPolicy(...))``; FSDP2's ``CPUOffloadPolicy``, DeepSpeed's ``offload_optimizer``)."""

    mode: Optional[str] = None
    """Stages 1-3: ``"optimizer"`` keeps the fp32 masters and the optimizer's state in host
    memory (pinned on CUDA), steps the optimizer there, and gives the device the
    parameters' shards in the compute dtype ([Note: optimizer offload] in
    zero_fx/runtime/offload.py). Stage 3: ``"parameters"`` keeps those shards in host memory
    too, each bucket copied to the device right before its all-gather. ``"auto"``: the least
    of these whose step fits ``device_memory`` ([Note: choosing what to offload] in
    zero_fx/runtime/offload_choice.py). None: everything on the training device. Flat name:
    ``offload``."""
    device_memory: Optional[int] = None
    """With ``mode``: the bytes of device memory a rank's step may fill, which ``"auto"``
    and ``update="auto"`` choose by. None: the training GPU's capacity (on the CPU, where
    host and device are one memory, nothing is offloaded and the optimizer steps on the
    host without it). Flat name: ``device_memory``."""
    update: str = "auto"
    """With ``mode``: where the optimizer steps. ``"host"``: in host memory (ZeRO-Offload);
    ``"device"``: on the device, its state streamed in and out bucket by bucket ([Note: the
    update streamed through the device] in zero_fx/runtime/update/streamed_update.py);
    ``"auto"``: on the device where the device's budget (``device_memory``, or the GPU's
    capacity) has room for two buckets of state beside what stays on the device between
    steps, else on the host. Flat name: ``offload_update``."""
    step: str = "sync"
    """With ``mode``: ``"overlap"`` runs each optimizer step on the host while the next
    call's forward and backward run, which then read parameters one step stale
    (ZeRO-Offload's delayed parameter update, [Note: the delayed update] in
    zero_fx/runtime/update/update.py); ``"sync"``: every call reads the latest parameters.
    Flat name: ``offload_step``."""

    @property
    def delayed(self) -> bool:
        """The delayed update: each host step overlaps the next call."""
        return self.step == "overlap"


@dataclass(frozen=True)
class QuantizationPolicy:
    """What the collectives move quantized (``zero_compile(quantization=...)``; ZeRO++'s
    qwZ and qgZ)."""

    weights: Union[None, str, Mapping[str, Optional[str]]] = None
    """Stage 3: the all-gathers move the parameters block-quantized, dequantized before
    use (ZeRO++'s qwZ; [Note: quantized blocks on the wire] in passes/common/quantized_code.py):
    ``"int8"`` or ``"fp8"`` (e4m3) for every gather, or ``{"forward": ..., "backward":
    ...}`` to choose each phase's apart (None in it: that phase's gathers as they are).
    The masters, the optimizer and the shards stay in full precision: only the copy on the
    wire is quantized. None: gathers move the parameters' own dtype. Flat name:
    ``quantize_weights``."""
    gradients: Optional[str] = None
    """Stages 1-3: each gradient reduction moves ``"int8"`` or ``"int4"`` blocks by
    all-to-all, summed in fp32 on arrival (ZeRO++'s qgZ; [Note: reductions as
    all-to-alls] in passes/common/quantized_code.py); with hybrid sharding, the all-reduce across
    replicas too where that moves fewer bytes. None: reductions in the gradients' dtype.
    Flat name: ``quantize_gradients``."""
    block: int = 256
    """Elements per quantized block (one fp32 scale each, 4 bytes): a multiple of 8.
    Smaller blocks follow the values more closely and move more scales. Flat name:
    ``quantize_block``."""


@dataclass(frozen=True)
class RecomputePolicy:
    """What the backward recomputes instead of keeping (``zero_compile(recompute=
    RecomputePolicy(...))``; FSDP2's ``checkpoint_wrapper``, torch's activation budget)."""

    mode: Union[None, str, Callable[[torch.fx.Node], str]] = None
    """What the backward recomputes instead of keeping from the forward ([Note: recompute as
    a graph pass] in passes/recompute_activations.py): None (keep what eager keeps);
    ``"blocks"``: keep only each repeated block's input (full activation checkpointing);
    ``"auto"``: keep what fits ``budget_fraction`` or ``budget_bytes``, the rest chosen by
    the cost model's recompute time per byte; or a policy ``fn(node) -> "save" |
    "recompute"`` asked for every forward op. Random ops (dropout) are never recomputed:
    their results are kept, so a recomputed dropout applies the forward's mask. Flat name:
    ``recompute``."""
    budget_fraction: Optional[float] = None
    """``"auto"``: keep this fraction, in (0, 1], of the bytes the backward would keep
    without recompute (as torch's partitioner knob ``activation_memory_budget``). Setting
    it alone means ``mode="auto"``; default with ``"auto"``: ``DEFAULT_ACTIVATION_BUDGET``
    (half). Flat name: ``activation_budget_fraction``."""
    budget_bytes: Optional[int] = None
    """``"auto"``: keep at most this many bytes of activations for the backward. Setting it
    alone means ``mode="auto"``. Not with ``budget_fraction``. Flat name:
    ``activation_budget_bytes``."""


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


FLAT_FIELDS = {flat: (keyword, name) for keyword, (_, names) in FLAT_NAMES.items()
               for name, flat in names.items()}
"""Each flat option -> (the policy keyword that holds it, its field there)."""


def grouped(options: dict) -> dict:
    """``options`` (``ZeroConfig``'s keywords) with the flat options of each policy gathered
    into that policy: ``{"offload": "optimizer", "offload_step": "overlap"}`` becomes
    ``{"offload": OffloadPolicy(mode="optimizer", step="overlap")}``. A policy none of whose
    options is given stays out (the field's default). Raises ``TypeError`` for a policy
    keyword given something else than its policy (``schedule=``, ``quantization=``), and
    ``ValueError`` when a policy and one of its flat options are both given."""
    out = dict(options)
    for keyword, (cls, names) in FLAT_NAMES.items():
        policy = out.pop(keyword, None)
        flat = {name: out.pop(option) for name, option in names.items()
                if option != keyword and option in out}
        if isinstance(policy, cls):
            for name in flat:
                raise ValueError(f"{names[name]} is set both as a keyword and in {keyword}="
                                 f"{cls.__name__}(...): set it in one place")
            out[keyword] = policy
            continue
        if keyword in options and keyword in names.values():  # offload="optimizer"
            flat[next(n for n, o in names.items() if o == keyword)] = policy
        elif policy is not None:
            raise TypeError(f"{keyword} must be a zero_fx.{cls.__name__}(...), got "
                            f"{type(policy).__name__}")
        if flat:
            out[keyword] = cls(**flat)
    return out
