"""gather_params: parameters enter the graph as shards and are all-gathered where used."""

from __future__ import annotations

import functools

import torch
from torch.fx import GraphModule, Node

from .predicates import CARRIES_META, GATHERED_META, Phase, is_param_input, param_name, phase_of
from .splice import splice

_c10d = torch.ops._c10d_functional


def gather_full(shard: torch.Tensor, *, numel: int, shape, world_size: int, group_name: str):
    """A full parameter from this rank's shard (see [Note: flat layout] in zero_fx/plan.py)."""
    if world_size == 1:
        flat = shard
    else:
        flat = _c10d.wait_tensor(_c10d.all_gather_into_tensor(shard, world_size, group_name))
    return flat[:numel].view(shape)


def gather_params(gm: GraphModule, plan) -> GraphModule:
    """Turn each parameter placeholder into its shard and gather it before use.

    Requires: phases annotated; parameter placeholders tagged with their plan
    name; in stage 3, ``recompute_param_views`` has run.
    Ensures: every parameter placeholder's value is its 1-D shard
    (``shard_numel`` elements). Stage 3: one gather right before the first
    forward use and one right before the first backward use, so nothing full
    crosses from forward to backward. Stages 1-2: one gather before the first
    use, shared by the whole step (see [Note: stages 1 and 2 gather at the
    start of the step]). World size 1 inserts no collective, only the slice
    and view.
    Does nothing in stage 0 (every rank holds whole parameters) or when the
    graph has no parameter placeholders.
    """
    params = [n for n in gm.graph.nodes if is_param_input(n)]
    if not params or plan.stage == 0:
        return gm
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for placeholder in params:
        layout = plan.layout(param_name(placeholder))
        full_val = placeholder.meta["val"]
        placeholder.meta["val"] = full_val.new_empty(layout.shard_numel)
        gather = functools.partial(
            gather_full,
            numel=layout.numel,
            shape=layout.shape,
            world_size=plan.world_size,
            group_name=plan.group_name,
        )
        for phase, users in _users_by_region(placeholder, plan.stage).items():
            first = min(users, key=order.__getitem__)
            full = splice(gm.graph, gather, [placeholder], before=first, phase=phase,
                          meta={CARRIES_META: (layout.name,)})
            full.meta[GATHERED_META] = (layout.name, phase)
            for user in users:
                user.replace_input_with(placeholder, full)
    gm.graph.lint()
    gm.recompile()
    return gm


# [Note: stages 1 and 2 gather at the start of the step]
# ZeRO-1/2 as DeepSpeed runs them keep full parameters on every rank and
# all-gather the updated shards right after the optimizer step. We gather at
# the start of the next step instead, inside the graph, each parameter right
# before its first use: the traffic is the same (one all-gather of Ψ per step),
# the full parameters live exactly as long as the step needs them (so the peak
# during the step is the same), every collective is in the graph where the
# scheduler can overlap it with the forward and the traffic report sees it, and
# the first step needs no special case. Between steps a rank holds only its
# shards; outside the step, use ``full_parameters()``.


def _users_by_region(placeholder: Node, stage: int) -> dict[Phase, list[Node]]:
    """The users that share one gather: per phase in stage 3, all together otherwise."""
    regions: dict[Phase, list[Node]] = {}
    for user in placeholder.users:
        region = phase_of(user) if stage == 3 else Phase.FORWARD
        regions.setdefault(region, []).append(user)
    return regions
