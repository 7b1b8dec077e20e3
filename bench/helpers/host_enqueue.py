"""Host enqueue time: how long the host takes to launch one training step while the device is
kept busy, so that it measures Python and launch overhead, not the device's work.

[Note: measuring the host's enqueue time]
A GPU step's wall time is the longer of two overlapping things: the host launching kernels
and the device running them. To see the host's part alone, the device is held busy first
(``DeviceHold.hold``: on CUDA a kernel that spins, ``torch.cuda._sleep``) for longer than the
host can need; the step is launched behind it and timed on the host without synchronizing;
then the host waits for both. If the hold had ended by the time the step returned, the
step waited for the device (an ``.item()``, a synchronize, a copy to the host, or more
launches than CUDA's queue takes before a launch waits) or took longer than the hold: its
time is then no enqueue time, and ``EnqueueTime.blocked`` says so.

A ``ThreadHold`` stands in for the device on a CPU (a thread that sleeps; synchronizing joins
it), so the measurement itself can be tested without a GPU: a step that only works on the
host measures its own time, one that waits for the "device" is flagged. On a CPU the step's
tensor work runs on the host, synchronously: there the measure is the step's time.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, NamedTuple, Protocol

import torch


class DeviceHold(Protocol):
    floor_s: float
    """The shortest hold worth making on this device."""

    def hold(self, seconds: float) -> None:
        """Keep the device busy for about ``seconds`` from now, without waiting for it."""

    def held(self) -> bool:
        """Whether the last hold is still running."""

    def synchronize(self) -> None:
        """Wait for the device: the hold and whatever was queued behind it."""


class CudaHold:
    """The current CUDA stream spins ``torch.cuda._sleep`` (its cycles per second measured
    once with CUDA events); an event recorded after it tells whether it has ended."""

    floor_s = 1.0

    def __init__(self, device: torch.device, calibration_cycles: int = 50_000_000):
        self.device = device
        torch.cuda._sleep(calibration_cycles)  # the kernel loaded before it is timed
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(calibration_cycles)
        end.record()
        end.synchronize()
        self.cycles_per_s = calibration_cycles / (start.elapsed_time(end) / 1e3)
        self._end = None

    def hold(self, seconds: float) -> None:
        torch.cuda._sleep(int(seconds * self.cycles_per_s))
        self._end = torch.cuda.Event()
        self._end.record()

    def held(self) -> bool:
        return self._end is not None and not self._end.query()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class ThreadHold:
    """A stand-in for a device on a CPU: the hold is a thread that sleeps; synchronizing
    joins it."""

    floor_s = 0.1

    def __init__(self):
        self._thread = None

    def hold(self, seconds: float) -> None:
        self._thread = threading.Thread(target=time.sleep, args=(seconds,), daemon=True)
        self._thread.start()

    def held(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def synchronize(self) -> None:
        if self._thread is not None:
            self._thread.join()


def hold_for(device: torch.device) -> DeviceHold:
    return CudaHold(device) if device.type == "cuda" else ThreadHold()


def hold_seconds(hold: DeviceHold, step_s: float) -> float:
    """Long enough to cover the launch of a step whose synchronized time is ``step_s`` (its
    launch cannot take much longer than the whole step): three of them, at least the floor."""
    return max(hold.floor_s, 3 * step_s)


class EnqueueTime(NamedTuple):
    seconds: float
    """Host time from calling the step to its return, the device held busy throughout."""
    blocked: bool
    """The hold had ended when the step returned: it waited for the device (or outlasted
    the hold), so ``seconds`` is no enqueue time."""
    hold_s: float


def enqueue_time(step: Callable[[], object], hold: DeviceHold, hold_s: float) -> EnqueueTime:
    """Time ``step()`` on the host behind a hold of ``hold_s`` (see [Note: measuring the
    host's enqueue time]); returns after the device has finished both."""
    hold.synchronize()
    hold.hold(hold_s)
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    blocked = not hold.held()
    hold.synchronize()
    return EnqueueTime(seconds, blocked, hold_s)
