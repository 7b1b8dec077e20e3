"""bench/helpers/profile_step.py: where a step's time goes (the GPU's figures checked on
made-up profiler events, the CPU's on a real profiled step)."""

from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from bench.helpers.profile_step import busy_microseconds, profile_step, summarize


def test_busy_time_counts_overlapping_kernels_once():
    assert busy_microseconds([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert busy_microseconds([]) == 0


def _event(name, device, start=0.0, end=0.0):
    return SimpleNamespace(name=name, device_type=device,
                           time_range=SimpleNamespace(start=start, end=end))


def test_the_summary_splits_a_gpu_step_into_busy_and_idle():
    events = [_event("aten::mm", DeviceType.CPU), _event("cudaLaunchKernel", DeviceType.CPU),
              _event("cudaLaunchKernel", DeviceType.CPU),
              _event("gemm", DeviceType.CUDA, 0, 3000), _event("gemm", DeviceType.CUDA, 4000, 6000),
              _event("nccl", DeviceType.CUDA, 5000, 7000)]
    s = summarize(events, wall_s=0.010)
    assert (s["kernels"], s["launches"], s["aten_ops"]) == (3, 2, 1)
    assert s["gpu_busy_ms"] == pytest.approx(6.0)  # 0-3 and 4-7 ms
    assert s["gpu_idle_ms"] == pytest.approx(4.0)
    assert s["gpu_idle_fraction"] == pytest.approx(0.4)
    assert s["top_kernels"][0] == {"name": "gemm", "ms": pytest.approx(5.0)}


def test_a_cpu_step_has_its_wall_time_and_ops_but_no_gpu_figures():
    model = torch.nn.Linear(16, 16)
    s = profile_step(lambda: model(torch.randn(4, 16)).sum().backward(), torch.device("cpu"))
    assert s["wall_ms"] > 0 and s["aten_ops"] > 0
    assert s["kernels"] == 0 and s["gpu_busy_ms"] is None
