"""The traffic report: every collective a compiled step issues, read off its rewritten graph.

[Note: counting traffic]
A collective's ``numel`` is the size of the whole buffer it works on: the
gathered output of an all-gather, the input of a reduce-scatter, the tensor of
an all-reduce. Summed over a step and divided by Ψ (the model's parameter
count) this gives the multiples the ZeRO table speaks of: stage 0 all-reduces
Ψ, stages 1-2 reduce-scatter Ψ and all-gather Ψ, stage 3 all-gathers 2Ψ and
reduce-scatters Ψ (plus padding; see [Note: flat layout] in plan/layout.py).
What a rank puts on the wire is a different number: over a ring, an all-gather
or reduce-scatter of B bytes sends (N-1)/N·B per rank, an all-reduce twice that
(it is a reduce-scatter followed by an all-gather). ``wire_bytes`` reports it.

With hybrid sharding ([Note: hybrid sharding] in runtime/distributed/process_group.py) N is the
size of the group a collective runs on: the shard group for gathers and
reduce-scatters (within a node), the replicate group for the all-reduce of each
gradient shard (across nodes); ``wire_bytes_by_group`` says how much crosses each.

Under tensor parallelism ([Note: ZeRO over tensor parallelism] in
zero_fx/plan/tensor_parallel.py) Ψ is this rank's tensor-parallel piece of the model, the
elements ZeRO's collectives move, and the collectives DTensor put in the step (on the
"tp" group, moving activations and their gradients) are rows of their own kinds,
``tp_all_reduce`` and the like, apart from ZeRO's totals.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch
from torch.fx import GraphModule, Node

from ..base.formatting import ranks_phrase
from ..passes.common.predicates import (
    carried_params,
    grad_slots,
    is_all_gather,
    is_all_reduce,
    is_all_to_all,
    is_collective,
    is_reduce_scatter,
    is_tensor_parallel_collective,
    is_token_exchange,
    is_wait,
    phase_of,
    runs_across_replicas,
    token_exchange_numel,
    token_exchange_wait,
)

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
ALL_TO_ALL = "all_to_all"
"""Expert parallelism's exchanges of tokens (a kind of the totals only where there are any)."""
SHARD_GROUP, REPLICATE_GROUP = "shard group", "replicate group"
EXPERT_GROUP, EXPERT_DATA_GROUP = "expert-parallel group", "expert-data-parallel group"
TP_GROUP = "tp group"
NODE_GROUP, ACROSS_NODES = "node group", "across-nodes group"  # [Note: the secondary partition]
TP_PREFIX = "tp_"
"""A tensor-parallel collective's kind: this before its operation's ("tp_all_reduce")."""
_RING = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2, ALL_TO_ALL: 1}
"""Bytes a rank sends over a ring, as a multiple of (n-1)/n of the buffer, per kind."""


_c10d = torch.ops._c10d_functional
KIND_OF_COLLECTIVE = {
    _c10d.all_gather_into_tensor: "all_gather",
    _c10d.all_gather_into_tensor_out: "all_gather",
    _c10d.all_gather_into_tensor_coalesced: "all_gather",
    _c10d.reduce_scatter_tensor: "reduce_scatter",
    _c10d.reduce_scatter_tensor_out: "reduce_scatter",
    _c10d.reduce_scatter_tensor_coalesced: "reduce_scatter",
    _c10d.all_reduce: "all_reduce",
    _c10d.all_reduce_: "all_reduce",
    _c10d.all_reduce_coalesced: "all_reduce",
}
"""A functional collective's kind, by its packet: the plain variants, the in-place and out=
ones (what Inductor calls) and the coalesced ones."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> "float32"."""
    return str(dtype).removeprefix("torch.")


def tensor_parallel_kind(op) -> Optional[str]:
    """The kind of a functional collective (an OpOverload) that tensor parallelism issued:
    ``tp_all_reduce``, ``tp_all_gather``, ``tp_reduce_scatter``, ``tp_all_to_all``; None for
    anything else."""
    packet = op.overloadpacket
    kind = KIND_OF_COLLECTIVE.get(packet, ALL_TO_ALL if packet == _c10d.all_to_all_single else None)
    return TP_PREFIX + kind if kind is not None else None


