"""Updates that need the whole tensor (Muon, Adafactor, LAMB, ...), run once, on the tensor's owner.

[Note: whole-tensor updates on owner ranks]
Stages 1-3 step an elementwise optimizer on each rank's flat 1/N shard of every parameter. An
optimizer that reads across a tensor (Muon orthogonalises each weight matrix, Adafactor
factors its second moment over rows and columns, LAMB scales by the tensor's norm) cannot
step a slice. Each such tensor has one owner (``ShardPlan.owners``, balanced by the update's
cost: plan/owners.py), and its update runs there, whole, once per step:

1. the graph reduces the gradient as it reduces any other, into every rank's flat shard of
   the mean: the same reduce-scatter (or, for buckets, the same fused one) as for AdamW;
2. after the graph, one ``all_to_all`` sends each rank's shard of each such gradient to the
   tensor's owner, which puts the N shards together into the whole gradient;
3. the owner's optimizer steps its whole tensors (it alone holds their state, whole: Muon's
   momentum, Adafactor's factors); the other ranks' optimizers hold an empty tensor in its
   place, with no gradient, which torch.optim skips;
4. one ``all_to_all`` sends each rank its shard of each updated tensor, into the masters the
   graph reads (stage 3) or the stage's all-gather brings back whole (stages 1-2).

Why shards are exchanged after the reduction rather than a layout whose reduction itself
delivers whole tensors (buckets laid out so each tensor falls in its owner's slice): the graph,
its collectives, their buckets and schedule, the checkpoint format and every feature built on
the flat layout stay exactly AdamW's, for every parameter, and the owners can be balanced over
the whole model rather than within each bucket (a GPT block's four matrices, 3:1:4:4 in size,
split 7:5 at best over two ranks, padding the bucket by 17 %). The price is the two exchanges:
each sends about ``(N - 1) / N**2`` of those tensors' elements per rank, ``1/N`` of what a
reduce-scatter of them sends, so the two add ``2/N`` of one collective pass on those tensors:
stages 1-2 (two passes) move ``1 + 1/N`` times AdamW's bytes on them (1.5x at 2 ranks, 1.125x
at 8), stage 3 (three) ``1 + 2/(3N)`` (1.33x, 1.08x). Measured on the 4-block test GPT at 2
ranks, stage 1, Muon holding 94 % of its elements: 306,304 wire bytes per rank a step against
AdamW's 208,000 (1.47x). A layout whose reduce-scatter itself delivers whole tensors to their
owners would remove this at the price above; it is the next step. ``analysis/traffic.py``
counts both exchanges. The owner holds each of its tensors whole in the
master dtype besides its shard (about Ψ/N more per rank, balanced), and the whole gradient
while it steps.

Every rank runs the same exchanges in the same order (the plan's order, over the parameters
that have a gradient this step, which the graph, the same on every rank, decides), so the
collectives match. At a world of one, or at stage 0, nothing is exchanged: the whole tensor
is the shard (stage 0 steps whole tensors on every rank, as DDP does).
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from ..plan import ShardPlan
from .cpu_group import cpu_group

_c10d = torch.ops._c10d_functional


class WholeTensorUpdates:
    """The whole tensors this rank owns, and the two exchanges with the shards."""

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

    def owns(self, name: str) -> bool:
        return self.plan.owner_of(name) == self.plan.rank

    @torch.no_grad()
    def send_grads(self, shards: dict[str, torch.nn.Parameter]) -> list[str]:
        """Step 2: each gradient shard to its tensor's owner, whose tensor then holds the whole
        gradient; returns the names exchanged (those with a gradient)."""
        names = [n for n in self.names if shards[n].grad is not None]
        wholes = self._to_owners(names, [shards[n].grad for n in names])
        for name, grad in wholes.items():
            self.tensors[name].grad = grad
        return names

    @torch.no_grad()
    def return_values(self, shards: dict[str, torch.nn.Parameter], names: Iterable[str]) -> None:
        """Step 4: each rank's shard of each updated tensor of ``names`` into its master."""
        names = list(names)
        for name, shard in self._from_owners(names).items():
            shards[name].detach().copy_(shard)

    @torch.no_grad()
    def take_values(self, shards: dict[str, torch.nn.Parameter]) -> None:
        """The owners' tensors made again from the masters (after a checkpoint is loaded)."""
        for name, whole in self._to_owners(self.names, [shards[n].detach() for n in self.names]).items():
            self.tensors[name].detach().copy_(whole)

    def zero_grad(self) -> None:
        for tensor in self.tensors.values():
            tensor.grad = None

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


def _padded(whole: torch.Tensor, shard_numel: int, world: int) -> torch.Tensor:
    """``whole`` flattened, padded with zeros to ``world * shard_numel``, as ``(world, shard)``."""
    flat = whole.reshape(-1)
    pad = world * shard_numel - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(world, shard_numel)
