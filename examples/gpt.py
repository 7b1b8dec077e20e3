"""A small GPT (token + position embedding, pre-norm attention and MLP blocks,
output projection tied to the token embedding), in the style of nanoGPT.

The model ships with zero_fx (zero_fx/models.py), where the planner's named
GPTs are built from it; this module keeps the examples' import path and their small
default sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

from zero_fx import models as torch_models
from zero_fx.models import GPT, CausalSelfAttention, GPTBlock as Block

__all__ = ["Block", "CausalSelfAttention", "GPT", "GPTConfig", "gpt_1b"]


@dataclass(frozen=True)
class GPTConfig(torch_models.GPTConfig):
    """The package's GPT configuration with an example's small defaults."""

    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128


def gpt_1b() -> GPT:
    """A 1.0B-parameter GPT (18 layers of width 2048, GPT-2's vocabulary), for planning."""
    return GPT(GPTConfig(vocab_size=50304, block_size=2048, n_layer=18, n_head=16, n_embd=2048,
                         bias=False))
