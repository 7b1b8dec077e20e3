"""Copying forward values into the backward: what both recompute passes do."""

from __future__ import annotations

from typing import Callable

from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from .predicates import PHASE_META, Phase, phase_of


def copy_into_backward(gm: GraphModule, copied: Callable[[Node], bool],
                       meta: Callable[[Node], dict] = lambda original: {}) -> dict[Node, Node]:
    """Give every BACKWARD reader of a forward node ``copied(node)`` picks a copy of it
    instead, placed right before the first such reader, with the copies of the inputs
    ``copied`` picks too (inputs first, so the graph stays in topological order). A copy
    carries the original's meta, phase BACKWARD, and ``meta(original)``. Returns
    original -> copy; the caller removes dead code and recompiles."""
    graph = gm.graph
    copies: dict[Node, Node] = {}

    def copy_of(value: Node, before: Node) -> Node:
        if not copied(value):
            return value
        if value not in copies:
            args = map_arg(value.args, lambda v: copy_of(v, before))
            kwargs = map_arg(value.kwargs, lambda v: copy_of(v, before))
            with graph.inserting_before(before):
                copy = graph.call_function(value.target, args, kwargs)
            copy.meta.update(value.meta)
            copy.meta[PHASE_META] = Phase.BACKWARD
            copy.meta.update(meta(value))
            copies[value] = copy
        return copies[value]

    for node in list(graph.nodes):
        if phase_of(node) is Phase.BACKWARD and node.op == "call_function":
            node.args = map_arg(node.args, lambda v: copy_of(v, node))
            node.kwargs = map_arg(node.kwargs, lambda v: copy_of(v, node))
    return copies
