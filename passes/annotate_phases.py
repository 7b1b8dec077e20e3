"""annotate_phases: mark every node as forward or backward."""

from __future__ import annotations

from torch.fx import GraphModule

from .common.predicates import PHASE_META, Phase, gradient_seeds


def annotate_phases(gm: GraphModule, plan=None) -> GraphModule:
    """Set ``node.meta["zero_phase"]`` on every node.

    Requires: a captured step graph (forward, then the backward that autograd
    started from ``ones_like(loss)``).
    Ensures: a node is BACKWARD iff it is reachable from a gradient seed; every
    other node is FORWARD. A node computed late but depending only on forward
    values (e.g. ``t(t(weight))``) counts as forward: that is what lets
    ``recompute_param_views`` find it.
    Does nothing to the graph's code; a graph with no seed is all forward.
    """
    seeds = gradient_seeds(gm)
    backward = set()
    for node in gm.graph.nodes:
        if node in seeds or any(arg in backward for arg in node.all_input_nodes):
            backward.add(node)
    for node in gm.graph.nodes:
        node.meta[PHASE_META] = Phase.BACKWARD if node in backward else Phase.FORWARD
    return gm
