"""The fake process group of ``--fake-world N``: one process simulating rank 0 of N, and which
of its losses say anything.

[Note: losses under the fake process group]
The fake group moves no data, but it does not leave every output alone, and what it does
decides which losses two peers share:

- all-gather replicates the input N times (torch 2.11 and 2.13): every rank's shard of a
  parameter is taken to be rank 0's;
- all-reduce leaves the tensor as it is: a loss "averaged over ranks" is this rank's own;
- reduce-scatter returns the first chunk of the input, unsummed, in torch 2.13; torch
  2.11 leaves the output untouched (whatever the allocator handed out).

zero_fx shards each parameter flat, rank r owning elements [r·n/N, (r+1)·n/N); FSDP2 chunks
dim 0. When every parameter's dim 0 divides by N the two are the same elements, so both
gather the same (replicated) parameters, and where reduce-scatter returns the first chunk
both update the same shard with the same gradient: the same losses at every step, on the
same batch. Where reduce-scatter leaves garbage, only the first step (before any update) is
shared. Where a dim 0 does not divide, FSDP2 pads rows and zero_fx elements: none is.
``comparable_loss_steps`` probes the group once and says which.
"""

from __future__ import annotations

import os
import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn


def join(world_size: int) -> None:
    """This process becomes rank 0 of a fake group of ``world_size``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed asks for it


def active() -> bool:
    return dist.is_initialized() and dist.get_backend() == "fake"


def reduce_scatter_returns_first_chunk(device: torch.device) -> bool:
    """Whether this torch's fake reduce-scatter hands rank 0 the first chunk of its input
    (torch 2.13), rather than leaving the output as it was (torch 2.11)."""
    world = dist.get_world_size()
    full = torch.arange(2 * world, dtype=torch.float32, device=device) + 1
    out = torch.zeros(2, device=device)
    with warnings.catch_warnings():  # 2.13 renames it reduce_scatter_single; 2.11 lacks that
        warnings.simplefilter("ignore", FutureWarning)
        dist.reduce_scatter_tensor(out, full)
    return torch.equal(out, full[:2])


class LossSteps(NamedTuple):
    """Which steps' losses the peers share under the fake group."""

    steps: int
    """How many leading steps to compare: all, 1 or 0."""
    why: str


def comparable_loss_steps(model: nn.Module, device: torch.device, steps: int) -> LossSteps:
    """Of ``steps`` steps, how many the peers' losses share: see [Note: losses under the
    fake process group]."""
    world = dist.get_world_size()
    uneven = [name for name, p in model.named_parameters() if p.dim() and p.shape[0] % world]
    if uneven:
        return LossSteps(0, f"dim 0 of {uneven[0]} does not divide by {world}: FSDP2's shards "
                            f"are not zero_fx's, no loss is shared")
    if reduce_scatter_returns_first_chunk(device):
        return LossSteps(steps, "every step: the fake reduce-scatter returns the first chunk, "
                               "so every peer updates the same shard with the same gradient")
    return LossSteps(1, "the first step only: the fake reduce-scatter leaves its output "
                        "untouched (torch < 2.13), so the updates are garbage")
