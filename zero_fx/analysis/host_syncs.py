"""Count what makes the host wait for the device: reads of device values on the host and
blocking waits for collectives ([Note: no host sync in the steady state] in
zero_fx/runtime/distributed/failures.py).

    with counting_host_syncs(step) as syncs:
        step(model, opt, x, y)
    print(syncs)          # each one, with the line of Python that made it

On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` catches the synchronizing CUDA calls
themselves; this counts them on any device, the CPU included, where nothing synchronizes
and so nothing else would notice one being added. What it counts:

- ``.item()``, ``.tolist()``, ``bool()``/``int()``/``float()`` of a tensor: every host read of a
  tensor's value goes through ``aten._local_scalar_dense`` (or ``tolist``), seen by a dispatch
  mode entered inside the step (``CompiledStep.observing``) and by patching ``Tensor.tolist``;
- ``.cpu()``, ``.numpy()``: patched on ``torch.Tensor`` (on the CPU they copy nothing, which is
  why they are counted at the call, not at a copy);
- ``Work.wait()`` of a collective not yet finished: patched on ``torch.distributed.Work``
  (an eager collective's handle, ``dist.all_gather(...)`` without ``async_op`` included;
  the graph's own waits, ``wait_tensor``, only order streams on CUDA and are not counted).
  One such wait is in every call by design: the ranks' agreement check
  (runtime/distributed/rank_agreement.py) all-gathers a fingerprint over a CPU group, a barrier between
  the ranks' hosts that never waits for a device.

Not counted: reads of the CPU tensors that stay on the host whatever the device (a
non-fused optimizer's ``step`` counters: ``torch.optim`` keeps them on the CPU unless
``capturable`` or ``fused``, and reads them); on the CPU they cannot be told from a device
read, so a test of the count uses a fused optimizer.

What Inductor's generated code does inside a compiled body does not dispatch through
Python and is not seen; bodies do not read values on the host (they are graphs of tensor
ops).
"""

from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

_READS = {torch.ops.aten._local_scalar_dense.default}
"""The ops that hand a tensor's value to the host (``.item()``, ``bool(t)``, ``int(t)``)."""


@dataclass
class HostSync:
    kind: str
    """"read" (a value to the host), "copy to host" (``.cpu()``, ``.numpy()``) or "wait"."""
    where: str
    """The innermost line of Python outside torch that made it."""

    def __str__(self) -> str:
        return f"{self.kind} at {self.where}"


@dataclass
class HostSyncs:
    """What ``counting_host_syncs`` saw, in order."""

    events: list[HostSync] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.events)

    def __str__(self) -> str:
        if not self.events:
            return "no host syncs"
        return f"{len(self.events)} host sync(s):\n" + "\n".join(f"  {e}" for e in self.events)

    def record(self, kind: str) -> None:
        self.events.append(HostSync(kind, _caller()))


class _ReadCounter(TorchDispatchMode):
    def __init__(self, syncs: HostSyncs):
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _READS:
            self.syncs.record("read")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_host_syncs(step=None) -> Iterator[HostSyncs]:
    """Count host syncs made while inside (by anything in this process). With ``step`` (a
    ``CompiledStep``), value reads inside its graph and optimizer update are seen too: a
    dispatch mode entered around the call would not reach them (dynamo does not run compiled
    code under one)."""
    syncs = HostSyncs()
    patches = [(torch.Tensor, "cpu", "copy to host"), (torch.Tensor, "numpy", "copy to host"),
               (torch.Tensor, "tolist", "read"), (dist.Work, "wait", "wait")]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]

    def counted(original, kind):
        def method(self, *args, **kwargs):
            if not (kind == "wait" and self.is_completed()):  # a finished one returns at once
                syncs.record(kind)
            return original(self, *args, **kwargs)
        return method

    for (owner, name, original), (_, _, kind) in zip(saved, patches):
        setattr(owner, name, counted(original, kind))
    reads = _ReadCounter(syncs)
    try:
        with (step.observing(reads) if step is not None else reads):
            yield syncs
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _caller() -> str:
    frames = traceback.extract_stack()[:-3]
    torch_dir = torch.__file__.rsplit("/", 1)[0]
    for frame in reversed(frames):
        if not frame.filename.startswith(torch_dir) and frame.filename != __file__:
            return f"{frame.filename}:{frame.lineno} ({frame.name}): {(frame.line or '').strip()}"
    return "(unknown)"
