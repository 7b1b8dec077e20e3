"""The comparisons behind [Note: a rewrite proves itself] (routed_experts.py): a module's own
forward against zero_fx's fixed-shape one, outputs and gradients, on one random input.
Shared by the expert-list blocks (routed_experts.py), the 3-D experts (fused_experts.py) and
the grouped-GEMM modules (grouped_gemm_modules.py)."""

from __future__ import annotations

import copy
from typing import Callable, Optional

import torch
from torch import nn


def output_and_grads(forward: Callable, x: torch.Tensor, named: list) -> tuple:
    """``forward(x)``'s outputs (detached) and the gradients of ``x`` and of each of
    ``named``'s parameters under one fixed random cotangent per floating output, as
    ``[(name, gradient)]``."""
    x = x.clone().requires_grad_(True)
    with torch.enable_grad():
        out = forward(x)
    outs = (out,) if isinstance(out, torch.Tensor) else tuple(out) if isinstance(out, tuple) else ()
    pairs = [(o, torch.randn(o.shape, generator=torch.Generator().manual_seed(i),
                             dtype=o.dtype).to(o.device))
             for i, o in enumerate(outs)
             if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad]
    detached = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outs)
    detached = detached[0] if isinstance(out, torch.Tensor) else detached
    if not pairs:
        return detached, []
    inputs = [("the block's input", x), *named]
    grads = torch.autograd.grad([o for o, _ in pairs], [t for _, t in inputs],
                                [c for _, c in pairs], allow_unused=True)
    return detached, [(n, torch.zeros_like(t) if g is None else g)
                      for (n, t), g in zip(inputs, grads)]


def worst_different_gradient(expected: list, got: list) -> Optional[str]:
    """Of the gradients that differ beyond the outputs' tolerance (relative to their own
    scale), the one furthest off, in words; None if all agree."""
    worst = None
    for (name, e), (_, g) in zip(expected, got):
        scale = e.abs().max().item()
        if not torch.allclose(g.float(), e.float(), rtol=1e-4, atol=1e-5 * scale + 1e-12):
            error = ((g.float() - e.float()).norm() / e.float().norm().clamp_min(1e-12)).item()
            worst = max(worst or (error, name), (error, name))
    return None if worst is None else f"{worst[1]} is {worst[0]:.1%} off"


def same_output(expected, got) -> bool:
    if isinstance(expected, torch.Tensor):
        expected, got = (expected,), (got,) if isinstance(got, torch.Tensor) else got
    if not isinstance(got, tuple) or len(got) != len(expected):
        return False
    for e, g in zip(expected, got):
        if not isinstance(e, torch.Tensor) or not isinstance(g, torch.Tensor):
            return False
        if e.shape != g.shape or not torch.allclose(g.float(), e.float(), rtol=1e-4, atol=1e-5):
            return False
    return True


def what_differs(original: Callable, ours: Callable, x: torch.Tensor, named: list) -> Optional[str]:
    """None if ``ours(x)`` gives ``original(x)``'s output (relative to its scale) and the same
    gradients of ``x`` and ``named``; else what differs, in words (a module's rewrite)."""
    try:
        expected, expected_grads = output_and_grads(original, x, named)
        got, got_grads = output_and_grads(ours, x, named)
    except Exception as err:  # noqa: BLE001 - a module the rewrite cannot run
        return f"fails on a random input ({type(err).__name__}: {err})"
    if not torch.allclose(got, expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item()):
        return "does not reproduce its output on a random input"
    differs = worst_different_gradient(expected_grads, got_grads)
    return None if differs is None else f"reproduces its output but not its gradients: {differs}"


def probe_copy(module: nn.Module) -> nn.Module:
    """The module itself when it holds real fp32 values, else an fp32 CPU copy with random
    weights (a meta-device or low-precision model), for the check to run on."""
    params = list(module.parameters())
    if all(p.device.type != "meta" and p.dtype == torch.float32 for p in params):
        return module
    probe = copy.deepcopy(module)
    if any(p.device.type == "meta" for p in params):
        probe = probe.to_empty(device="cpu")
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            for p in probe.parameters():
                p.normal_(0.0, 0.1)
            for b in probe.buffers():
                b.zero_()
    return probe.float()
