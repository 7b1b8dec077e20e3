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

So on NCCL each call ends with a fence (``CompletionCheck``): after the call's
last collective (after the update, and in stages 1-2 after the gathers that
follow it), this rank all-reduces one element on each of the step's groups,
asynchronously. Collectives of a group run in order on its stream, so when
the fence has finished, every collective this rank issued before it has.
Nothing waits for the fence there: the host goes on to the next call while
the GPU works ([Note: no host sync in the steady state]). At the start of
each later call (before anything of it runs), and before a checkpoint is
saved or the model read out, the fences are settled:

- a fence that has finished (``Work.is_completed``, a CUDA event query) is
  retired, and its error, if NCCL reported one, raised (``Work.wait`` on a
  finished collective returns at once);
- a fence still running is left alone, unless it is older than the group's
  timeout (then the call fails) or more than ``MAX_UNCONFIRMED`` calls behind
  (then the host waits for it, with what is left of the timeout: the CPU runs
  at most that many calls ahead of what it has confirmed).

What a user gets on NCCL, then: a failed or hung collective of call N is
reported at call N+1 or N+2 as a ``CollectiveFailedError``, unless the
watchdog has ended the process first (PyTorch's default,
``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``, ends it at the group's timeout, its
log naming the collective; restart from the last checkpoint). Since the host
did not wait, call N's optimizer update was queued on the device behind the
failed collective: this rank's parameters, shards and optimizer state may
hold an update computed from incomplete gradients, so the error says so and
the step refuses every later call (restore from a checkpoint). A checkpoint
is never written over unconfirmed collectives: saving settles every fence
first, waiting if it must. With ``TORCH_NCCL_BLOCKING_WAIT=1`` every wait in
the graph blocks the host and raises where it fails, as gloo does. None of
this has run on a GPU in zero_fx's tests; it follows PyTorch's
ProcessGroupNCCL (``WorkNCCL::isCompleted``, ``WorkNCCL::wait``), and the
fence itself is tested on gloo.

[Note: no host sync in the steady state]
On CUDA the host only queues work; the GPU runs it later. A host read of a
device value (``.item()``, ``.cpu()``, ``bool(tensor)``) or a blocking wait
(``Work.wait(timeout)``, ``torch.cuda.synchronize()``) stops the host until
the GPU has caught up, so the GPU then idles while Python queues the next
step's kernels, checks dynamo's guards and the ranks' agreement. zero_fx's
step reads nothing on the host in the steady state: the loss scale, the
overflow flag and the gradient norm stay on the device ([Note: clipping and
overflow] in update.py), and the NCCL completion check polls instead of
waiting (above). The exceptions, each documented where it is: an fp16 step
with an optimizer that cannot skip on the device reads the overflow flag
once, and the fences block when the host has run ``MAX_UNCONFIRMED`` calls
ahead. ``zero_fx.analysis.host_syncs.counting_host_syncs`` counts them
(tests/test_host_syncs.py holds the count at zero).
"""

from __future__ import annotations

import os
import time
import traceback
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from .process_group import World, backend_serving, world_timeout
from ...errors import CollectiveFailedError

CHECKED_BACKENDS = ("nccl",)
"""Backends that report a failed collective late, so the update checks first ([Note:
failures on NCCL]); gloo raises where the collective is called."""

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""NCCL's default group timeout, for a group whose own cannot be read."""

_TRANSPORT_WORDS = ("gloo", "nccl", "connection closed", "timed out", "timeout", "socket",
                    "connection reset", "broken pipe")


MAX_UNCONFIRMED = 2
"""How many calls' fences may still be running when a call starts ([Note: failures on
NCCL]); beyond that the host waits for the oldest."""


@dataclass
class _Fence:
    works: list
    issued: float
    """``time.monotonic()`` when it was issued."""
    call: int
    """Which call of the step issued it (1-based), for the error."""


