"""The tensor code of the secondary partition's gathers ([Note: the secondary partition] in
zero_fx/plan/secondary.py): the forward's, in two steps, keeping each parameter's
secondary shard, and the backward's, from those shards within the node.

A bucket costs one op per step as ``gather_bucket`` does ([Note: one op per bucket] in
collective_code.py). A secondary shard is ``(nodes, s)`` for a parameter of ``s``
elements per primary shard: row ``i`` is the primary shard of rank ``i * n + local``.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from .collective_code import bucket_buffer, cast, unpadded

_c10d = torch.ops._c10d_functional


def keeping_code(plan, names: Sequence[str], keep: Sequence[bool]) -> functools.partial:
    """``gather_keeping_secondary`` bound for a bucket of ``names`` (``keep``: whose
    secondary shards to return) under ``plan``."""
    layouts = [plan.layout(n) for n in names]
    secondary = plan.secondary
    return functools.partial(
        gather_keeping_secondary, numels=[l.numel for l in layouts],
        shapes=[l.shape for l in layouts], keep=list(keep), nodes=secondary.nodes,
        node_size=secondary.size, across_group_name=secondary.across_group_name,
        node_group_name=secondary.node_group_name, dtype=plan.compute_dtype,
        from_host=plan.device_type if plan.offloads_parameters else None)


def from_secondary_code(plan, names: Sequence[str]) -> functools.partial:
    """``gather_from_secondary`` bound for a bucket of ``names`` under ``plan``."""
    layouts = [plan.layout(n) for n in names]
    secondary = plan.secondary
    return functools.partial(gather_from_secondary, numels=[l.numel for l in layouts],
                             shapes=[l.shape for l in layouts], nodes=secondary.nodes,
                             node_size=secondary.size, node_group_name=secondary.node_group_name)


def gather_keeping_secondary(*shards: torch.Tensor, numels: Sequence[int], shapes: Sequence,
                             keep: Sequence[bool], nodes: int, node_size: int,
                             across_group_name: str, node_group_name: str,
                             dtype: Optional[torch.dtype] = None,
                             from_host: Optional[str] = None) -> list[torch.Tensor]:
    """The full parameters of a bucket of primary shards, then the secondary shard of each
    parameter ``keep`` marks, in bucket order: gathered across nodes (the secondary
    shards), then within the node."""
    flat = cast(bucket_buffer(shards, from_host), dtype).view(1, -1)
    across = _c10d.wait_tensor(_c10d.all_gather_into_tensor(flat, nodes, across_group_name))
    sizes = [s.numel() for s in shards]
    if len(shards) == 1:
        secondaries = [across]
    else:
        kept = [i for i, k in enumerate(keep) if k]
        columns = torch.split_with_sizes_copy(across, sizes, dim=1)
        secondaries = [columns[i] for i in kept]
    fulls = _within_node(across, sizes, numels, shapes, nodes, node_size, node_group_name)
    return fulls + (secondaries if any(keep) else [])


def gather_from_secondary(*secondaries: torch.Tensor, numels: Sequence[int], shapes: Sequence,
                          nodes: int, node_size: int, node_group_name: str) -> list[torch.Tensor]:
    """The full parameters of a bucket of secondary shards, gathered within the node."""
    flat = secondaries[0] if len(secondaries) == 1 else torch.cat(secondaries, dim=1)
    sizes = [s.shape[1] for s in secondaries]
    return _within_node(flat, sizes, numels, shapes, nodes, node_size, node_group_name)


def _within_node(across: torch.Tensor, sizes: Sequence[int], numels: Sequence[int],
                 shapes: Sequence, nodes: int, node_size: int,
                 group_name: str) -> list[torch.Tensor]:
    """Gather the node's ``(nodes, S)`` secondary buffers, ``(n, nodes, S)`` by local rank,
    and copy each parameter's columns out in rank order ``(nodes, n, s)``: the transpose
    is read by the copy, not made by an op of its own."""
    gathered = _c10d.wait_tensor(_c10d.all_gather_into_tensor(across, node_size, group_name))
    by_rank = gathered.view(node_size, nodes, -1).transpose(0, 1)
    columns = torch.split_with_sizes_copy(by_rank, list(sizes), dim=2)
    return [unpadded(column, numel, shape)
            for column, numel, shape in zip(columns, numels, shapes)]
