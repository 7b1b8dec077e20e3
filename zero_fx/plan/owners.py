"""Which rank steps each parameter whose update needs the whole tensor: its owner. Pure data.

The owners are chosen once, from the parameters' shapes, the same on every rank: a rank's
load is the summed cost of the updates it owns (for Muon its Newton-Schulz work, for other
optimizers the elements; ``zero_fx.runtime.optimizer.update_cost``), and each tensor, the
costliest first, goes to the rank with the least load so far (longest processing time
first: within 4/3 of the best balance, and near it when tensors are many and alike). Ties go
to the lowest rank, so the choice reads nothing but the plan's data.

They are chosen per group of N consecutive blocks (``owner_groups``), not over the whole
model at once: a group is what one reduction laid out by owner carries at stages 2-3 ([Note:
owner groups]), and balanced within each group, they are balanced over the model too.

[Note: owner groups]
A reduction laid out by owner ([Note: reductions laid out by owner] in
zero_fx/runtime/update/whole_tensor_updates.py) moves N rows as wide as the widest, so it
sends no more than a reduce-scatter of the same gradients only when the rows are equal. Over
one block they cannot be (a GPT block's four matrices, 3:1:4:4 in size, split 7:5 at best
over two ranks: 17 % padding; 4:4:3:1 over four, 33 %). Over N identical blocks they are:
each cost class (the N blocks' qkv weights, their fc weights, ...) has N members of one cost,
and longest-first, which finds the ranks' loads equal after each class, deals them one to
each rank. So every rank's row holds one of each: equal widths, no padding, and equal
Newton-Schulz work. The price is memory at stages 2-3: the group's reduction waits for its
last gradient, so N blocks of these gradients are alive at once where a reduce-scatter per
block holds one (the default stage-2 bucket, 25 MiB, holds several small blocks anyway).
Blocks are read off the names (``block_of``: "blocks.3.attn.qkv.weight" is in "blocks.3");
a tensor outside the blocks is a block of its own, and the last group takes the blocks left
over (fewer than N: some padding there).

A group's memory grows with N while what it saves shrinks with it: the all-to-all it replaces
sends ``(N - 1) / N**2`` of those tensors' elements, ``1/(2N)`` of stage 2's traffic on them
(25 % at 2 ranks, 6 % at 8). So where the largest group's gradients pass
``OWNER_GROUP_BYTES`` (256 MiB: on a GPT of width 2048, 8 blocks' matrices in fp32 are 1.6 GB)
the plan reduces them as before, into every rank's shards, and sends the shards to the owners
after the graph (``ShardPlan.reduces_to_owners_in_graph``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from .layout import owner_groups

NEWTON_SCHULZ_STEPS = 5
"""torch.optim.Muon's default ``ns_steps``, for a group that does not say."""


def newton_schulz_cost(shape: Sequence[int], ns_steps: int = NEWTON_SCHULZ_STEPS) -> float:
    """Multiply-adds of Muon's orthogonalisation of a matrix of ``shape``: each of its
    ``ns_steps`` Newton-Schulz iterations multiplies X (s x l, sides s <= l) by its transpose
    (s^2 l), squares the result (s^3) and multiplies it back into X (s^2 l):
    ``ns_steps * s^2 * (2l + s)``."""
    short, long = sorted(shape)
    return float(ns_steps * short * short * (2 * long + short))


def element_cost(shape: Sequence[int]) -> float:
    """The work of any other whole-tensor update, counted by its elements."""
    return float(math.prod(shape))


def assign_owners(costs: Mapping[str, float], world_size: int,
                  order: Sequence[str] = ()) -> dict[str, int]:
    """``{name: owner rank}`` for the tensors of ``costs`` over ``world_size`` ranks; ``order``
    breaks ties among equal costs (the plan's parameter order), else the names' own order."""
    position = {name: i for i, name in enumerate(order or costs)}
    loads = [0.0] * world_size
    owners: dict[str, int] = {}
    for name in sorted(costs, key=lambda n: (-costs[n], position.get(n, len(position)))):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[name] = rank
        loads[rank] += costs[name]
    return owners


def assign_owners_by_group(costs: Mapping[str, float], world_size: int,
                           order: Sequence[str]) -> dict[str, int]:
    """``assign_owners`` within each of ``owner_groups`` of the tensors of ``costs`` (in
    ``order``, the plan's): what training and the planner both call."""
    owners: dict[str, int] = {}
    for group in owner_groups([n for n in order if n in costs], world_size):
        owners.update(assign_owners({n: costs[n] for n in group}, world_size, group))
    return owners


def loads_of(owners: Mapping[str, int], costs: Mapping[str, float],
             world_size: int) -> list[float]:
    """Each rank's summed cost of the updates it owns."""
    loads = [0.0] * world_size
    for name, rank in owners.items():
        loads[rank] += costs[name]
    return loads


@dataclass(frozen=True)
class ParameterUpdate:
    """How one parameter is updated, for ``explain()``'s table ([Note: update rules] in
    zero_fx/runtime/optimizer.py)."""

    name: str
    optimizer: str
    """Its optimizer's class, and its place among the step's ("Muon", "AdamW (2 of 2)");
    "" when no optimizer holds it."""
    rule: str
    """"flat" (every rank steps its 1/N shard), "whole" (one rank steps the whole tensor),
    "whole, every rank" (stage 0: every rank steps it whole, as DDP) or "none"."""
    owner: Optional[int]
    """The rank that steps it whole; None for the other rules."""
    reason: str
    cost: float = 0.0
    """The whole-tensor update's work (``update_cost``), which the owners are balanced by."""

    @property
    def where(self) -> str:
        return {"flat": "every rank, its shard", "whole, every rank": "every rank, whole",
                "none": "-"}.get(self.rule, f"rank {self.owner}")
