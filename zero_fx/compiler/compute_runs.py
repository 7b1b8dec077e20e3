"""Which nodes each body of regional compilation holds ([Note: regional compilation] in
regions.py): the runs of compute between collectives and waits, with the views and copies
at their edges left out, views placed where the body that reads them can take them in.

[Note: views only the body reads go in]
Every node the outer graph runs costs a Python dispatch (on CUDA a launch too), so it
should run about one op per collective and per bucket, not one per parameter ([Note: one
op per bucket] in passes/common/collective_code.py). A view is free to place: it only aliases
its base. So before the graph is cut, each view is moved to right before its first reader
(``sink_views``), which puts a gathered weight's shaping and transposing views
(``view(w, shape)``, ``t``) in the run that reads them, and a view that only one body
reads goes into that body: the body takes the bucket's copied-out parameter as it is and
shapes it itself. The bodies' signatures still match across blocks (each block's copy-out
has the same shapes), so none is added. A view read by two runs, or outside any body,
stays in the outer graph, and so does a view that picks a position of its base (a slice:
``_picks_a_position``). And views that give back their own base (``t(t(w))`` of a
matrix, which the backward makes of every weight and every weight gradient, a
``detach``) are dropped before anything else (``drop_identity_views``). On GPT-2's
shape at 12 blocks (one of 2 fake ranks, aot_eager) the outer graph dispatched 1199 ops
before these changes and the bucket code's, 276 after; its nodes, counting its 77
inputs and the getitems that take the bodies' and buckets' results apart (a tuple index
each), went from 1762 to 839, and to 554 once values that travel together are passed
whole ([Note: results passed whole] in packed_results.py).

[Note: copies and writes in place]
Moving a copy to the edge of its run (``_separate_edges``) is right by data flow alone only
when nothing in the run writes in place. The captured graph keeps the model's in-place ops,
and autograd saves a clone of what one overwrites: DeepSeek-V3's router divides its top-k
weights in place (``topk_weights /= denominator``), so the graph reads ``c = clone(w);
div_(w, d)``, and the backward reads ``c`` for the gradient of ``d``. At stage 3 the
reduce-scatter of the head's gradient falls between the router's forward and its
backward, so nothing in the forward's run reads ``c``: it was moved after the body, past
the ``div_``, and copied the divided weights. The loss stayed right, the router's gradient
was 7% off (transformers 5's Mixtral router does the same: 42% off). So a copy that reads,
through views, a tensor that the run writes in place after it (or before it) stays in the
body; and whatever moves a read across a write anyway is caught ([Note: in-place writes
keep their readers' sides] in passes/check_invariants.py).
"""

from __future__ import annotations

import operator
from fractions import Fraction
from typing import Sequence

import torch
from torch.fx import GraphModule, Node

from ..passes.common.predicates import (is_collective, is_update, is_view, is_wait, reads_the_same,
                                        storage_base, written_in_place)

MIN_REGION_OPS = 4
"""Runs with fewer ops that compute (neither views nor copies) run in the outer graph, op by op."""

ONLY_MOVE_DATA = frozenset({"_unsafe_view", "clone", "cat", "_chunk_cat", "constant_pad_nd", "copy",
                            "split_with_sizes_copy", "stack"})
"""Ops that only copy or reshape data, besides those whose schemas declare a view: eager runs
each as the one copy a body would. ``stack`` among them: a mixture-of-experts block stacks
its experts' gathered weights ([Note: routed experts with fixed shapes]), an op with one
input per expert; in a body, Inductor's code for it grew with the number of experts (a
2-layer Mixtral's bodies took 35.7 s at 64 experts, 28.0 s at 8), outside it is one eager
op and the bodies are the same at any number of experts (29.0 s, 26.7 s)."""


def compute_runs(gm: GraphModule) -> list[list[Node]]:
    """The bodies to compile: in each run of calls between collectives and waits, what
    computes, with the views and copies at its edges left out; only bodies with enough
    ops that compute, taking and returning tensors. Reorders ``gm``'s graph so that each
    body is contiguous ([Note: regional compilation])."""
    bodies = [_separate_edges(run) for run in _runs_between_collectives(gm)]
    return [body for body in bodies
            if sum(map(computes, body)) >= MIN_REGION_OPS and _tensors_in_and_out(body)]


def computes(node: Node) -> bool:
    """An op that computes: neither a view (nor a getitem) nor a copy."""
    if node.target is operator.getitem or is_view(node):
        return False
    schema = getattr(node.target, "_schema", None)
    return schema is None or schema.name.split("::")[-1] not in ONLY_MOVE_DATA


