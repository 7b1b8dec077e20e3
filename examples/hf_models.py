"""HuggingFace ``transformers`` GPT-2, Llama, Mixtral, Qwen3-MoE and DeepSeek-V3 built from a config with random weights
(no hub access), ready for ``@zero_compile``.

Two settings make them capture as one graph (README, "Models that do not capture"):
``model.loss_type = "ForCausalLM"`` (otherwise the loss function logs a warning from inside
the step) and no dropout (``*pdrop``/``*dropout`` at 0: a dropout with p > 0 is
allowed, but its random numbers differ from eager and between ranks, so parity runs
keep it off).
"""

from __future__ import annotations

import torch.nn as nn

try:
    import transformers
except ImportError:  # pragma: no cover - the message is the point
    transformers = None


def require_transformers() -> None:
    if transformers is None:
        raise SystemExit("this needs HuggingFace transformers: pip install \"transformers>=4.57,<6\" (or, in a clone, pip install -e \".[examples]\")")


def gpt2_config(vocab_size: int, seq: int, layers: int, width: int, heads: int):
    require_transformers()
    return transformers.GPT2Config(vocab_size=vocab_size, n_positions=seq, n_embd=width,
                                   n_layer=layers, n_head=heads, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0)


def llama_config(vocab_size: int, seq: int, layers: int, width: int, heads: int,
                 kv_heads: int, ffn: int):
    require_transformers()
    return transformers.LlamaConfig(vocab_size=vocab_size, max_position_embeddings=seq,
                                    hidden_size=width, intermediate_size=ffn,
                                    num_hidden_layers=layers, num_attention_heads=heads,
                                    num_key_value_heads=kv_heads, attention_dropout=0.0)


def causal_lm(config) -> nn.Module:
    """``AutoModelForCausalLM`` from ``config``, random weights, set up for capture."""
    require_transformers()
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.loss_type = "ForCausalLM"
    return model


def tiny_gpt2(vocab_size: int = 64, seq: int = 16) -> nn.Module:
    """Two layers, width 32: the parity tests' GPT-2."""
    return causal_lm(gpt2_config(vocab_size, seq, layers=2, width=32, heads=2))


def tiny_llama(vocab_size: int = 64, seq: int = 16) -> nn.Module:
    """Two layers, width 32, grouped-query attention (4 heads, 2 key/value heads)."""
    return causal_lm(llama_config(vocab_size, seq, layers=2, width=32, heads=4, kv_heads=2,
                                  ffn=64))


def mixtral_config(vocab_size: int, seq: int, layers: int, width: int, heads: int,
                   kv_heads: int, ffn: int, experts: int = 8, top_k: int = 2,
                   aux_loss_coef: float = 0.02):
    """Mixtral with the router's load-balancing loss in ``outputs.loss``
    (``output_router_logits=True``)."""
    require_transformers()
    return transformers.MixtralConfig(
        vocab_size=vocab_size, max_position_embeddings=seq, hidden_size=width,
        intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, num_local_experts=experts, num_experts_per_tok=top_k,
        output_router_logits=True, router_aux_loss_coef=aux_loss_coef, attention_dropout=0.0)


def qwen3_moe_config(vocab_size: int, seq: int, layers: int, width: int, heads: int,
                     kv_heads: int, ffn: int, experts: int = 8, top_k: int = 2,
                     aux_loss_coef: float = 0.02):
    """Qwen3-MoE (every layer sparse), router loss in ``outputs.loss``."""
    require_transformers()
    return transformers.Qwen3MoeConfig(
        vocab_size=vocab_size, max_position_embeddings=seq, hidden_size=width,
        intermediate_size=ffn, moe_intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=width // heads,
        num_experts=experts, num_experts_per_tok=top_k, output_router_logits=True,
        router_aux_loss_coef=aux_loss_coef, attention_dropout=0.0)


def tiny_mixtral(vocab_size: int = 64, seq: int = 16, experts: int = 8,
                 layers: int = 2) -> nn.Module:
    """Two layers, width 32, 8 experts of width 64, top-2: the tests' Mixtral."""
    return causal_lm(mixtral_config(vocab_size, seq, layers=layers, width=32, heads=4,
                                    kv_heads=2, ffn=64, experts=experts))


def tiny_qwen3_moe(vocab_size: int = 64, seq: int = 16, experts: int = 8,
                   layers: int = 2) -> nn.Module:
    """Two layers, width 32, 8 experts of width 32, top-2, renormalisation off (Qwen3's
    default)."""
    return causal_lm(qwen3_moe_config(vocab_size, seq, layers=layers, width=32, heads=4,
                                      kv_heads=2, ffn=32, experts=experts))


def deepseek_v3_config(vocab_size: int, seq: int, layers: int, width: int, heads: int,
                       experts: int = 4, top_k: int = 2):
    """DeepSeek-V3: multi-head latent attention, dense first layer, then routed experts (a
    sigmoid router with a correction bias, group-limited top-k, its weights renormalised in
    place) beside one shared expert."""
    require_transformers()
    return transformers.DeepseekV3Config(
        vocab_size=vocab_size, max_position_embeddings=seq, hidden_size=width,
        intermediate_size=2 * width, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, n_routed_experts=experts, num_experts_per_tok=top_k,
        n_shared_experts=1, moe_intermediate_size=width // 2, n_group=1, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=width // 2,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, attention_dropout=0.0)


def tiny_deepseek_v3(vocab_size: int = 64, seq: int = 16) -> nn.Module:
    """Two layers (the first dense), width 32, 4 routed experts and a shared one, top-2."""
    return causal_lm(deepseek_v3_config(vocab_size, seq, layers=2, width=32, heads=4))
