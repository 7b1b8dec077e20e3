"""A grouped-GEMM module called with row counts and looping over them ([Note: grouped GEMM
modules that loop] in zero_fx/capture/experts/grouped_gemm_modules.py): Aria's block under
transformers 4, written out here so the test needs no transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from test_api import standard_step
from support.training import assert_computes_the_same, regression_batches, update_errors_against_eager

from zero_fx.capture.experts.fused_experts import FixedShapeFusedExperts
from zero_fx.capture.experts.grouped_gemm_modules import route_grouped_gemms_with_fixed_shapes

HIDDEN, FFN, EXPERTS, TOP_K = 12, 8, 4, 2


class LoopingGemm(nn.Module):
    """transformers 4's AriaGroupedExpertsGemm in miniature: rows sliced at the counts'
    running sums (``.cpu()``, a loop), each slice times its expert's weight."""

    def __init__(self, in_features: int, out_features: int, groups: int, transposed=False):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.randn(groups, in_features, out_features) * 0.3)
        self.transposed = transposed

    def forward(self, input, tokens_per_expert):
        output = torch.zeros(input.shape[0], self.weight.shape[-1], dtype=input.dtype)
        ends = torch.cat((torch.zeros(1, dtype=torch.long), tokens_per_expert.cpu().cumsum(0)))
        for e in range(self.groups):
            start, end = ends[e], ends[e + 1]
            w = self.weight[e].flip(0) if self.transposed else self.weight[e]
            output[start:end] = input[start:end] @ w
        return output


class AriaShapedMoE(nn.Module):
    """Aria's block: sort the (token, expert) rows, count them with ``histc``, two grouped
    GEMMs (the first a GLU's two halves), unsort, weight and sum."""

    def __init__(self, transposed: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.fc1 = LoopingGemm(HIDDEN, 2 * FFN, EXPERTS, transposed)
        self.fc2 = LoopingGemm(FFN, HIDDEN, EXPERTS)
        self.head = nn.Linear(HIDDEN, 7)

    def forward(self, x):
        top_logits, top_indices = torch.topk(self.router(x), k=TOP_K, dim=1)
        scores = F.softmax(top_logits, dim=-1)
        counts = torch.histc(top_indices.flatten().float(), bins=EXPERTS, min=0,
                             max=EXPERTS - 1).to(top_indices.dtype)
        order = torch.argsort(top_indices.view(-1))
        rows = x.index_select(0, order // TOP_K)
        projection, gate = self.fc1(rows, counts).chunk(2, dim=-1)
        out = self.fc2(F.silu(projection) * gate, counts)
        back = torch.zeros(x.shape[0] * TOP_K, HIDDEN).index_copy(0, order, out)
        return self.head(x + (back.view(-1, TOP_K, HIDDEN) * scores.unsqueeze(-1)).sum(1))


def test_the_grouped_matmul_replaces_the_loop_and_computes_what_it_did():
    model = AriaShapedMoE()
    rewritten, left = route_grouped_gemms_with_fixed_shapes(model)
    assert rewritten == ["fc1", "fc2"] and not left
    assert isinstance(model.fc1.__dict__["forward"], FixedShapeFusedExperts)
    assert_computes_the_same(model, AriaShapedMoE(), torch.randn(16, HIDDEN))  # its own loop


def test_a_module_it_does_not_compute_is_left_with_the_reason():
    """A weight read otherwise (rows flipped): the grouped matmul's output differs, and the
    module keeps its own forward."""
    model = AriaShapedMoE(transposed=True)
    rewritten, left = route_grouped_gemms_with_fixed_shapes(model)
    assert rewritten == ["fc2"] and "forward" not in model.fc1.__dict__
    assert "does not reproduce its output" in left[0] and "'fc1'" in left[0]


@pytest.mark.parametrize("stage", [0, 3])
def test_an_aria_shaped_model_trains_like_eager(stage):
    """Captured in one graph (the loop would not: slices the data decides), each update
    within 1e-5 of eager's at one rank."""
    errors, _ = update_errors_against_eager(AriaShapedMoE(), standard_step, regression_batches(HIDDEN, 7),
                                            stage=stage)
    assert max(errors.values()) < 1e-5, max(errors, key=errors.get)
