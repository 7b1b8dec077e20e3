"""The models the CLIs know by name, and how the planner builds any model without memory.

``--model`` of ``python -m zero_fx.plan`` and ``python -m zero_fx.estimate`` is one of
``NAMED`` (their shapes are written out in this package, zero_fx.models: no
hub access, no checkout of the repository), an old name in ``ALIASES``, or
``module:function`` returning an ``nn.Module`` (built on the meta device too). The
planner also takes a path to a HuggingFace ``config.json`` (or its folder).

The planner builds a named model with HuggingFace transformers when it is installed
(the module names of the HF model; ``pip install 'transformers>=4.57,<6'``), else as the
package's own torch module of the same shapes and parameter count; the estimate always
builds the torch module (it traces a forward that returns logits). A config.json needs
transformers.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn

from ..base.compat import SUPPORTED_TRANSFORMERS_TEXT, hf_no_init_weights
from .. import models as torch_models
from ..models import MLA, Experts, GPTConfig, LlamaConfig, ModelConfig

TRANSFORMERS_MISSING = f"pip install '{SUPPORTED_TRANSFORMERS_TEXT}'"
"""The install hint: the transformers releases pyproject.toml's [hf] extra takes."""

_GPT2 = dict(vocab_size=50257, block_size=1024)
_LLAMA2 = dict(vocab_size=32000, max_positions=4096, rope_theta=10000.0)
_LLAMA3 = dict(vocab_size=128256, max_positions=8192, rope_theta=500000.0)

NAMED: dict[str, ModelConfig] = {
    "gpt2": GPTConfig(**_GPT2, n_layer=12, n_embd=768, n_head=12),
    "gpt2-medium": GPTConfig(**_GPT2, n_layer=24, n_embd=1024, n_head=16),
    "gpt2-xl": GPTConfig(**_GPT2, n_layer=48, n_embd=1600, n_head=25),
    # 1.0B parameters: 18 layers of width 2048, GPT-2's vocabulary padded to 50304, no
    # biases (examples/gpt.py's gpt_1b; transformers has no GPT-2 without biases)
    "gpt-1b": GPTConfig(vocab_size=50304, block_size=2048, n_layer=18, n_head=16, n_embd=2048,
                        bias=False),
    # The ZeRO paper quotes Ψ = 7.5B without an architecture; this GPT-2-shaped model
    # has 7.49B parameters (36 layers of width 4096, 8192 positions).
    "zero-paper-7.5b": GPTConfig(vocab_size=50257, block_size=8192, n_layer=36, n_embd=4096,
                                 n_head=32),
    # ZeRO-Offload's 13B (Ren et al. 2021 train a 13B GPT-2 on one V100 32 GB): GPT-3
    # 13B's 40 blocks of width 5120 (40 heads of 128; Brown et al. 2020 print 5140), GPT-2's
    # vocabulary padded to 50304, 1024 positions, no biases (zero_fx's torch GPT, whose
    # attention is fused as Megatron's was; transformers has no GPT-2 without biases):
    # 12.85B parameters
    "zero-offload-13b": GPTConfig(vocab_size=50304, block_size=1024, n_layer=40, n_embd=5120,
                                  n_head=40, bias=False),
    "llama2-7b": LlamaConfig(**_LLAMA2, dim=4096, ffn_dim=11008, n_layer=32, n_head=32,
                             n_kv_head=32),
    "llama3-8b": LlamaConfig(**_LLAMA3, dim=4096, ffn_dim=14336, n_layer=32, n_head=32,
                             n_kv_head=8),
    "llama3-70b": LlamaConfig(**_LLAMA3, dim=8192, ffn_dim=28672, n_layer=80, n_head=64,
                              n_kv_head=8),
    # Llama 3.1 405B: 405.9B parameters (its 131072-token rope scaling left out: shapes only)
    "llama3-405b": LlamaConfig(**_LLAMA3, dim=16384, ffn_dim=53248, n_layer=126, n_head=128,
                               n_kv_head=8),
    # The seeds' "64K hidden dimension layer" (ZeRO-Infinity): GPT-2-shaped blocks of width
    # 65536 (512 heads of 128, a 4x MLP, no biases), 4 of them: 209.6B parameters, 51.5B a
    # block, whose fp16 parameters and gradients alone are 206 GB; its MLP's first matrix is
    # a 34 GB fp16 buffer. Tensor parallelism is what fits it (docs/planner.md).
    "gpt-64k": GPTConfig(vocab_size=50304, block_size=2048, n_layer=4, n_head=512,
                         n_embd=65536, bias=False),
    # Mixtral 8x7B: 46.7B parameters, 12.9B active (8 SwiGLU experts per block, top-2)
    "mixtral-8x7b": LlamaConfig(vocab_size=32000, max_positions=32768, rope_theta=1e6, dim=4096,
                                ffn_dim=14336, n_layer=32, n_head=32, n_kv_head=8,
                                experts=Experts(n_experts=8, top_k=2, ffn_dim=14336)),
    # DeepSeek-V3 (no multi-token-prediction module): 671B parameters, 37B active. 61
    # blocks of multi-head latent attention; the first 3 dense (SwiGLU 18432), the others
    # 256 routed experts of 2048 (top-8) and one shared. Its router's sigmoid and grouped
    # top-k are the HF model's; the torch module routes by softmax (same shapes)
    "deepseek-v3": LlamaConfig(vocab_size=129280, max_positions=163840, rope_theta=10000.0,
                               dim=7168, ffn_dim=18432, n_layer=61, n_head=128, n_kv_head=128,
                               experts=Experts(n_experts=256, top_k=8, ffn_dim=2048, n_shared=1,
                                               dense_layers=3),
                               mla=MLA()),
}
"""The shapes of every model the CLIs know by name (torch_models builds them)."""

