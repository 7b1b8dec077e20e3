"""Backward ops whose fake result is laid out unlike the kernel's: the step trains, at parity
([Note: a gradient's layout as traced and as run] in zero_fx/capture/layout_decompositions.py).
Without the decompositions every run here failed at its first call with "view size is not
compatible with input tensor's size and stride"."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from support import feature_runs
from support import models
from support.training import check_updates

from zero_fx.capture.layout_decompositions import MISLAID_BACKWARD_OPS

aten = torch.ops.aten

TRANSPOSED_EXACT = 1e-6
"""Update error bound: the decompositions compute the kernels' expressions (measured 0 at one
rank, and at two ranks up to 2e-7, the order of the gradient's sum over ranks)."""


def _pointwise_backward_calls():
    """Every pointwise activation's backward op, called with a transposed gradient and a
    contiguous input, as (op, args)."""
    grad = torch.randn(4, 6, 8).transpose(1, 2)   # (4, 8, 6), transposed
    x = torch.randn(4, 8, 6)
    probability = torch.rand(4, 8, 6) * 0.8 + 0.1
    return [
        (aten.softplus_backward.default, (grad, x, 1.0, 20.0)),
        (aten.elu_backward.default, (grad, 1.0, 1, 1, False, x)),
        (aten.hardswish_backward.default, (grad, x)),
        (aten.hardsigmoid_backward.default, (grad, x)),
        (aten.hardtanh_backward.default, (grad, x, -1.0, 1.0)),
        (aten.logit_backward.default, (grad, probability, 1e-3)),
        (aten.sigmoid_backward.default, (grad, probability)),
        (aten.tanh_backward.default, (grad, probability)),
        (aten.silu_backward.default, (grad, x)),
        (aten.gelu_backward.default, (grad, x)),
        (aten.threshold_backward.default, (grad, x, 0.0)),
        (aten.leaky_relu_backward.default, (grad, x, 0.01, False)),
        (aten.mish_backward.default, (grad, x)),
        (aten.softshrink_backward.default, (grad, x, 0.5)),
        (aten.hardshrink_backward.default, (grad, x, 0.5)),
    ]


def test_every_pointwise_backward_whose_fake_layout_differs_is_decomposed():
    """Probed on the installed torch: a new release that mislays another op fails here."""
    mislaid = set()
    for op, args in _pointwise_backward_calls():
        real = op(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
        if real.stride() != fake.stride():
            mislaid.add(op.overloadpacket)
    assert mislaid <= set(MISLAID_BACKWARD_OPS), mislaid - set(MISLAID_BACKWARD_OPS)
    assert aten.softplus_backward in mislaid   # the probe still sees what it is for


@pytest.mark.parametrize("activation", sorted(models.TRANSPOSED_GRADIENT_ACTIVATIONS))
def test_an_activation_whose_gradient_comes_back_transposed_trains_like_eager(activation):
    name = f"transposed_{activation}"
    check_updates(feature_runs.zero_fx_run(1, name, 0), feature_runs.reference_run(name),
                  TRANSPOSED_EXACT)


@pytest.mark.parametrize("stage", [0, 3])
def test_softplus_whose_gradient_comes_back_transposed_trains_like_eager_on_two_ranks(stage):
    check_updates(feature_runs.zero_fx_run(2, "transposed_softplus", stage),
                  feature_runs.reference_run("transposed_softplus"), TRANSPOSED_EXACT)
