"""Grouped matrix multiply: rows sorted by group, each group times its own matrix.

[Note: grouped matmul in every dtype]
A routed-experts layer sorts its (token, expert) rows by expert and multiplies each run of
rows by that expert's weight. PyTorch's ``torch._grouped_mm`` does this in one kernel, but
its fake-tensor rule accepts bfloat16 only, so an fp32 step cannot be compiled with it.
``zero_fx::grouped_mm`` is the same mathematics as a custom op: its kernel slices the rows
at ``offs`` and runs one ordinary matmul per group, exactly the matmul eager HuggingFace
code runs per expert (``expert(x[rows])``), and its backward is two more grouped ops. To
the compiler it is one opaque node with a static output shape, whatever the routing.
bfloat16 uses ``torch._grouped_mm`` (one kernel on CUDA); every other dtype this op.

``offs[g]`` is the end (exclusive) of group ``g``'s rows, int32, as ``torch._grouped_mm``
takes it; rows past ``offs[-1]`` are zero in the result.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def _group_bounds(offs: Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()
    return list(zip([0, *ends[:-1]], ends))


@torch.library.custom_op("zero_fx::grouped_mm", mutates_args=())
def grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """``x`` (rows, k) sorted by group, ``w`` (groups, k, n): row r of group g gets
    ``x[r] @ w[g]``."""
    out = x.new_zeros(x.shape[0], w.shape[2])
    for group, (start, end) in enumerate(_group_bounds(offs)):
        if end > start:
            torch.mm(x[start:end], w[group], out=out[start:end])
    return out


@grouped_mm.register_fake
def _(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("zero_fx::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(x: Tensor, grad_out: Tensor, offs: Tensor) -> Tensor:
    """The gradient of ``grouped_mm``'s ``w``: ``x[rows of g].T @ grad_out[rows of g]`` per group."""
    bounds = _group_bounds(offs)
    grad_w = x.new_zeros(len(bounds), x.shape[1], grad_out.shape[1])
    for group, (start, end) in enumerate(bounds):
        if end > start:
            torch.mm(x[start:end].t(), grad_out[start:end], out=grad_w[group])
    return grad_w


@grouped_mm_weight_grad.register_fake
def _(x: Tensor, grad_out: Tensor, offs: Tensor) -> Tensor:
    return x.new_empty(offs.shape[0], x.shape[1], grad_out.shape[1])


def _setup_context(ctx, inputs, output):
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _backward(ctx, grad_out):
    x, w, offs = ctx.saved_tensors
    grad_out = grad_out.contiguous()
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_x = grouped_mm(grad_out, w.transpose(1, 2), offs)
    if ctx.needs_input_grad[1]:
        grad_w = grouped_mm_weight_grad(x, grad_out, offs)
    return grad_x, grad_w, None


grouped_mm.register_autograd(_backward, setup_context=_setup_context)


def sort_by_group(group_of_pair: Tensor, per_token: int, groups: int
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(token, group) pairs, ``per_token`` per token in token order, sorted by group (stably,
    so a group's rows keep their tokens' order): the order, each row's group, each row's
    token, and each group's row count (``groups``: one per value a pair's group can take).
    Every shape is fixed, whatever the routing."""
    order = torch.argsort(group_of_pair, stable=True)
    counts = torch.zeros(groups, dtype=torch.int64, device=group_of_pair.device).scatter_add(
        0, group_of_pair, torch.ones_like(group_of_pair))
    return (order, group_of_pair[order], torch.div(order, per_token, rounding_mode="floor"),
            counts)


def grouped_linear(x: Tensor, weight: Tensor, bias: Tensor | None, offs: Tensor,
                   group_of_row: Tensor) -> Tensor:
    """``nn.Linear`` per group: ``weight`` (groups, out, in) as stacked ``Linear.weight``s,
    ``bias`` (groups, out) or None; ``group_of_row`` (rows,) names each row's group."""
    w = weight.transpose(1, 2)
    if x.dtype == torch.bfloat16:
        out = torch._grouped_mm(x, w, offs=offs)  # [Note: grouped matmul in every dtype]
    else:
        out = torch.ops.zero_fx.grouped_mm(x, w, offs)
    if bias is not None:
        out = out + bias[group_of_row]
    return out
