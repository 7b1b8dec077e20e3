"""What Muon costs each rank (``--optimizer muon``): the owners' Newton-Schulz work, their
whole-tensor memory and their exchanges, per stage.

[Note: planning whole-tensor updates]
``--optimizer muon`` plans the recipe Moonlight, Kimi K2 and GLM-4.5 publish: Muon for the
2-D weights inside the repeated blocks, AdamW for the embeddings, the head, the norms and the
biases. Training steps each Muon matrix once, whole, on its owner ([Note: whole-tensor updates
on owner ranks] in zero_fx/runtime/update/whole_tensor_updates.py); the planner chooses the owners as
training does (``assign_owners_by_group`` over the same costs in the same order), so the rank it calls
the busiest is the one training will have. For each stage it prices, on the rank with the most
of each:

- compute: the owner's Newton-Schulz FLOPs (two per multiply-add of ``newton_schulz_cost``),
  beside the mean over the ranks (the balance) and beside every rank orthogonalising every
  matrix (stage 0, and a Muon that gathers every matrix on every rank);
- memory: Muon's momentum (fp32, whole on the owner, none elsewhere) and the owner's whole
  fp32 copy of each matrix it steps, besides its shard: both in the model states; while it
  steps, the whole gradients and the largest matrix's Newton-Schulz temporaries (bf16 X, its
  successor, and three s x s products, with one fp32 copy for the Nesterov blend);
- traffic: the all-to-alls after the graph, in fp32, where the stage's own collectives cannot
  be laid out by owner ([Note: reductions laid out by owner] in
  zero_fx/runtime/update/whole_tensor_updates.py): each rank's gradient shards of the matrices others
  own (stages 2-3 where an owner group is too large to reduce laid out by owner: [Note: owner
  groups] in zero_fx/plan/owners.py), and each owner's updated matrices cut into the others'
  shards (at stage 3, and at stages 1-2 under mixed precision, only where an owner group's
  shards cannot hold its owners' rows: [Note: owners' rows as the shards] in
  zero_fx/runtime/update/whole_tensor_updates.py, where the owner's whole copy is its row, no
  memory besides the shards). The traffic table adds them; the padding of the rows laid out by
  owner is left out;
- at stages 2-3, the largest owner group's gradients and the buffer laid out by owner they are
  reduced from, alive while the group's reduction waits for its last gradient; at stage 3 where
  the shards hold the rows, the larger of that and the group's matrices gathered at once.

Stage 0 steps every matrix whole on every rank, as DDP: no owner, no exchange.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from ...analysis.hardware import hardware
from ...plan.layout import OWNER_GROUP_BYTES, ShardPlan, in_block
from ...plan.owners import assign_owners_by_group, loads_of, newton_schulz_cost

MUON = "muon"
"""``--optimizer`` of the Muon + AdamW recipe."""
MUON_STATE_BYTES = 4
"""Muon's state per element: the fp32 momentum buffer."""
WHOLE_MASTER_BYTES = 4
"""The owner's whole copy and gradient of each matrix it steps are fp32, as the masters."""
NEWTON_SCHULZ_ITEM = 2
"""torch.optim.Muon orthogonalises in bf16."""


def muon_matrices(plan: ShardPlan) -> list[str]:
    """The recipe's Muon parameters, in plan order: the trainable 2-D weights inside the
    repeated blocks."""
    return [layout.name for layout in plan.params
            if layout.requires_grad and len(layout.shape) == 2 and in_block(layout.name)]


@dataclass(frozen=True)
class WholeUpdateRow:
    """One stage's price of the Muon updates, on the rank with the most of each."""

    stage: int
    flops: float
    """Newton-Schulz FLOPs per step of the busiest rank."""
    mean_flops: float
    """The same, averaged over the ranks: what a perfect balance would give each."""
    state_bytes: float
    """Muon's momentum on the rank holding the most."""
    whole_copy_bytes: float
    """The owner's whole fp32 copies of its matrices, besides their shards (0 at stage 0)."""
    stepping_bytes: float
    """Held only while the owner steps: its whole gradients and the Newton-Schulz
    temporaries of its largest matrix."""
    exchange_bytes: float
    """Bytes the rank sending the most sends to other ranks in the stage's all-to-alls."""
    exchange_buffer_bytes: float
    """The same rank's send buffers of those all-to-alls (what the traffic table counts for
    every collective: its own shards included)."""
    group_reduction_bytes: float = 0.0
    """Stages 2-3: the largest owner group's gradients and its buffer laid out by owner, alive
    together while the graph reduces the group (0 where the group reduces as shards)."""
    group_gather_bytes: float = 0.0
    """Stage 3: the largest owner group whose shards hold its owners' rows, gathered whole at
    once, where per-block buckets gather one block ([Note: owners' rows as the shards])."""

    @property
    def group_bytes(self) -> float:
        """What the owner groups hold at once: the reduction's, or the gather's."""
        return max(self.group_reduction_bytes, self.group_gather_bytes)


