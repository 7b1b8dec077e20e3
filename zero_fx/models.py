"""The models zero_fx ships, as plain torch modules: the examples train them, and the named
models of ``python -m zero_fx.plan`` and ``python -m zero_fx.estimate`` are built from them
(their shapes by name are in zero_fx/planner/models.py), so the CLIs need nothing but torch.
A leaf: it imports torch only. Its old path, ``zero_fx.planner.torch_models``, still works.

Two families, each mapping token ids ``(batch, seq)`` to logits ``(batch, seq, vocab)``:

- ``GPT``: GPT-2's layout (learned positions, pre-norm LayerNorm blocks, a 4x GELU
  MLP, the output projection tied to the token embedding), in the style of nanoGPT; the
  examples train it (examples/gpt.py re-exports it with small defaults).
- ``Llama``: Llama's (RMSNorm, rotary positions, grouped-query attention, SwiGLU, an
  untied output projection). With ``experts`` its blocks (from ``dense_layers`` on) hold
  a mixture of SwiGLU experts instead of one (Mixtral's, DeepSeek-V3's shapes); with
  ``mla``, DeepSeek's multi-head latent attention instead of grouped-query attention.

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
class Experts:
    """A mixture of SwiGLU experts in place of a block's feed-forward (Mixtral, DeepSeek)."""

    n_experts: int
    """Routed experts per block (all of them are parameters, sharded and stored)."""
    top_k: int
    """Experts each token is routed to (what its activations pass through)."""
    ffn_dim: int
    """Each expert's SwiGLU width (three matrices of dim x ffn_dim)."""
    n_shared: int = 0
    """Shared experts, run on every token: one SwiGLU of width n_shared * ffn_dim."""
    dense_layers: int = 0
    """Leading blocks with the dense SwiGLU of ``LlamaConfig.ffn_dim`` instead (DeepSeek-V3: 3)."""


@dataclass(frozen=True)
class MLA:
    """DeepSeek's multi-head latent attention: queries and keys/values through low-rank
    projections; a rotary part of ``qk_rope_dim`` per head (the key's shared by all heads)."""

    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_dim: int = 128
    qk_rope_dim: int = 64
    v_head_dim: int = 128


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
    experts: Optional[Experts] = None
    """A mixture of experts in the blocks' feed-forward (None: dense)."""
    mla: Optional[MLA] = None
    """Multi-head latent attention instead of grouped-query attention (None: GQA)."""


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
        # -1 heads: a rank's own heads when the projections are split by tensor parallelism
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.n_kv_head != self.n_head)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class LatentAttention(nn.Module):
    """DeepSeek-V2/V3's multi-head latent attention (HuggingFace's DeepseekV3Attention's
    parameters, without its cache)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        m = self.shape = cfg.mla
        self.n_head = cfg.n_head
        self.wq_a = nn.Linear(cfg.dim, m.q_lora_rank, bias=False)
        self.q_norm = nn.RMSNorm(m.q_lora_rank)
        self.wq_b = nn.Linear(m.q_lora_rank, cfg.n_head * (m.qk_nope_dim + m.qk_rope_dim),
                              bias=False)
        self.wkv_a = nn.Linear(cfg.dim, m.kv_lora_rank + m.qk_rope_dim, bias=False)
        self.kv_norm = nn.RMSNorm(m.kv_lora_rank)
        self.wkv_b = nn.Linear(m.kv_lora_rank, cfg.n_head * (m.qk_nope_dim + m.v_head_dim),
                               bias=False)
        self.wo = nn.Linear(cfg.n_head * m.v_head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        m, H = self.shape, self.n_head
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(B, T, H, -1).transpose(1, 2)
        q_nope, q_rope = q.split([m.qk_nope_dim, m.qk_rope_dim], dim=-1)
        kv, k_rope = self.wkv_a(x).split([m.kv_lora_rank, m.qk_rope_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv)).view(B, T, H, -1).transpose(1, 2)
        k_nope, v = kv.split([m.qk_nope_dim, m.v_head_dim], dim=-1)
        k_rope = _rotate(k_rope.view(B, 1, T, m.qk_rope_dim), cos, sin).expand(B, H, T, -1)
        q = torch.cat([q_nope, _rotate(q_rope, cos, sin)], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class SwiGLU(nn.Module):
    """One expert: Llama's feed-forward."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MixtureOfExperts(nn.Module):
    """Routed SwiGLU experts (and shared ones): softmax over a linear router, each token's
    top-k experts, their weights renormalised (Mixtral's routing); returns the output and
    the router logits. The eager forward loops over the experts; zero_fx gives the block
    a fixed-shape forward before capture ([Note: routed experts with fixed shapes])."""

    def __init__(self, dim: int, e: Experts):
        super().__init__()
        self.top_k = e.top_k
        self.norm_topk_prob = True
        self.gate = nn.Linear(dim, e.n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(dim, e.ffn_dim) for _ in range(e.n_experts))
        if e.n_shared:
            self.shared_experts = SwiGLU(dim, e.n_shared * e.ffn_dim)

    def forward(self, x):
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        logits = self.gate(h)
        weights, chosen = torch.topk(F.softmax(logits, dim=1, dtype=torch.float), self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(h.dtype)
        out = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == i)
            out = out.index_add(0, token, expert(h[token]) * weights[token, slot, None])
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(h)
        return out.reshape(shape), logits


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int = 0):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim)
        self.attn = LatentAttention(cfg) if cfg.mla else Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim)
        if cfg.experts is not None and layer >= cfg.experts.dense_layers:
            self.moe = MixtureOfExperts(cfg.dim, cfg.experts)
        else:
            self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
            self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
            self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.ffn_norm(x)
        if hasattr(self, "moe"):
            return x + self.moe(h)[0]
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, layer) for layer in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens):
        T = tokens.shape[1]
        head_dim = self.cfg.mla.qk_rope_dim if self.cfg.mla else self.cfg.dim // self.cfg.n_head
        freqs = self.cfg.rope_theta ** -(torch.arange(0, head_dim, 2, device=tokens.device)
                                         / head_dim)
        angles = torch.outer(torch.arange(T, device=tokens.device), freqs)
        cos, sin = angles.cos(), angles.sin()
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.output(self.norm(x))


