"""Each stage's model states, traffic and buckets per rank, of the whole model or of a rank's
tensor-parallel piece, and flat against hybrid sharding over nodes ([Note: what the planner
counts] in zero_fx/planner/report.py)."""

from __future__ import annotations

from typing import Optional

from ..plan.layout import ShardPlan
from .report import OPTIMIZER_BYTES, Bucket, LevelRow, PlanReport, StagePlan, peak_of
from .table import TRAFFIC_IN_PSI, model_state_breakdown, zero_paper_bytes
from .features.whole_updates import MUON, plan_whole_updates


def _piece(numel: int, degree: int) -> int:
    """Elements of one rank's piece of a split parameter."""
    return -(-numel // degree)


def rank_pieces(plan: ShardPlan, tp: int, split: frozenset) -> dict[str, int]:
    """Each parameter's elements on a rank: its piece if ``split``, else all of it."""
    return {layout.name: _piece(layout.numel, tp) if layout.name in split else layout.numel
            for layout in plan.params}


def psi_per_rank(plan: ShardPlan, tp: int, split: frozenset) -> int:
    return sum(rank_pieces(plan, tp, split).values())


def _padded_pieces(plan: ShardPlan, tp: int, split: frozenset) -> dict[str, int]:
    """Each parameter's elements on a rank, padded to a multiple of ``plan``'s ranks."""
    n = plan.world_size
    return {layout.name: -(-_piece(layout.numel, tp) // n) * n if layout.name in split
            else layout.padded_numel for layout in plan.params}


def stage_plan(stage: int, plan: ShardPlan, item: int, mixed: bool, optimizer: str,
               tp: int = 1, split: frozenset = frozenset()) -> StagePlan:
    """The stage's states and traffic per rank; with ``tp`` > 1, of a rank's tensor-parallel
    piece (``split`` parameters 1/tp each) over ``plan``'s ranks ([Note: planning tensor
    parallelism])."""
    psi, n = psi_per_rank(plan, tp, split), plan.world_size
    muon = plan_whole_updates(plan) if optimizer == MUON else None
    row = muon.row(stage) if muon is not None else None
    flat_optimizer = "adamw" if optimizer == MUON else optimizer
    states = model_state_breakdown(stage, psi, n, optimizer_bytes=OPTIMIZER_BYTES[flat_optimizer],
                                   param_bytes=item, reduce_bytes=item)
    if row is not None:  # [Note: planning whole-tensor updates]
        flat_numel = psi - muon.numel
        states["optimizer"] = (OPTIMIZER_BYTES["adamw"] * flat_numel / (1 if stage == 0 else n)
                               + row.state_bytes)
        states["masters"] += row.whole_copy_bytes
    padded_of = _padded_pieces(plan, tp, split)
    padded = sum(padded_of.values())
    resident = sum(padded_of[name] for name in plan.resident) if stage == 3 else 0
    elements = {"all_reduce": psi * TRAFFIC_IN_PSI[stage].get("all_reduce", 0),
                "reduce_scatter": padded * TRAFFIC_IN_PSI[stage].get("reduce_scatter", 0),
                # stage 3's second gather (backward) leaves resident parameters out
                "all_gather": padded * TRAFFIC_IN_PSI[stage].get("all_gather", 0) - resident}
    traffic = {kind: count * item for kind, count in elements.items() if count}
    ring = (n - 1) / n
    wire = sum(size * ring * (2 if kind == "all_reduce" else 1) for kind, size in traffic.items())
    if row is not None and row.exchange_bytes:
        traffic["all_to_all"] = row.exchange_buffer_bytes
        wire += row.exchange_bytes
    paper = zero_paper_bytes(stage, psi, n) if mixed else float("nan")
    return StagePlan(stage=stage, states=states, paper_bytes=paper, traffic=traffic,
                     wire_bytes=wire)


def stage_buckets(plan: ShardPlan, item: int, tp: int = 1,
                  split: frozenset = frozenset()) -> dict[str, list[Bucket]]:
    """The chosen stage's fused collectives, cut from parameters in their order (the passes
    cut them in order of use, which for a transformer is the same blocks); with ``tp`` > 1,
    of a rank's tensor-parallel pieces."""
    names = [layout.name for layout in plan.params]
    trainable = [layout.name for layout in plan.params if layout.requires_grad]
    padded = _padded_pieces(plan, tp, split)

    def cut(chosen):
        return [Bucket(b, sum(padded[x] for x in b) * item) for b in plan.buckets(chosen)]

    if plan.replicated:
        return {"all_reduce": cut(trainable)}
    gathered = [x for x in names if x not in plan.resident]
    return {"reduce_scatter": cut(trainable), "all_gather": cut(gathered)}


def hybrid_levels(report: PlanReport, plan_over, nodes: int, item: int, mixed: bool) -> list[LevelRow]:
    """Flat sharding of the chosen stage over ``nodes``, then hybrid with one replica per
    node and with fewer replicas of shard groups spanning several nodes ([Note: what the
    planner counts]); peaks with the working set traced flat (the gathered blocks are the
    same)."""
    stage = report.stage
    flat = report.stages[stage]

    def peak(states: dict[str, float]) -> Optional[float]:
        return None if report.working_set is None else peak_of(states, report.working_set)

    rows = [LevelRow(f"flat over {report.world_size} ranks", flat.state_bytes, 0.0,
                     flat.wire_bytes, peak(flat.states))]
    replicas = [r for r in range(nodes, 1, -1) if nodes % r == 0] if stage else []
    for r in replicas:
        plan = plan_over(report.world_size // r)
        hybrid = stage_plan(stage, plan, item, mixed, report.optimizer)
        trainable = sum(layout.shard_numel for layout in plan.params if layout.requires_grad)
        all_reduce = 2 * (r - 1) / r * trainable * item
        on_one_node = r == nodes  # else the shard group's ring crosses nodes too
        rows.append(LevelRow(
            f"hybrid: {r} replicas x {plan.world_size} ranks"
            + ("" if on_one_node else f" ({nodes // r} nodes each)"), hybrid.state_bytes,
            hybrid.wire_bytes if on_one_node else 0.0,
            all_reduce + (0.0 if on_one_node else hybrid.wire_bytes), peak(hybrid.states)))
    return rows
