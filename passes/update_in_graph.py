"""update_in_graph: each bucket's optimizer update right after its reduction has landed.

[Note: the update in the graph] (zero_fx/runtime/update/graph_update.py) says what the call does
and when the update stays after the graph instead.
"""

from __future__ import annotations

import operator

from torch.fx import GraphModule, Node

from .common.predicates import (PHASE_META, UPDATES_META, Phase, carried_params, grad_slots,
                                is_collective, is_param_input, is_view, param_name)
from .common.update_code import update_bucket


def update_in_graph(gm: GraphModule, plan) -> GraphModule:
    """Put a call of ``update_bucket`` after each bucket of reduced gradients, and return
    None in their output slots: the call steps the optimizer on the bucket's shards and
    drops the gradients, which are then freed there instead of at the end of the step.

    Requires: the gradients are reduced and bucketed, their waits placed
    (``schedule_collectives`` has run). Ensures: each gradient output is read by exactly
    one ``update_bucket`` call, placed after the bucket's last gradient and after the
    last read of each of its parameters' graph inputs (stage 3 reads the masters the
    update changes in place; an all-gather reads its input until its wait). The calls'
    order is read off the graph and the plan: the same on every rank. Does nothing unless
    ``plan.updates_in_graph``.
    """
    slots = grad_slots(gm)
    if not getattr(plan, "updates_in_graph", False) or not slots:
        return gm
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    nodes = list(gm.graph.nodes)
    inputs = {param_name(n): n for n in gm.graph.find_nodes(op="placeholder") if is_param_input(n)}
    output = gm.graph.output_node()
    outs = list(output.args[0])
    buckets: dict[tuple, list[tuple[int, str]]] = {}
    for index, name in sorted(slots.items()):
        grad = outs[index]
        if isinstance(grad, Node):
            key = carried_params(grad) or (name,)
            buckets.setdefault(key, []).append((index, name))
    for members in sorted(buckets.values(), key=lambda m: min(order[outs[i]] for i, _ in m)):
        ready = max(order[outs[i]] for i, _ in members)
        ready = max([ready] + [_last_read(inputs[name], order) for _, name in members
                               if name in inputs])
        with gm.graph.inserting_after(nodes[ready]):
            call = gm.graph.call_function(
                update_bucket, (tuple(name for _, name in members),
                                *(outs[i] for i, _ in members)))
        call.meta.update({PHASE_META: Phase.BACKWARD, UPDATES_META: tuple(n for _, n in members),
                          "val": None})
        for index, _ in members:
            outs[index] = None
    output.args = (type(output.args[0])(outs),)
    gm.graph.lint()
    gm.recompile()
    return gm


def _last_read(placeholder: Node, order: dict) -> int:
    """The position of the last node that reads ``placeholder``'s storage: its readers,
    through views and the getitems of views, and a collective's wait (the collective reads
    its input until then)."""
    last, stack, seen = order[placeholder], [placeholder], set()
    while stack:
        for user in stack.pop().users:
            if user in seen or user.op == "output":
                continue
            seen.add(user)
            last = max(last, order[user])
            if user.target is operator.getitem or is_view(user):
                stack.append(user)
            elif is_collective(user):
                last = max([last] + [order[w] for w in _waits(user)])
    return last


def _waits(collective: Node) -> list[Node]:
    """The nodes that wait for ``collective``: its users, and those of its getitems."""
    found = []
    for user in collective.users:
        found += list(user.users) if user.target is operator.getitem else [user]
    return found