# -- building -------------------------------------------------------------------------------

def build(cfg: ModelConfig, layers: Optional[int] = None,
          dense_layers: Optional[int] = None) -> nn.Module:
    """The model of ``cfg``, with ``layers`` blocks instead of its own when given, and
    ``dense_layers`` of them without experts (a mixture-of-experts model)."""
    if layers is not None:
        cfg = replace(cfg, n_layer=layers)
    if dense_layers is not None:
        cfg = replace(cfg, experts=replace(cfg.experts, dense_layers=dense_layers))
    return GPT(cfg) if isinstance(cfg, GPTConfig) else Llama(cfg)


def max_positions(cfg: ModelConfig) -> int:
    return cfg.block_size if isinstance(cfg, GPTConfig) else cfg.max_positions


def huggingface_config(cfg: ModelConfig) -> Optional[dict[str, Any]]:
    """The HuggingFace configuration of the same shapes (``AutoConfig.for_model`` keywords,
    with ``model_type``), or None where transformers has no such model (a GPT without
    biases: HuggingFace's GPT-2 always has them; experts with shared or dense blocks but
    grouped-query attention). Experts: Mixtral; with ``mla``: DeepSeek-V3, which routes
    with sigmoid scores in groups where the torch module's router is Mixtral's softmax (the
    same parameters and shapes)."""
    if isinstance(cfg, GPTConfig):
        if not cfg.bias:
            return None
        return dict(model_type="gpt2", vocab_size=cfg.vocab_size, n_positions=cfg.block_size,
                    n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head)
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, num_hidden_layers=cfg.n_layer,
                  num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
                  max_position_embeddings=cfg.max_positions, rope_theta=cfg.rope_theta,
                  tie_word_embeddings=False)
    e, m = cfg.experts, cfg.mla
    if m is not None and e is not None:  # DeepSeek-V3 (its routing: sigmoid, grouped)
        return dict(model_type="deepseek_v3", **common, intermediate_size=cfg.ffn_dim,
                    moe_intermediate_size=e.ffn_dim, n_routed_experts=e.n_experts,
                    n_shared_experts=e.n_shared, num_experts_per_tok=e.top_k,
                    first_k_dense_replace=e.dense_layers, q_lora_rank=m.q_lora_rank,
                    kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_dim,
                    qk_rope_head_dim=m.qk_rope_dim, v_head_dim=m.v_head_dim)
    if m is not None or (e is not None and (e.n_shared or e.dense_layers)):
        return None  # no HuggingFace model of this layout
    if e is not None:
        return dict(model_type="mixtral", **common, intermediate_size=e.ffn_dim,
                    num_local_experts=e.n_experts, num_experts_per_tok=e.top_k)
    return dict(model_type="llama", **common, intermediate_size=cfg.ffn_dim)
