"""gather_params: parameters enter the graph as shards and are all-gathered where used."""

from __future__ import annotations

import functools

from torch.fx import GraphModule, Node

from .collective_code import gather_bucket
from .predicates import CARRIES_META, GATHERED_META, Phase, is_param_input, param_name, phase_of
from .splice import splice


def gather_params(gm: GraphModule, plan) -> GraphModule:
    """Turn each parameter placeholder into its shard and gather it before use.

    Stage 3 only: in stages 0-2 every rank holds whole parameters, which
    enter the graph as they are (see [Note: stages 1 and 2 keep whole
    parameters] in zero_fx/runtime/sharded_state.py).

    Requires: phases annotated; parameter placeholders tagged with their plan
    name; ``recompute_param_views`` has run.
    Ensures: every parameter placeholder's value is its 1-D shard
    (``shard_numel`` elements of ``layout.dtype``; with mixed precision cast to
    ``plan.compute_dtype`` before it is gathered); one gather right before the first forward use
    and one right before the first backward use, so nothing full crosses from
    forward to backward. A parameter the backward does not read (a bias, an
    embedding table) is not gathered for it. World size 1 inserts no
    collective, only the slice and view. A resident parameter
    (``plan.resident``) is gathered once, before its first use, and that full
    tensor serves forward and backward.
    Does nothing when the graph has no parameter placeholders.
    """
    params = [n for n in gm.graph.nodes if is_param_input(n)]
    if not params or not plan.params_sharded:
        return gm
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for placeholder in params:
        layout = plan.layout(param_name(placeholder))
        full_val = placeholder.meta["val"]
        placeholder.meta["val"] = full_val.new_empty(layout.shard_numel, dtype=layout.dtype)
        gather = functools.partial(
            gather_bucket,
            numels=[layout.numel],
            shapes=[layout.shape],
            world_size=plan.world_size,
            group_name=plan.group_name,
            dtype=plan.compute_dtype,
        )
        users_by_phase = _users_by_phase(placeholder)
        if layout.name in plan.resident:
            users_by_phase = {Phase.FORWARD: list(placeholder.users)}
        for phase, users in users_by_phase.items():
            first = min(users, key=order.__getitem__)
            (full,) = splice(gm.graph, gather, [placeholder], before=first, phase=phase_of(first),
                             meta={CARRIES_META: (layout.name,)})
            full.meta[GATHERED_META] = (layout.name, phase)
            for user in users:
                user.replace_input_with(placeholder, full)
    gm.graph.lint()
    gm.recompile()
    return gm


def _users_by_phase(placeholder: Node) -> dict[Phase, list[Node]]:
    by_phase: dict[Phase, list[Node]] = {}
    for user in placeholder.users:
        by_phase.setdefault(phase_of(user), []).append(user)
    return by_phase
