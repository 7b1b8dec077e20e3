"""Backward ops whose layout the fake tensors mispredict, traced as the pointwise ops they are.

[Note: a gradient's layout as traced and as run]
The captured graph is traced on fake tensors, and every view in it is recorded against the
fakes' strides: autograd's backward of ``x.view(...)`` or ``x.reshape(...)`` is
``grad.reshape(...)``, which make_fx records as ``aten.view`` when the fake gradient can be
viewed. The graph then runs on real tensors, and a view is only valid if each real tensor
has the strides its fake had.

For a few pointwise backward ops it does not. ``softplus_backward(grad, x)`` on the CPU lays
its result out like ``grad`` (the kernel's TensorIterator follows its first input), while
its fake lays it out like ``x``. When ``grad`` arrives transposed and ``x`` is contiguous, as
in the gated delta-net attention of Qwen3-Next, Qwen3.5-MoE and Qwen4 (``softplus(a +
dt_bias)``, its gradient coming back through a transpose), the fake says contiguous, the
graph holds ``aten.view`` of it, and the step fails at its first call with PyTorch's "view
size is not compatible with input tensor's size and stride". Plain ``torch.compile`` with
``aot_eager`` fails the same way (pytorch/pytorch#120035 is one report); eager does not.

zero_fx traces these ops through PyTorch's own decompositions (``torch._decomp``): plain
pointwise ops (``exp``, ``mul``, ``where``) whose fakes follow the same layout rule as their
kernels, so every view in the graph is recorded against the strides it will meet. The
arithmetic is the kernel's, the same expression. ``MISLAID_BACKWARD_OPS`` is the list measured
on torch 2.11-2.15; tests/test_layout_decompositions.py probes every pointwise backward op
on the installed torch and fails if one outside the list mispredicts its layout.
"""

from __future__ import annotations

import torch
from torch._decomp import get_decompositions

aten = torch.ops.aten

MISLAID_BACKWARD_OPS = (
    aten.softplus_backward,
    aten.elu_backward,
    aten.hardswish_backward,
    aten.hardsigmoid_backward,
    aten.hardtanh_backward,
    aten.logit_backward,
)
"""Pointwise backward ops whose fake result is laid out like ``self`` while the CPU kernel's
is laid out like ``grad_output``."""


def layout_safe_decompositions() -> dict:
    """make_fx's decomposition table for capturing a step: [Note: a gradient's layout as
    traced and as run]."""
    return get_decompositions(list(MISLAID_BACKWARD_OPS))
