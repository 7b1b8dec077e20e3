"""Distributed setup shared by the examples: torchrun sets the environment; without it the
example runs as one process (world size 1). NCCL on CUDA, gloo on CPU."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist


GROUP_TIMEOUT = timedelta(minutes=5)
"""How long a rank waits at a collective for its peers before the step fails (gloo raises
zero_fx's CollectiveFailedError; on NCCL the watchdog ends the process: README, "When a
collective fails"). PyTorch's defaults, 10 minutes for NCCL and 30 for gloo, leave a job
with a dead rank idle that long. It must cover the longest a rank waits for a slower
one: the first call's compilation and a checkpoint save included; raise it for big models."""


@dataclass(frozen=True)
class Launch:
    rank: int
    world: int
    device: torch.device
    log: Callable[..., None]
    """``print`` on rank 0, nothing elsewhere."""

    def mean_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of ``value`` over ranks (SUM then divide: gloo's AVG is unreliable)."""
        if dist.is_initialized():
            value = value.detach().clone()
            dist.all_reduce(value, op=dist.ReduceOp.SUM)
            value /= self.world
        return value

    def finish(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(timeout: timedelta = GROUP_TIMEOUT) -> Launch:
    if "RANK" in os.environ and not dist.is_initialized():
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        # Under torchrun --max-restarts, each attempt's group sets up in keys of its own:
        # torchrun's store outlives a restart with the dead attempt's keys in it (static
        # rendezvous, the default on one node), and a restarted rank that reads a dead
        # peer's address fails with "Gloo connectFullMesh failed ... Connection refused"
        # (NCCL: its unique id; pytorch#135712 is the same for shared stores).
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                store=dist.PrefixStore(f"attempt{attempt}", store), rank=rank,
                                world_size=world, timeout=timeout)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if torch.cuda.is_available():
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return Launch(rank=rank, world=world, device=device,
                  log=print if rank == 0 else (lambda *a, **k: None))
