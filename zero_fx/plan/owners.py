"""Which rank steps each parameter whose update needs the whole tensor: its owner. Pure data.

The owners are chosen once, from the parameters' shapes, the same on every rank: a rank's
load is the summed cost of the updates it owns (for Muon its Newton-Schulz work, for other
optimizers the elements; ``zero_fx.runtime.optimizer.update_cost``), and each tensor, the
costliest first, goes to the rank with the least load so far (longest processing time
first: within 4/3 of the best balance, and near it when tensors are many and alike). Ties go
to the lowest rank, so the choice reads nothing but the plan's data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

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


def rows_by_owner(names: Sequence[str], plan) -> tuple[int, dict[str, tuple[int, int]]]:
    """A buffer laid out by owner for ``names`` (of ``plan``, in its order): its rows' width,
    and each name's ``(owner, start)``. Row r holds the tensors rank r owns, flattened, one
    after the other, padded to the widest row: the layout of the reduce-scatter and
    all-gather that carry whole-tensor updates ([Note: reductions laid out by owner] in
    zero_fx/runtime/update/whole_tensor_updates.py), and of ``traffic()``'s count of them."""
    used, where = [0] * plan.world_size, {}
    for name in names:
        owner = plan.owner_of(name)
        where[name] = (owner, used[owner])
        used[owner] += plan.layout(name).numel
    return max(used), where
