"""Will it fit? Per-rank memory, traffic and buckets of a model at a world size, before any
memory is spent: the model is built on the meta device, only its shapes are read.

[Note: what the planner counts]
Model states follow ``zero_fx.plan.table.model_state_breakdown``: what zero_fx holds per
rank at the peak of a step, by stage. Under mixed precision that is the ZeRO
paper's table with one difference the planner prints beside it: zero_fx keeps
the gradient the optimizer reads in the master's dtype (fp32; it sums
accumulation steps and unscales fp16 there), where the paper counts fp16
gradients. Stage 3 comes out the same (16Ψ/N: no fp16 parameter shard is kept,
the fp32 master is cast at gather time), and so does stage 1 (its peak is the
whole fp16 gradients at the end of the backward); stage 2 holds 2Ψ/N more, stage
0 2Ψ more (fp32 gradients and masters beside the fp16 parameters).

The step's working set (activations, gathered parameters, gradients before
they are reduced) depends on batch and sequence length. It is the cost model's
memory timeline ([Note: the memory timeline]) of the rewritten step traced on
fake tensors, with three and with four transformer blocks; each further block
adds what the fourth added. The first blocks are not typical: the gather prefetched
into the backward, the reduction still in flight and (with activation recompute) the
block being recomputed are paid once, not per block, and they move the peak. Measured
on a Mixtral-shaped model (width 512, 8 experts, 512 tokens, 8 ranks), the second block
added 138 MiB, the third 97, and every block from the fourth on 41; on a Llama of the
same width 37, then 22.5 from the third on. A model of at most four blocks is traced
whole. The peak estimate is the model states without
their gradients, plus the larger of the working set (which holds the
gradients until they are reduced) and the gradients.

A mixture-of-experts model's states count every expert: each is a parameter, sharded
and stored like any other. Its activations count what a token passes through: the
planner traces the fixed-shape forward zero_fx captures ([Note: routed experts with
fixed shapes]), whose expert matmuls run on the T*k (token, expert) rows of the
block's top-k routing, plus the routing's buffers (router logits, the sorted pairs,
offsets), whatever the number of experts. "Active parameters" are those one token
passes through: all but the routed experts it is not sent to. A model with dense
blocks before its experts (DeepSeek-V3) is traced with one dense block and one and two
blocks with experts, and with two dense blocks: each kind of block grows the working
set at its own rate.

Over several nodes (``--nodes``) the planner sets flat sharding beside hybrid
sharding ([Note: hybrid sharding] in zero_fx/runtime/process_group.py): one replica
per node, sharded over the node's ranks, and fewer replicas of shard groups that
span several nodes. It counts the bytes each rank sends per step on each level. A
ring over ranks on several nodes is as fast as its slowest hop, the network, so
all of its bytes count as crossing nodes: flat's, and a multi-node shard group's.
One replica per node keeps gathers and reduce-scatters within the node, and only
the all-reduce of the gradient shards (2(R-1)/R·Ψ/S elements per rank) crosses.
Hybrid's price is memory: its states are sharded S ways, not N.

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
need the offline trace (zero_fx/plan/offline.py) to build the expert-parallel plan and to
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

import math
import statistics
import time
import re
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch
from torch.fx import GraphModule

from ..analysis.memory_timeline import memory_timeline
from ..config import DEFAULT_BUCKET_BYTES, DEFAULT_PERSISTENCE_THRESHOLD
from .layout import BLOCKS, ShardPlan, plan_for_module
from .models import ModelSource, on_meta
from .table import TRAFFIC_IN_PSI, model_state_breakdown, zero_paper_bytes

GB = 1e9
STEADY_FROM = 3
"""Blocks traced before each further block adds the same memory ([Note: what the planner
counts])."""
OPTIMIZER_BYTES = {"adamw": 8, "sgd-momentum": 4, "sgd": 0}
"""fp32 optimizer state per trainable element."""


@dataclass
class StagePlan:
    stage: int
    states: dict[str, float]
    """Model-state bytes per rank by kind (``model_state_breakdown``)."""
    paper_bytes: float
    traffic: dict[str, int]
    """Bytes each collective kind works on per step (its input or output size per rank)."""
    wire_bytes: float
    """Bytes each rank sends per step over a ring."""

    @property
    def state_bytes(self) -> float:
        return sum(self.states.values())


@dataclass
class LevelRow:
    """One way to lay ranks out over nodes: its model states and what each rank sends."""

    name: str
    state_bytes: float
    within_node: float
    """Bytes each rank sends per step to ranks of its own node."""
    across_nodes: float
    """Bytes each rank sends per step over the network."""
    peak_bytes: Optional[float] = None


@dataclass
class Bucket:
    names: list[str]
    bytes: int


@dataclass
class ExpertBlocks:
    """A mixture-of-experts model's experts (``PlanReport.experts``)."""

    blocks: int
    shapes: list[tuple[int, int, bool]]
    """Distinct (routed experts, top-k, shared expert) of the blocks, in model order."""
    expert_parameters: int
    """Elements of every block's routed experts (all sharded and stored)."""
    active_parameters: int
    """Elements one token passes through: all parameters but the routed experts it is not
    sent to (each block's experts times 1 - top_k / experts)."""
    routed: list[tuple[str, int, int, int]] = field(default_factory=list)
    """Each block: (its experts' module name, routed experts E, top-k, hidden size)."""

    def is_expert(self, name: str) -> bool:
        """Whether parameter ``name`` is a routed expert's, in this model or in one of fewer
        blocks built from the same config (layer indices read as any index)."""
        patterns = {_any_index(prefix) + "." for prefix, *_ in self.routed}
        return _any_index(name).startswith(tuple(patterns))