class CompletionCheck:
    """Fences on the step's groups, issued at the end of each call and settled at the start
    of later ones ([Note: failures on NCCL]): the host never waits for the GPU in the
    steady state, and a collective NCCL reports failed (or one past ``timeout``) is raised
    as a ``CollectiveFailedError`` one or two calls later."""

    def __init__(self, groups: list[dist.ProcessGroup], device: torch.device, timeout: timedelta,
                 max_unconfirmed: int = MAX_UNCONFIRMED):
        self.groups = groups
        self.device = device
        self.timeout = timeout
        self.max_unconfirmed = max_unconfirmed
        self.pending: deque[_Fence] = deque()
        self.calls = 0

    def issue(self) -> None:
        """After the call's last collective: a one-element all-reduce on each group, not
        waited for."""
        self.calls += 1
        works = [dist.all_reduce(torch.zeros(1, device=self.device), group=group, async_op=True)
                 for group in self.groups]
        self.pending.append(_Fence(works, time.monotonic(), self.calls))

    def settle(self, *, everything: bool = False) -> None:
        """Retire the fences that have finished (raising the error of a failed one); wait for
        those that must be confirmed now: every one with ``everything`` (before a checkpoint),
        else those beyond ``max_unconfirmed``. A fence older than the timeout fails."""
        while self.pending:
            fence = self.pending[0]
            must = everything or len(self.pending) > self.max_unconfirmed
            age = time.monotonic() - fence.issued
            for work in fence.works:
                if work.is_completed():  # a CUDA event query: no wait
                    try:
                        work.wait()  # finished: returns at once, or raises what NCCL reported
                    except RuntimeError as err:
                        raise FenceFailed(fence.call, err) from err
                elif must or age > self.timeout.total_seconds():
                    left = max(self.timeout.total_seconds() - age, 0.001)
                    try:
                        work.wait(timedelta(seconds=left))
                    except RuntimeError as err:
                        raise FenceFailed(fence.call, err) from err
                else:
                    return
            self.pending.popleft()


class FenceFailed(RuntimeError):
    """A fence failed or timed out: ``call`` is the call whose collectives it fenced."""

    def __init__(self, call: int, err: BaseException):
        super().__init__(_first_line(err))
        self.call = call
        self.cause = err


def completion_check(world: World, device: torch.device) -> Optional[CompletionCheck]:
    """The check for the step's groups (with hybrid sharding, the replicate group too) where
    the backend that moves the training device's tensors reports failures late (NCCL; [Note:
    the backend by device]); None where a failed collective raises at once, or there are no
    other ranks (unless a world of one keeps its collectives: [Note: collectives kept at a
    world of one] in process_group.py)."""
    if (world.size == 1 and not world.keeps_collectives) or world.simulated:
        return None
    names = [world.group_name] + ([world.replicate_group_name] if world.replicas > 1 else [])
    groups = [dist.distributed_c10d._resolve_process_group(name) for name in names]
    if backend_serving(device.type, groups[0]) not in CHECKED_BACKENDS:
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


def fence_failed(rank: int, failure: FenceFailed) -> CollectiveFailedError:
    return CollectiveFailedError(
        f"the collectives of call {failure.call} of the step did not complete on rank {rank}, "
        f"in the check that the step's collectives completed (a fence after that call): "
        f"{_first_line(failure.cause)}\nThat call's optimizer update had been queued behind them "
        "on the device, so this rank's parameters, shards and optimizer state may hold an update "
        "made from incomplete gradients; this step refuses further calls: restore from a "
        "checkpoint. Another rank probably died or stopped calling the step (its log says why), "
        "or the process group timed out (init_process_group(timeout=...)).")


def failed_after_update(rank: int, err: BaseException) -> CollectiveFailedError:
    return CollectiveFailedError(
        f"gathering the updated shards into the parameters failed on rank {rank}"
        f"{where_it_failed(err)}: "
        f"{_first_line(err)}\nThe optimizer had already updated this rank's shards, so its "
        "parameters are stale and this step refuses further calls: restore from a checkpoint.")


def failed_in_graph_update(rank: int, err: BaseException) -> CollectiveFailedError:
    return CollectiveFailedError(
        f"a collective of the step's graph failed on rank {rank}{where_it_failed(err)}: "
        f"{_first_line(err)}\nThe graph had already stepped the optimizer on some buckets of "
        "this rank's shards ([Note: the update in the graph]), so ranks may hold different "
        "parameters and this step refuses further calls: restore from a checkpoint.")


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
