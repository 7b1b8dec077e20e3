"""Where one training step's time goes, from ``torch.profiler``: the step's wall time, the
time the GPU ran kernels (the union of their intervals, so overlapping streams count once),
the time it was idle, how many kernels ran and how many the host launched, and the kernels
that took the most time.

    summary = profile_step(lambda: trainer.step(x, y), device)

Idle is the wall time no kernel covered: launch gaps the host left (a step whose Python
runs behind its GPU), waits for the host (a copy, a ``.item()``), and the first kernel's
launch latency. On the CPU there are no kernels: the summary gives the wall time and the
count of aten operators run, and leaves the GPU figures out (``None``).
"""

from __future__ import annotations

import collections
import time
from typing import Callable, Optional

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
            "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")
"""Runtime calls that enqueue work on the GPU (a kernel, a graph, a copy, a fill)."""
TOP = 5


def busy_microseconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``[start, end)`` intervals: time at least one ran."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def summarize(events, wall_s: float) -> dict:
    """The summary of a profiled step's ``events`` (``prof.events()``) that took ``wall_s``."""
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    on_host = [e for e in events if e.device_type == DeviceType.CPU]
    summary = {"wall_ms": wall_s * 1e3,
               "aten_ops": sum(1 for e in on_host if e.name.startswith("aten::")),
               "launches": sum(1 for e in on_host if e.name in LAUNCHES)}
    if not kernels:
        return {**summary, "kernels": 0, "gpu_busy_ms": None, "gpu_idle_ms": None,
                "gpu_idle_fraction": None, "top_kernels": []}
    busy_ms = busy_microseconds([(e.time_range.start, e.time_range.end) for e in kernels]) / 1e3
    by_name: dict[str, float] = collections.Counter()
    for e in kernels:
        by_name[e.name] += (e.time_range.end - e.time_range.start) / 1e3
    idle_ms = max(summary["wall_ms"] - busy_ms, 0.0)
    return {**summary, "kernels": len(kernels), "gpu_busy_ms": busy_ms, "gpu_idle_ms": idle_ms,
            "gpu_idle_fraction": idle_ms / summary["wall_ms"],
            "top_kernels": [{"name": name[:120], "ms": ms}
                            for name, ms in by_name.most_common(TOP)]}


def profile_step(step: Callable[[], object], device: torch.device) -> dict:
    """Run ``step`` once under the profiler, synchronized before and after, and summarize it."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync: Optional[Callable[[], None]] = (lambda: torch.cuda.synchronize(device)) if cuda else None
    with profile(activities=activities) as prof:
        if sync:
            sync()
        start = time.perf_counter()
        step()
        if sync:
            sync()
        wall_s = time.perf_counter() - start
    return summarize(prof.events(), wall_s)
