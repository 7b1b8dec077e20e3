"""The process groups of the secondary partition: each rank's node and the ranks across nodes
([Note: the secondary partition] in zero_fx/plan/secondary.py)."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Union

import torch.distributed as dist

from ...plan.secondary import SecondaryPartition
from .process_group import World, world_timeout

log = logging.getLogger("zero_fx")


def with_secondary_partition(world: World, secondary_partition: Union[None, bool, int],
                             default_world: World) -> World:
    """``world`` (what ``world_of`` made of the mesh) with its ranks split into nodes of
    ``secondary_partition`` ranks, or of the mesh's "shard" dimension. On a ("replicate",
    "shard") mesh the primary shards then span every rank (``default_world``'s group), the
    mesh's groups becoming the node and across-node groups. Making the groups is a
    collective of the default group: every rank calls it when its step is sharded."""
    if secondary_partition in (None, False):
        return world
    if world.replicas > 1:
        shard, replicas = world.size, world.replicas
        if secondary_partition is not True and secondary_partition != shard:
            raise ValueError(f"secondary_partition={secondary_partition} on a mesh of {replicas} "
                             f"replicas of {shard} ranks: the mesh's 'shard' dimension is the "
                             f"node, so give secondary_partition=True (or {shard})")
        secondary = SecondaryPartition(size=shard, nodes=replicas,
                                       node_group_name=world.group_name,
                                       across_group_name=world.replicate_group_name)
        return replace(default_world, secondary=secondary)
    ranks = world.size
    size = _ranks_per_node(secondary_partition, ranks)
    if size is None:
        return world
    members = _group_members(world)
    node_group = _my_group([members[i:i + size] for i in range(0, ranks, size)], members,
                           world.rank)
    across_group = _my_group([members[i::size] for i in range(size)], members, world.rank)
    return replace(world, secondary=SecondaryPartition(
        size=size, nodes=ranks // size, node_group_name=node_group.group_name,
        across_group_name=across_group.group_name))


def _ranks_per_node(secondary_partition: Union[bool, int], ranks: int):
    """Ranks per node, checked against the shard group's ``ranks``; None where every rank is
    in one node (True on one node: the backward's gathers stay in it already)."""
    if secondary_partition is True:
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local is None:
            raise ValueError("secondary_partition=True reads the ranks per node from torchrun's "
                             "LOCAL_WORLD_SIZE, which is not set: give the number of ranks per "
                             "node, secondary_partition=n")
        size = int(local)
        if size >= ranks:
            log.info("zero_fx: secondary_partition=True on one node of %d ranks: every gather "
                     "already stays in the node, so there is no secondary partition", ranks)
            return None
    else:
        size = secondary_partition
    if size >= ranks or ranks % size:
        raise ValueError(f"secondary_partition={size} ranks per node does not split the "
                         f"{ranks} ranks into several nodes: give a divisor of {ranks} below "
                         f"it" + (" (one node needs no secondary partition: leave it unset)"
                                  if size == ranks else ""))
    return size


def _group_members(world: World) -> list[int]:
    """The default group's ranks of the shard group, in its rank order."""
    if world.group_name == dist.group.WORLD.group_name:
        return list(range(world.size))
    group = dist.distributed_c10d._resolve_process_group(world.group_name)
    return dist.get_process_group_ranks(group)


def _my_group(splits: list[list[int]], members: list[int], rank: int) -> dist.ProcessGroup:
    """Make a group of each split (every rank makes every one, in the same order) and return
    the one holding this rank (``members[rank]``)."""
    mine = None
    for ranks in splits:
        group = dist.new_group(ranks, timeout=world_timeout(), use_local_synchronization=False)
        if members[rank] in ranks:
            mine = group
    return mine
