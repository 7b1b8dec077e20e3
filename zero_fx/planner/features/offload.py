"""Offload planned and priced: ``python -m zero_fx.plan --offload``.

[Note: planning offload]
``--offload`` plans ``zero_compile(offload=...)`` and sets every mode the stage allows side
by side, per rank (Ψ parameters, N ranks, p bytes of the compute dtype, o of optimizer
state, K = 4 + o + 4; ``offload_states``):

- ``none``: ``model_state_breakdown`` as above; stage 3 under mixed precision 16Ψ/N.
- ``optimizer`` (stages 1-3): the fp32 masters, the optimizer state and the fp32 gradient
  the optimizer reads live in host memory, KΨ/N (12Ψ/N + 4Ψ/N for Adam). The device keeps
  the compute-dtype parameters, its pΨ/N shard in stage 3 (whole, pΨ, in stages 1-2) and,
  as its gradients, two buckets' reduced shards on their way to the host (stage 1: the
  whole gradients it holds to the end of the backward). Stage 3 in bf16 goes from 16Ψ/N
  to 2Ψ/N plus those buckets.
- ``parameters`` (stage 3): the compute-dtype shards live on the host too ((p + K)Ψ/N,
  or KΨ/N in fp32 where the master is the parameter), and the device keeps two buckets'
  shards on their way to their gathers beside the gradients' two: its model states are
  buffers, and its peak the gathered working set.
- ``auto``: the first of these whose device peak (its model states without ``--seq``)
  fits ``--device-memory`` and whose host states fit the host memory.

Stage 0 is not offloaded (it shards nothing). The working set is not traced again: the
step traced without offload is priced again, as for tensor and expert parallelism. Its
outputs, the reduced gradients, live to the end of the step in the trace; offloaded, each
goes to the host as soon as it is reduced, so each counts until the next is made (one on
its way while the next is reduced). On one rank that is the difference between 27 GB and
1 GB of zero-offload-13b's working set with recompute of blocks: its 25.7 GB of fp16
gradients no longer pile up. The peak is then ``peak_of`` of the device states and that
working set. The gathers' buffers are the same with ``parameters``: a shard copied from
the host is gathered as one on the device would be.

Copies over the host link ([Note: pricing offload] in zero_fx/analysis/cost_model.py):
the reduced gradients go to the host in the compute dtype, pΨ/N (the host widens them to
fp32), during the backward; with ``optimizer`` the updated parameters come back after the
host's step, pΨ/N, which the next forward waits for; with ``parameters`` nothing comes
back, but each gather's shard comes over ahead of it (stage 3 gathers twice: about 2pΨ/N),
prefetched beside the compute. The step is max(compute without the device's optimizer
step, ZeRO's collectives, the copies that overlap) + the host's optimizer step + (with
``optimizer``) the copy back. What is approximated: the copies are not scheduled against
the traced order (a backward shorter than its gradients' copy is exposed only through the
max), the host step is not overlapped with the backward or delayed a step as
ZeRO-Offload's delayed parameter update does, and host memory counts model states only
(no pinned staging buffers, no allocator). ``largest_model`` inverts ``offload_states``:
the most parameters whose model states fit the device and the host, before activations.
"""

from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Optional

from torch.fx import GraphModule

from ...analysis.hardware import hardware
from ...config.checks import check_offload as check_config_offload
from ...config.policies import OffloadPolicy
from ...analysis.transfer_seconds import host_device_seconds, host_optimizer_seconds, ring_seconds
from ...analysis.memory_timeline import memory_timeline, peak_alive
from ...plan.layout import ShardPlan
from ..report import OPTIMIZER_BYTES, OffloadRow, PlanReport, peak_of
from ..table import model_state_breakdown


@dataclass(frozen=True)
class OffloadOptions:
    """What ``--offload`` plans ([Note: planning offload]): ``mode``, ``"none"``,
    ``"optimizer"``, ``"parameters"`` or ``"auto"`` (the least that fits ``device_memory``),
    with ``host_memory`` bytes a rank (None: the preset's) and ``device_memory`` bytes a
    device."""

    mode: str = "none"
    host_memory: Optional[float] = None
    device_memory: Optional[float] = None


