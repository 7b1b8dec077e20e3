"""recompute_param_views: backward reads parameters only through its own nodes.

[Note: forward values that are only parameters]
Autograd saves what the backward needs, and for a linear layer that includes
``t(weight)``, computed once in the forward and read again in the backward.
In a ZeRO-3 graph that forward node is a view of the *forward* gather, so
reading it in the backward would keep the full parameter alive across the
whole step, which is exactly what stage 3 exists to avoid. This pass copies
every such chain (a forward node whose inputs are only parameters, or other
such nodes) into the backward, right before its first backward reader, so
that ``gather_params`` gives the backward its own gather. The copies cost the
same as the forward originals: views and casts, almost always.
"""

from __future__ import annotations

from torch.fx import GraphModule, Node

from .common.backward_copies import copy_into_backward
from .common.predicates import Phase, is_param_input, phase_of


def recompute_param_views(gm: GraphModule, plan) -> GraphModule:
    """Give every backward use of a parameter-only forward value its own copy.

    Requires: phases annotated. Ensures: no BACKWARD node reads a FORWARD node
    computed only from parameters (parameter placeholders themselves may still
    be read; ``gather_params`` splits those). Does nothing unless
    ``plan.params_sharded`` (stage 3): in stages 0-2 the parameter is whole for the entire step.
    """
    if not plan.params_sharded:
        return gm
    graph = gm.graph
    param_only = _param_only_forward_nodes(gm)
    if not param_only:
        return gm
    copy_into_backward(gm, param_only.__contains__)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return gm


def _param_only_forward_nodes(gm: GraphModule) -> set[Node]:
    param_only: set[Node] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or phase_of(node) is not Phase.FORWARD:
            continue
        inputs = node.all_input_nodes
        if inputs and all(is_param_input(i) or i in param_only for i in inputs):
            param_only.add(node)
    return param_only
