"""Several ``backward()`` calls in one step: each parameter's gradients summed into one output.

[Note: several backward calls in one step]
A step may call ``backward()`` more than once before ``opt.step()``: two micro-batches,
``loss_a.backward()`` then ``loss_b.backward()``, or two losses on one graph with
``retain_graph=True``. Autograd adds the second call's gradient to ``p.grad``, and dynamo
(with ``trace_autograd_ops``) records that too: each backward is an
``autograd.grad`` whose gradient ``g_k`` is copied into a fresh ``empty_like(p)``, and
from the second call on that copy is added to the first in place. The aten graph's
output for ``p`` is then ``add_(copy_(empty_like(p), g_1), copy_(empty_like(p), g_2))``
(a third call adds to that ``add_``), not the ``copy_(empty_like(p), g)`` that
``_gradients_as_outputs`` takes as a gradient output.

``sum_accumulated_gradients`` rewrites each such chain into
``copy_(empty_like(p), g_1 + g_2 + ...)`` where its last ``add_`` stood, so the capture
sees one gradient per parameter: the sum, which exists only after the last backward
that reached ``p``. Our passes reduce that sum once, where it is produced, as DDP's
``no_sync`` does for all but the last micro-batch: the collectives are those of one
backward, whatever the number of calls. A parameter that only one of the calls reaches
keeps its plain ``copy_`` (autograd's ``allow_unused`` gives the other calls no
gradient for it). Over ``accumulation_steps=K`` calls each call's sum accumulates as a
single backward's gradient would.

A gradient read or changed between two calls (``p.grad`` printed, scaled or clipped
before the second ``backward()``) would read an unreduced value: the rewrite refuses it
with a ``CaptureError``, as ``_gradients_as_outputs`` does for reads after the last call.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx import GraphModule, Node

from ..passes.common.predicates import PARAM_META
from .errors import CaptureError

aten = torch.ops.aten


def sum_accumulated_gradients(gm: GraphModule) -> int:
    """Rewrite every ``add_(grad copy of p, grad copy of p)`` into one grad copy of the sum;
    ``CaptureError`` for a gradient read between two backward calls.

    Returns how many additions were rewritten (0: the step called ``backward()`` once).
    """
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.target != aten.add_.Tensor or len(node.args) != 2 or node.kwargs:
            continue
        first, second = node.args
        name = _gradient_copy_of(first)
        if name is None:
            continue
        if _gradient_copy_of(second) != name:
            raise CaptureError(f"the step changes the gradient of {name} in place between two "
                               "backward() calls; zero_fx sums the gradients of several "
                               "backward() calls itself and reduces the sum after the last: "
                               "leave p.grad alone inside the step")
        if any(user is not node for user in (*first.users, *second.users)):
            continue  # read between the calls: refused below
        node.replace_all_uses_with(_copy_of_sum(gm, node, first, second))
        for dead in (node, second, second.args[0], first):
            gm.graph.erase_node(dead)
        rewritten += 1
    _check_one_copy_each(gm)
    return rewritten


def _check_one_copy_each(gm: GraphModule) -> None:
    """Raise ``CaptureError`` for a parameter left with two gradient copies: something other
    than the next backward's ``add_`` read or changed the first (``p.grad.mul_(0.5)`` between two
    calls), and its gradient output would not be the sum autograd computes."""
    copies: dict[str, list[Node]] = {}
    for node in gm.graph.find_nodes(op="call_function", target=aten.copy_.default):
        name = _gradient_copy_of(node)
        if name is not None:
            copies.setdefault(name, []).append(node)
    for name, nodes in copies.items():
        readers = [user for node in nodes for user in node.users if user.op != "output"]
        if len(nodes) > 1 and readers:
            raise CaptureError(
                f"the step reads or changes the gradient of {name} between two backward() calls "
                f"({readers[0].target}); zero_fx sums the gradients of several backward() calls "
                "itself and reduces (and shards) the sum across ranks after the last, so code "
                "there would see unreduced values. Leave p.grad alone inside the step (clip with "
                "zero_compile(max_grad_norm=...))")


def _gradient_copy_of(node) -> Optional[str]:
    """The parameter name if ``node`` is ``copy_(empty_like(param), grad)``, else None."""
    if not (isinstance(node, Node) and node.target == aten.copy_.default):
        return None
    dest = node.args[0]
    if not (isinstance(dest, Node) and dest.target == aten.empty_like.default):
        return None
    param = dest.args[0]
    return param.meta.get(PARAM_META) if isinstance(param, Node) else None


def _copy_of_sum(gm: GraphModule, add: Node, first: Node, second: Node) -> Node:
    """``copy_(empty_like(p), g_1 + g_2)`` where ``add`` stands; ``first``'s destination."""
    dest, grad_1 = first.args[0], first.args[1]
    grad_2 = second.args[1]
    with gm.graph.inserting_before(add):
        total = gm.graph.call_function(aten.add.Tensor, (grad_1, grad_2))
        total.meta.update(add.meta)
        total.meta["val"] = grad_1.meta["val"] + grad_2.meta["val"]
        copy = gm.graph.call_function(aten.copy_.default, (dest, total))
        copy.meta.update(first.meta)
        copy.meta["val"] = add.meta["val"]
    return copy