def _any_index(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".#", name)


def expert_blocks(model: torch.nn.Module) -> Optional[ExpertBlocks]:
    """The mixture-of-experts blocks of ``model`` as zero_fx's capture recognises them
    (zero_fx/capture/routed_experts.py), or None for a dense model."""
    from ..capture.routed_experts import moe_shape

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
    if not blocks:
        return None
    total = sum(p.numel() for p in model.parameters())
    return ExpertBlocks(blocks, shapes, experts_total, total - round(inactive), routed)


@dataclass
class ExpertParallelRow:
    """One degree of expert parallelism, stage 3 ([Note: planning expert parallelism])."""

    degree: int
    working_set: float
    peak_bytes: float
    traffic: dict[str, float]
    """Bytes each kind works on per step per rank: all_gather, reduce_scatter, all_to_all
    (the token side)."""
    wire_bytes: float
    """Bytes each rank sends per step (rings and exchanges)."""
    compute_seconds: float
    collective_seconds: float
    """Gathers and reduce-scatters, one after another (beside compute)."""
    exchange_seconds: float
    """The token exchanges, which nothing hides."""

    @property
    def step_seconds(self) -> float:
        return max(self.compute_seconds, self.collective_seconds) + self.exchange_seconds


@dataclass
class PlanReport:
    model: str
    world_size: int
    stage: int
    dtype: torch.dtype
    optimizer: str
    psi: int
    tensors: int
    padding: int
    stages: list[StagePlan]
    buckets: dict[str, list[Bucket]]
    """Collective kind -> its buckets in the chosen stage (parameter order)."""
    bucket_cap: Union[int, str]
    """Bytes, or ``BLOCKS`` (one bucket per repeated block)."""
    resident: int
    """Stage 3: parameters kept whole through the step (persistence threshold)."""
    working_set: Optional[float] = None
    working_set_how: str = ""
    seconds: float = 0.0
    nodes: int = 1
    levels: Optional[list[LevelRow]] = None
    """With ``nodes`` > 1: flat and hybrid sharding of the chosen stage, side by side."""
    experts: Optional[ExpertBlocks] = None
    """A mixture-of-experts model's experts, None for a dense model."""
    expert_parallel: Optional[list[ExpertParallelRow]] = None
    """With ``expert_parallel`` degrees: each one's peak, bytes and step time."""
    hardware: str = ""
    """The cost model's hardware the step times are for (with ``expert_parallel``)."""
    tokens_per_rank: int = 0
    """Batch times sequence length of the traced working set (0 without ``seq``)."""
    expert_capacity_factor: Optional[float] = None
    """With ``expert_parallel``: the experts' capacity factor the buffers are sized for
    ([Note: expert capacity] in zero_fx/capture/expert_exchange.py); None: the worst case."""

    @property
    def peak_bytes(self) -> Optional[float]:
        """Estimated peak per rank in the chosen stage ([Note: what the planner counts])."""
        if self.working_set is None:
            return None
        return peak_of(self.stages[self.stage].states, self.working_set)


