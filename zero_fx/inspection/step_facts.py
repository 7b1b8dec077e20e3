"""What ``explain`` reads off the rewritten graph besides the cost model's replay: where each
gathered parameter lives, and the shards copied to and from the host (offload)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch.fx import GraphModule

from ..analysis.memory_timeline import MemoryTimeline, tensor_bytes
from ..passes.common.host_copies import is_device_copy, is_device_copy_wait, is_host_copy, reduction_read_by
from ..passes.common.predicates import (carried_params, gathered_param, is_anchor_compute, is_wait,
                                 kept_through_loss, readers_through_views)


@dataclass(frozen=True)
class GatheredLifetime:
    """Where one full (gathered) parameter lives in the step."""

    param: str
    phase: str
    ready_at: int
    """The node that yields the full parameter."""
    first_use: int
    last_use: int
    released_after: int
    """The last reader of its memory (for a bucket of one: of the gathered buffer)."""
    released_node: str
    bytes: int
    kept: str = ""
    """Why a forward gather lives on into the backward: "resident", "through the loss"
    ([Note: a weight kept through the loss]); "" for a gather released in its phase."""


@dataclass(frozen=True)
class HostCopy:
    """One bucket's gradient shard streamed to the host in the graph ([Note: gradients
    streamed to the host] in passes/common/host_copies.py)."""

    bucket: tuple[str, ...]
    bytes: int
    at: int
    """The copy's node index."""
    after_wait: Optional[int]
    """The node index of the reduction's wait it follows (None: one rank, no collective)."""
    compute_after: int
    """Matmuls, attention and convolutions the graph runs after it: what hides the copy."""


@dataclass(frozen=True)
class DeviceCopy:
    """One bucket's shards brought from the host before its all-gather (offload="parameters",
    [Note: shards brought from the host] in passes/common/host_copies.py)."""

    bucket: tuple[str, ...]
    bytes: int
    at: int
    """The copy's node index: where it is issued."""
    waited: int
    """The node index of its wait, where the compute stream waits for it (its gather's)."""
    compute_between: int
    """Matmuls, attention and convolutions the graph runs between the two: what hides it."""


def host_copies_in(gm: GraphModule) -> list[HostCopy]:
    nodes = list(gm.graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    compute_after = [0] * (len(nodes) + 1)
    for i in range(len(nodes) - 1, -1, -1):
        compute_after[i] = compute_after[i + 1] + is_anchor_compute(nodes[i])
    copies = []
    for node in nodes:
        if is_host_copy(node):
            waits = [order[n] for n in reduction_read_by(node) if is_wait(n)]
            copies.append(HostCopy(bucket=carried_params(node), bytes=tensor_bytes(node.meta.get("val")),
                                   at=order[node], after_wait=max(waits, default=None),
                                   compute_after=compute_after[order[node]]))
    return copies


def device_copies_in(gm: GraphModule) -> list[DeviceCopy]:
    nodes = list(gm.graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    compute_before = [0]
    for node in nodes:
        compute_before.append(compute_before[-1] + is_anchor_compute(node))
    copies = []
    for node in nodes:
        if is_device_copy(node):
            wait = min((order[u] for u in node.users if is_device_copy_wait(u)), default=order[node])
            copies.append(DeviceCopy(bucket=carried_params(node),
                                     bytes=tensor_bytes(node.meta.get("val")), at=order[node],
                                     waited=wait,
                                     compute_between=compute_before[wait] - compute_before[order[node]]))
    return copies


def gathered_lifetimes(gm: GraphModule, plan, memory: MemoryTimeline) -> list[GatheredLifetime]:
    kept = {**{name: "through the loss" for name in kept_through_loss(gm)},
            **{name: "resident" for name in plan.resident}}
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    buffers = {t.node: t for t in memory.tensors}
    names = list(memory.node_names)
    lifetimes = []
    for node in gm.graph.nodes:
        gathered = gathered_param(node)
        if not gathered:
            continue
        readers = readers_through_views(node)
        uses = sorted(order[r] for r in readers) or [order[node]]
        buffer = buffers.get(memory.buffer_of.get(node.name, node.name))
        released = buffer.last_use if buffer else uses[-1]
        val = node.meta["val"]
        lifetimes.append(GatheredLifetime(
            param=gathered[0], phase=gathered[1].value, ready_at=order[node], first_use=uses[0],
            last_use=uses[-1], released_after=released, released_node=names[released],
            bytes=tensor_bytes(val), kept=kept.get(gathered[0], "")))
    return lifetimes
