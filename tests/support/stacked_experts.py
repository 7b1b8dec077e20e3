"""transformers 5's layout of a mixture-of-experts block, under transformers 4: the tests'
Mixtral with each block's experts held as two 3-D parameters.

transformers 5 holds a block's experts as ``gate_up_proj`` (E, 2I, H) and ``down_proj``
(E, H, I) in one module, called by its block as ``experts(hidden, top_k_index,
top_k_weights)`` after a router module returned ``(logits, weights, indices)``, and its
``use_experts_implementation`` decorator sets the layout's flags (``has_gate``, ``has_bias``,
``is_transposed``, ...) and runs it as one grouped matmul. CI runs transformers 4.57, so the
expert-parallel tests build that shape here from the tiny Mixtral's own weights: the same
model, eager, before and after. The experts' forward is dense (every expert on every token,
weighted by a (tokens, experts) matrix of routing weights): fixed shapes, as the decorated
module's are, and another computation than zero_fx's, which its check before installing
compares against ([Note: fused experts that loop] in zero_fx/capture/experts/fused_experts.py).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from examples import hf_models
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock


class StackedExperts(nn.Module):
    """Every expert of a block as rows of two 3-D parameters, with the decorator's flags."""

    def __init__(self, experts: nn.ModuleList, config):
        super().__init__()
        with torch.no_grad():
            self.gate_up_proj = nn.Parameter(torch.stack(
                [torch.cat([e.w1.weight, e.w3.weight]) for e in experts]))
            self.down_proj = nn.Parameter(torch.stack([e.w2.weight for e in experts]))
        self.act_fn = experts[0].act_fn
        self.config = config
        self.has_gate, self.has_bias, self.has_post_expert_norm = True, False, False
        self.is_transposed, self.is_concatenated = False, True

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        dense = torch.zeros(hidden.shape[0], self.gate_up_proj.shape[0], dtype=hidden.dtype,
                            device=hidden.device).scatter(1, top_k_index, top_k_weights)
        gate, up = torch.einsum("th,eoh->teo", hidden, self.gate_up_proj).chunk(2, dim=-1)
        out = torch.einsum("tei,ehi->teh", self.act_fn(gate) * up, self.down_proj)
        return (out * dense.unsqueeze(-1)).sum(1)


class TopKRouter(nn.Module):
    """Softmax over the experts, top-k, renormalised: (logits, weights, indices)."""

    def __init__(self, gate: nn.Linear, top_k: int):
        super().__init__()
        self.weight = nn.Parameter(gate.weight.detach().clone())
        self.top_k = top_k

    def forward(self, hidden: torch.Tensor):
        logits = F.linear(hidden, self.weight)
        weights, indices = torch.topk(F.softmax(logits.float(), dim=-1), self.top_k, dim=-1)
        return logits, weights / weights.sum(dim=-1, keepdim=True), indices


class StackedMoeBlock(MixtralSparseMoeBlock):
    """A transformers-4 Mixtral block's router and experts in transformers 5's layout; returns
    (hidden, router logits) as the transformers-4 decoder layer expects (a subclass of its
    block so that transformers records the logits for the load-balancing loss)."""

    def __init__(self, block: nn.Module, config):
        nn.Module.__init__(self)
        self.gate = TopKRouter(block.gate, block.top_k)
        self.experts = StackedExperts(block.experts, config)
        # transformers 4's output recorder puts the block's forward back on the instance after
        # each call: there from the start, the second call's guards are the first's
        self.forward = types.MethodType(type(self).forward, self)

    def forward(self, hidden_states: torch.Tensor):
        batch, seq, width = hidden_states.shape
        hidden = hidden_states.view(-1, width)
        logits, weights, indices = self.gate(hidden)
        out = self.experts(hidden, indices, weights.to(hidden.dtype))
        return out.reshape(batch, seq, width), logits


def tiny_mixtral_stacked(vocab_size: int = 64, seq: int = 16, layers: int = 2) -> nn.Module:
    """The tests' Mixtral (``hf_models.tiny_mixtral``), its experts in transformers 5's layout
    (under transformers 5, the tests' Mixtral as it is)."""
    model = hf_models.tiny_mixtral(vocab_size, seq, layers=layers)
    block = getattr(model.model.layers[0], "block_sparse_moe", None)  # "mlp" in transformers 5
    if not isinstance(getattr(block, "experts", None), nn.ModuleList):
        return model
    for layer in model.model.layers:
        layer.block_sparse_moe = StackedMoeBlock(layer.block_sparse_moe, model.config)
    return model
