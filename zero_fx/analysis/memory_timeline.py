"""Per-rank memory over a rewritten step, estimated from the graph: what is alive at each node.

[Note: the memory timeline]
Every tensor the graph creates is alive from its node to its last reader:

- a view (and a ``getitem`` of a multi-output op, and a collective's wait) is
  its base, so it adds no bytes but extends the base's life;
- a collective's input lives until the collective's wait (the communication
  library reads it until then);
- a graph output lives to the end of the graph.

On top of that lives what survives the step: the graph's inputs (shards or
parameters, the batch) and the optimizer state. This is what Inductor's
scheduler frees too (after last use), but it does not model the allocator's
caching or fragmentation, nor the fused kernels' fewer temporaries, so it is
an estimate: read its shape and its peak, not its last byte.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Mapping

import torch
from torch.fx import GraphModule, Node

from ..passes.common.predicates import (carried_params, gathered_param, hint, is_collective,
                                        is_view, is_wait, phase_of, tensor_bytes, vals)


@dataclass(frozen=True)
class LiveTensor:
    """One tensor the graph creates, and where it is alive."""

    node: str
    index: int
    """Position of the node that creates it."""
    last_use: int
    """Position of its last reader (the graph's length for outputs)."""
    bytes: int
    phase: str
    what: str
    """What it is, in words: "gathered h.0.attn.weight", "gradient bucket (3 params)", or the op."""


@dataclass(frozen=True)
class MemoryTimeline:
    """Estimated bytes alive at every node of one rank's step ([Note: the memory timeline])."""

    node_names: tuple[str, ...]
    phases: tuple[str, ...]
    persistent_bytes: int
    """Alive through the whole step: graph inputs plus the optimizer state."""
    transient: tuple[int, ...]
    """Bytes of graph-created tensors alive at each node."""
    tensors: tuple[LiveTensor, ...]
    buffer_of: Mapping[str, str]
    """Node name -> the node whose memory it is, for views, getitems and waits."""

    @property
    def total(self) -> list[int]:
        return [self.persistent_bytes + t for t in self.transient]

    @property
    def peak_index(self) -> int:
        return max(range(len(self.transient)), key=self.transient.__getitem__) if self.transient else 0

    @property
    def peak_bytes(self) -> int:
        return self.persistent_bytes + (self.transient[self.peak_index] if self.transient else 0)

    def live_at(self, index: int) -> list[LiveTensor]:
        """The graph-created tensors alive at node ``index``, largest first."""
        alive = [t for t in self.tensors if t.index <= index <= t.last_use]
        return sorted(alive, key=lambda t: -t.bytes)


def memory_timeline(gm: GraphModule, *, persistent_bytes: int = 0) -> MemoryTimeline:
    """The timeline of ``gm``; ``persistent_bytes``: what lives beside the graph's inputs
    (the optimizer state)."""
    nodes = list(gm.graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    base = _bases(nodes)
    last: dict[Node, int] = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            root = base.get(arg, arg)
            end = len(nodes) - 1 if node.op == "output" else order[node]
            if is_collective(node):
                end = order[next(iter(node.users))]
            last[root] = max(last.get(root, 0), end)
    gathered_into = {base.get(n, n): n for n in nodes if gathered_param(n)}
    tensors = []
    for node in nodes:
        if node.op in ("placeholder", "output") or node in base:
            continue
        size = sum(tensor_bytes(v) for v in vals([node]))
        if size:
            tensors.append(LiveTensor(node=node.name, index=order[node],
                                      last_use=last.get(node, order[node]), bytes=size,
                                      phase=phase_of(node).value,
                                      what=_what(gathered_into.get(node, node))))
    change = [0] * (len(nodes) + 1)
    for t in tensors:
        change[t.index] += t.bytes
        change[t.last_use + 1] -= t.bytes
    transient, alive = [], 0
    for delta in change[:-1]:
        alive += delta
        transient.append(alive)
    inputs = sum(tensor_bytes(n.meta.get("val")) for n in nodes if n.op == "placeholder")
    return MemoryTimeline(node_names=tuple(n.name for n in nodes),
                          phases=tuple(phase_of(n).value for n in nodes),
                          persistent_bytes=inputs + persistent_bytes, transient=tuple(transient),
                          tensors=tuple(tensors),
                          buffer_of={n.name: b.name for n, b in base.items()})


def peak_alive(length: int, tensors) -> float:
    """The most bytes alive at once of ``tensors``, (first node, last node, bytes) each, over
    a timeline of ``length`` nodes (a subset of a timeline's tensors, or priced again)."""
    change = [0] * (length + 1)
    for first, last, nbytes in tensors:
        change[first] += nbytes
        change[last + 1] -= nbytes
    alive = peak = 0
    for delta in change[:-1]:
        alive += delta
        peak = max(peak, alive)
    return peak


def _bases(nodes: list[Node]) -> dict[Node, Node]:
    """Node -> the tensor whose memory it is (for views, getitems and waits): a
    graph-created one, or an input (whose bytes are already persistent)."""
    base: dict[Node, Node] = {}
    for node in nodes:
        if node.op == "placeholder":
            continue
        source = node.args[0] if node.args and isinstance(node.args[0], Node) else None
        if source is not None and aliases_input(node):
            base[node] = base.get(source, source)  # a view of an input is the input's memory
    return base


def aliases_input(node: Node) -> bool:
    """``node``'s result is (part of) its first input's memory: a view, a getitem, a wait,
    or ``_unsafe_view`` (a view of a fresh tensor, whatever its schema says)."""
    return (is_view(node) or node.target in (operator.getitem, torch.ops.aten._unsafe_view.default)
            or is_wait(node))


def _what(node: Node) -> str:
    gathered = gathered_param(node)
    if gathered:
        return f"full {gathered[0]}"
    carried = carried_params(node)
    if carried:
        kind = str(node.target).split(".")[-2] if node.op == "call_function" else node.op
        members = carried[0] if len(carried) == 1 else f"{len(carried)} params from {carried[0]}"
        return f"{kind} buffer [{members}]"
    if node.op != "call_function":
        return node.op
    return str(node.target).removeprefix("aten.").removesuffix(".default")
