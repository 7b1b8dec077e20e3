"""The whole values of a rank's sharded parameters: all-gathered into the model's parameters
(after an update, or for ``gathered_parameters()``), or copied out of the shards
(``full_parameters``, ``stream_full_parameters``: checkpoints and ``full_state_dict``)."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Optional

import torch

from ..base.formatting import format_bytes
from ..passes.common.collective_code import gather_bucket

_c10d = torch.ops._c10d_functional
log = logging.getLogger("zero_fx")


class WholeParameters:
    """``ShardedState``'s whole values, made from its shards (the experts of other ranks in
    stages 1-2 too: [Note: expert parallelism at stages 1 and 2] in sharded_state.py). A base
    of ``ShardedState``: it reads the state's ``plan``, ``world``, ``device``, ``params``,
    ``shards``, ``gathered``, ``masters_sharded``, ``local``, ``shards_flat`` and
    ``optimizer_state_as_shards``."""

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """A copy of every parameter as the optimizer holds it (fp32 masters under mixed
        precision); in stages 1-3 gathered from all ranks where the model's own parameters
        are not that (a collective: call it on every rank)."""
        if self.plan.replicated:
            return {name: shard.detach().clone() for name, shard in self.shards.items()}
        if not self.masters_sharded:
            return {name: self._whole(name, self.local(name).detach().clone())
                    for name in self.params}
        with self.shards_flat():
            return {name: self._whole(name, self._gather([name], [shard.detach()])[0].clone())
                    for name, shard in self.shards.items()}

    def full_optimizer_state(self) -> dict[str, dict]:
        """The optimizer's state of every parameter it has state for, by parameter name, as
        torch.optim would hold it for the whole parameter: each tensor of a shard's size
        gathered whole, in the parameter's shape; numbers and scalars (``step``) as they are.
        A collective in stages 1-3: call it on every rank."""
        with self.optimizer_state_as_shards():  # [Note: checkpoints of whole-tensor updates]
            return self._full_optimizer_state()

    def _full_optimizer_state(self) -> dict[str, dict]:
        out = {}
        for name, shard in self.shards.items():
            state = self.optimizer.state.get(shard)
            if not state:
                continue
            out[name] = {key: self._whole_state(name, value) for key, value in state.items()}
        return out

    def _whole_state(self, name: str, value):
        """One entry of a shard's optimizer state, whole (``full_optimizer_state``)."""
        if not isinstance(value, torch.Tensor) or self.plan.replicated or value.ndim != 1:
            return value.detach().clone() if isinstance(value, torch.Tensor) else value
        layout = self.plan.layout(name)
        if value.numel() != layout.shard_numel:
            return value.detach().clone()
        return self._whole(name, self._gather([name], [value.detach()])[0].clone())

    def _whole(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """Parameter ``name``'s whole value from its whole local piece: under tensor
        parallelism a collective over "tp" for a split one, else ``local`` itself."""
        parallel = self.plan.tensor_parallel
        return parallel.whole(name, local) if parallel is not None else local

    @torch.no_grad()
    def stream_full_parameters(self, keep: bool, dtype: Optional[torch.dtype] = None,
                               to: Optional[torch.device] = None
                               ) -> Iterator[tuple[str, Optional[torch.Tensor]]]:
        """``(name, whole value)`` for every parameter as the optimizer holds it (fp32
        masters under mixed precision), in plan order, holding at most one bucket of them
        whole on the device at a time ([Note: streaming whole parameters]).

        ``keep``: whether this rank wants the values; a rank that does not gets ``None``
        for each (it still takes part in the gathers it is needed for). ``dtype``: cast
        floating-point values (before the gather, so the collective moves that dtype).
        ``to``: where the kept values go (a fresh copy there; None: this rank's device).
        Sharded masters are gathered one bucket at a time (``plan.buckets``): a
        collective over the shard group, so every rank of it must run the generator to its
        end; whole ones (stage 0, or stages 1-2 without mixed precision) are copied one
        at a time and need no other rank.

        [Note: streaming whole parameters]
        The dict of every whole parameter is the model: on the device it is exactly
        what stage 3 exists to avoid. Streamed, the device holds the shards it always
        holds plus two buffers made once for the largest bucket and reused by every
        bucket: its shards cast and packed (1/N of the bucket) and the gathered
        bucket; each parameter is copied from its column of the gathered buffer
        straight into a fresh tensor on ``to``. So the extra device memory is one
        bucket times (1 + 1/N), whatever the allocator or the backend does with
        tensors a collective has released (gloo's worker thread drops its reference
        to a finished all-gather's tensors a moment after the wait returns: a fresh
        buffer per bucket measured two buckets alive at times). Where a column is
        strided (several parameters in a bucket) the copy to another device may
        make one contiguous temporary of that parameter. The copy to the host is
        synchronous (pageable memory): a pinned, double-buffered copy would overlap
        the next gather with it, at the price of a second bucket.
        """
        if self.plan.tensor_parallel is not None:
            # every rank takes part in making each split parameter whole over "tp"
            for name, local in self._stream_local(True, dtype, None):
                whole = self._whole(name, local)  # on every rank, kept or not
                yield name, _copied(whole, None, to) if keep else None
            return
        with self.shards_flat():
            yield from self._stream_local(keep, dtype, to)

    def _stream_local(self, keep: bool, dtype: Optional[torch.dtype],
                      to: Optional[torch.device]) -> Iterator[tuple[str, Optional[torch.Tensor]]]:
        """``stream_full_parameters`` of the local pieces ([Note: ZeRO over tensor
        parallelism]): whole over the shard group."""
        if not self.masters_sharded:
            for layout in self.plan.params:
                source = (self.shards[layout.name] if self.plan.replicated
                          else self.local(layout.name))
                yield layout.name, (_copied(source.detach(), dtype, to) if keep else None)
            return
        size = self.world.size
        buckets = [[self.plan.layout(name) for name in bucket]
                   for bucket in self.plan.buckets([layout.name for layout in self.plan.params])]
        dtypes = [_cast_dtype(layouts[0].dtype, dtype) for layouts in buckets]
        most = max(sum(l.shard_numel for l in layouts) * d.itemsize
                   for layouts, d in zip(buckets, dtypes))
        send_bytes = torch.empty(most, dtype=torch.uint8, device=self.device)
        gathered_bytes = torch.empty(most * size, dtype=torch.uint8, device=self.device)
        for layouts, gathered_dtype in zip(buckets, dtypes):
            if self.plan.is_expert(layouts[0].name):  # [Note: expert parallelism]
                for layout in layouts:
                    whole = self._gather_expert(layout.name, self.shards[layout.name].detach(),
                                                gathered_dtype)
                    yield layout.name, _copied(whole, None, to) if keep else None
                continue
            numel = sum(l.shard_numel for l in layouts)
            send = send_bytes[:numel * gathered_dtype.itemsize].view(gathered_dtype)
            for piece, layout in zip(send.split([l.shard_numel for l in layouts]), layouts):
                piece.copy_(self.shards[layout.name].detach())  # casts as it copies
            gathered = gathered_bytes[:numel * size * gathered_dtype.itemsize].view(gathered_dtype)
            if self.plan.issues_collectives:  # [Note: collectives kept at a world of one]
                _c10d.wait_tensor(_c10d.all_gather_into_tensor_out(
                    send, size, self.world.group_name, out=gathered))
            else:
                gathered = send
            columns = gathered.view(size, -1).split([l.shard_numel for l in layouts], dim=1)
            for layout, column in zip(layouts, columns):
                yield layout.name, (_column_copy(column, layout, to) if keep else None)

    def gathered_bytes(self) -> int:
        """What ``gathered_parameters()`` allocates on this rank: every parameter whole, in
        the compute dtype (0 in stages 0-2, whose parameters are always whole)."""
        if not self.plan.params_sharded:
            return 0
        return sum(layout.numel * self.plan.gather_dtype(layout).itemsize
                   for layout in self.plan.params)

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        """Stage 3: fill the model's parameters with their full values (in the compute dtype)
        for the duration; free them again after. Changes made to them are discarded. A no-op
        in stages 0-2, whose parameters are always whole. A collective: enter on every rank."""
        if not self.plan.params_sharded or self.gathered:
            yield
            return
        log.info("zero_fx: gathered_parameters: rank %d gathers %s (every parameter whole, in "
                 "%s) on %s for the block; for the values alone, full_state_dict(cpu_offload="
                 "True) holds one bucket at a time", self.world.global_rank,
                 format_bytes(self.gathered_bytes()),
                 ", ".join(sorted({str(self.plan.gather_dtype(layout)).removeprefix("torch.")
                                   for layout in self.plan.params})),
                 self.device)
        with self.whole_in_model():
            yield

    @contextlib.contextmanager
    def whole_in_model(self) -> Iterator[None]:
        """Stage 3: every parameter gathered into the model (compute dtype, one all-gather per
        bucket in plan order) for the duration and its storage freed after, its gradient left
        as it is; what ``gathered_parameters()`` and a step run eagerly after a graph break
        do. A collective: enter on every rank."""
        with torch.no_grad(), self.shards_flat():
            self._gather_into_parameters([layout.name for layout in self.plan.params])
        self.gathered = True  # the model's forward pre-hook lets calls through
        try:
            yield
        finally:
            self.gathered = False
            for name in self.params:
                self.local(name).untyped_storage().resize_(0)

    def _gather_into_parameters(self, names: list[str]) -> None:
        """All-gather the masters of ``names`` (cast to the compute dtype) into the model's
        parameters, one collective per bucket in plan order; a freed (stage 3) parameter gets
        its storage back first."""
        for bucket in self.plan.buckets(names):
            if self.plan.is_expert(bucket[0]) and (not self.plan.params_sharded
                                                   or self.plan.is_expert_rows(bucket[0])):
                bucket = [name for name in bucket if self.plan.holds(name)]
                if not bucket:
                    continue
                fulls = self._gather_over_group(  # [Note: expert parallelism at stages 1 and 2]
                    bucket, [self.shards[name].detach() for name in bucket], self.plan.compute_dtype)
            else:
                fulls = self._gather(bucket, [self.shards[name].detach() for name in bucket],
                                     dtype=self.plan.compute_dtype)
            for name, full in zip(bucket, fulls):
                param = self.local(name)
                if param.untyped_storage().nbytes() == 0:
                    param.untyped_storage().resize_(param.numel() * param.element_size())
                param.copy_(full)

    def _gather(self, names: list[str], shards: list[torch.Tensor],
                dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
        if self.plan.is_expert(names[0]):  # a bucket holds experts only, or none
            return [self._gather_expert(name, shard, dtype) for name, shard in zip(names, shards)]
        return self._gather_over_group(names, shards, dtype)

    def _gather_over_group(self, names: list[str], shards: list[torch.Tensor],
                           dtype: Optional[torch.dtype]) -> list[torch.Tensor]:
        """``names`` whole, gathered over the ranks that shard them (``plan.collective_group``:
        the shard group, or a routed expert's holders)."""
        layouts = [self.plan.layout(name) for name in names]
        size, group = self.plan.collective_group(names[0])
        shards = [shard.to(self.device) for shard in shards]  # offloaded masters: a device copy
        return gather_bucket(*shards, numels=[l.numel for l in layouts],
                             shapes=[l.shape for l in layouts], world_size=size,
                             group_name=group, dtype=dtype,
                             keep_at_one=self.plan.keeps_collectives_at_one)

    def _gather_expert(self, name: str, shard: torch.Tensor,
                       dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """A routed expert's whole value on every rank, under expert parallelism: its shards
        live on the ranks of one expert-data-parallel group only, so every rank puts in a
        buffer of a shard's size (the holders their shard, the others zeros), gathered over
        all ranks, and the holders' rows make the value. For whole values (checkpoints,
        ``full_parameters``), not the step: it moves the expert ``P`` times over."""
        layout, parallel = self.plan.layout(name), self.plan.expert_parallel
        mine = (shard.to(self.device) if self.plan.holds(name)
                else shard.new_zeros(layout.shard_numel, device=self.device))
        mine = mine.to(dtype) if dtype is not None and mine.dtype.is_floating_point else mine
        gathered = _c10d.wait_tensor(_c10d.all_gather_into_tensor(
            mine.contiguous(), self.plan.world_size, self.plan.group_name))
        if self.plan.is_expert_rows(name):
            # [Note: experts held as 3-D parameters, split by rows]: rank g holds shard g // P
            # of place g % P's rows; the places' rows one after the other make the whole
            places = gathered.view(parallel.data_size, parallel.degree, -1).transpose(0, 1)
            rows = places.reshape(parallel.degree, -1)[:, :layout.numel]
            return rows.reshape(self.plan.whole_shape(name))
        rows = gathered.view(self.plan.world_size, -1)[parallel.slices[name]::parallel.degree]
        return rows.reshape(-1)[:layout.numel].view(layout.shape)


def _cast_dtype(own: torch.dtype, dtype: Optional[torch.dtype]) -> torch.dtype:
    """``dtype`` for a floating-point ``own``, else ``own`` (integers are not cast)."""
    return dtype if dtype is not None and own.is_floating_point else own


def _copied(tensor: torch.Tensor, dtype: Optional[torch.dtype],
            to: Optional[torch.device]) -> torch.Tensor:
    """A fresh copy of ``tensor`` on ``to`` (None: where it is), cast as ``_cast_dtype`` says; the
    cast happens in the copy, with no temporary on the source device."""
    out = torch.empty(tensor.shape, dtype=_cast_dtype(tensor.dtype, dtype),
                      device=to if to is not None else tensor.device)
    return out.copy_(tensor)


def _column_copy(column: torch.Tensor, layout, to: Optional[torch.device]) -> torch.Tensor:
    """Parameter ``layout``'s whole value, copied to ``to`` from its column ``(world size,
    shard numel)`` of a gathered bucket (rank-major, padded: [Note: flat layout])."""
    out = torch.empty(column.shape, dtype=column.dtype,
                      device=to if to is not None else column.device)
    out.copy_(column)
    return out.view(-1)[:layout.numel].view(layout.shape)