@dataclass(frozen=True)
class WholeUpdates:
    matrices: int
    numel: int
    """Elements Muon steps (Ψ_M)."""
    total_flops: float
    """Newton-Schulz FLOPs per step over every matrix."""
    rows: tuple[WholeUpdateRow, ...]
    mixed: bool = False
    """Under mixed precision: fp32 masters, which the stage's all-gather at stages 1-2 cannot
    write but where the shards hold the owners' rows."""
    rows_at: frozenset = frozenset()
    """The stages at which some owner group's shards hold its owners' rows."""

    def row(self, stage: int) -> WholeUpdateRow:
        return self.rows[stage]


def plan_whole_updates(plan: ShardPlan) -> Optional[WholeUpdates]:
    """The Muon updates of ``plan``'s model at its world size, each stage; None without a
    Muon matrix."""
    names = muon_matrices(plan)
    if not names:
        return None
    layouts = {name: plan.layout(name) for name in names}
    costs = {name: newton_schulz_cost(layouts[name].shape) for name in names}
    total = 2 * sum(costs.values())
    numel = sum(layout.numel for layout in layouts.values())
    n = plan.world_size
    every_rank = WholeUpdateRow(
        stage=0, flops=total, mean_flops=total, state_bytes=MUON_STATE_BYTES * numel,
        whole_copy_bytes=0.0, stepping_bytes=_temporaries(layouts.values()),
        exchange_bytes=0.0, exchange_buffer_bytes=0.0)
    if n == 1:
        return WholeUpdates(len(names), numel, total, (every_rank,) * 4)
    owners = assign_owners_by_group(costs, n, [layout.name for layout in plan.params])
    staged = {stage: dataclasses.replace(plan, stage=stage, owners=tuple(
        (name, owners[name]) for name in names)) for stage in (1, 2, 3)}
    loads = loads_of(owners, costs, n)
    owned = [[layouts[name] for name in names if owners[name] == r] for r in range(n)]
    owned_numel = [sum(layout.numel for layout in mine) for mine in owned]
    all_shards = sum(layout.shard_numel for layout in layouts.values())
    owned_shards = [sum(layout.shard_numel for layout in mine) for mine in owned]
    # the owner groups whose shards hold their owners' rows (stage 3, and stages 1-2 under
    # mixed precision): no whole copy besides the shards, no all-to-all back
    rows = {stage: {n for n in names if staged[stage].stored_as_rows(n)} for stage in (1, 2, 3)}
    returned = {stage: [sum(l.shard_numel for l in mine if l.name not in rows[stage])
                        for mine in owned] for stage in (1, 2, 3)}
    copied = {stage: max(sum(l.numel for l in mine if l.name not in rows[stage])
                         for mine in owned) for stage in (1, 2, 3)}
    mixed = plan.compute_dtype is not None

    def exchanges(stage: int) -> tuple[float, float]:
        """(sent, send buffers) of the rank sending the most, in the all-to-alls ``stage``
        runs: to owners (a rank's shard of every matrix, its own staying) but at stage 1,
        whose reduction is laid out by owner; from owners (each matrix it owns cut into n
        shards, one staying) at stage 3 and under mixed precision, where the stage's gather
        laid out by owner cannot return them ([Note: reductions laid out by owner])."""
        to_owners = stage >= 2 and not staged[stage].reduces_to_owners_in_graph
        from_owners = stage == 3 or mixed
        buffers = [WHOLE_MASTER_BYTES * (all_shards * to_owners + n * back * from_owners)
                   for back in returned[stage]]
        sent = [WHOLE_MASTER_BYTES * ((all_shards - mine) * to_owners
                                      + (n - 1) * back * from_owners)
                for mine, back in zip(owned_shards, returned[stage])]
        return max(sent), max(buffers)

    stepping = max(WHOLE_MASTER_BYTES * owned_numel[r] + _temporaries(owned[r])
                   for r in range(n))
    gathered = max((sum(layouts[m].numel * staged[3].gather_dtype(layouts[m]).itemsize
                        for m in group) for group in staged[3].owner_row_groups), default=0.0)
    sharded = [WholeUpdateRow(
        stage=stage, flops=2 * max(loads), mean_flops=total / n,
        state_bytes=MUON_STATE_BYTES * max(owned_numel),
        whole_copy_bytes=WHOLE_MASTER_BYTES * copied[stage], stepping_bytes=stepping,
        exchange_bytes=sent, exchange_buffer_bytes=buffers,
        group_reduction_bytes=2.0 * staged[stage].owner_group_bytes
        if staged[stage].reduces_to_owners_in_graph else 0.0,
        group_gather_bytes=gathered if stage == 3 else 0.0)
        for stage in (1, 2, 3) for sent, buffers in (exchanges(stage),)]
    return WholeUpdates(len(names), numel, total, (every_rank, *sharded), mixed,
                        frozenset(stage for stage in (1, 2, 3) if rows[stage]))


