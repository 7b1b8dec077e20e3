"""Pinning: the collective schedule our passes chose is the order Inductor's program runs.

[Note: pinning the schedule through Inductor]
``schedule_collectives`` decides where each collective is issued and waited
for, relative to the compute around it. Inductor, left alone, does not keep
that order: its scheduler re-sorts the program (the peak-memory reordering
waits on each collective right after issuing it; without it, horizontal fusion
of kernels that read the same shards pulls backward gathers into the forward),
so the FX order would be a plan nobody runs.

We keep it with Inductor's own machinery for exactly this: the ``control_deps``
higher-order op (``torch._inductor.fx_passes.control_dependencies``), which
its overlap scheduler uses to keep ``start -> compute -> wait``. A control
dependency is an extra input edge that every later stage (pattern rewrites,
fusion, the peak-memory reordering, buffer reuse) must respect,
because it is a real dependency to them. Two steps:

1. ``tag_schedule`` (before lowering) writes each node's position in our
   final graph into ``node.meta["custom"]``, which AOTAutograd copies onto
   every node it retraces from it, so the post-grad graph Inductor lowers
   still knows our order whatever it has moved since.
2. ``PinSchedule`` (an Inductor ``post_grad_custom_pre_pass``) walks the
   tagged *events* in our order: collective issues, waits, and *anchors*;
   and makes each depend on the one before it. That chain holds every issue
   and every wait between the same anchors as in our graph: the compute we
   placed between an issue and its wait stays between them, a gather is not
   issued earlier than planned (which would undo release and
   ``memory_budget_bytes``), and a wait is neither hoisted nor sunk.

Anchors are the ops Inductor always runs as kernels of their own, matmuls,
attention and convolutions (``passes.common.predicates.is_anchor_compute``): a
pointwise op may be fused into another kernel or inlined into its reader, so
neither its place nor a dependency on it means anything in the generated code
(a control dependency on an op that gets inlined is silently dropped).
Pointwise work may still move between the anchors around it, which is what
Inductor's fusion needs.

Why a *pre* pass (before Inductor's pattern rewrites, not after): a pattern
may move an anchor. Measured on a GPT with tied embeddings: ``add(mm, x)``
becomes ``addmm(x, ...)`` placed where ``x`` is ready, so the last forward
matmul's gradient moved to the end of the backward, keeping the logits'
gradient alive through all of it. A wrapped anchor matches no pattern.

Every added edge points from a later position to an earlier one, and data
edges do too (our graph is topologically ordered), so no edge can close a
cycle; Inductor's stable topological sort after its post-grad passes puts
what its locality reordering moved back in our order.

[Note: no edge the data implies]
An event that already reads the one before it (a wait reads its collective; the
head's input gradient reads the logits through the loss) gets no control
dependency: the data orders them already, and a control dependency is not
free. Inductor counts it as one more reader of the buffer it points at, and
writes a kernel's result into a dead input's buffer only when that kernel is
the input's last reader. With the dependency, GPT-2 125M's fused loss kernel
could not write the logits' gradient over the logits: one more 98 MiB buffer
at the step's peak.

[Note: a gather's copy-in is pinned with it]
A bucket's all-gather sends one buffer: its members' shards concatenated (and
cast, with mixed precision). That copy-in reads only the step's inputs, so
nothing holds it near its gather: Inductor fused the copy-ins of three of GPT-2
125M's block buckets into the kernel of the final layer norm's backward, and
the three 13.5 MiB buffers lived from there to each block's gather, at the
step's peak (read from the generated program, [Note: reading buffer lifetimes
from generated code]). So the copy-in gets the same dependency as its gather,
on the event before it: it is computed between the same two anchors as the
gather is issued.

The pass has a ``uuid()`` (a hash of this file), so the FX graph cache still
works. ``lowered_schedule.py`` reads the order back from the generated code;
tests/test_lowered_order.py holds the two equal and shows that without this
pass they differ.
"""

from __future__ import annotations

import operator
from typing import Optional, Sequence

import torch

from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx import Graph, GraphModule, Node
from torch.utils._ordered_set import OrderedSet

from ..passes.common.predicates import is_all_gather, is_anchor_compute, is_collective, is_wait

POSITION_KEY = "zero_fx_position"
"""Key in ``node.meta["custom"]``: the node's index in our final graph."""


def tag_schedule(gm: GraphModule) -> None:
    """Write each call's position in ``gm`` into its ``meta["custom"]`` (kept by retracing)."""
    for position, node in enumerate(gm.graph.nodes):
        if node.op == "call_function":
            node.meta["custom"] = {**(node.meta.get("custom") or {}), POSITION_KEY: position}


def position(node: Node) -> Optional[int]:
    return (node.meta.get("custom") or {}).get(POSITION_KEY)


class PinSchedule(CustomGraphPass):
    """Inductor post-grad pre-pass: control dependencies that hold our collective schedule
    ([Note: pinning the schedule through Inductor])."""

    def __call__(self, graph: Graph) -> None:
        deps = ordering_dependencies(list(graph.nodes))
        if deps:
            from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
            preserve_node_ordering(graph, deps)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


def ordering_dependencies(nodes: Sequence[Node]) -> dict[Node, OrderedSet[Node]]:
    """``{node: the node it must run after}``: each tagged event after the one before it in
    our order (dependents in that order, so a dependency is rewritten before its users)."""
    events = [n for _, _, n in sorted((position(n), i, n) for i, n in enumerate(nodes)
                                      if position(n) is not None and _is_event(n))]
    index = {n: i for i, n in enumerate(nodes)}
    dependencies: dict[Node, OrderedSet[Node]] = {}
    for before, node in zip(events, events[1:]):
        copy_in = _copy_in(node)
        if copy_in is not None:  # [Note: a gather's copy-in is pinned with it]
            dependencies[copy_in] = OrderedSet([_one_tensor_of(before, copy_in, index)])
        if not _reads_result_of(node, before, index):  # [Note: no edge the data implies]
            dependencies[node] = OrderedSet([_one_tensor_of(before, node, index)])
    return dependencies


def _one_tensor_of(event: Node, dependent: Node, index: dict[Node, int]) -> Node:
    """``event``, or for an op that returns several tensors (attention's output and its
    statistics) one of its ``getitem`` users ahead of ``dependent``: torch 2.11's Inductor
    drops a dependency on a tuple without a word, later releases flatten it; a dependency on
    one of its tensors holds on both."""
    if not isinstance(event.meta.get("val"), (tuple, list)):
        return event
    for user in event.users:
        if (user.target is operator.getitem and isinstance(user.meta.get("val"), torch.Tensor)
                and index.get(user, len(index)) < index[dependent]):
            return user
    return event


def _reads_result_of(node: Node, earlier: Node, index: dict[Node, int]) -> bool:
    """Whether ``node`` reads ``earlier``'s result, directly or through other nodes (all
    between the two in the graph, which is topologically ordered)."""
    stack, seen = [node], set()
    while stack:
        for source in stack.pop().all_input_nodes:
            if source is earlier:
                return True
            if source not in seen and index[source] > index[earlier]:
                seen.add(source)
                stack.append(source)
    return False


def _copy_in(node: Node) -> Optional[Node]:
    """What computes the buffer an all-gather sends, when the graph computes it (a bucket's
    concatenated shards, a shard cast to the compute dtype); None for a shard sent as it is."""
    if not is_all_gather(node):
        return None
    source = node.args[0]
    return source if isinstance(source, Node) and source.op == "call_function" else None


def _is_event(node: Node) -> bool:
    return node.op == "call_function" and (
        is_collective(node) or is_wait(node) or is_anchor_compute(node))