OFFLOAD_MODES = ("none", "optimizer", "parameters")
"""``zero_compile(offload=...)``'s modes, least offload first; ``"auto"`` picks the first
that fits ([Note: planning offload])."""


def check_offload(offload: str, *, stage: int, device_memory: Optional[float] = None,
                  others: bool = False) -> None:
    """A ValueError that says what to do instead where ``offload`` cannot apply: the
    config's own offload check (``zero_fx.config.checks.check_offload``, with ``--offload
    none`` as its None), then what only the planner needs."""
    if offload not in (*OFFLOAD_MODES, "auto"):
        raise ValueError(f"offload must be one of {', '.join(OFFLOAD_MODES)} or auto, got "
                         f"{offload!r}")
    mode = None if offload == "none" else offload
    check_config_offload(OffloadPolicy(mode=mode, device_memory=None if mode is None
                                       else device_memory), stage)
    if mode is None:
        return
    if offload == "auto" and device_memory is None:
        raise ValueError("--offload auto picks the least offload that fits the device: give "
                         "--device-memory GB")
    if others:
        raise ValueError("plan --offload with --tp or --expert-parallel one at a time")


def offload_modes(stage: int) -> tuple[str, ...]:
    """The modes ``stage`` allows, least offload first."""
    return OFFLOAD_MODES if stage == 3 else OFFLOAD_MODES[:2]


def offload_states(stage: int, psi: float, world_size: int, mode: str, *, optimizer_bytes: int,
                   param_bytes: int, staging: tuple[float, float] = (0.0, 0.0)
                   ) -> tuple[dict[str, float], dict[str, float]]:
    """(device, host) model-state bytes per rank by kind under ``mode`` ([Note: planning
    offload]). ``staging``: bytes of the device's buffers for gradients on their way to the
    host and (``"parameters"``) for shards on their way to the device."""
    p, o, n = param_bytes, optimizer_bytes, world_size
    device = model_state_breakdown(stage, psi, n, optimizer_bytes=o, param_bytes=p,
                                   reduce_bytes=p)
    host = dict.fromkeys(device, 0.0)
    if mode == "none":
        return device, host
    grads, shards = staging
    whole = stage < 3  # stages 1 and 2 keep whole parameters on the device
    device = {"parameters": (p * psi if whole else p * psi / n) if mode == "optimizer" else shards,
              # stage 1 holds the whole gradients to the end of the backward
              "gradients": p * psi if stage == 1 else grads,
              "masters": 0.0, "optimizer": 0.0}
    host = {"parameters": p * psi / n if mode == "parameters" and p < 4 else 0.0,
            "gradients": 4 * psi / n, "masters": 4 * psi / n, "optimizer": o * psi / n}
    return device, host


def largest_model(stage: int, world_size: int, mode: str, *, optimizer_bytes: int,
                  param_bytes: int, device_memory: float, host_memory: float
                  ) -> tuple[float, str]:
    """The most parameters whose model states fit ``device_memory`` and ``host_memory`` bytes
    a rank under ``mode``, before activations and the working set, and which memory bounds
    them ("device" or "host"; [Note: planning offload])."""
    device, host = offload_states(stage, 1.0, world_size, mode, optimizer_bytes=optimizer_bytes,
                                  param_bytes=param_bytes)
    per_device, per_host = sum(device.values()), sum(host.values())
    on_device = device_memory / per_device if per_device else math.inf
    on_host = host_memory / per_host if per_host else math.inf
    return (on_device, "device") if on_device <= on_host else (on_host, "host")


