"""A mixture of experts' blocks, and expert parallelism planned and priced: ``python -m
zero_fx.plan --expert-parallel 1,2,4,8``.

[Note: planning expert parallelism]
``--expert-parallel 1,2,4,8`` compares degrees P of expert parallelism ([Note: expert
parallelism] in zero_fx/plan/expert_parallel.py; stage 3 only) side by side. Model states
do not change: a rank holds E/W of each block's experts whatever P. Three things do:

- the gathered working set: a block gathers its E/P experts, not E, and its experts'
  gradients before the reduce-scatter are E/P experts' too;
- the expert computation's rows: the receiving buffer is the worst case, C = P*T*min(k,
  E/P) rows ([Note: exchanging rows in fixed shapes]), where without expert parallelism
  the experts run on the T*k routed rows;
- bytes: the experts' gathers and reduce-scatters move 1/P of their elements (over the
  expert-data-parallel group of D = W/P ranks, which sends (D-1)/D of them), and each MoE
  block adds four exchanges of its T*k rows (dispatch, combine and their gradients), of
  which a rank sends (P-1)/P (the counts' exchange, E integers, is left out).

The planner does not trace each degree. Tracing expert parallelism on fake tensors would
need the offline trace (zero_fx/planner/offline.py) to build the expert-parallel plan and to
leave the other ranks' experts out of the gradients; instead the graph it already traces
(P = 1) is priced again for each P: in its memory timeline every tensor that holds routed
experts' weights or gradients (a gathered or reduced bucket: the experts' share of its
elements; the stacked expert weights and their gradients) counts 1/P of its bytes, and
every tensor of the expert computation's routed rows (those of T*k rows connected to a
grouped matmul, not across the index ops that gather tokens and add them back) counts
C/(T*k) of its bytes; the peak is then taken again and extrapolated over the blocks as
for P = 1. That is an estimate: a traced expert-parallel step also keeps the token side's
T*k rows beside the buffer, and its peak may fall at another node.

The step time is the cost model's compute (the replay of the traced graphs, extrapolated
like the working set; expert FLOPs on T*k rows a rank, what balanced routing gives it),
beside which the gathers and reduce-scatters run (a ring each kind on its group, overlapped
with compute as the cost model's prefetch does: max of the two), plus the exchanges, which
nothing hides: 4 per MoE block of ``link_latency + (P-1)/P*bytes / link_bandwidth`` on the
expert-parallel group's link (within a node while P <= the preset's ranks per node).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch.fx import GraphModule

from ...analysis.transfer_seconds import all_to_all_seconds, ring_seconds
from ...analysis.hardware import hardware
from ...analysis.memory_timeline import memory_timeline, peak_alive
from ...capture.experts.expert_exchange import received_rows
from ...capture.experts.fused_experts import holds_stacked_experts, splittable_fused_experts
from ...capture.experts.moe_blocks import TOP_K_NAMES, shared_expert_name, moe_shape
from ...passes.common.predicates import carried_params
from ...plan.layout import ShardPlan
from ..report import ExpertBlocks, ExpertParallelRow, PlanReport, peak_of


@dataclass(frozen=True)
class ExpertParallelOptions:
    """What ``--expert-parallel`` compares ([Note: planning expert parallelism]): the
    ``degrees`` of expert parallelism (none: not planned), their buffers of received rows
    sized by ``capacity_factor`` (None: the worst case; [Note: expert capacity] in
    zero_fx/capture/experts/expert_exchange.py)."""

    degrees: Sequence[int] = ()
    capacity_factor: Optional[float] = None


def expert_blocks(model: torch.nn.Module) -> Optional[ExpertBlocks]:
    """The mixture-of-experts blocks of ``model`` as zero_fx's capture recognises them
    (zero_fx/capture/experts/routed_experts.py), or None for a dense model."""
    blocks, shapes, experts_total, inactive, routed = 0, [], 0, 0.0, []
    for path, block in model.named_modules():
        moe = moe_shape(block)
        if moe is None:
            continue
        experts = getattr(block, moe.experts)
        top_k = moe.top_k or moe.num_experts
        hidden = getattr(block, moe.router).weight.shape[-1]
        routed.append((f"{path}.{moe.experts}" if path else moe.experts, moe.num_experts,
                       min(top_k, moe.num_experts), hidden))
        numel = sum(p.numel() for p in experts.parameters())
        blocks += 1
        experts_total += numel
        inactive += numel * (1 - min(top_k, moe.num_experts) / moe.num_experts)
        shape = (moe.num_experts, top_k, moe.shared_expert is not None)
        if shape not in shapes:
            shapes.append(shape)
    stacked = 0
    modules = dict(model.named_modules())
    for path, module in modules.items():  # experts as 3-D parameters: transformers 5
        found = _stacked_experts(module, modules.get(path.rpartition(".")[0]))
        if found is None:
            continue
        num_experts, top_k, shared = found
        numel = sum(p.numel() for p in module.parameters())
        form = splittable_fused_experts(module)
        if form is None:
            stacked += 1
        else:  # its rows split: [Note: experts held as 3-D parameters, split by rows]
            routed.append((path, num_experts, top_k, module.gate_up_proj.shape[form.hidden_dim]))
        blocks += 1
        experts_total += numel
        inactive += numel * (1 - top_k / num_experts)
        if (num_experts, top_k, shared) not in shapes:
            shapes.append((num_experts, top_k, shared))
    if not blocks:
        return None
    total = sum(p.numel() for p in model.parameters())
    return ExpertBlocks(blocks, shapes, experts_total, total - round(inactive), routed, stacked)


def _stacked_experts(module: torch.nn.Module, block: Optional[torch.nn.Module]
                     ) -> Optional[tuple[int, int, bool]]:
    """(routed experts, top-k, shared expert) of an experts module holding 3-D
    ``gate_up_proj`` and ``down_proj`` (its top-k read from its config or its block, as
    transformers 5 keeps it), or None."""
    if block is None or not holds_stacked_experts(module):
        return None
    # the config last: transformers 4's configs also hold generation's `top_k` (50)
    places = [block, *block.children(), getattr(module, "config", None)]
    top_k = next((k for place in places for name in TOP_K_NAMES
                  if isinstance(k := getattr(place, name, None), int)), None)
    if top_k is None:
        return None
    num_experts = module.down_proj.shape[0]
    return num_experts, min(top_k, num_experts), shared_expert_name(block) is not None


def check_degrees(degrees: Sequence[int], world_size: int,
                  experts: Optional[ExpertBlocks]) -> None:
    if experts is None:
        raise ValueError("expert parallelism splits mixture-of-experts blocks, and this model "
                         "has none")
    if experts.stacked:
        raise ValueError(f"{experts.stacked} of the model's {experts.blocks} mixture-of-experts "
                         "blocks hold their experts as 3-D parameters (gate_up_proj, down_proj) "
                         "in a layout other than transformers 5's concatenated one, which "
                         "expert parallelism does not split yet")
    counts = sorted({e for _, e, _, _ in experts.routed})
    for p in degrees:
        if p < 1 or world_size % p or any(e % p for e in counts):
            raise ValueError(f"expert parallelism of degree {p} must divide the {world_size} "
                             f"ranks and the {'/'.join(map(str, counts))} experts of a block")


def expert_parallel_row(report: PlanReport, plan: ShardPlan, degree: int, traced: dict,
                        tokens: int) -> ExpertParallelRow:
    """Degree ``degree``'s bytes and time, and its peak from the re-priced working set
    ([Note: planning expert parallelism])."""
    hw, experts, item = hardware(report.hardware), report.experts, report.dtype.itemsize
    w, p = report.world_size, degree
    d = w // p
    def padded(layout, ranks: int) -> int:
        return -(-layout.numel // ranks) * ranks

    def summed(of_experts: bool, resident: bool) -> int:  # elements, padded over their group
        return sum(padded(layout, d if of_experts else w) for layout in plan.params
                   if experts.is_expert(layout.name) == of_experts
                   and (not resident or layout.name in plan.resident))

    # stage 3 gathers twice what is not resident, once what is ([Note: what the planner
    # counts]); a rank gathers (and reduces) its E/P experts
    other = summed(False, False)
    gather_other = (2 * other - summed(False, True)) * item
    gather_experts = (2 * summed(True, False) - summed(True, True)) / p * item
    reduce_other, reduce_experts = other * item, summed(True, False) / p * item
    exchange = sum(4 * tokens * k * hidden * item for _, _, k, hidden in experts.routed
                   ) if p > 1 else 0  # P = 1 exchanges nothing
    on_shards = (gather_other + reduce_other) * (w - 1) / w
    on_experts = (gather_experts + reduce_experts) * (d - 1) / d
    states = report.stages[3].states
    return ExpertParallelRow(
        degree=p, working_set=traced[p], peak_bytes=peak_of(states, traced[p]),
        traffic={"all_gather": gather_other + gather_experts,
                 "reduce_scatter": reduce_other + reduce_experts, "all_to_all": exchange},
        wire_bytes=on_shards + on_experts + exchange * (p - 1) / p,
        compute_seconds=traced["compute"],
        collective_seconds=(ring_seconds(gather_other + reduce_other, range(w), hw)
                            + ring_seconds(gather_experts + reduce_experts, range(0, w, p), hw)),
        exchange_seconds=sum(4 * all_to_all_seconds(tokens * k * hidden * item, range(p), hw)
                             for _, _, k, hidden in experts.routed))


_GROUPED_MATMULS = ("zero_fx.grouped_mm", "zero_fx.grouped_mm_weight_grad", "aten._grouped_mm")


_TOKEN_MOVES = ("index", "scatter", "gather", "sort")
"""Ops that move rows between the token side and the routed rows: the routed rows' region
stops at them ([Note: planning expert parallelism])."""


def buffer_rows(tokens: int, degree: int, experts: int, top_k: int,
                capacity_factor: Optional[float]) -> int:
    """A rank's rows of the expert computation: its T*k without expert parallelism, else
    the buffer of received rows ([Note: expert capacity])."""
    if degree == 1:
        return tokens * top_k
    return received_rows(tokens, degree, experts, top_k, capacity_factor)


def peaks_by_degree(gm: GraphModule, plan: ShardPlan, experts: ExpertBlocks, tokens: int,
                    degrees: Sequence[int], capacity_factor: Optional[float] = None
                    ) -> dict[int, float]:
    """The working set of ``gm`` (traced without expert parallelism) priced again for each
    degree ([Note: planning expert parallelism])."""
    timeline = memory_timeline(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    shape_of_rows = {tokens * k: (e, k) for _, e, k, _ in experts.routed}
    counts = {e for _, e, _, _ in experts.routed}
    routed = _routed_rows(gm, set(shape_of_rows))
    priced = []  # (first, last, bytes, experts' share, (E, k) of routed rows or None)
    for t in timeline.tensors:
        node = nodes[t.node]
        val = node.meta.get("val")
        val = val[0] if isinstance(val, (list, tuple)) and val else val
        names = carried_params(node)
        if names:
            sizes = [(plan.layout(n).padded_numel, experts.is_expert(n)) for n in names]
            share = sum(s for s, e in sizes if e) / max(1, sum(s for s, _ in sizes))
        else:  # stacked expert weights and their gradients: (E, K, N)
            share = float(isinstance(val, torch.Tensor) and val.ndim == 3
                          and int(val.shape[0]) in counts)
        rows = shape_of_rows.get(int(val.shape[0])) if node.name in routed else None
        priced.append((t.index, t.last_use, t.bytes, share, rows))

    def scale(p: int, share: float, rows) -> float:
        if rows is None:
            return 1 - share + share / p
        e, k = rows
        rows_scale = buffer_rows(tokens, p, e, k, capacity_factor) / (tokens * k)
        return (1 - share + share / p) * rows_scale

    return {p: peak_alive(len(timeline.transient), ((first, last, nbytes * scale(p, share, rows))
                                               for first, last, nbytes, share, rows in priced))
            for p in degrees}


def _routed_rows(gm: GraphModule, rows: set[int]) -> set[str]:
    """Names of the nodes holding the expert computation's routed rows: tensors of T*k rows
    connected to a grouped matmul through such tensors, not across the ops that move rows
    between tokens and routed rows (``_TOKEN_MOVES``)."""
    def has_rows(node) -> bool:
        val = node.meta.get("val")
        return isinstance(val, torch.Tensor) and val.ndim >= 1 and int(val.shape[0]) in rows

    def moves_tokens(node) -> bool:
        return any(word in str(node.target) for word in _TOKEN_MOVES)

    stack = [n for n in gm.graph.nodes if n.op == "call_function"
             and str(n.target).startswith(_GROUPED_MATMULS)]
    seen = {n for n in stack if has_rows(n)}
    while stack:
        node = stack.pop()
        for other in [*node.all_input_nodes, *node.users]:
            if other in seen or other.op != "call_function" or not has_rows(other):
                continue
            seen.add(other)
            if not moves_tokens(other):
                stack.append(other)
    return {n.name for n in seen}
