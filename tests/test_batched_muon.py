"""Muon's Newton-Schulz batched by shape ([Note: Newton-Schulz batched by shape] in
zero_fx/runtime/update/batched_muon.py) against torch.optim.Muon's own per-matrix loop: the
parameters and the momentum bit for bit after every step on a CPU, over a mix of shapes (tall,
wide, square, one of a kind), with and without Nesterov, each learning-rate adjustment; and
torch's loop where the orthogonalisation was replaced."""

from __future__ import annotations

import pytest
import torch
from torch.optim import _muon as muon_module

from zero_fx.runtime.update.batched_muon import ShapesBatched, applies, batched_by_shape

SHAPES = [(96, 32), (32, 96), (32, 32), (128, 32), (32, 128), (32, 32), (48, 20),
          (1280, 320), (960, 320), (1280, 320), (320, 1280), (320, 1280)]
"""Tall and wide matrices of one shape once transposed, two squares, one of its own, and
gpt-small's feed-forward and attention shapes, two of a kind (where a contiguous transpose
rounds differently from torch's view)."""
STEPS = 3


def _trained(batched: bool, **options) -> tuple[list, list, ShapesBatched]:
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, generator=generator)) for s in SHAPES]
    grads = [[torch.randn(*s, generator=generator) for s in SHAPES] for _ in range(STEPS)]
    opt = torch.optim.Muon(params, lr=0.02, weight_decay=0.01, **options)
    record = ShapesBatched()
    for step in range(STEPS):
        for p, g in zip(params, grads[step]):
            p.grad = g.clone()
        if batched:
            with batched_by_shape(record):
                opt.step()
            record.settle()
        else:
            opt.step()
    return ([p.detach() for p in params],
            [opt.state[p]["momentum_buffer"] for p in params], record)


@pytest.mark.parametrize("options", [{}, {"nesterov": False}, {"adjust_lr_fn": "match_rms_adamw"},
                                     {"momentum": 0.0, "ns_steps": 3}])
def test_batched_iterations_equal_torchs_bit_for_bit(options):
    params, bufs, record = _trained(True, **options)
    expected_params, expected_bufs, _ = _trained(False, **options)
    for got, expected in zip(params + bufs, expected_params + expected_bufs):
        assert torch.equal(got, expected), (got - expected).abs().max()
    # each shape together, a tall one apart from the wide one of its transposed shape
    # ([Note: Newton-Schulz batched by shape])
    assert record.last == {(96, 32): 1, (32, 96): 1, (32, 32): 2, (128, 32): 1, (32, 128): 1,
                           (48, 20): 1, (1280, 320): 2, (960, 320): 1, (320, 1280): 2}, record.last
    assert "12 matrices in 9 batched chains a step" in record.describe()


def test_a_replaced_orthogonalisation_keeps_torchs_loop():
    calls = []
    original = muon_module._zeropower_via_newtonschulz

    def counted(grad, *args):
        calls.append(tuple(grad.shape))
        return original(grad, *args)

    muon_module._zeropower_via_newtonschulz = counted
    try:
        assert not applies()
        record = ShapesBatched()
        p = torch.nn.Parameter(torch.randn(8, 4))
        p.grad = torch.randn(8, 4)
        with batched_by_shape(record):
            torch.optim.Muon([p]).step()
    finally:
        muon_module._zeropower_via_newtonschulz = original
    assert calls == [(8, 4)] and not record.last
    assert applies()
