"""Updates that need the whole tensor (Muon, Adafactor, LAMB, ...), run once, on the tensor's owner.

[Note: whole-tensor updates on owner ranks]
Stages 1-3 step an elementwise optimizer on each rank's flat 1/N shard of every parameter. An
optimizer that reads across a tensor (Muon orthogonalises each weight matrix, Adafactor
factors its second moment over rows and columns, LAMB scales by the tensor's norm) cannot
step a slice. Each such tensor has one owner (``ShardPlan.owners``, balanced by the update's
cost: plan/owners.py), and its update runs there, whole, once per step:

1. the gradient reaches its owner by the reduction itself ([Note: reductions laid out by
   owner]). At stage 1, which keeps every whole gradient to the end of the backward anyway,
   the graph leaves these gradients whole and one reduce-scatter laid out by owner gives each
   owner its tensors' mean gradients. At stages 2-3, which reduce gradients as they land, the
   graph does, one reduce-scatter laid out by owner per group of N blocks ([Note: owner
   groups] in zero_fx/plan/owners.py). Where a group is too large for that, or the gradients
   are quantized or replicated, the graph reduce-scatters them into every rank's flat shard as
   for AdamW, and after the graph one ``all_to_all`` sends each rank's shard to the owner;
2. the owner's optimizer steps its whole tensors (it alone holds their state, whole: Muon's
   momentum, Adafactor's factors); the other ranks' optimizers hold an empty tensor in its
   place, with no gradient, which torch.optim skips. After the graph, or at stages 2-3 in it,
   right after each group's reduction ([Note: whole-tensor updates in the graph] in
   graph_update.py);
3. the result returns. At stages 1-2 without mixed precision, by the all-gather the stage
   runs anyway, laid out by owner: every rank's parameter (and master shard) of each such
   tensor comes from its owner's row. At stage 3 by the graph's own all-gather of each owner
   group, whose shards hold their owners' rows ([Note: owners' rows as the shards]), so
   nothing runs after the step; at stages 1-2 under mixed precision, whose fp32 masters hold
   the rows the same way, by the stage's all-gather of each group's rows, cast, into the
   parameters. Otherwise (a group that cannot be stored so) one ``all_to_all`` sends each rank
   its shard of each updated tensor, into its master, and the stage goes on as for any
   parameter.

What each exchange costs: an ``all_to_all`` sends about ``(N - 1) / N**2`` of those tensors'
elements per rank, ``1/N`` of what a reduce-scatter of them sends. So on those tensors stages
1-3 move AdamW's bytes, with mixed precision or without (but for the padding of the rows laid
out by owner); a group returned by all-to-all sends more (at stage 3 ``1 + 1/(3N)`` times them,
1.17x at 2 ranks; at stages 1-2 under mixed precision, fp32 beside bf16 collectives, 1.47x on
the test GPT at 2 ranks); with the all-to-all to the owners as well, more again.
``analysis/traffic.py`` counts every exchange as it runs. Without mixed precision at stages 1-2
the owner holds each of its tensors whole in the master dtype besides its shard (about Ψ/N more
per rank, balanced); where its shards hold the rows, they are that copy. It holds the whole
gradient while it steps.

[Note: owners' rows as the shards]
Stage 3's masters are the flat shards the graph gathers, and so are the fp32 masters of mixed
precision at stages 1-2, and an owner's update changes whole tensors: cutting them back into
every rank's shards after the step was an all-to-all, 1.24x AdamW's bytes on the 4-block test
GPT at 2 ranks at stage 3, 1.47x at stages 1-2 under mixed precision (the stage's bf16
all-gather of the shards came after it). Instead, where an owner group's rows fit its shards,
the shards hold the rows (``plan.owner_row_groups``):

- the group's shards, one after the other (``S``, the sum of their ``shard_numel``), are one
  buffer on each rank (``rows``), its row: the tensors it owns of the group, whole, one after the
  other ([Note: reductions laid out by owner]), then zeros. Over N alike blocks the rows are
  equal, ``S`` elements at most, so they fit; the owner's tensors are views of its row at their
  starts, and its optimizer, which steps them in place, writes the shards;
- the graph gathers the group as one bucket (``passes.gather_params``,
  ``gather_owner_rows``): one all-gather of the ``S`` elements a rank that per-block buckets
  of the same shards would move, and each tensor copied out of its owner's row. So the
  updated tensors reach every rank by the gather the stage runs anyway, and nothing returns
  them after the step, in the graph or after it. The gather's code (owners, starts) is the
  plan's, the same on every rank. At stages 1-2 under mixed precision the same gather runs
  after the step, each group's rows cast to the compute dtype, into the whole parameters
  (``_gather_rows``), in place of the stage's all-gather of those shards: the same bytes;
- the price at stage 3: a group is gathered at once, so N blocks of these tensors are alive from the
  group's gather to each one's last use (each a copy, freed after it), where per-block buckets
  hold one block and the prefetch. The same bound as the group's reduction
  (``OWNER_GROUP_BYTES``, [Note: owner groups] in zero_fx/plan/owners.py), which it goes
  with (at stages 1-2 the gathered rows are a transient buffer of one group);
- outside the step, what reads or writes the shards as flat slices (checkpoints,
  ``full_parameters``, ``gathered_parameters()``, a step run eagerly after a graph break)
  enters ``shards_flat``: one all-to-all cuts the owners' tensors into flat slices for the
  duration, a cost per read, not per step; what a checkpoint's load writes there becomes the
  owners' tensors (``take_values``), and so the rows.

A group is not stored so, and returns by the all-to-all, where its widest row is wider than
its shards (the last group's leftover blocks, uneven ones), where its members mix resident and
released parameters or dtypes, where the reduction does not bring the gradients to the owners
(hybrid sharding, stage 2's quantized gradients or too large a group), or under a secondary
partition, quantized weights, offload or tensor parallelism; ``explain()`` says how many groups
are. At stages 1-2 without mixed precision the masters are the parameters' values and the
all-gather laid out by owner writes them already (``returns_owners_whole``).

[Note: reductions laid out by owner]
The gradient reaches its owner by the reduction itself, with no exchange after it: a buffer of
``N`` rows, row r the whole gradients of the tensors rank r owns one after the other (plan
order), zero-padded to the widest row; one reduce-scatter leaves each rank its own row, the
mean of its tensors' gradients, computed as the graph's reductions compute any (its dtype, its
mean, divided where they divide). At stage 1 the runtime lays out one such buffer per dtype
over the whole model, at the end of the backward, where every whole gradient is there at once
(``reduce_to_owners``). At stages 2-3 the graph lays out one per owner group, N consecutive
blocks whose rows are equal ([Note: owner groups] in zero_fx/plan/owners.py), spliced right
after the group's last gradient (``passes.reduce_grads``); each gradient's output is the
``numel`` elements of the rank's own row at that gradient's start: on its owner its whole mean,
on the others whatever lies there, dropped (``receive``). The code is the same on every rank. The return is the same layout: each owner puts its updated tensors in
its row, and one all-gather gives every rank every tensor whole, which is the all-gather
stages 1-2 run for the parameters anyway. The layout is the same on every rank (the plan's
owners and order), so the graph stays rank-agnostic: these gradients simply leave it whole,
and the runtime reduces them (``ShardPlan.reduces_to_owners``, ``reduced_by_owner``).

Why groups of N blocks and not one block's reduction: within one block the rows are uneven (a
GPT block's four matrices, 3:1:4:4 in size, split 7:5 at best over two ranks, padding by
17 %); over N alike blocks they are equal. Why not hold them to the end of the backward, as
stage 1 does: that is stage 1's gradient memory. Why not reduce each gradient to its owner as
it lands: that is a reduce to one rank, which the functional collectives the graph uses do not
have. The only cost besides the group's memory is the padding to the widest row, which
``traffic()`` counts. Stage 3's return is the graph's gather of the group, whose shards hold the
rows ([Note: owners' rows as the shards]).

Every rank runs the same exchanges in the same order (the plan's order, over the parameters
that have a gradient this step, which the graph, the same on every rank, decides), so the
collectives match. At a world of one, or at stage 0, nothing is exchanged: the whole tensor
is the shard (stage 0 steps whole tensors on every rank, as DDP does).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from ...plan import ShardPlan
from ...passes.reduce_grads import reduction
from ..distributed.cpu_group import cpu_group

_c10d = torch.ops._c10d_functional


class WholeTensorUpdates:
    """The whole tensors this rank owns, and the exchanges that bring them their gradients and
    return their values."""

    def __init__(self, plan: ShardPlan, shards: dict[str, torch.nn.Parameter],
                 device: torch.device):
        self.plan = plan
        self.device = device
        self.names = [layout.name for layout in plan.params if plan.owner_of(layout.name) is not None]
        """Every parameter stepped whole by its owner, in plan order."""
        self.tensors: dict[str, torch.nn.Parameter] = {}
        """What the optimizer steps for each of ``names``: on its owner the whole tensor, in
        the master's dtype; elsewhere an empty tensor that never gets a gradient."""
        wholes = self._to_owners(self.names, [shards[n].detach() for n in self.names])
        for name in self.names:
            layout = plan.layout(name)
            value = wholes.get(name)
            if value is None:
                value = shards[name].detach().new_empty((0, *layout.shape[1:]) if layout.shape
                                                        else (0,))
            self.tensors[name] = torch.nn.Parameter(value, requires_grad=shards[name].requires_grad)
        self.rows: dict[tuple, torch.Tensor] = {}
        """Stage 3, for each of ``plan.owner_row_groups``: this rank's row, the storage of the
        group's shards, one after the other, and of the group's tensors it owns ([Note: owners'
        rows as the shards])."""
        self._slots: dict[str, torch.Tensor] = {}
        """Each such shard's place in its group's row."""
        for group in plan.owner_row_groups:
            self._store_rows(group, shards)
        self.delivered: list[str] = []
        """The names whose gradients ``reduce_to_owners`` gave their owners this step (the
        same on every rank)."""
        self.returned: set[str] = set()
        """The names the latest ``return_values`` brought back whole into the parameters, which
        the stage's all-gather of shards after it leaves out (``plan.returns_owners_whole``)."""

    def owns(self, name: str) -> bool:
        return self.plan.owner_of(name) == self.plan.rank

    @torch.no_grad()
    def _store_rows(self, group: tuple, shards: dict[str, torch.nn.Parameter]) -> None:
        """``group``'s shards become views of one row, and the whole tensors this rank owns
        of it views of that row at their starts, their values kept ([Note: owners' rows as
        the shards])."""
        plan = self.plan
        layouts = [plan.layout(n) for n in group]
        first = shards[group[0]].detach()
        row = torch.zeros(sum(l.shard_numel for l in layouts), dtype=first.dtype, device=first.device)
        _, where = plan.rows_by_owner(group)
        for layout, slot in zip(layouts, row.split([l.shard_numel for l in layouts])):
            name = layout.name
            shards[name].data = slot
            self._slots[name] = slot
            if self.owns(name):
                start = where[name][1]
                whole = row[start:start + layout.numel].view(layout.shape)
                whole.copy_(self.tensors[name].detach())
                self.tensors[name] = torch.nn.Parameter(
                    whole, requires_grad=self.tensors[name].requires_grad)
        self.rows[group] = row

    @contextlib.contextmanager
    def shards_flat(self, shards: dict[str, torch.nn.Parameter]):
        """Inside, the shards stored as rows hold their flat slices, as every other shard does,
        for what reads or writes shards outside the step (checkpoints, ``full_parameters``,
        ``gathered_parameters()``); on the way out the rows come back (with what was written
        into the flat slices, once ``take_values`` has made the owners' tensors of them). A
        collective where any group is stored as rows: enter on every rank."""
        names = list(self._slots)
        if not names or self._flat:
            yield
            return
        flats = self._from_owners(names)
        for name in names:
            shards[name].data = flats[name].clone()
        self._flat = True
        try:
            yield
        finally:
            self._flat = False
            for name in names:
                shards[name].data = self._slots[name]

    _flat = False

    @torch.no_grad()
    def reduce_to_owners(self, wholes: dict[str, torch.Tensor]) -> None:
        """Stage 1 (``plan.reduces_to_owners``): the whole gradients of ``wholes`` (this rank's,
        unreduced) reduced over the ranks into their owners' tensors, one reduce-scatter per
        dtype laid out by owner ([Note: reductions laid out by owner])."""
        plan = self.plan
        names = [n for n in self.names if n in wholes]
        for dtype, members in _by_dtype(names, [wholes[n] for n in names]):
            width, where = plan.rows_by_owner([n for n, _ in members])
            rows = torch.cat([_row([g.reshape(-1) for n, g in members if where[n][0] == r],
                                   width, dtype, self.device) for r in range(plan.world_size)])
            # the reduction the graph runs for any gradient (its dtype, its mean), on one buffer
            mine = reduction(plan, names[:1])(rows, paddings=[0])[0].to(dtype)
            for name, _ in members:
                owner, start = where[name]
                if owner == plan.rank:
                    layout = plan.layout(name)
                    self.tensors[name].grad = mine[start:start + layout.numel].view(layout.shape)
        self.delivered = names

    @torch.no_grad()
    def receive(self, name: str, grad: torch.Tensor) -> None:
        """Stages 2-3 (``plan.reduces_to_owners_in_graph``): what the graph's reduction laid out
        by owner returned for ``name``, flat: on its owner the whole mean gradient, added to its
        tensor's (accumulation); elsewhere another tensor's elements, dropped."""
        if name not in self.delivered:
            self.delivered.append(name)
        if not self.owns(name):
            return
        tensor = self.tensors[name]
        grad = grad.view(tensor.shape).to(tensor.dtype)
        tensor.grad = grad if tensor.grad is None else tensor.grad + grad

    def reduced_grads(self) -> list[torch.Tensor]:
        """The whole gradients ``reduce_to_owners`` gave this rank's tensors, not yet stepped."""
        return [self.tensors[n].grad for n in self.delivered if self.owns(n)
                and self.tensors[n].grad is not None]

    @torch.no_grad()
    def send_grads(self, shards: dict[str, torch.nn.Parameter]) -> list[str]:
        """Step 2: each gradient shard to its tensor's owner, whose tensor then holds the whole
        gradient; returns the names exchanged (those with a gradient). Where the reduction
        delivered them (``plan.delivers_to_owners``), only the zero gradients ``zero_grad(
        set_to_none=False)`` keeps for a parameter this window gave none are put in."""
        if self.plan.delivers_to_owners:
            kept = [n for n in self.names if n not in self.delivered and shards[n].grad is not None]
            for name in self.names:  # the owners' tensors carry these gradients
                shards[name].grad = None
            for name in kept:
                if self.owns(name):
                    self.tensors[name].grad = torch.zeros_like(self.tensors[name])
            return [n for n in self.names if n in self.delivered or n in kept]
        names = [n for n in self.names if shards[n].grad is not None]
        wholes = self._to_owners(names, [shards[n].grad for n in names])
        for name, grad in wholes.items():
            self.tensors[name].grad = grad
        return names

    @torch.no_grad()
    def return_values(self, shards: dict[str, torch.nn.Parameter], names: Iterable[str],
                      parameter: Callable[[str], torch.Tensor]) -> None:
        """Step 4: each rank's shard of each updated tensor of ``names`` into its master; at
        stages 1-2 without mixed precision (``plan.returns_owners_whole``) each tensor whole
        into the model's parameter (``parameter(name)``) too, by one all-gather laid out by
        owner, so the stage's all-gather leaves them out (``returned``). Those stored as rows
        are in their masters already; at stages 1-2 their groups' rows are gathered into the
        parameters (``_gather_rows``)."""
        plan = self.plan
        names = list(names)
        rows = [n for n in names if plan.stored_as_rows(n)]  # stepped in place, in the row
        names = [n for n in names if n not in rows]
        self.returned = set()
        if rows and plan.gathers_after_step:
            self._gather_rows(rows, parameter)
        if not plan.returns_owners_whole:
            for name, shard in self._from_owners(names).items():
                shards[name].detach().copy_(shard)
            return
        for dtype, members in _by_dtype(names, [self.tensors[n].detach() for n in names],
                                        dtype_of=lambda n: plan.layout(n).dtype):
            width, where = plan.rows_by_owner([n for n, _ in members])
            mine = _row([t.reshape(-1) for n, t in members if self.owns(n)], width, dtype,
                        self.device)
            rows = _c10d.wait_tensor(_c10d.all_gather_into_tensor(
                mine, plan.world_size, plan.group_name)).view(plan.world_size, width)
            for name, _ in members:
                (owner, start), layout = where[name], plan.layout(name)
                whole = rows[owner, start:start + layout.numel]
                parameter(name).detach().copy_(whole.view(layout.shape))
                shards[name].detach().copy_(
                    _padded(whole, layout.shard_numel, plan.world_size)[plan.rank])
        self.returned |= set(names)

    @torch.no_grad()
    def _gather_rows(self, names: list[str], parameter: Callable[[str], torch.Tensor]) -> None:
        """Stages 1-2: each owner group stored as rows that holds any of ``names`` (the same on
        every rank) all-gathered, cast to the parameters' dtype, and every member copied into
        its parameter from its owner's row ([Note: owners' rows as the shards]); the stage's
        all-gather leaves them out (``returned``)."""
        plan, wanted = self.plan, set(names)
        for group in plan.owner_row_groups:
            if not wanted.intersection(group):
                continue
            mine = self.rows[group].to(parameter(group[0]).dtype)
            rows = _c10d.wait_tensor(_c10d.all_gather_into_tensor(
                mine, plan.world_size, plan.group_name)).view(plan.world_size, -1)
            _, where = plan.rows_by_owner(group)
            for name in group:
                (owner, start), layout = where[name], plan.layout(name)
                parameter(name).detach().copy_(
                    rows[owner, start:start + layout.numel].view(layout.shape))
            self.returned |= set(group)

    @torch.no_grad()
    def take_values(self, shards: dict[str, torch.nn.Parameter]) -> None:
        """The owners' tensors made again from the masters (after a checkpoint is loaded)."""
        for name, whole in self._to_owners(self.names, [shards[n].detach() for n in self.names]).items():
            self.tensors[name].detach().copy_(whole)

    def zero_grad(self) -> None:
        for tensor in self.tensors.values():
            tensor.grad = None
        self.delivered = []

    def held_tensors(self) -> Iterable[torch.Tensor]:
        for tensor in self.tensors.values():
            yield tensor
            if tensor.grad is not None:
                yield tensor.grad

    # the optimizer's state as flat shards ------------------------------------------------

    @contextlib.contextmanager
    def state_in_shard_form(self, optimizers: list, shards: dict[str, torch.nn.Parameter],
                            loading: bool = False):
        """Inside, each optimizer holds the flat shards for its whole-tensor updates, and their
        state as an elementwise optimizer's would be: each entry shaped like the parameter cut
        into this rank's flat shard, everything else (``step``, Adafactor's row and column
        factors) whole on every rank. So checkpoints and ``full_optimizer_state`` read and write
        one layout for every parameter, which any world size and stage loads ([Note: checkpoints
        of whole-tensor updates]). ``loading``: what was written inside becomes the owners'
        state and tensors on the way out; otherwise their own is put back.

        [Note: checkpoints of whole-tensor updates]
        An owner holds Muon's momentum, or LAMB's moments, whole; the checkpoint holds them as
        it holds AdamW's, by flat shards of the parameter's elements, so a checkpoint saved with
        Muon at 2 ranks, stage 3, loads at 1 rank, stage 0 (where every rank holds whole
        tensors) or at 4 ranks, stage 1. A collective: call it on every rank."""
        plan = self.plan
        held = {n: (o, o.state.get(self.tensors[n])) for o in optimizers for g in o.param_groups
                for p in g["params"] for n in self.names if p is self.tensors[n]}
        described = self._describe({n: st for n, (o, st) in held.items() if self.owns(n) and st})
        flat_keys = sorted({(n, k) for n, entries in described.items()
                            for k, (kind, _) in entries.items() if kind == "flat"})
        cut = {}
        for key in sorted({k for _, k in flat_keys}):
            names = [n for n in self.names if (n, key) in flat_keys]
            cut.update({(n, key): v for n, v in self._from_owners(
                names, {n: held[n][1][key] for n in names if self.owns(n)}).items()})
        own = {n: st for n, (o, st) in held.items() if st is not None}
        for name, (optimizer, _) in held.items():
            _swap(optimizer, self.tensors[name], shards[name])
            optimizer.state.pop(self.tensors[name], None)
            if name in described:
                optimizer.state[shards[name]] = {
                    k: cut[(name, k)].clone() if kind == "flat" else
                    (value.to(self.device) if isinstance(value, torch.Tensor) else value)
                    for k, (kind, value) in described[name].items()}
        try:
            yield
        finally:
            written = {n: o.state.pop(shards[n], None) for n, (o, _) in held.items()}
            for name, (optimizer, _) in held.items():
                _swap(optimizer, shards[name], self.tensors[name])
            if not loading:
                for name, state in own.items():
                    held[name][0].state[self.tensors[name]] = state
                return
            self.take_values(shards)
            for key in sorted({k for st in written.values() if st for k in st}):
                names = [n for n in self.names if written[n] and key in written[n]
                         and isinstance(written[n][key], torch.Tensor)
                         and written[n][key].ndim == 1
                         and written[n][key].numel() == plan.layout(n).shard_numel
                         and described.get(n, {}).get(key, ("", None))[0] == "flat"]
                for name, whole in self._to_owners(names, [written[n][key] for n in names]).items():
                    written[name][key] = whole
            for name, (optimizer, _) in held.items():
                if self.owns(name) and written[name]:
                    optimizer.state[self.tensors[name]] = written[name]

    def _describe(self, states: dict) -> dict:
        """``{name: {key: (kind, value)}}`` of every owner's state, on every rank: ``("flat",
        None)`` for a tensor shaped like the parameter, else ``("value", the value)`` (on the
        host)."""
        mine = {}
        for name, state in states.items():
            shape = tuple(self.plan.layout(name).shape)
            mine[name] = {
                key: ("flat", None) if isinstance(value, torch.Tensor) and value.ndim > 0
                and tuple(value.shape) == shape else
                ("value", value.detach().cpu() if isinstance(value, torch.Tensor) else value)
                for key, value in state.items()}
        if not self._exchanges():
            return mine
        gathered = [None] * dist.get_world_size(cpu_group())
        dist.all_gather_object(gathered, mine, group=cpu_group())
        return {name: entries for part in gathered for name, entries in part.items()}

    # the exchanges ---------------------------------------------------------------------

    def _to_owners(self, names: list[str], shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{name: whole tensor}`` for the names this rank owns, from every rank's flat shard of
        each of ``names`` (``shards``: this rank's, in that order)."""
        plan, out = self.plan, {}
        for dtype, members in _by_dtype(names, shards):
            mine = [n for n, _ in members if self.owns(n)]
            sizes = {n: plan.layout(n).shard_numel for n, _ in members}
            if not self._exchanges():
                for name, shard in members:
                    out[name] = self._whole(name, shard.reshape(1, -1))
                continue
            world = plan.world_size
            send = torch.cat([s.reshape(-1) for r in range(world) for n, s in members
                              if plan.owner_of(n) == r]) if members else None
            sent = [sum(sizes[n] for n, _ in members if plan.owner_of(n) == r) for r in range(world)]
            width = sum(sizes[n] for n in mine)
            received = self._all_to_all(send, [width] * world, sent)
            columns = received.view(world, width).split([sizes[n] for n in mine], dim=1)
            for name, column in zip(mine, columns):
                out[name] = self._whole(name, column)
        return out

    def _from_owners(self, names: list[str], wholes: Optional[dict] = None) -> dict[str, torch.Tensor]:
        """``{name: this rank's flat shard}`` of each owner's tensor of ``names`` (``wholes``:
        the owner's tensors to cut instead, by name)."""
        plan, out = self.plan, {}
        values = [(wholes[n] if wholes is not None and n in wholes else self.tensors[n]).detach()
                  for n in names]
        for dtype, members in _by_dtype(names, values, dtype_of=lambda n: plan.layout(n).dtype):
            sizes = {n: plan.layout(n).shard_numel for n, _ in members}
            if not self._exchanges():
                for name, whole in members:
                    out[name] = _padded(whole, sizes[name], 1)[0]
                continue
            world = plan.world_size
            mine = [(n, w) for n, w in members if self.owns(n)]
            rows = [_padded(whole, sizes[n], world) for n, whole in mine]
            width = sum(sizes[n] for n, _ in mine)
            send = (torch.cat(rows, dim=1) if rows else
                    torch.empty(world, 0, dtype=dtype, device=self.device)).reshape(-1)
            got = [sum(sizes[n] for n, _ in members if plan.owner_of(n) == r) for r in range(world)]
            received = self._all_to_all(send, got, [width] * world)
            by_source = received.split(got)
            for r in range(world):
                pieces = by_source[r].split([sizes[n] for n, _ in members if plan.owner_of(n) == r])
                for (name, _), piece in zip([m for m in members if plan.owner_of(m[0]) == r],
                                            pieces):
                    out[name] = piece
        return out

    def _exchanges(self) -> bool:
        return self.plan.world_size > 1

    def _all_to_all(self, send: Optional[torch.Tensor], received: list[int],
                    sent: list[int]) -> torch.Tensor:
        if send is None:
            send = torch.empty(0, device=self.device)
        return _c10d.wait_tensor(_c10d.all_to_all_single(send.contiguous(), received, sent,
                                                         self.plan.group_name))

    def _whole(self, name: str, columns: torch.Tensor) -> torch.Tensor:
        """Parameter ``name`` whole from its ``(N, shard)`` pieces (padding cut off)."""
        layout = self.plan.layout(name)
        return columns.reshape(-1)[:layout.numel].reshape(layout.shape).clone()


def _swap(optimizer: torch.optim.Optimizer, old: torch.Tensor, new: torch.Tensor) -> None:
    """``new`` in ``old``'s place in ``optimizer``'s param groups."""
    for group in optimizer.param_groups:
        group["params"] = [new if p is old else p for p in group["params"]]


def _by_dtype(names, tensors, dtype_of=None):
    """``[(dtype, [(name, tensor), ...]), ...]``: one exchange per dtype, names in order."""
    groups: dict[torch.dtype, list] = {}
    for name, tensor in zip(names, tensors):
        dtype = dtype_of(name) if dtype_of is not None else tensor.dtype
        groups.setdefault(dtype, []).append((name, tensor))
    return list(groups.items())


def _row(pieces: list[torch.Tensor], width: int, dtype: torch.dtype,
         device: torch.device) -> torch.Tensor:
    """``pieces`` one after the other, zero-padded to ``width`` elements."""
    flat = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
    return torch.nn.functional.pad(flat, (0, width - flat.numel()))


def _padded(whole: torch.Tensor, shard_numel: int, world: int) -> torch.Tensor:
    """``whole`` flattened, padded with zeros to ``world * shard_numel``, as ``(world, shard)``."""
    flat = whole.reshape(-1)
    pad = world * shard_numel - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(world, shard_numel)