ALIASES = {"llama-8b": "llama3-8b"}
"""Old names, still accepted: ``python -m zero_fx.estimate`` called Llama 3 8B ``llama-8b``."""

MODEL_NAMES_HELP = (f"{', '.join(NAMED)} (old name: "
                    + ", ".join(f"{old} = {new}" for old, new in ALIASES.items()) + ")")


def named_model(spec: str) -> Optional[str]:
    """The name in ``NAMED`` that ``spec`` means (aliases resolved; a note on stderr for an
    old name), or None when ``spec`` is no name."""
    if spec in ALIASES:
        print(f"note: --model {spec} is the old name of {ALIASES[spec]}", file=sys.stderr)
        return ALIASES[spec]
    return spec if spec in NAMED else None


def named_builder(name: str, layers: Optional[int] = None) -> Callable[[], nn.Module]:
    """A callable building the named model as the package's torch module (token ids to
    logits), with ``layers`` blocks instead of its own when given."""
    return lambda: torch_models.build(NAMED[name], layers)


@dataclass
class ModelSource:
    """How to build the model, at full depth or with fewer layers."""

    description: str
    build: Callable[..., nn.Module]
    """``build(layers)``: the model, with ``layers`` transformer blocks (None: as configured);
    ``build(layers, dense_layers)`` too when ``dense_layers``: that many of them without
    experts."""
    layers: Optional[int]
    """Blocks in the full model, or None when the source cannot change its depth."""
    vocab_size: Optional[int]
    max_positions: Optional[int]
    dense_layers: int = 0
    """A mixture-of-experts model's leading blocks without experts (DeepSeek-V3's 3)."""


def model_source(spec: str) -> ModelSource:
    """``--model``: a name in ``NAMED`` (or ``ALIASES``), a ``config.json`` path, or
    ``module:function``."""
    name = named_model(spec)
    if name is not None:
        hf_config = torch_models.huggingface_config(NAMED[name])
        if hf_config is not None and importlib.util.find_spec("transformers") is not None:
            return _hf_source(hf_config, name)
        return _torch_source(name, missing_transformers=hf_config is not None)
    if spec.endswith(".json") or os.path.isdir(spec):
        path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
        try:
            with open(path) as f:
                return _hf_source(json.load(f), path)
        except OSError as err:
            raise SystemExit(f"cannot read the config {path}: {err}") from None
    if ":" in spec:
        return _function_source(spec)
    raise SystemExit(f"--model must be one of {MODEL_NAMES_HELP}, a HuggingFace config.json, "
                     f"or module:function; got {spec!r}")


def on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` with every tensor on the meta device: shapes and dtypes, no memory."""
    with torch.device("meta"):
        return build()


def _hf_source(config: dict, description: str) -> ModelSource:
    try:
        import transformers
    except ImportError:
        raise SystemExit(f"HuggingFace configs need transformers: {TRANSFORMERS_MISSING} "
                         "(or give a named model or module:function)") from None
    model_type = config.pop("model_type", None)
    if model_type is None:
        raise SystemExit(f"{description} has no model_type; is it a HuggingFace config.json?")
    base = transformers.AutoConfig.for_model(model_type, **config)

    def build(layers: Optional[int], dense_layers: Optional[int] = None) -> nn.Module:
        cfg = transformers.AutoConfig.for_model(model_type, **config)
        if layers is not None:
            cfg.num_hidden_layers = layers
        if dense_layers is not None:
            cfg.first_k_dense_replace = dense_layers
        # shapes only: HuggingFace's weight init visits every module (DeepSeek-V3's 45k
        # experts' linears: about 40 s on meta), and the planner reads no values
        with hf_no_init_weights():
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        model.tie_weights()  # the init it skipped also ties the embedding and the head
        model.loss_type = "ForCausalLM"
        return model

    return ModelSource(
        description=f"{description} (HuggingFace {type(base).__name__})", build=build,
        layers=getattr(base, "num_hidden_layers", None), vocab_size=base.vocab_size,
        max_positions=getattr(base, "max_position_embeddings", None),
        # DeepSeek's dense blocks before its experts
        dense_layers=getattr(base, "first_k_dense_replace", 0) or 0)


def _torch_source(name: str, *, missing_transformers: bool) -> ModelSource:
    cfg = NAMED[name]
    how = (f"zero_fx's torch {type(cfg).__name__.removesuffix('Config')}"
           + ("; without transformers, not the HF model" if missing_transformers else ""))
    return ModelSource(description=f"{name} ({how})",
                       build=lambda layers, dense_layers=None: torch_models.build(
                           cfg, layers, dense_layers),
                       layers=cfg.n_layer, vocab_size=cfg.vocab_size,
                       max_positions=torch_models.max_positions(cfg),
                       dense_layers=getattr(getattr(cfg, "experts", None), "dense_layers", 0))


def _function_source(spec: str) -> ModelSource:
    make = import_builder(spec)
    return ModelSource(description=spec, build=lambda layers: make(), layers=None,
                       vocab_size=embedding_rows(on_meta(make)), max_positions=None)


def import_builder(spec: str) -> Callable[[], nn.Module]:
    """``module:function`` -> the function (it builds the model)."""
    module_name, _, function = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError) as err:
        raise SystemExit(f"cannot load {spec}: {err} (put your module on PYTHONPATH; the "
                         f"named models need none: {', '.join(NAMED)})") from None


def embedding_rows(model: nn.Module) -> Optional[int]:
    """Rows of the model's first ``nn.Embedding`` (its vocabulary), or None without one."""
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    return embeddings[0].num_embeddings if embeddings else None
