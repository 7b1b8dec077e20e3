"""The call ``update_in_graph`` puts in the graph after each bucket's reduction
([Note: the update in the graph] in zero_fx/runtime/update/graph_update.py)."""

from __future__ import annotations

import contextvars

import torch
from torch._subclasses.fake_tensor import FakeTensor

ACTIVE_UPDATE: contextvars.ContextVar = contextvars.ContextVar("zero_fx_graph_update", default=None)
"""The update of the step whose graph runs now (``GraphUpdate.running``): what
``update_bucket`` calls."""


def update_bucket(names: tuple, *grads: torch.Tensor) -> None:
    """In the graph, after a bucket's reduction: step the optimizer on the shards of
    ``names`` with their reduced gradients ``grads``. Traced on fake tensors (the planner,
    ``explain``'s replay) it does nothing."""
    active = ACTIVE_UPDATE.get()
    if active is not None:
        active.update(names, grads)
        return
    if any(isinstance(g, torch.Tensor) and not isinstance(g, FakeTensor) and not g.is_meta
           for g in grads):
        raise RuntimeError(
            "a zero_fx graph that updates the optimizer ran outside its compiled step (no "
            "update is active), so its gradients would be dropped; call the compiled step")
