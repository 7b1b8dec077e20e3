"""The tensor code passes splice in to move parameters and gradients: one function per collective.

Each takes a bucket: the tensors of one or more parameters, in bucket order, and returns
one tensor per parameter. A bucket costs the step's own graph one op per step of its
code, not one per parameter ([Note: one op per bucket]): the shards go into the flat
buffer in one ``_chunk_cat``, a gathered buffer comes out in one
``split_with_sizes_copy``, the gradients go into theirs in one ``_chunk_cat``, which
flattens, pads and lays them out rank-major at once.

[Note: one op per bucket]
Under regional compilation the code around a collective runs in the step's own graph as
Python, op by op (zero_fx/compiler/regions.py), so an op per parameter costs a dispatch
(on CUDA a launch too) per parameter. FSDP2 does each step of a bucket in one op, and so
do we:

- gather: ``_chunk_cat(shards, 0, 1)`` is the ``(1, S)`` flat buffer (the cast to the
  compute dtype follows, one op for the bucket), the all-gather makes it ``(N, S)``, and
  ``split_with_sizes_copy`` along dim 1 copies each parameter's columns out at once; a
  view gives each its shape.
- reduce: ``_chunk_cat(grads, 0, N)`` pads each gradient to ``N * shard`` elements and
  puts rank r's slices of all of them in row r: the reduce-scatter's input, in one op.
  A gradient whose rows split evenly over the ranks goes in as it is (row chunks are
  then the flat layout's shards); any other is flattened first.

Copies, not views into the gathered buffer: each full parameter stays its own tensor
and dies after its own last use, not the bucket's (passes/README.md, the release
invariant). Views would save the copy-out (one read and one write of the bucket), but a
view keeps the whole gathered buffer alive while any member is in use, so a bucket's
first parameter would live as long as its last: with buckets of ``bucket_bytes``
spanning blocks, or a member read again late, that is the bucket held, not a parameter.
The copy costs one bucket of transient memory while it runs, as the per-parameter
copies did.

[Note: divide before the sum]
A reduction's mean over N ranks is SUM over ranks of ``grad / N``: the bucket buffer is
divided as it is assembled, before the collective, so no sum of N undivided gradients
ever exists. In fp16 the sum of N loss-scaled gradients overflows where each one does
not (at 4 ranks, a gradient a quarter of fp16's largest value), which made the dynamic
loss scale fall with the world size; divided first, the sum is no larger than the
largest gradient. (DeepSpeed divides first too.) With hybrid sharding the division is
by every rank's count, ``world_size * replicas``, before the reduce-scatter; the
replicate group's all-reduce then sums.

That is for reductions in 16 bits (fp16, bf16). An fp32 reduce-scatter divides its
shard after the sum instead, as before: the division is then over 1/N of the elements,
where before the sum it is over the whole bucket. Under regional compilation the
division runs eagerly in the step's own graph, a pass of its own over what it divides:
on GPT-2's shape at 2 ranks, dividing the whole buffer means 62M more fp32 elements a
step, 98 ms on one thread of the 2-core CPU box (about 2 % of a 4.4 s step; the step
measured 127 ms slower that way). fp32's range makes the sum's overflow moot, and with N
a power of two the two orders give the same bits (subnormals aside). A stage-0
all-reduce divides its whole buffer either way, so it always divides first.

On gloo: SUM, never AVG: gloo's AVG returns sums in some paths (pytorch#162338), and
PREMUL_SUM, which would fold the division into the collective, is not on gloo. On NCCL
(``ShardPlan.collectives_average``, set where NCCL moves the training device's tensors)
the reductions are AVG: for floating types NCCL runs it as a sum pre-multiplied by 1/N
(PreMulSum), which is dividing first with no op of ours at all, in every dtype.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from .host_copies import copy_to_device, copy_to_host, wait_device_copy

_c10d = torch.ops._c10d_functional


def gather_code(plan, names: Sequence[str]) -> functools.partial:
    """``gather_bucket`` bound for a bucket of ``names`` (one collective group's) under
    ``plan``."""
    layouts = [plan.layout(n) for n in names]
    size, group = plan.collective_group(names[0])
    return functools.partial(gather_bucket, numels=[l.numel for l in layouts],
                             shapes=[l.shape for l in layouts], world_size=size,
                             group_name=group, dtype=plan.compute_dtype,
                             from_host=plan.device_type if plan.offloads_parameters else None,
                             keep_at_one=plan.keeps_collectives_at_one)


def gather_bucket(*shards: torch.Tensor, numels: Sequence[int], shapes: Sequence,
                  world_size: int, group_name: str,
                  dtype: Optional[torch.dtype] = None,
                  from_host: Optional[str] = None, keep_at_one: bool = False) -> list[torch.Tensor]:
    """Full parameters from this rank's shards (see [Note: flat layout] in zero_fx/plan/layout.py).

    The gathered buffer is rank-major: ``[rank 0: shard 1, shard 2, ...][rank 1: ...]``;
    parameter ``i`` is column block ``i`` of its ``(world_size, bucket shard numel)`` view,
    copied out with the others in one op ([Note: one op per bucket]).
    ``dtype`` (mixed precision): cast the shards first, so the collective moves that dtype.
    ``from_host``: the shards are in host memory, copied to the training device of that type
    first, in one buffer ([Note: shards brought from the host] in passes/common/host_copies.py).
    ``keep_at_one``: gather over a group of one rank too ([Note: collectives kept at a world of
    one] in zero_fx/runtime/distributed/process_group.py); otherwise one rank gathers nothing.
    """
    if any(s.numel() == 0 for s in shards):  # [Note: parameters with no elements]
        kept = [i for i, s in enumerate(shards) if s.numel()]
        fulls = gather_bucket(*(shards[i] for i in kept), numels=[numels[i] for i in kept],
                              shapes=[shapes[i] for i in kept], world_size=world_size,
                              group_name=group_name, dtype=dtype, from_host=from_host,
                              keep_at_one=keep_at_one) if kept else []
        # made from each member (read, not copied), so every result stays the member's chain
        return _with_empty(fulls, kept, [
            s.new_empty(shape, dtype=dtype or s.dtype,
                        device=s.device if from_host is None else from_host)
            for s, shape in zip(shards, shapes)])
    flat = cast(bucket_buffer(shards, from_host), dtype)
    if world_size > 1 or keep_at_one:
        flat = _c10d.wait_tensor(_c10d.all_gather_into_tensor(flat, world_size, group_name))
    if len(shards) == 1:
        return [unpadded(flat, numels[0], shapes[0])]
    columns = torch.split_with_sizes_copy(flat, [s.numel() for s in shards], dim=1)
    return [unpadded(column, numel, shape)
            for column, numel, shape in zip(columns, numels, shapes)]


def owner_rows_gather_code(plan, names: Sequence[str]) -> functools.partial:
    """``gather_owner_rows`` bound for one of ``plan.owner_row_groups`` (``names``, in
    plan order)."""
    layouts = [plan.layout(n) for n in names]
    _, where = plan.rows_by_owner(names)
    return functools.partial(gather_owner_rows, owners=[where[n][0] for n in names],
                             numels=[l.numel for l in layouts], shapes=[l.shape for l in layouts],
                             world_size=plan.world_size, group_name=plan.group_name,
                             dtype=plan.compute_dtype)


def gather_owner_rows(*shards: torch.Tensor, owners: Sequence[int], numels: Sequence[int],
                      shapes: Sequence, world_size: int, group_name: str,
                      dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
    """Full parameters of an owner group whose shards hold their owners' rows ([Note: owners'
    rows as the shards] in zero_fx/runtime/update/whole_tensor_updates.py): the shards one
    after the other are this rank's row, the tensors it owns whole, one after the other; the
    all-gather makes the ``(N, row)`` buffer, and each rank's tensors are copied out of its
    row in one op ([Note: one op per bucket])."""
    flat = cast(bucket_buffer(shards, None), dtype)
    rows = _c10d.wait_tensor(_c10d.all_gather_into_tensor(flat, world_size, group_name))
    rows = rows.view(world_size, -1)
    fulls: list[Optional[torch.Tensor]] = [None] * len(shards)
    for rank in range(world_size):
        members = [i for i, owner in enumerate(owners) if owner == rank]
        sizes = [numels[i] for i in members]
        if not members:
            continue
        pieces = torch.split_with_sizes_copy(rows[rank, :sum(sizes)], sizes)
        for i, piece in zip(members, pieces):
            fulls[i] = piece.view(shapes[i])
    return fulls


def bucket_buffer(shards: Sequence[torch.Tensor], from_host: Optional[str]) -> torch.Tensor:
    """The bucket's shards in one buffer, in one op ([Note: one op per bucket]): 1-D for one
    shard, else ``(1, bucket shard numel)``; ``from_host``: copied to the device first."""
    if from_host is not None:
        flat = wait_device_copy(copy_to_device(list(shards), from_host))
        return flat if len(shards) == 1 else flat.view(1, -1)
    return shards[0] if len(shards) == 1 else torch._chunk_cat(shards, 0, 1)


def reduce_scatter_bucket(*grads: torch.Tensor, paddings: Sequence[int], world_size: int,
                          group_name: str, dtype: Optional[torch.dtype] = None, replicas: int = 1,
                          replicate_group_name: str = "", averages: bool = False,
                          mean_over: Optional[int] = None, to_host: bool = False,
                          keep_at_one: bool = False) -> list[torch.Tensor]:
    """This rank's 1-D shard of each gradient's mean over ranks, in ``dtype`` (None: the
    gradients' own); ``to_host``: copied to the host once reduced ([Note: gradients
    streamed to the host] in passes/common/host_copies.py).

    The bucket buffer puts rank r's slices of all the gradients (flattened and padded to
    their layouts) together, so one reduce-scatter leaves this rank exactly its shard of
    each; it is assembled in one op ([Note: one op per bucket]) and divided by every rank's
    count, in 16 bits before the sum, in 32 after it ([Note: divide before the sum]). With
    ``replicas`` (hybrid sharding), the shard is also summed across the replicate group.
    ``averages``: the backend averages in the collective (NCCL's AVG, a sum pre-multiplied
    by 1/N): no division op at all. ``mean_over``: the ranks whose batches the mean is over,
    where they are more than the group's (a routed expert's gradient under expert
    parallelism, reduced over its expert-data-parallel group and divided by every rank's
    count: [Note: expert parallelism] in zero_fx/plan/expert_parallel.py). ``keep_at_one``:
    reduce-scatter over a group of one rank too ([Note: collectives kept at a world of one]
    in zero_fx/runtime/distributed/process_group.py).
    """
    if any(g.numel() == 0 for g in grads):  # [Note: parameters with no elements]
        kept = [i for i, g in enumerate(grads) if g.numel()]
        shards = reduce_scatter_bucket(
            *(grads[i] for i in kept), paddings=[paddings[i] for i in kept],
            world_size=world_size, group_name=group_name, dtype=dtype, replicas=replicas,
            replicate_group_name=replicate_group_name, averages=averages, mean_over=mean_over,
            to_host=to_host, keep_at_one=keep_at_one) if kept else []
        return _with_empty(shards, kept, [
            g.new_empty(0, dtype=dtype or g.dtype, device="cpu" if to_host else g.device)
            for g in grads])
    ranks = mean_over or world_size * replicas
    grads = [cast(g, dtype) for g in grads]
    if world_size == 1 and not keep_at_one:  # the whole gradient is this rank's shard
        flat = [torch.nn.functional.pad(g.reshape(-1), (0, p)) if p else g.reshape(-1)
                for g, p in zip(grads, paddings)]
        if replicas > 1:  # still summed across the replicas, in one collective
            summed = _c10d.wait_tensor(_c10d.all_reduce(
                torch.cat(flat) if len(flat) > 1 else flat[0], "sum", replicate_group_name))
            flat = list(summed.split([f.numel() for f in flat]))
        flat = flat if ranks == 1 else [_average(f, ranks) for f in flat]
        return [copy_to_host(f) for f in flat] if to_host else flat
    rows = [g if g.dim() == 1 or (g.dim() > 1 and g.shape[0] % world_size == 0) else g.reshape(-1)
            for g in grads]
    buffer = torch._chunk_cat(rows, 0, world_size)
    shard = _mean_reduce_scatter(buffer.view(-1), ranks, world_size, group_name, averages,
                                 replicate_group_name if replicas > 1 else None)
    if to_host:
        shard = copy_to_host(shard)
    if len(grads) == 1:
        return [shard]
    return list(shard.split([(g.numel() + p) // world_size for g, p in zip(grads, paddings)]))


def reduce_to_owners_bucket(*grads: torch.Tensor, owners: Sequence[int], starts: Sequence[int],
                            width: int, world_size: int, group_name: str,
                            dtype: Optional[torch.dtype] = None, averages: bool = False,
                            mean_over: Optional[int] = None) -> list[torch.Tensor]:
    """Each gradient's mean over ranks, whole (flat), on its owner: one reduce-scatter of a
    buffer of ``world_size`` rows of ``width`` elements, row r the gradients rank r owns
    (``owners``) one after the other from ``starts``, zero-padded ([Note: reductions laid
    out by owner] in zero_fx/runtime/update/whole_tensor_updates.py). Every rank returns, for
    each gradient, the ``numel`` elements of its own row at that gradient's start: on the
    gradient's owner its mean, elsewhere whatever the row holds there (another tensor's, or
    padding), which the runtime drops. So the code, and every shape in it, is the same on
    every rank. Divided as ``reduce_scatter_bucket`` divides ([Note: divide before the sum])."""
    if any(g.numel() == 0 for g in grads):  # [Note: parameters with no elements]
        kept = [i for i, g in enumerate(grads) if g.numel()]
        wholes = reduce_to_owners_bucket(
            *(grads[i] for i in kept), owners=[owners[i] for i in kept],
            starts=[starts[i] for i in kept], width=width, world_size=world_size,
            group_name=group_name, dtype=dtype, averages=averages,
            mean_over=mean_over) if kept else []
        return _with_empty(wholes, kept, [g.new_empty(0, dtype=dtype or g.dtype) for g in grads])
    flats = [cast(g, dtype).reshape(-1) for g in grads]
    pieces = []
    for rank in range(world_size):
        mine = [f for f, owner in zip(flats, owners) if owner == rank]
        pieces += mine
        pad = width - sum(f.numel() for f in mine)
        if pad:
            pieces.append(flats[0].new_zeros(pad))
    row = _mean_reduce_scatter(torch.cat(pieces), mean_over or world_size, world_size,
                               group_name, averages)
    return [row.narrow(0, start, flat.numel()) for start, flat in zip(starts, flats)]


def _mean_reduce_scatter(buffer: torch.Tensor, ranks: int, world_size: int, group_name: str,
                         averages: bool, replicate_group_name: Optional[str] = None) -> torch.Tensor:
    """This rank's part of the mean over ``ranks`` of flat ``buffer``: the backend's average
    (``averages``), else SUM divided in 16 bits before it, in 32 after it ([Note: divide before
    the sum]); ``replicate_group_name``: the part summed across the replicas too."""
    op = "avg" if averages else "sum"
    first = not averages and _divides_first(buffer.dtype)
    if first:
        buffer = _average(buffer, ranks)
    part = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(buffer, op, world_size, group_name))
    if replicate_group_name is not None:
        part = _c10d.wait_tensor(_c10d.all_reduce(part, op, replicate_group_name))
    if not (averages or first):
        part = _average(part, ranks)
    return part


def all_reduce_bucket(*grads: torch.Tensor, world_size: int, group_name: str,
                      dtype: Optional[torch.dtype] = None, averages: bool = False,
                      keep_at_one: bool = False) -> list[torch.Tensor]:
    """Each gradient, whole, averaged over ranks (stage 0), in ``dtype`` (None: its own):
    the bucket is flattened into one buffer in one op and divided before the sum
    ([Note: divide before the sum]). ``keep_at_one``: all-reduce over a group of one rank
    too ([Note: collectives kept at a world of one] in zero_fx/runtime/distributed/process_group.py)."""
    grads = [cast(g, dtype) for g in grads]
    if any(g.numel() == 0 for g in grads):  # [Note: parameters with no elements]
        kept = [i for i, g in enumerate(grads) if g.numel()]
        summed = all_reduce_bucket(*(grads[i] for i in kept), world_size=world_size,
                                   group_name=group_name, averages=averages,
                                   keep_at_one=keep_at_one) if kept else []
        return _with_empty(summed, kept, [g.new_empty(g.shape) for g in grads])
    if world_size == 1 and not keep_at_one:
        return grads
    # (1, numel); _chunk_cat takes no 0-dim tensor (a learnt temperature, CLIP's logit_scale)
    buffer = grads[0] if len(grads) == 1 else torch._chunk_cat(
        [g.reshape(1) if g.dim() == 0 else g for g in grads], 0, 1)
    summed = _c10d.wait_tensor(_c10d.all_reduce(buffer, "avg", group_name) if averages else
                               _c10d.all_reduce(_average(buffer, world_size), "sum", group_name))
    if len(grads) == 1:
        return [summed]
    return [part.view(g.shape) for part, g in zip(summed.split([g.numel() for g in grads], 1),
                                                   grads)]


def _with_empty(results: Sequence[torch.Tensor], kept: Sequence[int],
                empty: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor per member of a bucket: ``results`` for the members ``kept`` (in order), the
    member's own of ``empty`` for the others.

    [Note: parameters with no elements]
    A parameter with no elements (``nn.Parameter(torch.empty(0, 4))``, ``nn.Linear(4, 0)``)
    has nothing to move, and ``_chunk_cat`` refuses an empty member. Each bucket's code
    moves its other members as it would without it, and gives it an empty tensor of its
    own (its whole shape gathered, a shard of 0 elements reduced); a bucket of nothing
    else issues no collective. Its optimizer state has no elements either: it trains, and
    never moves."""
    out = list(empty)
    for index, result in zip(kept, results):
        out[index] = result
    return out


def cast(tensor: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)


def unpadded(flat: torch.Tensor, numel: int, shape) -> torch.Tensor:
    """The parameter: the first ``numel`` elements of contiguous ``flat``, in ``shape``;
    only the views that change something (each is an op in the step's graph)."""
    if flat.numel() != numel:
        flat = (flat if flat.dim() == 1 else flat.view(-1))[:numel]
    return flat if tuple(flat.shape) == tuple(shape) else flat.view(shape)


def _divides_first(dtype: torch.dtype) -> bool:
    """Whether a reduce-scatter in ``dtype`` divides its buffer before the sum: in 16 bits,
    not in 32 or more ([Note: divide before the sum])."""
    return torch.finfo(dtype).bits < 32


def _average(buffer: torch.Tensor, ranks: int) -> torch.Tensor:
    """``buffer`` divided by the number of ranks its sum runs over, before the sum
    ([Note: divide before the sum])."""
    return buffer / ranks
