"""One peer on this rank: build the model, train it, measure the same things as for every peer."""

from __future__ import annotations

import gc
import os
import statistics
import time

import torch
import torch.distributed as dist

from ..helpers import cpu_memory, wire
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
    value = value.detach().float().clone()
    if world > 1:
        dist.all_reduce(value)  # SUM then divide: gloo's AVG is unreliable
    return value.item() / world


def run_peer(name: str, spec: BenchModel, setting: Setting, steps: int, warmup: int,
             count_wire: bool = True) -> dict:
    """Train ``steps`` steps; the first ``warmup`` (which include the first, with any
    compilation) are not timed. Returns this rank's row; times are per step, memory
    peaks over the timed steps."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = setting.device
    meter = memory_meter(device)
    torch.manual_seed(0)
    model = spec.build().to(device)
    psi = sum(p.numel() for p in model.parameters())
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
    row = {
        "peer": name,
        "rank": rank,
        "pid": os.getpid(),
        "psi": psi,
        "first_step_s": first_step_s,
        "step_s": times,
        "median_step_s": statistics.median(times),
        "peak_bytes": meter.max_allocated(),
        "held_bytes": meter.allocated(),
        "sent_bytes_per_step": statistics.median(sent) if count_wire else None,
        "losses": losses,
        "whole_batch": trainer.whole_batch,
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
