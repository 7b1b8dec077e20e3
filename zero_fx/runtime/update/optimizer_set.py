"""Several optimizers in one step (Muon over the hidden matrices, AdamW over the rest), held as
one by zero_fx's runtime.

[Note: several optimizers in one step]
The recipe Moonlight, Kimi K2 and GLM-4.5 publish steps two optimizers each step::

    loss.backward()
    muon.step(); adamw.step()
    muon.zero_grad(); adamw.zero_grad()

Each keeps its own param groups, state and schedulers, and zero_fx rebinds each to what it
steps (a flat shard, or a whole tensor on its owner: [Note: update rules] in optimizer.py).
What is one for the whole step is held here as one: the shards, the gradient's global norm
(a clip covers every optimizer's parameters, as ``clip_grad_norm_(model.parameters())``
does), the exchanges of whole-tensor updates, and the update itself, which runs when the
step calls the first optimizer's ``step()`` (``OptimizerSet.step`` steps each in turn). Every
optimizer must be stepped, and zeroed, once per call (``check_members_called``). The update in
the graph steps each member on what it holds of a bucket, with that member's own ``step``
([Note: whole-tensor updates in the graph] in graph_update.py).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Iterator, Sequence

import torch


class OptimizerSet:
    """The step's optimizers as one: what zero_fx's runtime reads of "the optimizer"."""

    def __init__(self, members: Sequence[torch.optim.Optimizer]):
        self.members = list(members)

    @property
    def param_groups(self) -> list[dict]:
        """Every member's groups, in member order (the user's dicts themselves)."""
        return [group for member in self.members for group in member.param_groups]

    @property
    def state(self) -> "SetState":
        return SetState(self.members)

    def step(self) -> None:
        for member in self.members:
            member.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for member in self.members:
            member.zero_grad(set_to_none)

    def __repr__(self) -> str:
        return f"OptimizerSet({', '.join(type(m).__name__ for m in self.members)})"


class SetState(MutableMapping):
    """The members' ``state`` mappings as one (their keys, the tensors they step, are
    distinct); a key not yet held goes to the member whose groups hold it."""

    def __init__(self, members: Sequence[torch.optim.Optimizer]):
        self._members = members

    def _member_of(self, key) -> torch.optim.Optimizer:
        for member in self._members:
            if key in member.state:
                return member
        for member in self._members:
            if any(p is key for group in member.param_groups for p in group["params"]):
                return member
        raise KeyError(key)

    def __getitem__(self, key):
        for member in self._members:
            if key in member.state:
                return member.state[key]
        raise KeyError(key)

    def __setitem__(self, key, value) -> None:
        self._member_of(key).state[key] = value

    def __delitem__(self, key) -> None:
        del self._member_of(key).state[key]

    def __iter__(self) -> Iterator:
        for member in self._members:
            yield from member.state

    def __len__(self) -> int:
        return sum(len(member.state) for member in self._members)

    def __contains__(self, key) -> bool:
        return any(key in member.state for member in self._members)


def members(optimizer) -> list[torch.optim.Optimizer]:
    """The user's optimizers that ``optimizer`` (one, or an ``OptimizerSet``) stands for."""
    return list(optimizer.members) if isinstance(optimizer, OptimizerSet) else [optimizer]


def same_optimizers(a, b) -> bool:
    """Whether ``a`` and ``b`` stand for the same optimizers, in the same order."""
    ma, mb = members(a), members(b)
    return len(ma) == len(mb) and all(x is y for x, y in zip(ma, mb))
