"""The tensor code passes splice in to move parameters and gradients: one function per collective.

Each takes a bucket: the tensors of one or more parameters, in bucket order,
and returns one tensor per parameter. One parameter means no copy in or out;
several mean one ``cat`` into the flat buffer the collective works on, and
(all-gather) one copy out per parameter, so each full parameter is its own
tensor and dies after its own last use, not the bucket's.

SUM-then-divide, never AVG: gloo's AVG returns sums in some paths
(pytorch#162338).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

_c10d = torch.ops._c10d_functional


def gather_bucket(*shards: torch.Tensor, numels: Sequence[int], shapes: Sequence,
                  world_size: int, group_name: str,
                  dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
    """Full parameters from this rank's shards (see [Note: flat layout] in zero_fx/plan/layout.py).

    The gathered buffer is rank-major: ``[rank 0: shard 1, shard 2, ...][rank 1: ...]``;
    parameter ``i`` is column block ``i`` of its ``(world_size, bucket shard numel)`` view.
    ``dtype`` (mixed precision): cast the shards first, so the collective moves that dtype.
    """
    shards = _cast(shards, dtype)
    flat = shards[0] if len(shards) == 1 else torch.cat(shards)
    if world_size > 1:
        flat = _c10d.wait_tensor(_c10d.all_gather_into_tensor(flat, world_size, group_name))
    if len(shards) == 1:
        return [flat[:numels[0]].view(shapes[0])]
    columns = flat.view(world_size, -1).split([s.numel() for s in shards], dim=1)
    return [column.reshape(-1)[:numel].view(shape)
            for column, numel, shape in zip(columns, numels, shapes)]


def reduce_scatter_bucket(*grads: torch.Tensor, paddings: Sequence[int], world_size: int,
                          group_name: str, dtype: Optional[torch.dtype] = None, replicas: int = 1,
                          replicate_group_name: str = "") -> list[torch.Tensor]:
    """This rank's 1-D shard of each gradient's mean over ranks, in ``dtype`` (None: the
    gradients' own).

    Each gradient is flattened and padded to its layout; the bucket buffer
    puts rank r's slices of all of them together, so one reduce-scatter leaves
    this rank exactly its shard of each. With ``replicas`` (hybrid sharding), the
    summed shard is then all-reduced across the replicate group, and divided by
    every rank's count once.
    """
    grads = _cast(grads, dtype)
    flats = [torch.nn.functional.pad(g.reshape(-1), (0, p)) if p else g.reshape(-1)
             for g, p in zip(grads, paddings)]
    if world_size == 1:
        return flats
    if len(flats) == 1:
        buffer = flats[0]
    else:
        buffer = torch.cat([f.view(world_size, -1) for f in flats], dim=1).reshape(-1)
    summed = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(buffer, "sum", world_size, group_name))
    if replicas > 1:
        summed = _c10d.wait_tensor(_c10d.all_reduce(summed, "sum", replicate_group_name))
    shard = _average(summed, world_size * replicas)
    if len(flats) == 1:
        return [shard]
    return list(shard.split([f.numel() // world_size for f in flats]))


def all_reduce_bucket(*grads: torch.Tensor, world_size: int, group_name: str,
                      dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
    """Each gradient, whole, averaged over ranks (stage 0), in ``dtype`` (None: its own)."""
    grads = _cast(grads, dtype)
    if world_size == 1:
        return list(grads)
    buffer = grads[0] if len(grads) == 1 else torch.cat([g.reshape(-1) for g in grads])
    summed = _c10d.wait_tensor(_c10d.all_reduce(buffer, "sum", group_name))
    mean = _average(summed, world_size)
    if len(grads) == 1:
        return [mean]
    return [part.view(g.shape) for part, g in zip(mean.split([g.numel() for g in grads]), grads)]


def _cast(tensors: Sequence[torch.Tensor], dtype: Optional[torch.dtype]) -> list[torch.Tensor]:
    return [t if dtype is None or t.dtype == dtype else t.to(dtype) for t in tensors]


def _average(summed: torch.Tensor, world_size: int) -> torch.Tensor:
    return summed / world_size