def _runs_between_collectives(gm: GraphModule) -> list[list[Node]]:
    runs, current = [], []
    for node in gm.graph.nodes:
        if (node.op == "call_function" and not is_collective(node) and not is_wait(node)
                and not is_update(node)):
            current.append(node)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def _separate_edges(run: list[Node]) -> list[Node]:
    """``run``'s body: its nodes but the views and copies that read only values from
    before the body (a gather's copy-out) or that the body does not read (a gradient
    bucket's concatenation). The graph is reordered to run those before and after the
    body, which it makes contiguous; data flow allows it, as none of them reads the body
    or is read by it, respectively. A copy that reads a tensor the body changes in place
    stays in the body, where it reads it between the same writes ([Note: copies and
    writes in place])."""
    position = {node: i for i, node in enumerate(run)}
    writes = _writes_in_place(run)
    before, inside = [], {}
    for node in run:
        if (not computes(node) and not any(a in inside for a in node.all_input_nodes)
                and not _written_around(node, writes, position, later=False)):
            before.append(node)
        else:
            inside[node] = None
    # see [Note: views only the body reads go in]
    pulled: set[Node] = set()
    for node in reversed(before):
        if (node.target is not operator.getitem and is_view(node) and node.users
                and not _picks_a_position(node)
                and all(user in inside or user in pulled for user in node.users)):
            pulled.add(node)
    before = [node for node in before if node not in pulled]
    inside = {node: None for node in run if node in inside or node in pulled}  # ordered
    after = []
    for node in reversed(list(inside)):  # a getitem stays with the tuple it takes apart
        if (not computes(node) and node.target is not operator.getitem
                and not any(user in inside for user in node.users)
                and not _written_around(node, writes, position, later=True)):
            del inside[node]
            after.append(node)
    body = list(inside)
    end = run[-1].next
    for node in [*before, *body, *reversed(after)]:
        end.prepend(node)
    return body


def _writes_in_place(run: Sequence[Node]) -> list[tuple[int, set[Node]]]:
    """For each op of ``run`` that changes a tensor in place (``div_``, ``index_add_``):
    its position and the storage bases of the tensors it changes."""
    return [(i, {storage_base(w) for w in written}) for i, node in enumerate(run)
            if (written := written_in_place(node))]


def _written_around(node: Node, writes, position: dict, *, later: bool) -> bool:
    """Whether a copy moved out of the body would read a tensor that the body changes in
    place after it (``later``, moved after the body) or before it (moved before): it would
    read the value after, or before, that write instead of the one it read
    ([Note: copies and writes in place]). Views are free to move: they read when read."""
    if not writes or _pure_view(node) or node.target is operator.getitem:
        return False
    read = {storage_base(a) for a in node.all_input_nodes}
    at = position[node]
    return any((i > at if later else i < at) and read & changed for i, changed in writes)


def drop_identity_views(gm: GraphModule) -> None:
    """Replace each view that is its own base again by that base: the same storage, sizes,
    strides, offset and conjugate and negative bits (``t(t(w))`` of a matrix, a ``detach``,
    a view to the same shape; not ``_conj``: [Note: views that read differently]).
    Each is an op the outer graph would run for nothing ([Note: one op per bucket] in
    passes/common/collective_code.py counts why that matters)."""
    for node in list(gm.graph.nodes):
        if not _pure_view(node):
            continue
        value, base = node.meta.get("val"), node
        while _pure_view(base) and base.all_input_nodes:
            base = base.all_input_nodes[0]
            if reads_the_same(value, base.meta.get("val")):  # [Note: views that read differently]
                node.replace_all_uses_with(base)
                break
    for node in reversed(list(gm.graph.nodes)):
        if _pure_view(node) and not node.users:
            gm.graph.erase_node(node)


def sink_views(gm: GraphModule) -> None:
    """Move each view to right before its first reader, so that it lies in the run of
    compute that reads it, and goes into that body ([Note: views only the body reads go
    in]); a view only aliases its base, so where it is made changes no lifetime."""
    # exact positions: float midpoints run out of bits after about 50 views sunk before one
    # reader (a routed-experts block's backward unbinds 32+ expert gradients), and ties then
    # put a view after a reader of it
    order = {node: Fraction(i) for i, node in enumerate(gm.graph.nodes)}
    for node in reversed(list(gm.graph.nodes)):
        if not _pure_view(node) or not node.users:
            continue
        first = min(node.users, key=order.__getitem__)
        if first.prev is not node:
            order[node] = (order[first.prev] + order[first]) / 2
            first.prepend(node)


POSITIONAL_VIEWS = frozenset({torch.ops.aten.slice, torch.ops.aten.select, torch.ops.aten.narrow,
                              torch.ops.aten.as_strided, torch.ops.aten.diagonal,
                              torch.ops.aten.unfold})
"""Views that pick a position of their base: their offsets may differ from block to block."""


def _picks_a_position(node: Node) -> bool:
    """A view such as ``slice(g, 0, 256, 384)``, which stays outside the body it feeds
    ([Note: views only the body reads go in]): the backward of a concatenation over the
    blocks (a mixture of experts' router logits, for the load-balancing loss) slices each
    block's part at its own offset, and inside the bodies those offsets would make every
    block's body distinct, compiled once per block."""
    return getattr(node.target, "overloadpacket", None) in POSITIONAL_VIEWS


def _pure_view(node: Node) -> bool:
    return node.op == "call_function" and node.target is not operator.getitem and is_view(node)


def _tensors_in_and_out(run: Sequence[Node]) -> bool:
    inside = set(run)
    for node in run:
        outer = [a for a in node.all_input_nodes if a not in inside]
        if any(not isinstance(a.meta.get("val"), torch.Tensor) for a in outer):
            return False
        if (any(user not in inside for user in node.users)
                and not isinstance(node.meta.get("val"), torch.Tensor)):
            return False
    return True
