"""A Llama-style decoder (RMSNorm, rotary positions, grouped-query attention, SwiGLU),
for planning and cost estimates at real sizes (``llama_8b``) on fake tensors.

The model ships with zero_fx (zero_fx/models.py), so that ``python -m
zero_fx.estimate --model llama3-8b`` works from an installed package; this module keeps
the examples' import path.
"""

from __future__ import annotations

from zero_fx.planner.models import NAMED
from zero_fx.models import Attention, Block, Llama, LlamaConfig

__all__ = ["Attention", "Block", "Llama", "LlamaConfig", "llama_8b"]


def llama_8b() -> Llama:
    """Llama 3 8B's shapes (8.03B parameters)."""
    return Llama(NAMED["llama3-8b"])