@dataclass(frozen=True)
class Collective:
    """One collective of the step, as the rewritten graph issues it."""

    kind: str
    """"all_gather", "reduce_scatter" or "all_reduce"."""
    dtype: torch.dtype
    numel: int
    """Elements of the whole buffer (see [Note: counting traffic])."""
    bucket: tuple[str, ...]
    """The parameters whose elements it moves."""
    phase: str
    """The part of the step that issues it: "forward", "backward", "after
    accumulation" (stages 0-1 with gradient accumulation: the summed gradients
    reduced once per optimizer step; [Note: gradient accumulation] in update.py),
    or "after step" (stages 1-2: the updated shards gathered back into the
    parameters, eagerly, after the optimizer; see [Note: stages 1 and 2 keep
    whole parameters] in sharded_state.py)."""
    issued_at: Optional[int]
    """Position of the collective among the graph's nodes (None: outside the graph)."""
    waited_at: Optional[int]
    """Position of its wait; everything between may overlap with it."""
    node: str
    """The collective's node in the graph ("" outside it)."""
    group: str = SHARD_GROUP
    """Where it runs: ``SHARD_GROUP`` (every rank when flat) or ``REPLICATE_GROUP``."""

    @property
    def bytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class TrafficReport:
    """Per-step collectives of one compiled graph, with totals per kind."""

    stage: int
    world_size: int
    psi: int
    """Ψ: parameters in the model (unpadded)."""
    collectives: tuple[Collective, ...]
    replicas: int = 1
    """Hybrid sharding: copies of each shard; ``world_size`` is the shard group's size."""
    expert_numel: Optional[dict] = None
    """Mixture-of-experts models: elements of the routed experts' parameters each kind
    moves per step (within the totals); None for a dense model."""
    expert_parallel: int = 1
    """Ranks each block's experts are split over ([Note: expert parallelism] in
    zero_fx/plan/expert_parallel.py); the expert-data-parallel group has ``world_size /
    expert_parallel``."""
    tp: int = 1
    """Ranks of the tensor-parallel group: Ψ is then this rank's piece of the model."""
    node_size: int = 1
    """With a secondary partition: ranks per node ([Note: the secondary partition] in
    zero_fx/plan/secondary.py); ``world_size / node_size`` nodes."""

    def numel_by_kind(self) -> dict[str, int]:
        return self._total_by_kind(lambda c: c.numel)

    def bytes_by_kind(self) -> dict[str, int]:
        return self._total_by_kind(lambda c: c.bytes)

    def launches_by_kind(self) -> dict[str, int]:
        """Collective launches per kind in one step (a bucket is one launch)."""
        return self._total_by_kind(lambda c: 1)

    def _total_by_kind(self, value) -> dict[str, int]:
        totals = Counter({kind: 0 for kind in KINDS})  # all_to_all only where there are any
        for c in self.collectives:
            totals[c.kind] += value(c)
        return dict(totals)

    def bytes_by_dtype(self) -> dict[str, int]:
        """Bytes per step by the dtype they move in ("float32", "bfloat16", "uint8" for
        quantized blocks: [Note: quantized blocks on the wire] in passes/common/quantized_code.py),
        every kind together."""
        totals = Counter()
        for c in self.collectives:
            totals[dtype_name(c.dtype)] += c.bytes
        return dict(totals)

    def psi_by_kind(self) -> dict[str, float]:
        """Elements per kind as a multiple of Ψ (padding makes it a little above the table)."""
        return {kind: numel / self.psi for kind, numel in self.numel_by_kind().items()}

    def wire_bytes(self) -> int:
        """Bytes each rank sends per step over a ring (see [Note: counting traffic])."""
        return sum(self.wire_bytes_by_group().values())

    def wire_bytes_by_group(self) -> dict[str, int]:
        """Bytes each rank sends per step over a ring, within its shard group, across
        replicas and within its tensor-parallel group ([Note: counting traffic])."""
        sizes = {SHARD_GROUP: self.world_size, REPLICATE_GROUP: self.replicas,
                 EXPERT_GROUP: self.expert_parallel,
                 EXPERT_DATA_GROUP: self.world_size // self.expert_parallel, TP_GROUP: self.tp,
                 NODE_GROUP: self.node_size, ACROSS_NODES: self.world_size // self.node_size}
        totals = {SHARD_GROUP: 0, REPLICATE_GROUP: 0} if self.replicas > 1 else {SHARD_GROUP: 0}
        for c in self.collectives:
            n = sizes[c.group]  # an all-to-all sends (n-1)/n of its rows on average
            ring = _RING[c.kind.removeprefix(TP_PREFIX)]
            totals[c.group] = totals.get(c.group, 0) + ring * c.bytes * (n - 1) // n
        return totals

    def __str__(self) -> str:
        lines = [f"zero_fx traffic per step: stage {self.stage}, "
                 f"{ranks_phrase(self.world_size, self.replicas)}, "
                 f"Ψ = {self.psi:,} parameters"
                 + (f" (this rank's piece of a model split over {self.tp} tensor-parallel "
                    "ranks)" if self.tp > 1 else "")]
        if not self.collectives:
            lines.append("  no collectives (one rank)")
        else:
            lines.append(f"  {'#':>3}  {'kind':<14} {'dtype':<8} {'elements':>11}  {'phase':<10} "
                         f"{'issued':>6} {'waited':>6}  bucket")
            for i, c in enumerate(self.collectives):
                lines.append(f"  {i:>3}  {c.kind:<14} {dtype_name(c.dtype):<8} "
                             f"{c.numel:>11,}  {c.phase:<10} {_position(c.issued_at):>6} "
                             f"{_position(c.waited_at):>6}  {', '.join(c.bucket)}"
                             + (f" ({c.group})" if c.group != SHARD_GROUP else ""))
        lines.append("  " + self.summary())
        if self.expert_numel:
            moved = [f"{kind} {numel:,} elements = {numel / self.psi:.3f} Ψ"
                     for kind, numel in self.expert_numel.items() if numel]
            lines.append(f"  of which routed experts' parameters: {'; '.join(moved) or 'nothing'}")
        return "\n".join(lines)

    def summary(self) -> str:
        """The totals in one line: per kind, elements, multiple of Ψ and bytes; wire bytes."""
        psi, nbytes = self.psi_by_kind(), self.bytes_by_kind()
        kinds = [f"{kind} {numel:,} elements" + ("" if kind.startswith(TP_PREFIX) else
                                                 f" = {psi[kind]:.3f} Ψ")
                 + f" ({nbytes[kind]:,} B)"
                 for kind, numel in self.numel_by_kind().items() if numel]
        by_dtype = self.bytes_by_dtype()
        if len(by_dtype) > 1:
            kinds.append("by dtype " + ", ".join(f"{dtype} {nbytes:,} B"
                                                 for dtype, nbytes in by_dtype.items()))
        launches = sum(self.launches_by_kind().values())
        wire = f"on the wire (ring) per rank: {self.wire_bytes():,} B"
        by_group = self.wire_bytes_by_group()
        if len(by_group) > 1:
            wire += " (" + ", ".join(
                f"{nbytes:,} B " + ("across replicas" if group == REPLICATE_GROUP else
                                    "across nodes" if group == ACROSS_NODES else
                                    f"within the {group}")
                for group, nbytes in by_group.items()) + ")"
        return f"totals: {'; '.join(kinds) or 'nothing'}; {launches} launches; {wire}"


def traffic_report(gm: GraphModule, plan, expert_prefixes: tuple[str, ...] = ()) -> TrafficReport:
    """The collectives one step runs, in issue order: those of ``gm`` (a graph our
    passes rewrote for ``plan``); in stages 0-1 with gradient accumulation the
    reductions of the accumulated gradients, once per optimizer step; in stages
    1-2 the gathers after the optimizer. ``expert_prefixes``: the module names of a
    mixture-of-experts model's routed experts, whose share the report gives apart."""
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    collectives = [_describe(node, position, plan) for node in gm.graph.nodes
                   if is_collective(node) or is_token_exchange(node)
                   or is_tensor_parallel_collective(node)]
    # what the runtime issues outside the graph, where it issues collectives at all (at one
    # rank if the plan keeps them: [Note: collectives kept at a world of one])
    if plan.issues_collectives and not plan.reduces_in_graph:
        kind = "all_reduce" if plan.replicated else "reduce_scatter"
        collectives += _outside_graph(plan, kind, "after accumulation", plan.reduce_dtype,
                                      [n for n in grad_slots(gm).values()
                                       if not plan.reduced_by_owner(n)])
        if plan.replicas > 1 and not plan.replicated:
            collectives += _outside_graph(plan, "all_reduce", "after accumulation",
                                          plan.reduce_dtype, list(grad_slots(gm).values()),
                                          group=REPLICATE_GROUP)
    if plan.issues_collectives and plan.gathers_after_step:
        # under expert parallelism a rank gathers its own experts only, over the ranks
        # holding them, and nothing where it holds them alone ([Note: expert parallelism at
        # stages 1 and 2] in zero_fx/runtime/sharded_state.py)
        trainable = [layout.name for layout in plan.params
                     if layout.requires_grad and plan.holds(layout.name)
                     and not (plan.returns_owners_whole and plan.owner_of(layout.name) is not None)
                     and not getattr(plan, "stored_as_rows", lambda name: False)(layout.name)
                     and (plan.collective_group(layout.name)[0] > 1
                          or plan.keeps_collectives_at_one)]
        collectives += _outside_graph(plan, "all_gather", "after step", plan.compute_dtype,
                                      trainable)
    collectives += _owner_exchanges(plan)
    parallel = getattr(plan, "expert_parallel", None)
    tensor_parallel = getattr(plan, "tensor_parallel", None)
    return TrafficReport(stage=plan.stage, world_size=plan.world_size, psi=plan.total_numel,
                         collectives=tuple(collectives), replicas=plan.replicas,
                         expert_numel=_expert_numel(collectives, plan, expert_prefixes),
                         expert_parallel=parallel.degree if parallel else 1,
                         tp=tensor_parallel.degree if tensor_parallel else 1,
                         node_size=plan.secondary.size if getattr(plan, "secondary", None) else 1)


def _expert_numel(collectives: list[Collective], plan, prefixes: tuple[str, ...]):
    """Per kind, the elements of the routed experts' parameters the collectives move (each
    parameter's share of its bucket: its padded size, its shard across replicas)."""
    if not prefixes:
        return None
    starts = tuple(f"{p}." for p in prefixes)
    moved = Counter({kind: 0 for kind in KINDS})
    for c in collectives:
        if c.kind == ALL_TO_ALL:
            continue
        for name in c.bucket:
            if name.startswith(starts):
                layout = plan.layout(name)
                moved[c.kind] += (layout.shard_numel if c.group == REPLICATE_GROUP
                                  else layout.numel if c.kind == "all_reduce"
                                  else layout.padded_numel)
    return dict(moved)


def _outside_graph(plan, kind: str, phase: str, dtype, names: list[str],
                   group: str = SHARD_GROUP) -> list[Collective]:
    """The collectives the runtime issues eagerly, one per bucket of ``names`` (plan order);
    across replicas, the all-reduce of each bucket's reduced shard."""
    wanted = set(names)
    ordered = [layout.name for layout in plan.params if layout.name in wanted]

    def numel(layout) -> int:
        if group == REPLICATE_GROUP:
            return layout.shard_numel
        return layout.numel if kind == "all_reduce" else layout.padded_numel

    return [Collective(kind=kind, dtype=dtype or plan.layout(bucket[0]).dtype,
                       numel=sum(numel(plan.layout(name)) for name in bucket),
                       bucket=tuple(bucket), phase=phase, issued_at=None, waited_at=None, node="",
                       group=group)
            for bucket in plan.buckets(ordered)]


def _owner_exchanges(plan) -> list[Collective]:
    """The collectives of whole-tensor updates after the graph, per dtype ([Note: whole-tensor
    updates on owner ranks] in zero_fx/runtime/update/whole_tensor_updates.py): the gradients to their
    owners ("to owners": at stage 1 the reduce-scatter laid out by owner; at stages 2-3 the
    graph's own, read with the graph's collectives, or with quantized gradients an all-to-all
    of every rank's reduced shards), then the owners' updated tensors back ("from owners": at
    stages 1-2 without mixed precision the all-gather laid out by owner, else an all-to-all
    cutting them into every rank's shards). Each counts this rank's send buffer, the shards
    it sends to itself included, as a counter of what runs does."""
    owners = [(plan.layout(name), rank) for name, rank in getattr(plan, "owners", ())
              if plan.layout(name).requires_grad]
    if plan.world_size < 2 or not owners:
        return []
    laid_out = {"to owners": plan.reduces_to_owners, "from owners": plan.returns_owners_whole}
    kinds = {"to owners": "reduce_scatter", "from owners": "all_gather"}
    out = []
    if plan.gathers_after_step:  # [Note: owners' rows as the shards]: each group's rows, cast
        for group in getattr(plan, "owner_row_groups", ()):
            layouts = [plan.layout(name) for name in group]
            out.append(Collective(
                kind="all_gather", numel=sum(l.shard_numel for l in layouts) * plan.world_size,
                dtype=plan.compute_dtype or layouts[0].dtype, bucket=group, phase="from owners",
                issued_at=None, waited_at=None, node=""))
    phases = ("from owners",) if plan.reduces_to_owners_in_graph else ("to owners", "from owners")
    for phase in phases:
        for dtype in dict.fromkeys(layout.dtype for layout, _ in owners):
            members = [(l, r) for l, r in owners if l.dtype == dtype]
            if laid_out[phase]:  # [Note: reductions laid out by owner]
                width, _ = plan.rows_by_owner([l.name for l, _ in members])
                out.append(Collective(
                    kind=kinds[phase], numel=width * plan.world_size,
                    dtype=(plan.reduce_dtype or dtype) if phase == "to owners" else dtype,
                    bucket=tuple(l.name for l, _ in members), phase=phase, issued_at=None,
                    waited_at=None, node=""))
                continue
            # a group stored as rows returns by its own all-gather (above, stages 1-2) or the
            # graph's next (stage 3) ([Note: owners' rows as the shards] in
            # zero_fx/runtime/update/whole_tensor_updates.py)
            rows = getattr(plan, "stored_as_rows", lambda name: False)
            sent = [l for l, r in members if phase == "to owners" or (
                r == plan.rank and not rows(l.name))]
            if phase == "from owners" and all(rows(l.name) for l, _ in members):
                continue
            numel = sum(l.shard_numel for l in sent) * (1 if phase == "to owners"
                                                        else plan.world_size)
            out.append(Collective(kind=ALL_TO_ALL, dtype=dtype, numel=numel,
                                  bucket=tuple(l.name for l in sent), phase=phase,
                                  issued_at=None, waited_at=None, node=""))
    return out


def _position(index: Optional[int]) -> str:
    return "-" if index is None else str(index)


def _describe(node: Node, position: dict[Node, int], plan) -> Collective:
    if is_token_exchange(node):  # [Note: exchanging rows in fixed shapes]
        rows = node.args[0].meta["val"]
        wait = token_exchange_wait(node) or node
        return Collective(kind=ALL_TO_ALL, dtype=rows.dtype,
                          numel=token_exchange_numel(rows, node.meta["val"]), bucket=(),
                          phase=phase_of(node).value, issued_at=position[node],
                          waited_at=position[wait], node=node.name, group=EXPERT_GROUP)
    if is_tensor_parallel_collective(node):  # [Note: capturing a tensor-parallel step]
        kind = tensor_parallel_kind(node.target)
        buffer = node.meta["val"] if kind == TP_PREFIX + "all_gather" else node.args[0].meta["val"]
        waits = [u for u in node.users if is_wait(u, tensor_parallel=True)]
        return Collective(kind=kind, dtype=buffer.dtype, numel=buffer.numel(), bucket=(),
                          phase=phase_of(node).value, issued_at=position[node],
                          waited_at=position[waits[0]] if waits else -1, node=node.name,
                          group=TP_GROUP)
    if is_all_gather(node):
        kind, buffer = "all_gather", node.meta["val"]
    elif is_reduce_scatter(node):
        kind, buffer = "reduce_scatter", node.args[0].meta["val"]
    elif is_all_to_all(node):  # a quantized reduction ([Note: reductions as all-to-alls])
        kind, buffer = ALL_TO_ALL, node.args[0].meta["val"]
    else:
        assert is_all_reduce(node), node
        kind, buffer = "all_reduce", node.meta["val"]
    waits = [u for u in node.users if is_wait(u)]
    return Collective(
        kind=kind,
        dtype=buffer.dtype,
        numel=buffer.numel(),
        bucket=carried_params(node),
        phase=phase_of(node).value,
        issued_at=position[node],
        waited_at=position[waits[0]] if waits else -1,
        node=node.name,
        group=(REPLICATE_GROUP if runs_across_replicas(node, plan) else
               EXPERT_DATA_GROUP if _on_expert_data_group(node, plan) else
               _secondary_group(node, plan) or SHARD_GROUP),
    )


def _secondary_group(collective: Node, plan) -> str:
    """NODE_GROUP or ACROSS_NODES for a secondary partition's gathers, else ""."""
    secondary = getattr(plan, "secondary", None)
    if secondary is None:
        return ""
    return {secondary.node_group_name: NODE_GROUP,
            secondary.across_group_name: ACROSS_NODES}.get(collective.args[-1], "")


def _on_expert_data_group(collective: Node, plan) -> bool:
    """A gather or reduction of routed experts' weights under expert parallelism (the
    group's name is a functional collective's last argument)."""
    parallel = getattr(plan, "expert_parallel", None)
    return parallel is not None and collective.args[-1] == parallel.data_group_name
