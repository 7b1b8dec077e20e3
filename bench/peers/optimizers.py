"""The optimizers every peer trains with: AdamW (the default), or ``--optimizer muon``:
torch.optim.Muon on the blocks' 2-D weights and AdamW on the rest (embeddings, head, norms,
biases), the recipe Moonlight, Kimi K2 and GLM-4.5 publish.

How each peer runs Muon, as its users would:

- zero_fx: the two optimizers in the step (``muon.step(); adamw.step()``); each matrix is
  orthogonalised once, on its owner rank;
- DDP: torch.optim.Muon on the whole parameters, every rank orthogonalising every matrix;
- FSDP2: torch.optim.Muon on FSDP2's DTensor shards. DTensor's matmuls redistribute what
  Newton-Schulz multiplies, so the update is the whole matrix's (measured with fp32
  iterations on a two-layer model at 2 gloo ranks: 5e-6 from one process), every rank doing
  the whole work, as the simplest correct way does (torchtitan#3353);
- DeepSpeed: its own ``"optimizer": {"type": "Muon"}``, which chooses the Muon parameters by
  name (2-D, the name holding neither "embed" nor "lm_head") and runs its own Newton-Schulz,
  so its losses are not the others' (the report leaves them out of the comparison). On a
  CPU it orthogonalises in fp32 (its fp16 "gram" iterations fall back where the accelerator
  has no fp16), where torch.optim.Muon's run in bf16, which a CPU without bf16 units
  emulates, several times slower: ``--muon-iterations fp32`` runs torch's in fp32 too
  (``orthogonalised_in_fp32``), for a like-for-like step time.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.optim._muon as muon_module

LEARNING_RATE = 1e-3
"""AdamW's."""
MUON_LEARNING_RATE = 0.02
MUON_MOMENTUM = 0.95
OPTIMIZERS = ("adamw", "muon")
MUON_ITERATIONS = ("bf16", "fp32")
"""torch.optim.Muon's own bf16 Newton-Schulz, or the same iterations in fp32."""


def muon_matrices(model: nn.Module, blocks) -> list[nn.Parameter]:
    """The recipe's Muon parameters: the 2-D weights inside the model's repeated blocks."""
    seen, out = set(), []
    for block in blocks:
        for p in block.parameters():
            if p.ndim == 2 and p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def optimizers_of(model: nn.Module, blocks, optimizer: str, iterations: str = "bf16") -> list:
    """The peer's optimizers for ``model``: ``[AdamW]``, or ``[Muon, AdamW]`` with Muon's
    ``iterations`` ("fp32": in this process, ``orthogonalised_in_fp32`` replaces torch's)."""
    if optimizer == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)]
    if iterations == "fp32":
        muon_module._zeropower_via_newtonschulz = orthogonalised_in_fp32
    matrices = muon_matrices(model, blocks)
    chosen = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in chosen]
    muon = torch.optim.Muon(matrices, lr=MUON_LEARNING_RATE, momentum=MUON_MOMENTUM,
                            weight_decay=0.0)
    return [muon, torch.optim.AdamW(rest, lr=LEARNING_RATE)]


def deepspeed_optimizer(optimizer: str) -> dict:
    """DeepSpeed's config entry for ``--optimizer muon`` ({} for AdamW, given as an object)."""
    if optimizer == "adamw":
        return {}
    return {"optimizer": {"type": "Muon", "params": {
        "lr": MUON_LEARNING_RATE, "momentum": MUON_MOMENTUM, "weight_decay": 0.0,
        "adam_lr": LEARNING_RATE}}}


def orthogonalised_in_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's Newton-Schulz iterations (``_zeropower_via_newtonschulz``, the same
    arguments) in fp32 instead of bf16."""
    a, b, c = ns_coefficients
    x = grad.float()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x
