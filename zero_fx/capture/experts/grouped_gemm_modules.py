"""A grouped-GEMM module that loops over its experts' row counts: the same as one grouped matmul.

[Note: grouped GEMM modules that loop]
Aria under transformers 4 sorts a block's (token, expert) rows by expert itself (``argsort``,
``index_select``: fixed shapes) and counts them per expert (``histc``), then calls its
experts' two projections as ``AriaGroupedExpertsGemm(rows, tokens_per_expert)``: a 3-D
``weight`` (experts, in, out) and, on the CPU or without the ``grouped_gemm`` package, a
Python loop that slices the rows at the counts' running sums (``tokens_per_expert.cpu()``,
``token_states[start:end]``), sizes the data decides, which one graph cannot hold. That
loop is a grouped matmul: rows ``offs[g-1]:offs[g]`` times ``weight[g]``, rows past the last
count zero. So such a module (a 3-D ``weight``, ``groups`` of them, called with
``(input, tokens_per_expert)``) gets ``zero_fx::grouped_mm`` on the counts' running sums
([Note: grouped matmul in every dtype] in grouped_mm.py), after its own forward and this one
agree on a random input and random counts, in output and gradients ([Note: a rewrite proves
itself] in routed_experts.py). The rest of the block is the model's own code.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
import torch.nn as nn

from .fused_experts import install_where_reproduced
from .moe_blocks import tensor_without_running
from .rewrite_check import what_differs

Tensor = torch.Tensor

CALLED_WITH = ("input", "tokens_per_expert")
"""The arguments such a module's forward takes, by name."""


def grouped_gemm_forward(module: nn.Module, input: Tensor, tokens_per_expert: Tensor) -> Tensor:
    """Each run of ``input``'s rows (``tokens_per_expert`` of them, in expert order) times its
    expert's ``weight``; rows past the counts' total are zero."""
    offs = tokens_per_expert.cumsum(0).to(torch.int32)
    if input.dtype == torch.bfloat16:
        return torch._grouped_mm(input, module.weight, offs=offs)
    return torch.ops.zero_fx.grouped_mm(input, module.weight, offs)


class _GroupedGemm:
    """The form ``FixedShapeFusedExperts`` installs for such a module."""

    name = "grouped GEMM over the experts' row counts"
    forward = staticmethod(grouped_gemm_forward)


def is_looping_grouped_gemm(module: nn.Module) -> bool:
    """A module of the note's shape: a 3-D ``weight`` of ``groups`` experts, its forward
    called with ``(input, tokens_per_expert)``."""
    weight = tensor_without_running(module, "weight")  # [Note: recognition runs no parametrization]
    if not (isinstance(weight, nn.Parameter) and weight.dim() == 3
            and getattr(module, "groups", None) == weight.shape[0]):
        return False
    try:
        names = tuple(inspect.signature(type(module).forward).parameters)[1:]
    except (TypeError, ValueError):
        return False
    return names == CALLED_WITH


def route_grouped_gemms_with_fixed_shapes(model: nn.Module, *, confirm: bool = True
                                          ) -> tuple[list[str], list[str]]:
    """Install ``grouped_gemm_forward`` on every module of the note's shape that it
    reproduces; (names rewritten, reasons for those left as they are)."""
    return install_where_reproduced(
        model, (_GroupedGemm,), lambda m: _GroupedGemm if is_looping_grouped_gemm(m) else None,
        (lambda m, _: _differs(m)) if confirm else None,
        "multiplies rows by its experts' 3-D weight at the counts it is given, but zero_fx's "
        "grouped matmul for it")


def _differs(module: nn.Module) -> Optional[str]:
    """None if ``grouped_gemm_forward`` computes what ``module``'s own forward does, forward
    and backward, on a random input and random counts (the note); else what differs."""
    weight = module.weight
    if weight.device.type == "meta":
        return None  # nothing to run: the planner's fakes
    original = type(module).forward
    with torch.random.fork_rng(devices=[weight.device] if weight.device.type == "cuda" else []):
        torch.manual_seed(0)
        groups, rows = weight.shape[0], 4 * weight.shape[0]
        counts = torch.bincount(torch.randint(0, groups, (rows - 1,)), minlength=groups)
        counts = counts.to(weight.device)  # one row past the counts: it stays zero
        hidden = torch.randn(rows, weight.shape[1], device=weight.device, dtype=weight.dtype)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        return what_differs(lambda x: original(module, x, counts),
                            lambda x: grouped_gemm_forward(module, x, counts), hidden, named)
