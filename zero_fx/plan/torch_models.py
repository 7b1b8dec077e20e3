"""The named models of ``python -m zero_fx.plan`` and ``python -m zero_fx.estimate`` as
plain torch modules, shipped with the package so that the CLIs need nothing but torch.

Two families, each mapping token ids ``(batch, seq)`` to logits ``(batch, seq, vocab)``:

- ``GPT``: GPT-2's layout (learned positions, pre-norm LayerNorm blocks, a 4x GELU
  MLP, the output projection tied to the token embedding), in the style of nanoGPT; the
  examples train it (examples/gpt.py re-exports it with small defaults).
- ``Llama``: Llama's (RMSNorm, rotary positions, grouped-query attention, SwiGLU, an
  untied output projection).

With biases (GPT) they have the parameter count of the HuggingFace model of the same
configuration, tensor for tensor; ``huggingface_config`` gives that configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257
    block_size: int = 1024
    """Learned positions: the longest sequence."""
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    bias: bool = True
    """Biases in Linear and LayerNorm layers (GPT-2 has them). The key part of the qkv
    bias has a gradient that is zero in exact arithmetic, which Adam turns into updates of
    pure rounding noise; parity tests use bias=False to compare real signal."""
    dropout: float = 0.0
    """Dropout after the embeddings and on each block's two residual branches (nanoGPT's
    places, less attention dropout); 0 leaves no dropout op in the model."""


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 128256
    dim: int = 4096
    n_layer: int = 32
    n_head: int = 32
    n_kv_head: int = 8
    ffn_dim: int = 14336
    rope_theta: float = 500000.0
    max_positions: int = 8192
    """The context the model was trained for (rotary positions have no table)."""


ModelConfig = Union[GPTConfig, LlamaConfig]


# -- GPT ------------------------------------------------------------------------------------

def _dropout(p: float) -> nn.Module:
    return nn.Dropout(p) if p else nn.Identity()


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = _dropout(cfg.dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(B, T, C)))


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias),
                                 _dropout(cfg.dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = _dropout(cfg.dropout)
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied input/output embedding
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


# -- Llama ----------------------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.dim // cfg.n_head
        self.wq = nn.Linear(cfg.dim, cfg.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * self.head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.n_kv_head != self.n_head)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim)
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens):
        T = tokens.shape[1]
        head_dim = self.cfg.dim // self.cfg.n_head
        freqs = self.cfg.rope_theta ** -(torch.arange(0, head_dim, 2, device=tokens.device)
                                         / head_dim)
        angles = torch.outer(torch.arange(T, device=tokens.device), freqs)
        cos, sin = angles.cos(), angles.sin()
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.output(self.norm(x))


# -- building -------------------------------------------------------------------------------

def build(cfg: ModelConfig, layers: Optional[int] = None) -> nn.Module:
    """The model of ``cfg``, with ``layers`` blocks instead of its own when given."""
    if layers is not None:
        cfg = replace(cfg, n_layer=layers)
    return GPT(cfg) if isinstance(cfg, GPTConfig) else Llama(cfg)


def max_positions(cfg: ModelConfig) -> int:
    return cfg.block_size if isinstance(cfg, GPTConfig) else cfg.max_positions


def huggingface_config(cfg: ModelConfig) -> Optional[dict[str, Any]]:
    """The HuggingFace configuration of the same shapes (``AutoConfig.for_model`` keywords,
    with ``model_type``), or None where transformers has no such model (a GPT without
    biases: HuggingFace's GPT-2 always has them)."""
    if isinstance(cfg, GPTConfig):
        if not cfg.bias:
            return None
        return dict(model_type="gpt2", vocab_size=cfg.vocab_size, n_positions=cfg.block_size,
                    n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head)
    return dict(model_type="llama", vocab_size=cfg.vocab_size, hidden_size=cfg.dim,
                intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layer,
                num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
                max_position_embeddings=cfg.max_positions, rope_theta=cfg.rope_theta,
                tie_word_embeddings=False)
