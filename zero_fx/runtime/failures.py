"""When a collective fails: say so in words, and say what state the rank is left in.

[Note: what a failure leaves]
A peer that dies makes gloo fail at once ("Connection closed by peer"); a
peer that hangs makes it fail after the process group's timeout
(``init_process_group(timeout=...)``). Either way the error surfaces on the
ranks still alive as a ``CollectiveFailedError`` that says whether this
rank's training state is intact:

- inside the compiled graph (forward, backward, gradient reduction), the
  check that ranks agree, or the reduction and gradient norm before the
  update (``OptimizerUpdate.accumulate``): the optimizer has not run, so
  parameters, shards, optimizer state and the loss scale are exactly as
  before the call (after the graph, the accumulation window's gradients are
  dropped);
- in the gathers after the optimizer (stages 1-2): the shards are updated but
  the parameters are not, so the step refuses every later call; restore from
  a checkpoint.

That holds as stated on gloo, whose collectives fail on the thread that calls
them. NCCL reports failures late; see the next note.

[Note: failures on NCCL]
NCCL runs each collective on a stream of its own; waiting for one in the graph
(``wait_tensor``) only makes the compute stream wait for it on the GPU, so the
host runs on and enqueues the optimizer's kernels behind it. A failure is found
by ProcessGroupNCCL's watchdog thread: a collective past the group's timeout,
or an error NCCL reports for the communicator. With PyTorch's default
(``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``) the watchdog then ends the process, and
no Python exception is raised anywhere.

So on NCCL the optimizer update waits for the step's collectives first
(``CompletionCheck``): before the update (``OptimizerUpdate.accumulate``), and
in stages 1-2 again after the gathers that follow it, this rank all-reduces
one element on the step's group and waits for that with the group's timeout
(``Work.wait(timeout)``). Collectives of a group run in order on its stream,
so when that one has finished, every one this rank issued before it has; and
a wait with a timeout polls NCCL's error state of the communicator
(``WorkNCCL::isCompleted``) and raises, in this thread, on an error or at the
timeout. What this checks is completion and the error NCCL reports, not the
data; what it costs is a one-element all-reduce and the host waiting for the
GPU once per optimizer step (twice in stages 1-2), where it could otherwise
enqueue the next step's kernels.

What a user gets on NCCL, then: the update never runs on this rank after a
collective that NCCL reported failed or that had not finished. A peer that
dies or hangs leaves this rank's collective waiting; the watchdog, whose clock
started when that collective was issued, ends the process at the group's
timeout (its log names the collective); restart from the last checkpoint. An
error NCCL reports before that raises ``CollectiveFailedError`` at the check,
unless the watchdog has ended the process first. With
``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` (the watchdog only logs) or
``TORCH_NCCL_BLOCKING_WAIT=1`` (every wait blocks the host and raises), every
failure is a ``CollectiveFailedError`` with the guarantees above. None of this
has run on a GPU in zero_fx's tests; it follows PyTorch's ProcessGroupNCCL
source (``WorkNCCL::wait``), and the check itself is tested on gloo.
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from .process_group import World, world_timeout

CHECKED_BACKENDS = ("nccl",)
"""Backends that report a failed collective late, so the update checks first ([Note:
failures on NCCL]); gloo raises where the collective is called."""

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""NCCL's default group timeout, for a group whose own cannot be read."""

_TRANSPORT_WORDS = ("gloo", "nccl", "connection closed", "timed out", "timeout", "socket",
                    "connection reset", "broken pipe")


class CollectiveFailedError(RuntimeError):
    """A collective of the step failed: a peer died, hung past the timeout, or the network broke."""


class CompletionCheck:
    """Waits until every collective this rank has issued on ``group`` has finished, and
    raises if the backend reports one failed or the wait outlasts ``timeout`` ([Note:
    failures on NCCL])."""

    def __init__(self, groups: list[dist.ProcessGroup], device: torch.device, timeout: timedelta):
        self.groups = groups
        self.device = device
        self.timeout = timeout

    def __call__(self) -> None:
        for group in self.groups:
            fence = torch.zeros(1, device=self.device)
            dist.all_reduce(fence, group=group, async_op=True).wait(self.timeout)


def completion_check(world: World, device: torch.device) -> Optional[CompletionCheck]:
    """The check for the step's groups (with hybrid sharding, the replicate group too) where
    their backend reports failures late (NCCL); None where a failed collective raises at
    once, or there are no other ranks."""
    if world.size == 1 or world.simulated:
        return None
    names = [world.group_name] + ([world.replicate_group_name] if world.replicas > 1 else [])
    groups = [dist.distributed_c10d._resolve_process_group(name) for name in names]
    if str(dist.get_backend(groups[0])).lower() not in CHECKED_BACKENDS:
        return None
    return CompletionCheck(groups, device, world_timeout() or DEFAULT_TIMEOUT)


def is_communication_failure(err: BaseException) -> bool:
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(word in text for word in _TRANSPORT_WORDS)


def failed_before_update(rank: int, err: BaseException) -> CollectiveFailedError:
    return CollectiveFailedError(
        f"a collective of the step failed on rank {rank}{where_it_failed(err)}: "
        f"{_first_line(err)}\n"
        "Another rank probably died or stopped calling the step (its log says why), or the "
        "process group timed out (init_process_group(timeout=...)). Nothing was updated on this "
        "rank: parameters, shards and optimizer state are as before the call.")


def failed_after_update(rank: int, err: BaseException) -> CollectiveFailedError:
    return CollectiveFailedError(
        f"gathering the updated shards into the parameters failed on rank {rank}"
        f"{where_it_failed(err)}: "
        f"{_first_line(err)}\nThe optimizer had already updated this rank's shards, so its "
        "parameters are stale and this step refuses further calls: restore from a checkpoint.")


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def where_it_failed(err: BaseException) -> str:
    """Which collective failed, in words (", in ..."), from the innermost frame of the
    traceback that is zero_fx's or the compiled graph's; "" if none is."""
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        line = (frame.line or "").strip()
        ours = frame.filename.startswith(_PACKAGE)
        generated = frame.filename.startswith("<eval_with_key>") or "torchinductor" in frame.filename
        if ours and os.path.basename(frame.filename) == "rank_agreement.py":
            return (", in the check that ranks agree (an all-gather, the call's first "
                    "collective: a peer that has not reached this call fails it here)")
        if ours and frame.name == "__call__" and frame.filename == os.path.abspath(__file__):
            return ", in the check that the step's collectives completed (an all-reduce)"
        if generated and "_c10d_functional." in line:
            return f", in the compiled step at `{_shortened(line.split(';')[0])}`"
        if ours and line:
            return f", in {frame.name} ({os.path.basename(frame.filename)}): `{_shortened(line)}`"
    return ""


def _shortened(line: str, limit: int = 120) -> str:
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
