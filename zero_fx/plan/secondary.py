"""The secondary partition (ZeRO++'s hpZ): a copy of the parameters sharded within each node.

[Note: the secondary partition]
Stage 3 gathers every parameter twice a step, in the forward and again in the backward,
and over every rank: across nodes, where links are slow. With ``secondary_partition`` the
forward's gather also leaves each rank a second, larger shard of the parameter, 1/n of it
for n ranks per node, and the backward gathers from those, within the node only.

Ranks are numbered node-major: rank ``r = node * n + local``. The primary layout is the
usual one (zero_fx/plan/layout.py): the padded parameter cut into ``W = nodes * n``
shards, rank r holding shard r. The forward gathers in two steps, and nothing in the graph
reads the rank:

1. across nodes, among the ranks with this rank's ``local`` index (the "across" group,
   ``nodes`` ranks in node order): the result is shards ``local, n + local, 2n + local,
   ...``, an ``(nodes, S)`` buffer. That buffer is this rank's secondary shard: the n
   ranks of a node hold disjoint parts of the parameter, and together all of it.
2. within the node (the "node" group, ``n`` ranks in local order): the secondary shards of
   the node's ranks, an ``(n, nodes, S)`` buffer indexed ``[local][node]``. Rank order is
   ``[node][local]``: the copy that cuts the buffer into parameters reads it transposed,
   ``(nodes, n, S)``, so the reorder costs no pass of its own.

The secondary shard is kept (as one tensor per parameter, so buckets in the backward need
not be the forward's) until the backward's gather, which repeats step 2 alone. The
forward moves what one gather over every rank moves (``(nodes - 1) S + (n - 1) nodes S =
(W - 1) S`` per rank), the backward ``(n - 1)/n`` of the parameter over the node's links
instead of ``(W - 1)/W`` across nodes; gradients are reduced as before, over every rank.
The cost is memory: each rank keeps ``Ψ / n`` parameters between its forward and its
backward gathers, in the compute dtype (the planner counts it).

A (replicate, shard) mesh names the nodes itself: the "shard" dimension is the node, the
"replicate" dimension the ranks across nodes. With ``secondary_partition`` the primary
partition then spans the whole mesh, as ZeRO++ partitions over every rank: gradients,
optimizer states and primary shards are 1/W, not 1/n, of the model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SecondaryPartition:
    """How the step's ``W`` ranks split into nodes for the secondary partition."""

    size: int
    """Ranks per node ``n``: the secondary shard is ``1/n`` of each parameter."""
    nodes: int
    """Nodes: ``W / n``."""
    node_group_name: str
    """The group of this rank's node (``n`` ranks, in local order)."""
    across_group_name: str
    """The group of the ranks with this rank's local index (``nodes`` ranks, in node order)."""


def planned(secondary_partition, world_size: int, replicas: int):
    """For a plan made with no process group (``rewritten_step_on_fake``, the planner):
    ``(world_size, replicas, SecondaryPartition or None)`` of a step with
    ``secondary_partition`` on ``replicas`` copies of ``world_size`` ranks; with replicas,
    the mesh's shard group is the node and the primary spans every rank."""
    if secondary_partition in (None, False):
        return world_size, replicas, None
    if replicas > 1:
        size, ranks = world_size, world_size * replicas
    else:
        if secondary_partition is True or world_size % secondary_partition:
            raise ValueError(f"secondary_partition must be a number of ranks per node dividing "
                             f"{world_size}, got {secondary_partition!r}")
        size, ranks = secondary_partition, world_size
    return ranks, 1, SecondaryPartition(size=size, nodes=ranks // size,
                                        node_group_name="planned-node",
                                        across_group_name="planned-across")
