"""What the planner is asked: the training step a rank runs, ``Workload``, which every
question (``plan_model``, the traced working set, the priced quantized collectives) reads.
What to compare beside it is grouped by role in the module that plans it:
``ExpertParallelOptions`` (expert_parallel.py), ``TensorParallelOptions``
(tensor_parallel.py), ``OffloadOptions`` (offload.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Workload:
    """A rank's training step, as ``zero_compile`` would run it: ``world_size`` ranks at
    ZeRO ``stage`` in ``dtype`` (bf16/fp16: mixed precision with fp32 masters) with
    ``optimizer``; with ``seq``, ``batch`` sequences of ``seq`` tokens a rank (None: 1),
    traced with ``recompute`` (None, ``"blocks"`` or ``"auto"``) and its
    ``activation_memory_budget`` (a fraction when <= 1, else bytes)."""

    world_size: int
    stage: int = 3
    dtype: torch.dtype = torch.float32
    optimizer: str = "adamw"
    batch: Optional[int] = None
    seq: Optional[int] = None
    recompute: Optional[str] = None
    activation_memory_budget: Optional[float] = None

    @property
    def sequences(self) -> int:
        """Sequences a rank: ``batch``, 1 where not given."""
        return self.batch or 1

    def recompute_options(self) -> dict:
        """``recompute`` and its budget as ``zero_compile``'s keywords."""
        return {"recompute": self.recompute, **budget_option(self.activation_memory_budget)}


def budget_option(budget: Optional[float]) -> dict:
    """``--activation-budget`` (a fraction when <= 1, else bytes) as zero_compile's option."""
    if budget is None:
        return {}
    return ({"activation_budget_fraction": budget} if budget <= 1
            else {"activation_budget_bytes": int(budget)})
