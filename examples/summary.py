"""The examples' step clock, and their closing report: loss, compile and step time, memory
and traffic per rank."""

from __future__ import annotations

import time
from typing import Optional

import torch

MiB = 2 ** 20


def wait_for_device(device: torch.device) -> None:
    """CUDA runs kernels after the call that launched them has returned: wait for them, so
    that the clock read next counts their work. The CPU has nothing to wait for."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """Each training step's wall time, measured honestly on CUDA: it waits for the device
    before reading the clock, and resets the allocator's peak as the second step starts,
    so the summary's peak is that of the steps after the first (which compiles) rather
    than compilation's."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: list[float] = []
        self._began: Optional[float] = None

    def start(self) -> None:
        wait_for_device(self.device)
        if len(self.seconds) == 1 and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._began = time.perf_counter()

    def stop(self) -> float:
        """The step's seconds, also kept in ``seconds``."""
        wait_for_device(self.device)
        self.seconds.append(time.perf_counter() - self._began)
        return self.seconds[-1]

    @property
    def peak_span(self) -> str:
        """Which steps the allocator's peak covers."""
        return "steps after the first" if len(self.seconds) > 1 else "the first step, compiling"


def held_bytes(train_step) -> int:
    """Bytes of parameters, shards, gradients and optimizer state this rank holds now."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in train_step.state.held_tensors()}
    return sum(storages.values())


def summary(train_step, *, final_loss: float, clock: StepClock) -> str:
    steady = sorted(clock.seconds[1:]) or clock.seconds
    median = steady[len(steady) // 2]
    device = clock.device
    if device.type == "cuda":
        peak = (f"{torch.cuda.max_memory_allocated(device) / MiB:.1f} MiB (CUDA allocator, "
                f"{clock.peak_span})")
    else:  # CPU keeps no allocator statistics: the cost model's estimate from the graph
        peak = (f"{train_step.estimate().peak_bytes / MiB:.1f} MiB (estimated from the graph; "
                "CPU has no allocator statistics)")
    traffic = train_step.traffic()
    return "\n".join([
        f"done: final loss {final_loss:.4f}",
        f"compile (capture + passes + lowering): {sum(train_step.compile_seconds):.1f} s; "
        f"median step after the first: {1e3 * median:.1f} ms",
        f"memory on rank 0: {held_bytes(train_step) / MiB:.2f} MiB held between steps "
        f"(parameters, shards, optimizer state); peak during a step {peak}",
        f"traffic per step: {traffic.summary()}",
    ])