def _temporaries(layouts) -> float:
    """Bytes of the Newton-Schulz temporaries of the largest of ``layouts``: X and the next X
    (s x l each) and three s x s products in bf16, and one fp32 s x l copy."""
    largest = 0.0
    for layout in layouts:
        short, long = sorted(layout.shape)
        largest = max(largest, NEWTON_SCHULZ_ITEM * (2 * short * long + 3 * short * short)
                      + 4 * short * long)
    return largest


def format_whole_updates(updates: WholeUpdates, psi: int, tensors: int, hardware_name: str,
                         world_size: int) -> list[str]:
    """The Muon section of the planner's report."""
    hw = hardware(hardware_name)
    every, sharded = updates.row(0), updates.row(1)

    def seconds(flops: float) -> str:
        return f"{flops / hw.flops * 1e3:.2f} ms"

    def exchange_time(row: WholeUpdateRow) -> str:
        if not row.exchange_bytes:
            return "—"
        return f"{(row.exchange_bytes / hw.link_bandwidth + 2 * (world_size - 1) * hw.link_latency) * 1e3:.2f} ms"

    def row_of(label: str, row: WholeUpdateRow, note: str = "") -> str:
        return (f"| {label} | {row.flops / 1e12:.3f} / {row.mean_flops / 1e12:.3f}{note} | "
                f"{seconds(row.flops)} | {(row.state_bytes + row.whole_copy_bytes) / 1e9:.2f} | "
                f"{row.stepping_bytes / 1e9:.2f} | {row.group_bytes / 1e9:.2f} | "
                f"{row.exchange_bytes / 1e9:.2f} | {exchange_time(row)} |")

    lines = [
        f"Muon (--optimizer muon) on the blocks' {updates.matrices} matrices, Ψ_M = "
        f"{updates.numel / 1e9:.3f}B ({100 * updates.numel / psi:.0f} % of Ψ), each stepped whole "
        f"once, on its owner rank; AdamW on the other {tensors - updates.matrices} tensors. Per "
        f"step, on the rank with the most of each (times on {hw.name}, at its matmul FLOP/s and "
        "link bandwidth):",
        "",
        "| stage | Newton-Schulz TFLOP (busiest / mean) | its time | Muon state + whole copies GB "
        "| while stepping GB | owner group GB | exchanges sent GB | their time |",
        "|---|---|---|---|---|---|---|---|",
        row_of("0", every, " (every rank, every matrix)"),
    ]
    if world_size > 1:
        lines += [row_of(str(stage), updates.row(stage)) for stage in (1, 2, 3)]
        lines += [
            "",
            f"The owners are balanced by Newton-Schulz work (longest first): the busiest does "
            f"{sharded.flops / sharded.mean_flops:.2f}x the mean, {every.flops / sharded.flops:.1f}x "
            f"less than a Muon that orthogonalises every matrix on every rank. The owner holds "
            f"its matrices' momentum and a whole fp32 copy of each (in the model states above; "
            f"none where its shards hold them); "
            f"while it steps, their whole gradients and the largest one's Newton-Schulz "
            f"temporaries. The reduce-scatters, laid out by owner (stage 1's after the backward, "
            f"stages 2-3's in the graph, one per {world_size} blocks, where the group fits "
            f"{OWNER_GROUP_BYTES >> 20} MiB: owner group, the gradients and their buffer), "
            f"reduce the gradients to their owners" + ("" if updates.mixed else
                                                       ", and stages 1-2's all-gather, laid out "
                                                       "the same, returns the updated matrices") +
            ("" if 3 not in updates.rows_at else
             "; at stage 3 each such group's shards hold its owners' rows, and the graph's "
             "all-gather of the group brings the updated matrices (owner group: the group "
             "gathered at once, where a block's bucket holds one block)") +
            ("" if not {1, 2} & updates.rows_at else
             "; under mixed precision stages 1-2's fp32 shards hold the rows too, and the "
             "stage's all-gather of each group, cast, brings the matrices into the parameters") +
            "; the other exchanges (gradient shards to the owners, updated shards back, fp32) "
            "are in the traffic table's all-to-all.",
        ]
    return lines