def streamed_peak(gm: GraphModule) -> float:
    """The working set of ``gm`` with its gradient outputs streamed to the host: each output
    lives until the next one is made (one on its way while the next is reduced), not to the
    end of the step ([Note: planning offload])."""
    timeline = memory_timeline(gm)
    end = len(timeline.transient) - 1
    outputs = sorted(t.index for t in timeline.tensors if t.last_use == end)
    following = dict(zip(outputs, outputs[1:] + [end]))
    return peak_alive(len(timeline.transient),
                 ((t.index, following[t.index] if t.last_use == end else t.last_use, t.bytes)
                  for t in timeline.tensors))


def device_optimizer_seconds(plan: ShardPlan, preset: str) -> float:
    """The device's optimizer step as the cost model's replay prices it ([Note: the cost
    model]): what offload takes off the device."""
    hw = hardware(preset)
    shard = sum(l.shard_numel * l.dtype.itemsize for l in plan.params if plan.holds(l.name))
    return 7 * shard * (plan.world_size if plan.replicated else 1) / hw.memory_bandwidth \
        + hw.op_overhead * len(plan.params)


def plan_offload(report: PlanReport, offload: str, traced: Optional[dict],
                 host_memory: Optional[float], device_memory: Optional[float]) -> None:
    """Every mode the stage allows, side by side in ``report.offload_rows``, and the mode
    planned in ``report.offload`` (``"auto"``: the least offload that fits)."""
    hw = hardware(report.hardware)
    host_budget = hw.host_memory if host_memory is None else host_memory
    if not host_budget:
        raise ValueError(f"the preset {report.hardware} states no host memory: give "
                         "--host-memory GB")
    n, psi, p = report.world_size, report.psi, report.dtype.itemsize
    o, stage = OPTIMIZER_BYTES[report.optimizer], report.stages[report.stage]

    def largest(kind: str) -> int:
        return max((b.bytes for b in report.buckets.get(kind, [])), default=0)

    # double-buffered: one bucket's shard on its way while the next is reduced (gathered)
    staging = (2 * largest("reduce_scatter") / n, 2 * largest("all_gather") / n)
    collectives = sum(ring_seconds(size, range(n), hw) * (2 if kind == "all_reduce" else 1)
                      for kind, size in stage.traffic.items())
    rows = []
    for mode in offload_modes(report.stage):
        device, host = offload_states(report.stage, psi, n, mode, optimizer_bytes=o,
                                      param_bytes=p, staging=staging)
        working = None if traced is None else traced[1 if mode == "none" else "streamed"]
        shard = psi / n  # a rank's elements of masters, optimizer state, reduced gradients
        to_host = 0.0 if mode == "none" else p * shard
        to_device = {"none": 0.0, "optimizer": p * shard,
                     "parameters": stage.traffic.get("all_gather", 0) / n}[mode]
        compute = None
        if traced is not None:
            compute = traced["compute"] - (0.0 if mode == "none" else traced["device_optimizer"])
        rows.append(OffloadRow(
            mode=mode, device=device, host=host, working_set=working,
            peak_bytes=None if working is None else peak_of(device, working),
            to_host=to_host, to_device=to_device,
            copy_seconds=(0.0, 0.0) if mode == "none" else
            (host_device_seconds(to_host, hw), host_device_seconds(to_device, hw)),
            host_step_seconds=0.0 if mode == "none" else host_optimizer_seconds(
                shard, hw, optimizer_bytes=o, param_bytes=p),
            compute_seconds=compute, collective_seconds=collectives))
    report.offload_rows, report.host_memory = rows, host_budget
    report.device_memory = device_memory if device_memory is not None else (
        hw.device_memory or None)
    report.offload_auto = offload == "auto"
    if offload == "auto":
        report.offload = next((r.mode for r in rows if offload_fits(report, r)), rows[-1].mode)
    else:
        report.offload = offload


def offload_fits(report: PlanReport, row: OffloadRow) -> bool:
    """Whether ``row``'s device peak (its model states without ``seq``) fits the report's
    device memory and its host states the host memory."""
    device = row.device_bytes if row.peak_bytes is None else row.peak_bytes
    return ((report.device_memory is None or device <= report.device_memory)
            and row.host_bytes <= report.host_memory)
