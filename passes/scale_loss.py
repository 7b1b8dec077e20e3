"""scale_loss: fp16 training multiplies the backward's seed by a loss scale, a graph input."""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from .common.predicates import LOSS_SCALE_META, Phase, gradient_seeds
from .common.splice import splice


def scale_loss(gm: GraphModule, plan) -> GraphModule:
    """Seed the backward with ``loss_scale`` instead of 1, as ``GradScaler.scale(loss)`` would.

    In fp16 small gradients underflow to zero; scaling the seed scales every
    gradient of the backward by the same factor, which the runtime divides
    out of the reduced gradient shards before the optimizer steps (and skips
    the step when any is inf or NaN; see zero_fx/runtime/update/precision.py).

    Requires: phases annotated. Ensures: with ``plan.loss_scaled``, the graph
    has one more placeholder, ``loss_scale`` (a float32 scalar, after all
    others, tagged ``meta["zero_loss_scale"]``), and every gradient seed's
    users read ``seed * loss_scale`` (cast to the seed's dtype) instead of the
    seed. Does nothing otherwise, or when the graph has no seed.
    """
    seeds = gradient_seeds(gm)
    if not plan.loss_scaled or not seeds:
        return gm
    last_input = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_after(last_input):
        scale = gm.graph.placeholder("loss_scale")
    any_seed = next(iter(seeds))
    scale.meta["val"] = any_seed.meta["val"].new_empty((), dtype=torch.float32)
    scale.meta[LOSS_SCALE_META] = True
    for seed in seeds:
        (scaled,) = splice(gm.graph, _scaled_seed, [seed, scale], before=seed.next,
                           phase=Phase.BACKWARD)
        seed.replace_all_uses_with(scaled, delete_user_cb=lambda user, scaled=scaled: user is not scaled)
    gm.graph.lint()
    gm.recompile()
    return gm


def _scaled_seed(seed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return seed * scale.to(seed.dtype)
