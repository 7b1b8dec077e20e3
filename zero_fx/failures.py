"""When a collective fails: say so in words, and say what state the rank is left in.

A peer that dies makes gloo fail at once ("Connection closed by peer"); a
peer that hangs makes it fail after the process group's timeout
(``init_process_group(timeout=...)``). Either way the error surfaces on the
ranks still alive as a ``CollectiveFailedError`` that says whether this
rank's training state is intact:

- inside the compiled graph (forward, backward, gradient reduction) or the
  check that ranks agree: the optimizer has not run, so parameters, shards
  and optimizer state are exactly as before the call;
- in the gathers after the optimizer (stages 1-2): the shards are updated but
  the parameters are not, so the step refuses every later call; restore from
  a checkpoint.
"""

from __future__ import annotations

import torch.distributed as dist

_TRANSPORT_WORDS = ("gloo", "nccl", "connection closed", "timed out", "timeout", "socket",
                    "connection reset", "broken pipe")


class CollectiveFailedError(RuntimeError):
    """A collective of the step failed: a peer died, hung past the timeout, or the network broke."""


def is_communication_failure(err: BaseException) -> bool:
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(word in text for word in _TRANSPORT_WORDS)


def failed_before_update(rank: int, err: BaseException) -> CollectiveFailedError:
    return CollectiveFailedError(
        f"a collective of the step failed on rank {rank}: {_first_line(err)}\n"
        "Another rank probably died or stopped calling the step (its log says why), or the "
        "process group timed out (init_process_group(timeout=...)). Nothing was updated on this "
        "rank: parameters, shards and optimizer state are as before the call.")


def failed_after_update(rank: int, err: BaseException) -> CollectiveFailedError:
    return CollectiveFailedError(
        f"gathering the updated shards into the parameters failed on rank {rank}: "
        f"{_first_line(err)}\nThe optimizer had already updated this rank's shards, so its "
        "parameters are stale and this step refuses further calls: restore from a checkpoint.")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
