"""Experts held as 3-D parameters and looped over in Python ([Note: fused experts that loop]
in zero_fx/capture/experts/fused_experts.py): LongCat-Flash's shape under transformers 5, written
out here so the test needs no transformers."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from test_api import standard_step
from support.training import assert_computes_the_same, regression_batches, update_errors_against_eager

from zero_fx.capture.experts.fused_experts import (FixedShapeFusedExperts,
                                           route_fused_experts_with_fixed_shapes)

HIDDEN, FFN, ROUTED, IDENTITY, TOP_K = 12, 8, 4, 2, 2


class LoopingExperts(nn.Module):
    """transformers 5's LongcatFlashExperts in miniature: stacked weights, identity
    ("zero-computation") experts past the routed ones, a loop over the experts hit."""

    def __init__(self, interleaved: bool = False):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(ROUTED + IDENTITY, 2 * FFN, HIDDEN) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(ROUTED, HIDDEN, FFN) * 0.3)
        self.act_fn = nn.SiLU()
        self.interleaved = interleaved

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        mask = F.one_hot(top_k_index, num_classes=ROUTED + IDENTITY).permute(2, 1, 0)
        for expert in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            e = int(expert.item())
            slot, token = torch.where(mask[e])
            state = hidden_states[token]
            if e >= ROUTED:
                out = state
            else:
                both = F.linear(state, self.gate_up_proj[e])
                gate, up = (both[:, 0::2], both[:, 1::2]) if self.interleaved else both.chunk(2, -1)
                out = F.linear(self.act_fn(gate) * up, self.down_proj[e])
            final.index_add_(0, token, out * top_k_weights[token, slot, None])
        return final


class LoopingMoE(nn.Module):
    def __init__(self, interleaved: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(HIDDEN, ROUTED + IDENTITY, bias=False)
        self.experts = LoopingExperts(interleaved)
        self.head = nn.Linear(HIDDEN, 7)

    def forward(self, x):
        scores = self.router(x).softmax(-1)
        weights, index = scores.topk(TOP_K, dim=-1)
        return self.head(x + self.experts(x, index, weights))


def test_the_fixed_shape_forward_replaces_the_loop_and_computes_what_it_did():
    model = LoopingMoE()
    rewritten, left = route_fused_experts_with_fixed_shapes(model)
    assert rewritten == ["experts"] and not left
    assert isinstance(model.experts.__dict__["forward"], FixedShapeFusedExperts)
    assert_computes_the_same(model, LoopingMoE(), torch.randn(16, HIDDEN))  # its own loop


def test_a_layout_it_does_not_compute_is_left_with_the_reason():
    """Gate and up interleaved (GPT-OSS's layout): the fixed-shape forward chunks them, so
    its output differs, and the module keeps its own forward."""
    model = LoopingMoE(interleaved=True)
    rewritten, left = route_fused_experts_with_fixed_shapes(model)
    assert not rewritten and "forward" not in model.experts.__dict__
    assert "does not reproduce its output" in left[0] and "'experts'" in left[0]


@pytest.mark.parametrize("stage", [0, 3])
def test_a_looping_fused_experts_model_trains_like_eager(stage):
    """Captured in one graph (the loop would not: a count the data decides), each update
    within 1e-5 of eager's at one rank (measured 2e-7)."""
    errors, _ = update_errors_against_eager(LoopingMoE(), standard_step, regression_batches(HIDDEN, 7),
                                            stage=stage)
    assert max(errors.values()) < 1e-5, max(errors, key=errors.get)




def test_the_planner_counts_experts_held_as_3d_parameters():
    """transformers 5's layout: the plan's mixture-of-experts line counts them (top-k read
    from the block), and expert parallelism, which does not split them yet, says so."""
    from zero_fx.planner.features.expert_parallel import check_degrees, expert_blocks

    model = LoopingMoE()
    model.num_experts_per_tok = TOP_K
    found = expert_blocks(model)
    experts = sum(p.numel() for p in model.experts.parameters())
    assert (found.blocks, found.stacked, found.shapes) == (1, 1, [(ROUTED, TOP_K, False)])
    assert found.expert_parameters == experts
    total = sum(p.numel() for p in model.parameters())
    assert found.active_parameters == total - round(experts * (1 - TOP_K / ROUTED))
    with pytest.raises(ValueError, match="3-D parameters"):
        check_degrees([2], 4, found)


def test_gpt_oss_experts_of_transformers_4_get_the_grouped_form():
    """GPT-OSS's experts under transformers 4 (transposed, interleaved, biased, a clamped
    GLU, dense routing weights; a loop on the CPU): rewritten, and the same output and
    gradients as their own loop. (transformers 5 runs them through its experts interface.)"""
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    config = modeling.GptOssConfig(hidden_size=HIDDEN, intermediate_size=FFN,
                                   num_local_experts=ROUTED, num_experts_per_tok=TOP_K)
    torch.manual_seed(0)
    experts = modeling.GptOssExperts(config)
    if hasattr(experts, "has_gate"):
        pytest.skip("this transformers dispatches GPT-OSS's experts itself")
    for p in experts.parameters():
        nn.init.normal_(p, std=0.3)
    model = nn.ModuleDict({"experts": experts})
    reference = copy.deepcopy(model)
    rewritten, left = route_fused_experts_with_fixed_shapes(model)
    assert rewritten == ["experts"], left
    assert experts.forward.form.name.startswith("GPT-OSS")
    x = torch.randn(2, 8, HIDDEN)
    weights, index = torch.randn(16, ROUTED).softmax(-1).topk(TOP_K, dim=-1)
    dense = torch.zeros(16, ROUTED).scatter(1, index, weights)
    outs = [m["experts"](x, router_indices=index, routing_weights=dense) for m in (model, reference)]
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    for out in outs:
        out.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-5), name


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(HIDDEN, FFN, bias=False), nn.Linear(HIDDEN, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ClassifierRouter(nn.Module):
    top_k = TOP_K

    def __init__(self):
        super().__init__()
        self.classifier = nn.Linear(HIDDEN, ROUTED + IDENTITY, bias=False)

    def forward(self, hidden):
        scores = self.classifier(hidden.view(-1, HIDDEN)).softmax(-1)
        index = scores.topk(TOP_K, dim=-1)[1]
        return index, scores.gather(1, index)


class ListWithIdentityExperts(nn.Module):
    """transformers 4's LongCat-Flash block in miniature: routed experts then identity
    ("zero-computation") experts in one list, a router module returning (indices, weights)
    from its classifier, a loop skipping the experts no token chose."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList([MLP() for _ in range(ROUTED)] + [nn.Identity()] * IDENTITY)
        self.router = ClassifierRouter()

    def forward(self, hidden_states):
        index, weights = self.router(hidden_states)
        hidden = hidden_states.view(-1, HIDDEN)
        out = torch.zeros_like(hidden)
        mask = F.one_hot(index, num_classes=len(self.experts)).permute(2, 0, 1)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(mask[e])
            if token.numel() > 0:
                out.index_add_(0, token, expert(hidden[token]) * weights[token, slot, None])
        return out.view(hidden_states.shape)


class IdentityExpertsModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.moe = ListWithIdentityExperts()
        self.head = nn.Linear(HIDDEN, 7)

    def forward(self, x):
        return self.head(x + self.moe(x))


def test_identity_experts_after_the_routed_ones_train_like_eager():
    """Rows routed to an identity expert pass through; captured in one graph, the updates
    within 1e-5 of eager's (the loop's) at stage 3; expert parallelism is refused for them."""
    model = IdentityExpertsModel()
    errors, step = update_errors_against_eager(model, standard_step, regression_batches(HIDDEN, 7),
                                               stage=3)
    (block,) = step.moe_blocks
    assert (block.num_experts, block.identity_experts) == (ROUTED, IDENTITY)
    assert max(errors.values()) < 1e-5, max(errors, key=errors.get)
    from zero_fx.runtime.distributed.expert_groups import split_experts
    with pytest.raises(ValueError, match="identity experts"):
        split_experts(model, [block], None, 2)
