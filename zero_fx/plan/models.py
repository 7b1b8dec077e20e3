"""The models the planner knows by name, and how it builds any model without memory.

``--model`` is one of ``NAMED`` (HuggingFace configs, written out here so that no
hub access is needed), a path to a HuggingFace ``config.json``, or
``module:function`` returning an ``nn.Module`` (built on the meta device too).
The HuggingFace forms need ``transformers`` (``pip install -e ".[hf]"``).
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

_GPT2 = dict(model_type="gpt2", vocab_size=50257, n_positions=1024)
_LLAMA2 = dict(model_type="llama", vocab_size=32000, max_position_embeddings=4096,
               tie_word_embeddings=False)
_LLAMA3 = dict(model_type="llama", vocab_size=128256, max_position_embeddings=8192,
               rope_theta=500000.0, tie_word_embeddings=False)

NAMED: dict[str, dict[str, Any]] = {
    "gpt2": dict(_GPT2, n_layer=12, n_embd=768, n_head=12),
    "gpt2-medium": dict(_GPT2, n_layer=24, n_embd=1024, n_head=16),
    "gpt2-xl": dict(_GPT2, n_layer=48, n_embd=1600, n_head=25),
    # The ZeRO paper quotes Ψ = 7.5B without an architecture; this GPT-2-shaped model
    # has 7.49B parameters (36 layers of width 4096, 8192 positions).
    "zero-paper-7.5b": dict(_GPT2, n_layer=36, n_embd=4096, n_head=32, n_positions=8192),
    "llama2-7b": dict(_LLAMA2, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32),
    "llama3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8),
    "llama3-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8),
}


@dataclass
class ModelSource:
    """How to build the model, at full depth or with fewer layers."""

    description: str
    build: Callable[[Optional[int]], nn.Module]
    """``build(layers)``: the model, with ``layers`` transformer blocks (None: as configured)."""
    layers: Optional[int]
    """Blocks in the full model, or None when the source cannot change its depth."""
    vocab_size: Optional[int]
    max_positions: Optional[int]


def model_source(spec: str) -> ModelSource:
    """``--model``: a name in ``NAMED``, a ``config.json`` path, or ``module:function``."""
    if spec in NAMED:
        return _hf_source(dict(NAMED[spec]), spec)
    if spec.endswith(".json") or os.path.isdir(spec):
        path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
        try:
            with open(path) as f:
                return _hf_source(json.load(f), path)
        except OSError as err:
            raise SystemExit(f"cannot read the config {path}: {err}") from None
    if ":" in spec:
        return _function_source(spec)
    raise SystemExit(f"--model must be one of {', '.join(NAMED)}, a HuggingFace config.json, "
                     f"or module:function; got {spec!r}")


def on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` with every tensor on the meta device: shapes and dtypes, no memory."""
    with torch.device("meta"):
        return build()


def _hf_source(config: dict, description: str) -> ModelSource:
    try:
        import transformers
    except ImportError:
        raise SystemExit("HuggingFace configs need transformers: pip install -e \".[hf]\" "
                         "(or give --model module:function)") from None
    model_type = config.pop("model_type", None)
    if model_type is None:
        raise SystemExit(f"{description} has no model_type; is it a HuggingFace config.json?")
    base = transformers.AutoConfig.for_model(model_type, **config)

    def build(layers: Optional[int]) -> nn.Module:
        cfg = transformers.AutoConfig.for_model(model_type, **config)
        if layers is not None:
            cfg.num_hidden_layers = layers
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        model.loss_type = "ForCausalLM"
        return model

    return ModelSource(
        description=f"{description} (HuggingFace {type(base).__name__})", build=build,
        layers=getattr(base, "num_hidden_layers", None), vocab_size=base.vocab_size,
        max_positions=getattr(base, "max_position_embeddings", None))


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
        raise SystemExit(f"cannot load {spec}: {err} (run from the repository root for the "
                         "examples' models, or put your module on PYTHONPATH)") from None


def embedding_rows(model: nn.Module) -> Optional[int]:
    """Rows of the model's first ``nn.Embedding`` (its vocabulary), or None without one."""
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    return embeddings[0].num_embeddings if embeddings else None
