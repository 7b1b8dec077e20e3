"""The models of ``python -m bench.peers``, and the batches every peer trains them on.

Each is built from a seed with random weights (no downloads), so every peer and
every rank starts from the same parameters. The batches are a learnable pattern
(arithmetic sequences of tokens modulo the vocabulary), the same for every peer:
rank r of N takes rows r, r+N, ... of step s's global batch, so the losses of
every data-parallel peer agree with each other and with one process training the
whole batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from examples.gpt import GPT, GPTConfig


@dataclass(frozen=True)
class BenchModel:
    build: Callable[[], nn.Module]
    vocab_size: int
    seq: int
    batch_per_rank: int
    blocks: Callable[[nn.Module], list]
    """The repeated blocks (FSDP2 shards and compiles each; DeepSpeed ZeRO-3 prefetches them)."""
    hf: bool = False
    """A HuggingFace ``transformers`` model (called with ``input_ids=``, returns ``.logits``)."""
    own_loss: bool = False
    """An HF model whose loss is its own: ``model(input_ids=x, labels=x).loss`` (it shifts
    the labels itself, so the last target is left out; a mixture of experts adds its
    router's load-balancing loss there, which the logits alone cannot give; each rank's
    is over its own tokens, so the whole-batch ``torch.compile`` peer's differs slightly)."""
    about: str = ""
    gpt: Optional[GPTConfig] = None
    """The configuration of an ``examples.gpt`` model (``with_layers`` rebuilds it deeper)."""

    def with_layers(self, layers: int) -> "BenchModel":
        """The same model with ``layers`` blocks (GPT models only)."""
        if self.gpt is None:
            raise ValueError("--layers applies to the examples.gpt models only")
        config = dataclasses.replace(self.gpt, n_layer=layers)
        return dataclasses.replace(self, build=_gpt(config), gpt=config,
                                   about=f"{self.about}; here {layers} layers")


def _gpt(cfg: GPTConfig) -> Callable[[], nn.Module]:
    return lambda: GPT(cfg)


def _gpt_model(config: GPTConfig, **spec) -> BenchModel:
    return BenchModel(_gpt(config), blocks=_gpt_blocks, gpt=config, **spec)


def _gpt_blocks(model: nn.Module) -> list:
    return list(model.blocks)


def _hf(kind: str, **sizes) -> Callable[[], nn.Module]:
    def build():
        from examples import hf_models

        config = {"gpt2": hf_models.gpt2_config, "llama": hf_models.llama_config,
                  "mixtral": hf_models.mixtral_config}[kind](**sizes)
        return hf_models.causal_lm(config)  # loss_type "ForCausalLM", no dropout
    return build


def _hf_blocks(model: nn.Module) -> list:
    body = getattr(model, "transformer", None) or model.model
    return list(getattr(body, "h", None) or body.layers)


MODELS = {
    "tiny": _gpt_model(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2,
                                 n_embd=32, bias=False),
                       vocab_size=64, seq=16, batch_per_rank=2,
                       about="the smoke test's GPT, 2 layers of width 32"),
    "gpt-small": _gpt_model(GPTConfig(vocab_size=8192, block_size=256, n_layer=6, n_head=5,
                                      n_embd=320, bias=False),
                            vocab_size=8192, seq=256, batch_per_rank=4,
                            about="GPT, 6 layers of width 320, vocabulary 8192 (10.0M parameters)"),
    "gpt2-125m": _gpt_model(GPTConfig(vocab_size=50304, block_size=1024, n_layer=12,
                                      n_head=12, n_embd=768, bias=False),
                            vocab_size=50304, seq=512, batch_per_rank=1,
                            about="GPT-2 small's shape: 12 layers of width 768, vocabulary 50304 "
                                  "(124M parameters)"),
    "gpt-1b": _gpt_model(GPTConfig(vocab_size=50304, block_size=2048, n_layer=24, n_head=16,
                                   n_embd=2048, bias=False),
                         vocab_size=50304, seq=2048, batch_per_rank=4,
                         about="GPT, 24 layers of width 2048, 16 heads, vocabulary 50304 "
                               "(1.32B parameters)"),
    "hf-gpt2": BenchModel(_hf("gpt2", vocab_size=8192, seq=256, layers=6, width=320, heads=5),
                          vocab_size=8192, seq=256, batch_per_rank=4, blocks=_hf_blocks, hf=True,
                          about="HuggingFace GPT2LMHeadModel from a config, 6 layers of width 320"),
    "hf-llama": BenchModel(_hf("llama", vocab_size=8192, seq=256, layers=6, width=320, heads=5,
                               kv_heads=5, ffn=864),
                           vocab_size=8192, seq=256, batch_per_rank=4, blocks=_hf_blocks, hf=True,
                           about="HuggingFace LlamaForCausalLM from a config, 6 layers of width 320"),
    # HF's own sparse block (a loop over the experts that received tokens) for the other
    # peers (each expert also called on no rows: trainers._every_expert_takes_part);
    # zero_fx rewrites it to fixed shapes inside zero_compile (capture/experts/routed_experts.py)
    "hf-mixtral": BenchModel(_hf("mixtral", vocab_size=8192, seq=256, layers=4, width=256,
                                 heads=4, kv_heads=2, ffn=512, experts=8, top_k=2,
                                 aux_loss_coef=0.02),
                             vocab_size=8192, seq=256, batch_per_rank=2, blocks=_hf_blocks,
                             hf=True, own_loss=True,
                             about="HuggingFace MixtralForCausalLM from a config, 4 layers of "
                                   "width 256, 8 experts of width 512, top-2, router loss "
                                   "0.02 (17.6M parameters)"),
}


def global_batch(spec: BenchModel, step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s inputs and next-token targets for all ranks: rows are
    ``a, a+s, a+2s, ...`` modulo the vocabulary with a random start and stride."""
    g = torch.Generator().manual_seed(1000 + step)
    rows = spec.batch_per_rank * world_size
    start = torch.randint(0, spec.vocab_size, (rows, 1), generator=g)
    stride = torch.randint(1, 8, (rows, 1), generator=g)
    tokens = (start + stride * torch.arange(spec.seq + 1)) % spec.vocab_size
    return tokens[:, :-1], tokens[:, 1:]


def rank_batch(spec: BenchModel, step: int, rank: int, world_size: int, device) -> tuple:
    x, y = global_batch(spec, step, world_size)
    return x[rank::world_size].to(device), y[rank::world_size].to(device)


def loss_of(spec: BenchModel, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (the HF models take ``y`` as already shifted labels);
    for ``own_loss`` models the model's own loss, router loss included."""
    if spec.own_loss:
        return model(input_ids=x, labels=x).loss
    if spec.hf:
        logits = model(input_ids=x).logits
    else:
        logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