def peak_of(states: dict[str, float], working_set: float) -> float:
    """The peak per rank: the model states without their gradients, plus the larger of the
    working set (which holds the gradients until they are reduced) and the gradients."""
    return sum(states.values()) - states["gradients"] + max(working_set, states["gradients"])


def plan_model(source: ModelSource, *, world_size: int, stage: int = 3,
               dtype: torch.dtype = torch.float32, optimizer: str = "adamw",
               batch: Optional[int] = None, seq: Optional[int] = None,
               recompute: Optional[str] = None,
               activation_memory_budget: Optional[float] = None, nodes: int = 1,
               expert_parallel: Sequence[int] = (), hardware: Optional[str] = None,
               expert_capacity_factor: Optional[float] = None) -> PlanReport:
    """Plan ``source``'s model on ``world_size`` ranks; trace the working set when ``seq`` is
    given, with ``recompute`` (and its budget) as ``zero_compile`` takes them. ``nodes`` > 1:
    also set flat and hybrid sharding side by side ([Note: what the planner counts]).
    ``expert_parallel``: degrees of expert parallelism to compare (stage 3, with ``seq``),
    their step times on ``hardware`` (a cost-model preset; default 8xH100 over NVLink up
    to 8 ranks, nodes of 8 over InfiniBand above; [Note: planning expert parallelism]),
    their buffers of received rows sized by ``expert_capacity_factor`` (None: the worst
    case; [Note: expert capacity] in zero_fx/capture/expert_exchange.py)."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if nodes < 1 or world_size % nodes:
        raise ValueError(f"{world_size} ranks do not split evenly over {nodes} nodes")
    degrees = tuple(dict.fromkeys(expert_parallel))
    if degrees and stage != 3:
        raise ValueError(f"expert parallelism needs stage 3 (it splits the experts' sharded "
                         f"weights over ranks; stages 0-2 keep every parameter whole on every "
                         f"rank), got stage {stage}")
    if degrees and seq is None:
        raise ValueError("expert parallelism is planned from the step's working set: give seq "
                         "(--seq) too")
    start = time.perf_counter()
    model = on_meta(lambda: source.build(None))
    item = dtype.itemsize
    mixed = item < 4

    def plan_over(ranks: int) -> ShardPlan:
        return plan_for_module(model, world_size=ranks, stage=stage,
                               persistence_threshold=DEFAULT_PERSISTENCE_THRESHOLD,
                               bucket_bytes=DEFAULT_BUCKET_BYTES[stage],
                               compute_dtype=dtype if mixed else None,
                               reduce_dtype=dtype if mixed else None)

    plan = plan_over(world_size)
    psi = plan.total_numel
    report = PlanReport(
        model=source.description, world_size=world_size, stage=stage, dtype=dtype,
        optimizer=optimizer, psi=psi, tensors=len(plan.params), padding=plan.padding_numel,
        stages=[_stage_plan(s, plan, item, mixed, optimizer) for s in range(4)],
        buckets=_buckets(plan, item), bucket_cap=plan.bucket_bytes, resident=len(plan.resident),
        experts=expert_blocks(model))
    if degrees:
        _check_degrees(degrees, world_size, report.experts)
        report.hardware = hardware or ("8xh100-nvlink" if world_size <= 8 else "4x8xh100-ib")
        report.expert_capacity_factor = expert_capacity_factor
    if seq is not None:
        report.tokens_per_rank = (batch or 1) * seq
        traced, report.working_set_how = _working_set(
            source, world_size=world_size, stage=stage, dtype=dtype, batch=batch or 1, seq=seq,
            recompute={"recompute": recompute, **_budget_option(activation_memory_budget)},
            experts=report.experts if degrees else None, degrees=degrees,
            hardware=report.hardware, capacity_factor=expert_capacity_factor)
        report.working_set = traced[1]
        if degrees:
            report.expert_parallel = [
                _expert_parallel_row(report, plan, p, traced, (batch or 1) * seq)
                for p in degrees]
    if nodes > 1:
        report.nodes = nodes
        report.levels = _levels(report, plan_over, nodes, item, mixed)
    report.seconds = time.perf_counter() - start
    return report


def _check_degrees(degrees: Sequence[int], world_size: int,
                   experts: Optional[ExpertBlocks]) -> None:
    if experts is None:
        raise ValueError("expert parallelism splits mixture-of-experts blocks, and this model "
                         "has none")
    counts = sorted({e for _, e, _, _ in experts.routed})
    for p in degrees:
        if p < 1 or world_size % p or any(e % p for e in counts):
            raise ValueError(f"expert parallelism of degree {p} must divide the {world_size} "
                             f"ranks and the {'/'.join(map(str, counts))} experts of a block")


def _expert_parallel_row(report: PlanReport, plan: ShardPlan, degree: int, traced: dict,
                         tokens: int) -> ExpertParallelRow:
    """Degree ``degree``'s bytes and time, and its peak from the re-priced working set
    ([Note: planning expert parallelism])."""
    from ..analysis.cost_model import all_to_all_seconds, hardware, ring_seconds

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


def _buffer_rows(tokens: int, degree: int, experts: int, top_k: int,
                 capacity_factor: Optional[float]) -> int:
    """A rank's rows of the expert computation: its T*k without expert parallelism, else
    the buffer of received rows ([Note: expert capacity])."""
    from ..capture.expert_exchange import received_rows

    if degree == 1:
        return tokens * top_k
    return received_rows(tokens, degree, experts, top_k, capacity_factor)


def _peaks_by_degree(gm: GraphModule, plan: ShardPlan, experts: ExpertBlocks, tokens: int,
                     degrees: Sequence[int], capacity_factor: Optional[float] = None
                     ) -> dict[int, float]:
    """The working set of ``gm`` (traced without expert parallelism) priced again for each
    degree ([Note: planning expert parallelism])."""
    from ..passes.predicates import carried_params

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
    peaks = {}
    for p in degrees:
        change = [0.0] * (len(timeline.transient) + 1)
        for first, last, nbytes, share, rows in priced:
            scale = 1 - share + share / p
            if rows is not None:
                e, k = rows
                scale *= _buffer_rows(tokens, p, e, k, capacity_factor) / (tokens * k)
            change[first] += nbytes * scale
            change[last + 1] -= nbytes * scale
        alive, peak = 0.0, 0.0
        for delta in change[:-1]:
            alive += delta
            peak = max(peak, alive)
        peaks[p] = peak
    return peaks


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


def _levels(report: PlanReport, plan_over, nodes: int, item: int, mixed: bool) -> list[LevelRow]:
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
        hybrid = _stage_plan(stage, plan, item, mixed, report.optimizer)
        trainable = sum(layout.shard_numel for layout in plan.params if layout.requires_grad)
        all_reduce = 2 * (r - 1) / r * trainable * item
        on_one_node = r == nodes  # else the shard group's ring crosses nodes too
        rows.append(LevelRow(
            f"hybrid: {r} replicas x {plan.world_size} ranks"
            + ("" if on_one_node else f" ({nodes // r} nodes each)"), hybrid.state_bytes,
            hybrid.wire_bytes if on_one_node else 0.0,
            all_reduce + (0.0 if on_one_node else hybrid.wire_bytes), peak(hybrid.states)))
    return rows


def _stage_plan(stage: int, plan: ShardPlan, item: int, mixed: bool, optimizer: str) -> StagePlan:
    psi, n = plan.total_numel, plan.world_size
    states = model_state_breakdown(stage, psi, n, optimizer_bytes=OPTIMIZER_BYTES[optimizer],
                                   param_bytes=item, reduce_bytes=item)
    padded = sum(layout.padded_numel for layout in plan.params)
    resident = sum(plan.layout(name).padded_numel for name in plan.resident) if stage == 3 else 0
    elements = {"all_reduce": psi * TRAFFIC_IN_PSI[stage].get("all_reduce", 0),
                "reduce_scatter": padded * TRAFFIC_IN_PSI[stage].get("reduce_scatter", 0),
                # stage 3's second gather (backward) leaves resident parameters out
                "all_gather": padded * TRAFFIC_IN_PSI[stage].get("all_gather", 0) - resident}
    traffic = {kind: count * item for kind, count in elements.items() if count}
    ring = (n - 1) / n
    wire = sum(size * ring * (2 if kind == "all_reduce" else 1) for kind, size in traffic.items())
    paper = zero_paper_bytes(stage, psi, n) if mixed else float("nan")
    return StagePlan(stage=stage, states=states, paper_bytes=paper, traffic=traffic,
                     wire_bytes=wire)


def _buckets(plan: ShardPlan, item: int) -> dict[str, list[Bucket]]:
    """The chosen stage's fused collectives, cut from parameters in their order (the passes
    cut them in order of use, which for a transformer is the same blocks)."""
    names = [layout.name for layout in plan.params]
    trainable = [layout.name for layout in plan.params if layout.requires_grad]

    def cut(chosen):
        return [Bucket(b, sum(plan.layout(x).padded_numel for x in b) * item)
                for b in plan.buckets(chosen)]

    if plan.replicated:
        return {"all_reduce": cut(trainable)}
    gathered = [x for x in names if x not in plan.resident]
    return {"reduce_scatter": cut(trainable), "all_gather": cut(gathered)}


def _working_set(source: ModelSource, *, world_size: int, stage: int, dtype: torch.dtype,
                 batch: int, seq: int, recompute: dict, experts: Optional[ExpertBlocks] = None,
                 degrees: Sequence[int] = (), hardware: str = "",
                 capacity_factor: Optional[float] = None) -> tuple[dict, str]:
    """The working set extrapolated to the model's depth, ``{1: bytes}``; with ``experts``,
    also each degree of ``degrees`` and the cost model's ``"compute"`` seconds on
    ``hardware`` ([Note: planning expert parallelism])."""
    from ..plan.offline import rewritten_step_on_fake  # traces through the passes: import on use

    def traced_peak(layers: Optional[int], dense_layers: Optional[int] = None) -> dict:
        build = ((lambda: source.build(layers)) if dense_layers is None
                 else (lambda: source.build(layers, dense_layers)))
        gm, plan = rewritten_step_on_fake(
            build, batch=batch, seq=seq, vocab_size=source.vocab_size,
            world_size=world_size, stage=stage, dtype=dtype, loss_fn=_causal_lm_loss, **recompute)
        if experts is None:
            return {1: float(max(memory_timeline(gm).transient))}
        from ..analysis.cost_model import replay

        out: dict = _peaks_by_degree(gm, plan, experts, batch * seq, sorted({1, *degrees}),
                                     capacity_factor)
        out["compute"] = replay(gm, plan, hardware).estimate.compute_seconds
        return out

    def grow(base: dict, *more: tuple[int, dict]) -> dict:  # base + n x (traced - base), by key
        return {key: base[key] + sum(n * (t[key] - base[key]) for n, t in more) for key in base}

    if source.vocab_size is None:
        raise SystemExit("the model has no nn.Embedding to read a vocabulary size from")
    if source.max_positions is not None and seq > source.max_positions:
        raise SystemExit(f"--seq {seq} is longer than the model's {source.max_positions} positions")
    chosen = recompute["recompute"] or ("auto" if len(recompute) > 1 else None)
    if source.layers is None or source.layers <= STEADY_FROM + 1:
        return traced_peak(None), (f"batch {batch} x {seq} tokens per rank, recompute "
                                   f"{chosen or 'none'}; traced whole")
    dense = source.dense_layers
    first = STEADY_FROM  # [Note: what the planner counts]
    if 0 < dense < source.layers and source.layers - dense > STEADY_FROM:
        # dense blocks, then blocks with experts: each kind grows at its own rate
        moe = source.layers - dense
        base = traced_peak(1 + first, 1)
        more_moe = traced_peak(2 + first, 1)
        more_dense = traced_peak(2 + first, 2) if dense > 1 else base
        total = grow(base, (moe - first, more_moe), (dense - 1, more_dense))
        per_moe, per_dense = more_moe[1] - base[1], more_dense[1] - base[1]
        how = (f"batch {batch} x {seq} tokens per rank, recompute {chosen or 'none'}; traced "
               f"with 1 dense and {first} expert blocks, then one more of each, of {dense} dense "
               f"and {moe} expert blocks on fake tensors: {base[1] / GB:.2f} GB + {moe - first} x "
               f"{per_moe / GB:.3f} GB + {dense - 1} x {per_dense / GB:.3f} GB")
        return total, how
    base, grown = traced_peak(first), traced_peak(first + 1)
    total = grow(base, (source.layers - first, grown))
    how = (f"batch {batch} x {seq} tokens per rank, recompute {chosen or 'none'}; "
           f"traced with {first} and {first + 1} of {source.layers} blocks on fake tensors: "
           f"{base[1] / GB:.2f} GB + {source.layers - first} x {(grown[1] - base[1]) / GB:.3f} GB")
    return total, how


def _causal_lm_loss(model, tokens, targets):
    out = model(tokens)
    logits = getattr(out, "logits", out)  # HuggingFace returns an output object
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# -- printing -------------------------------------------------------------------------------


def format_report(report: PlanReport, *, device_memory_gb: Optional[float] = None,
                  all_buckets: bool = False) -> str:
    n = report.world_size
    dtype = str(report.dtype).removeprefix("torch.")
    precision = (f"{dtype} compute, fp32 masters" if report.dtype.itemsize < 4 else f"{dtype}")
    lines = [
        f"zero_fx plan: {report.model} on {n} ranks, {precision}, {report.optimizer}",
        f"{report.psi / 1e9:.3f}B parameters (Ψ) in {report.tensors} tensors; padding to {n} "
        f"ranks adds {report.padding:,} elements. Planned in {report.seconds:.1f} s. "
        "GB = 10^9 bytes.",
        *_format_experts(report),
        "",
        "Model states per rank at the peak of a step (parameters, gradients, masters, optimizer):",
        "",
        "| stage | parameters | gradients | fp32 masters | optimizer | total | ZeRO paper (2+2+12)Ψ |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in report.stages:
        mark = " ←" if s.stage == report.stage else ""
        paper = "" if math.isnan(s.paper_bytes) else _three_digits(s.paper_bytes / GB)
        lines.append(f"| {s.stage}{mark} | " + " | ".join(
            f"{s.states[k] / GB:.2f}" for k in ("parameters", "gradients", "masters", "optimizer"))
            + f" | **{s.state_bytes / GB:.2f}** | {paper} |")
    if report.dtype.itemsize < 4:
        lines += ["", "The paper counts 2-byte gradients; zero_fx keeps the gradient the optimizer "
                  "reads in fp32: 2Ψ/N more in stage 2, 2Ψ more in stage 0, the same in stages 1 "
                  "and 3."]
    lines += ["", f"Traffic per step per rank ({dtype} collectives; stage 3's all-gather counts "
              "the backward's re-gather, an upper bound):", "",
              "| stage | all-reduce | reduce-scatter | all-gather | sent over a ring | in Ψ |",
              "|---|---|---|---|---|---|"]
    for s in report.stages:
        cells = [f"{s.traffic[k] / GB:.2f}" if k in s.traffic else "—"
                 for k in ("all_reduce", "reduce_scatter", "all_gather")]
        in_psi = sum(s.traffic.values()) / (report.psi * report.dtype.itemsize)
        lines.append(f"| {s.stage} | " + " | ".join(cells) + f" | {s.wire_bytes / GB:.2f} | "
                     f"{in_psi:.2f} |")
    cut = ("one per repeated block" if report.bucket_cap == BLOCKS
           else f"cap {report.bucket_cap / 2**20:.0f} MiB")
    lines += ["", f"Buckets in stage {report.stage} ({cut}"
              + (f"; {report.resident} small parameters stay resident" if report.stage == 3 else "")
              + "):"]
    for kind, buckets in report.buckets.items():
        sizes = [b.bytes for b in buckets]
        if not sizes:  # every parameter resident
            lines.append(f"- {kind}: none")
            continue
        lines.append(f"- {kind}: {len(buckets)} buckets, {min(sizes) / 2**20:.1f} / "
                     f"{statistics.median(sizes) / 2**20:.1f} / {max(sizes) / 2**20:.1f} MiB "
                     "(smallest / median / largest)")
        shown = buckets if all_buckets else buckets[:3]
        for b in shown:
            lines.append(f"    {b.bytes / 2**20:8.1f} MiB  {b.names[0]}"
                         + (f" … {b.names[-1]} ({len(b.names)})" if len(b.names) > 1 else ""))
        if len(shown) < len(buckets):
            lines.append(f"    … {len(buckets) - len(shown)} more (--buckets lists them all)")
    if report.levels:
        lines += ["", *_format_levels(report)]
    lines.append("")
    if report.working_set is None:
        lines.append("Working set: give --seq (and --batch) to trace activations on fake tensors.")
    else:
        peak = report.peak_bytes
        lines += [f"Step working set (activations, gathered parameters, gradients before they are "
                  f"reduced), stage {report.stage}: {report.working_set / GB:.2f} GB",
                  f"    ({report.working_set_how})",
                  f"Estimated peak per rank, stage {report.stage}: {peak / GB:.2f} GB"]
        if device_memory_gb is not None:
            verdict = "fits" if peak <= device_memory_gb * GB else "does NOT fit"
            lines.append(f"    {verdict} in {device_memory_gb:g} GB per device")
    if report.expert_parallel:
        lines += ["", *_format_expert_parallel(report, device_memory_gb)]
    if device_memory_gb is not None and report.working_set is None:
        fitting = [s.stage for s in report.stages if s.state_bytes <= device_memory_gb * GB]
        lines.append(f"Model states fit in {device_memory_gb:g} GB in stages: "
                     f"{', '.join(map(str, fitting)) or 'none'} (activations not counted)")
    return "\n".join(lines)


def _format_experts(report: PlanReport) -> list[str]:
    e = report.experts
    if e is None:
        return []
    shapes = "; ".join(f"{n} experts, top-{k}" + (" + a shared expert" if shared else "")
                       for n, k, shared in e.shapes)
    return [f"Mixture of experts: {e.blocks} blocks of {shapes}. {e.expert_parameters / 1e9:.3f}B "
            f"expert parameters, all sharded and stored; {e.active_parameters / 1e9:.3f}B "
            "parameters active per token (activations count each token's top-k experts)."]


def _format_expert_parallel(report: PlanReport, device_memory_gb: Optional[float]) -> list[str]:
    e = report.experts
    counts = "/".join(str(n) for n in sorted({n for _, n, _, _ in e.routed}))
    tokens = report.working_set_how.split(" tokens")[0].removeprefix("batch ")
    lines = [f"Expert parallelism, stage {report.stage} (a block's {counts} experts split over P "
             f"ranks; per rank per step; times on {report.hardware}; [Note: planning expert "
             "parallelism] in zero_fx/plan/planner.py):", "",
             "| P | experts gathered per block | expert rows per block | working set | "
             "estimated peak per rank | all-gather + reduce-scatter | all-to-all | sent per rank "
             "| step (compute, collectives, exchanges) |",
             "|---|---|---|---|---|---|---|---|---|"]
    _, n, k, _ = e.routed[-1]
    t = report.tokens_per_rank
    for row in report.expert_parallel:
        p = row.degree
        rows = f"{_buffer_rows(t, p, n, k, report.expert_capacity_factor) / t:g}T"
        fits = ("" if device_memory_gb is None else
                " (fits)" if row.peak_bytes <= device_memory_gb * GB else " (does NOT fit)")
        lines.append(
            f"| {p} | {n // p} | {rows} | {row.working_set / GB:.2f} GB | "
            f"{row.peak_bytes / GB:.2f} GB{fits} | "
            f"{(row.traffic['all_gather'] + row.traffic['reduce_scatter']) / GB:.2f} GB | "
            f"{row.traffic['all_to_all'] / GB:.2f} GB | {row.wire_bytes / GB:.2f} GB | "
            f"{1e3 * row.step_seconds:.0f} ms ({1e3 * row.compute_seconds:.0f}, "
            f"{1e3 * row.collective_seconds:.0f}, {1e3 * row.exchange_seconds:.1f}) |")
    buffer = ("the worst case, P·T·min(k, E/P) rows" if report.expert_capacity_factor is None
              else f"the experts' capacity at expert_capacity_factor "
                   f"{report.expert_capacity_factor:g}, about {report.expert_capacity_factor:g}"
                   f"·T·k rows (rows past it dropped)")
    lines.append(f"T = {tokens} tokens per rank. Model states are the same for every P. The "
                 f"buffer of received rows is {buffer}; all-to-all "
                 "counts the token side, 4 exchanges of T·k rows per block, of which a rank "
                 "sends (P-1)/P. The step is max(compute, collectives) + exchanges.")
    return lines


def _format_levels(report: PlanReport) -> list[str]:
    per_node = report.world_size // report.nodes
    lines = [f"Flat or hybrid over {report.nodes} nodes of {per_node} ranks, stage {report.stage} "
             "(bytes each rank sends per step; a ring over ranks on several nodes runs at the "
             "network's speed, so all of its bytes count as crossing):", "",
             "| sharding | model states per rank | estimated peak per rank | sent within a node "
             "| sent across nodes |", "|---|---|---|---|---|"]
    for row in report.levels:
        peak = "—" if row.peak_bytes is None else f"{row.peak_bytes / GB:.2f} GB"
        lines.append(f"| {row.name} | {row.state_bytes / GB:.2f} GB | {peak} | "
                     f"{row.within_node / GB:.2f} GB | {row.across_nodes / GB:.2f} GB |")
    if report.stage == 0:
        lines.append("Stage 0 shards nothing: a mesh changes nothing (one all-reduce over every rank).")
    elif len(report.levels) > 1:
        flat, one_per_node = report.levels[:2]
        lines.append(f"One replica per node sends {flat.across_nodes / one_per_node.across_nodes:.1f}x "
                     f"fewer bytes across nodes than flat, for "
                     f"{(one_per_node.state_bytes - flat.state_bytes) / GB:.2f} GB more states "
                     "per rank.")
    return lines


def _three_digits(x: float) -> str:
    """120, 31.4, 16.6, 1.88: three significant digits, as the ZeRO paper prints them."""
    decimals = max(0, 2 - math.floor(math.log10(abs(x)))) if x else 0
    return f"{x:.{decimals}f}"


def _budget_option(budget: Optional[float]) -> dict:
    """``--activation-budget`` (a fraction when <= 1, else bytes) as zero_compile's option."""
    if budget is None:
        return {}
    return ({"activation_budget_fraction": budget} if budget <= 1
            else {"activation_budget_bytes": int(budget)})
