"""One peer on this rank: build the model, train it, measure the same things as for every peer:
each step's time and loss, the allocator's peak, and after the timed steps the host's
enqueue time of a step (bench/helpers/host_enqueue.py)."""

from __future__ import annotations

import gc
import os
import statistics
import time

import torch
import torch.distributed as dist

from ..helpers import cpu_memory, host_enqueue, mfu, wire
from ..helpers.profile_step import profile_step
from . import fake_group
from .models import BenchModel, global_batch, rank_batch
from .trainers import PEERS, Setting


class _CudaMemory:
    allocated = staticmethod(torch.cuda.memory_allocated)
    max_allocated = staticmethod(torch.cuda.max_memory_allocated)
    reset_peak = staticmethod(torch.cuda.reset_peak_memory_stats)


def memory_meter(device: torch.device):
    """The allocator's bytes: CUDA's own statistics, or the counting CPU allocator
    (see [Note: one meter for every peer's CPU memory] in bench/helpers/cpu_memory.py)."""
    if device.type == "cuda":
        return _CudaMemory
    cpu_memory.install()
    return cpu_memory


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mean_over_ranks(value: torch.Tensor, world: int) -> float:
    """The loss averaged over ranks; under the fake group this rank's own (its all-reduce
    leaves the value as it is: [Note: losses under the fake process group])."""
    value = value.detach().float().clone()
    if world > 1 and not fake_group.active():
        dist.all_reduce(value)  # SUM then divide: gloo's AVG is unreliable
        value /= world
    return value.item()


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


ENQUEUE_STEPS = 2
"""Steps after the timed ones whose host enqueue time is measured (the least is reported)."""


def run_peer(name: str, spec: BenchModel, setting: Setting, steps: int, warmup: int,
             count_wire: bool = True, profile: bool = False) -> dict:
    """Train ``steps`` steps; the first ``warmup`` (which include the first, with any
    compilation) are not timed. Returns this rank's row; times are per step, memory
    peaks over the timed steps. Then ``ENQUEUE_STEPS`` more, untimed and their losses
    left out, measure the host's enqueue time; with ``profile``, one more runs under the
    profiler (bench/helpers/profile_step.py: kernels, launches, the GPU's idle time)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = setting.device
    meter = memory_meter(device)
    torch.manual_seed(0)
    with torch.device(device):  # built where it trains: a 1B model's init is slow on the host
        model = spec.build()
    psi = sum(p.numel() for p in model.parameters())
    loss_steps = (fake_group.comparable_loss_steps(model, device, steps) if fake_group.active()
                  else None)
    trainer = PEERS[name](model, spec, setting)

    def batch(step):
        if trainer.whole_batch:
            return tuple(t.to(device) for t in global_batch(spec, step, world))
        return rank_batch(spec, step, rank, world, device)

    losses, times, sent = [], [], []
    first_step_s = None
    for step in range(steps):
        x, y = batch(step)
        if step == warmup:
            gc.collect()
            meter.reset_peak()
        if dist.is_initialized():
            dist.barrier()
        _sync(device)
        sent_before, start = wire.bytes_sent() if count_wire else 0, time.perf_counter()
        loss = trainer.step(x, y)
        _sync(device)
        elapsed = time.perf_counter() - start
        sent_bytes = (wire.bytes_sent() if count_wire else 0) - sent_before
        if step == 0:
            first_step_s = elapsed
        if step >= warmup:
            times.append(elapsed)
            sent.append(sent_bytes)
        losses.append(_mean_over_ranks(loss, world))
        if rank == 0:
            print(f"  {name}: step {step + 1}/{steps} {elapsed * 1e3:.0f} ms "
                  f"loss {losses[-1]:.4f}", flush=True)
    peak_bytes, held_bytes = meter.max_allocated(), meter.allocated()
    enqueue = _enqueue_times(trainer, batch, steps, statistics.median(times), device)
    if rank == 0:
        print(f"  {name}: host enqueue {min(e.seconds for e in enqueue) * 1e3:.1f} ms"
              + (" (blocked: it waited for the device)" if any(e.blocked for e in enqueue) else ""),
              flush=True)
    profiled = None
    if profile:
        x, y = batch(steps + ENQUEUE_STEPS)
        profiled = profile_step(lambda: trainer.step(x, y), device)
    device_name = _device_name(device)
    row = {
        "peer": name,
        "rank": rank,
        "pid": os.getpid(),
        "psi": psi,
        "device_name": device_name,
        "first_step_s": first_step_s,
        "step_s": times,
        "median_step_s": statistics.median(times),
        "tokens_per_step": x.numel(),
        "flops_per_token": (None if spec.gpt is None
                            else mfu.gpt_flops_per_token(spec.gpt, spec.seq)),
        "peak_flops": mfu.peak_bf16_flops(device_name) if device.type == "cuda" else None,
        "enqueue_s": [e.seconds for e in enqueue],
        "enqueue_blocked": any(e.blocked for e in enqueue),
        "enqueue_hold_s": enqueue[0].hold_s,
        "enqueue_synchronous": device.type == "cpu",  # the step's own time on the host
        "peak_bytes": peak_bytes,
        "held_bytes": held_bytes,
        "sent_bytes_per_step": statistics.median(sent) if count_wire else None,
        "losses": losses,
        "loss_steps_compared": steps if loss_steps is None else loss_steps.steps,
        "loss_steps_why": "every step" if loss_steps is None else loss_steps.why,
        "whole_batch": trainer.whole_batch,
        "profile": profiled,
    }
    if trainer.zero_fx_step is not None:
        report = trainer.zero_fx_step.traffic()
        row["compile_s"] = trainer.zero_fx_step.compile_seconds[0]
        row["ring_bytes_per_step"] = report.wire_bytes()
        row["traffic_psi"] = report.psi_by_kind()
        # the graph's own estimate of its peak ([Note: the memory timeline]) and, under
        # Inductor, its generated program's (read from its code), beside the measure
        timeline = trainer.zero_fx_step.explain().memory
        row["predicted_peak_bytes"] = timeline.peak_bytes
        lowered = trainer.zero_fx_step.compilations[-1].memory
        if lowered is not None:
            row["predicted_lowered_peak_bytes"] = timeline.persistent_bytes + lowered.peak_bytes
    return row


def _enqueue_times(trainer, batch, steps: int, step_s: float,
                   device: torch.device) -> list[host_enqueue.EnqueueTime]:
    """``ENQUEUE_STEPS`` steps more, each launched behind a device hold ([Note: measuring
    the host's enqueue time]); their batches are ready on the device before the hold."""
    hold = host_enqueue.hold_for(device)
    seconds = host_enqueue.hold_seconds(hold, step_s)
    times = []
    for step in range(steps, steps + ENQUEUE_STEPS):
        x, y = batch(step)
        if dist.is_initialized():
            dist.barrier()
        times.append(host_enqueue.enqueue_time(lambda: trainer.step(x, y), hold, seconds))
    return times
