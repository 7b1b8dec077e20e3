"""``explain``: what zero_fx did to a step, in one report a person reads top to bottom.

The plan (ranks, shards, padding, buckets), every collective with where it is
issued and waited and the compute that can hide it, where each gathered
parameter lives, the estimated memory over the step with what is alive at its
peak, and the compilations so far with the reason for each. Everything is read
off the rewritten graph and the plan; times and bytes are the cost model's
([Note: the cost model], [Note: the memory timeline]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from torch.fx import GraphModule

from ..analysis.cost_model import CollectiveTiming, Estimate, replay
from ..analysis.memory_timeline import MemoryTimeline, tensor_bytes
from ..analysis.traffic import ACROSS_NODES, NODE_GROUP, REPLICATE_GROUP
from ..capture.graph_breaks import GraphBreak
from ..capture.routed_experts import RoutedExperts
from ..formatting import format_bytes, format_seconds, short_dtype
from ..passes.common.host_copies import (is_device_copy, is_device_copy_wait, is_host_copy,
                                         reduction_read_by)
from ..passes.common.predicates import (carried_params, gathered_param, is_anchor_compute, is_wait,
                                        kept_through_loss, readers_through_views)
from ..passes.recompute_activations import RECOMPUTE_META, RecomputeSummary
from ..plan.layout import BLOCKS

if TYPE_CHECKING:  # a type for annotations only: the compiler sits above inspection/
    from ..compiler.backend import Compilation

LIVE_AT_PEAK_SHOWN = 8
SPARKLINE_WIDTH = 64
_BARS = " ▁▂▃▄▅▆▇█"


@dataclass(frozen=True)
class GatheredLifetime:
    """Where one full (gathered) parameter lives in the step."""

    param: str
    phase: str
    ready_at: int
    """The node that yields the full parameter."""
    first_use: int
    last_use: int
    released_after: int
    """The last reader of its memory (for a bucket of one: of the gathered buffer)."""
    released_node: str
    bytes: int
    kept: str = ""
    """Why a forward gather lives on into the backward: "resident", "through the loss"
    ([Note: a weight kept through the loss]); "" for a gather released in its phase."""


@dataclass(frozen=True)
class HostCopy:
    """One bucket's gradient shard streamed to the host in the graph ([Note: gradients
    streamed to the host] in passes/common/host_copies.py)."""

    bucket: tuple[str, ...]
    bytes: int
    at: int
    """The copy's node index."""
    after_wait: Optional[int]
    """The node index of the reduction's wait it follows (None: one rank, no collective)."""
    compute_after: int
    """Matmuls, attention and convolutions the graph runs after it: what hides the copy."""


@dataclass(frozen=True)
class DeviceCopy:
    """One bucket's shards brought from the host before its all-gather (offload="parameters",
    [Note: shards brought from the host] in passes/common/host_copies.py)."""

    bucket: tuple[str, ...]
    bytes: int
    at: int
    """The copy's node index: where it is issued."""
    waited: int
    """The node index of its wait, where the compute stream waits for it (its gather's)."""
    compute_between: int
    """Matmuls, attention and convolutions the graph runs between the two: what hides it."""


@dataclass(frozen=True)
class Explanation:
    """The report ``explain`` returns: print it, or read its fields."""

    title: str
    plan: object
    """The ShardPlan."""
    timings: tuple[CollectiveTiming, ...]
    lifetimes: tuple[GatheredLifetime, ...]
    memory: MemoryTimeline
    estimate: Estimate
    compilations: tuple[Compilation, ...]
    recompute: Optional[RecomputeSummary] = None
    """What ``recompute_activations`` recomputed and the memory it saves; None: nothing."""
    moe_blocks: tuple[RoutedExperts, ...] = ()
    """The mixture-of-experts blocks capture rewrote to fixed shapes (``step.moe_blocks``)."""
    host_copies: tuple[HostCopy, ...] = ()
    """The gradient shards the graph streams to the host (offload "optimizer", "parameters")."""
    device_copies: tuple[DeviceCopy, ...] = ()
    """The buckets of shards the graph brings from the host (offload="parameters")."""
    offload_choice: Optional[object] = None
    """With ``offload="auto"``: each mode's device bytes and the verdict (an
    ``OffloadChoice``, [Note: choosing what to offload])."""

    def __str__(self) -> str:
        plan = _plan_section(self.plan, self.moe_blocks)
        if self.offload_choice is not None:
            plan += "\n" + "\n".join(self.offload_choice.lines())
        sections = [self.title, plan,
                    _collectives_section(self), _host_copies_section(self.host_copies),
                    _device_copies_section(self.device_copies),
                    _lifetimes_section(self),
                    _memory_section(self.memory, self.compilations, self.recompute),
                    f"Estimate\n  {self.estimate}", _compilations_section(self.compilations)]
        return "\n\n".join(s for s in sections if s) + "\n"


def explain_graph(gm: GraphModule, plan, *, hardware="cpu-gloo", title: str = "",
                  compilations: Sequence[Compilation] = (),
                  moe_blocks: Sequence[RoutedExperts] = (),
                  offload_choice: Optional[object] = None) -> Explanation:
    """The explanation of ``gm``, a graph our passes rewrote for ``plan`` (from a compiled
    step's ``graphs``, or from ``rewritten_step_on_fake``); ``moe_blocks``: the model's
    mixture-of-experts blocks (``step.moe_blocks``), listed under the plan."""
    replayed = replay(gm, plan, hardware)
    memory = replayed.memory
    return Explanation(
        title=title or f"zero_fx explain: stage {plan.stage} over {plan.world_size} rank(s)",
        plan=plan,
        timings=replayed.timings,
        lifetimes=tuple(_lifetimes(gm, plan, memory)),
        memory=memory,
        estimate=replayed.estimate,
        compilations=tuple(compilations),
        recompute=gm.meta.get(RECOMPUTE_META),
        moe_blocks=tuple(moe_blocks),
        host_copies=tuple(_host_copies(gm)),
        device_copies=tuple(_device_copies(gm)),
        offload_choice=offload_choice,
    )


def _host_copies(gm: GraphModule) -> list[HostCopy]:
    nodes = list(gm.graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    compute_after = [0] * (len(nodes) + 1)
    for i in range(len(nodes) - 1, -1, -1):
        compute_after[i] = compute_after[i + 1] + is_anchor_compute(nodes[i])
    copies = []
    for node in nodes:
        if is_host_copy(node):
            waits = [order[n] for n in reduction_read_by(node) if is_wait(n)]
            copies.append(HostCopy(bucket=carried_params(node), bytes=tensor_bytes(node.meta.get("val")),
                                   at=order[node], after_wait=max(waits, default=None),
                                   compute_after=compute_after[order[node]]))
    return copies


def _device_copies(gm: GraphModule) -> list[DeviceCopy]:
    nodes = list(gm.graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    compute_before = [0]
    for node in nodes:
        compute_before.append(compute_before[-1] + is_anchor_compute(node))
    copies = []
    for node in nodes:
        if is_device_copy(node):
            wait = min((order[u] for u in node.users if is_device_copy_wait(u)), default=order[node])
            copies.append(DeviceCopy(bucket=carried_params(node),
                                     bytes=tensor_bytes(node.meta.get("val")), at=order[node],
                                     waited=wait,
                                     compute_between=compute_before[wait] - compute_before[order[node]]))
    return copies


def _lifetimes(gm: GraphModule, plan, memory: MemoryTimeline) -> list[GatheredLifetime]:
    kept = {**{name: "through the loss" for name in kept_through_loss(gm)},
            **{name: "resident" for name in plan.resident}}
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    buffers = {t.node: t for t in memory.tensors}
    names = list(memory.node_names)
    lifetimes = []
    for node in gm.graph.nodes:
        gathered = gathered_param(node)
        if not gathered:
            continue
        readers = readers_through_views(node)
        uses = sorted(order[r] for r in readers) or [order[node]]
        buffer = buffers.get(memory.buffer_of.get(node.name, node.name))
        released = buffer.last_use if buffer else uses[-1]
        val = node.meta["val"]
        lifetimes.append(GatheredLifetime(
            param=gathered[0], phase=gathered[1].value, ready_at=order[node], first_use=uses[0],
            last_use=uses[-1], released_after=released, released_node=names[released],
            bytes=tensor_bytes(val), kept=kept.get(gathered[0], "")))
    return lifetimes


# -- rendering ---------------------------------------------------------------------------

def _moe_lines(plan, moe_blocks: Sequence[RoutedExperts]) -> list[str]:
    """One line per distinct shape of mixture-of-experts block ([Note: routed experts with
    fixed shapes]); then, under expert parallelism, which experts this rank runs."""
    shapes: dict[tuple, list[str]] = {}
    for b in moe_blocks:
        shapes.setdefault((b.num_experts, b.top_k, b.routing, b.expert_parameters,
                           b.shared_expert), []).append(b.name)
    lines = []
    for (experts, top_k, routing, numel, shared), names in shapes.items():
        inside = [l.name for l in plan.params if l.name.startswith(f"{names[0]}.")]
        held = ("whole on every rank" if not plan.params_sharded
                else "resident (gathered once per step)"
                if inside and all(n in plan.resident for n in inside)
                else "gathered with their block's bucket" if plan.bucket_bytes == BLOCKS
                else "gathered in the buckets of their block's parameters")
        which = names[0] if len(names) == 1 else (
            f"{names[0]}, {names[1]}" if len(names) == 2 else f"{names[0]} … {names[-1]}")
        lines.append(
            f"  mixture of experts: {len(names)} block{'s' if len(names) > 1 else ''} ({which}): "
            f"{experts} experts, top-{top_k}, routed by {routing}"
            + (f", shared expert {shared!r}" if shared else "")
            + f"; {numel:,} expert parameters each, {held}; each token's rows run through its "
              f"top-{top_k} experts only, in fixed shapes")
    parallel = plan.expert_parallel
    if parallel is not None and moe_blocks:
        local = moe_blocks[0].num_experts // parallel.degree
        first = parallel.rank * local
        lines.append(
            f"  expert parallelism {parallel.degree}: this rank runs experts {first}-"
            f"{first + local - 1} of each block, and sends each token's rows to the rank of its "
            f"experts and back (all_to_all over its {parallel.degree} ranks, group "
            f"{parallel.group_name!r}); its experts' weights are sharded over the "
            f"{parallel.data_size} rank(s) that hold the same experts (group "
            f"{parallel.data_group_name!r}); every other parameter over all {plan.world_size}"
            + ("" if parallel.capacity_factor is None else
               f"; each expert takes at most {parallel.capacity_factor:g}x an even spread's "
               f"rows (expert_capacity_factor), the rest dropped"))
    return lines


def _tensor_parallel_lines(plan) -> list[str]:
    """What tensor parallelism changed ([Note: ZeRO over tensor parallelism])."""
    parallel = plan.tensor_parallel
    if parallel is None:
        return []
    split = len(parallel.specs) - len(parallel.replicated & parallel.specs.keys())
    return [f"  tensor parallel: the model's layers split over {parallel.degree} ranks (group "
            f"{parallel.group_name!r}, this rank {parallel.rank}); shapes above are this rank's "
            f"pieces: {split} parameters split, {len(parallel.replicated)} whole on every tp "
            f"rank; DTensor's tp collectives stay in the step where its placements put them"]


def _quantization_lines(plan) -> list[str]:
    """What ``quantize_collectives`` moves quantized ([Note: quantized blocks on the wire])."""
    forward, backward = getattr(plan, "quantize_weights", (None, None))
    gradients = getattr(plan, "quantize_gradients", None)
    if not (forward or backward or gradients):
        return []
    parts = []
    if forward or backward:
        parts.append("gathers " + (forward if forward == backward else
                                   f"{forward or 'unquantized'} in the forward, "
                                   f"{backward or 'unquantized'} in the backward"))
    if gradients:
        parts.append(f"reductions {gradients} by all-to-all, summed in fp32"
                     + (" (across replicas too, where it moves fewer bytes)"
                        if plan.replicas > 1 else ""))
    return [f"  quantized communication: {'; '.join(parts)}; blocks of {plan.quantize_block} "
            f"elements with an fp32 scale each; masters and shards in full precision "
            f"([Note: quantized blocks on the wire])"]


def _plan_section(plan, moe_blocks: Sequence[RoutedExperts] = ()) -> str:
    lines = ["Plan"]
    dtypes = sorted({short_dtype(l.dtype) for l in plan.params})
    if plan.replicated:
        lines.append(f"  {plan.world_size} rank(s), group {plan.group_name!r}; stage 0 keeps every "
                     f"parameter whole on every rank (Ψ = {plan.total_numel:,}, {'/'.join(dtypes)})")
    else:
        lines.append(
            f"  {plan.world_size} rank(s), group {plan.group_name!r}; Ψ = {plan.total_numel:,} "
            f"parameters in {len(plan.params)} tensors ({'/'.join(dtypes)}); each rank holds "
            f"{plan.shard_numel:,} elements ({plan.padding_numel:,} of padding in all)")
        if plan.replicas > 1:
            lines.append(f"  hybrid sharding: {plan.replicas} replicas of these {plan.world_size} "
                         f"ranks (group {plan.replicate_group_name!r}); each reduced gradient shard "
                         f"is all-reduced across them, the only traffic between replicas")
        secondary = getattr(plan, "secondary", None)
        if secondary is not None:
            lines.append(
                f"  secondary partition: {secondary.nodes} nodes of {secondary.size} ranks; the "
                f"forward gathers across nodes (group {secondary.across_group_name!r}), keeping "
                f"1/{secondary.size} of each parameter, then within the node (group "
                f"{secondary.node_group_name!r}); the backward gathers within the node only")
    lines += _tensor_parallel_lines(plan)
    lines.append("  buckets: one per repeated block (bucket_bytes='blocks')" if plan.bucket_bytes == BLOCKS
                 else f"  buckets of at most {format_bytes(plan.bucket_bytes)}"
                 if plan.bucket_bytes else "  one collective per parameter (bucket_bytes=0)")
    lines[-1] += (f", prefetch_buckets {plan.prefetch}, max_gathered_bytes "
                  f"{format_bytes(plan.memory_budget_bytes) if plan.memory_budget_bytes else 'none'}")
    if plan.compute_dtype is not None:
        lines.append(f"  mixed precision: compute and gather {short_dtype(plan.compute_dtype)}, reduce "
                     f"{short_dtype(plan.reduce_dtype or plan.compute_dtype)}, masters and optimizer "
                     f"state {'/'.join(dtypes)}" + (", loss scaled" if plan.loss_scaled else ""))
    lines += _quantization_lines(plan)
    if getattr(plan, "offloads_optimizer", False):
        lines.append("  offload: the fp32 masters and the optimizer's state in host memory, where "
                     "the optimizer steps; each gradient shard streams to the host in the graph "
                     "as soon as it is reduced (below), each updated parameter comes back after the "
                     "optimizer's step"
                     + (" into its host shard in the compute dtype, the graph's input, copied "
                        "to the device bucket by bucket before each all-gather, issued one bucket "
                        "ahead of it (with the previous gather, where the prefetch allows), so the "
                        "copy can run during the compute between the two (offload='parameters', "
                        "[Note: shards brought from the host])" if plan.offloads_parameters
                        else " into its device shard in the compute dtype, the graph's input"
                        if plan.params_sharded else ", gathered into the whole parameters")
                     + " ([Note: optimizer offload])")
        if plan.offload_step == "overlap":
            lines.append("  delayed update (offload_step='overlap'): each optimizer step runs on "
                         "the host while the next call's forward and backward run, on parameters "
                         "one step stale ([Note: the delayed update])")
    if plan.accumulation_steps > 1:
        where = ("summed whole and reduced once per optimizer step, outside the graph"
                 if not plan.reduces_in_graph else "reduced every call, shards summed")
        lines.append(f"  gradient accumulation: {plan.accumulation_steps} calls per optimizer "
                     f"step; gradients {where}")
    if plan.params_sharded:
        lines.append(f"  resident (gathered once per step): {len(plan.resident)} parameters, "
                     f"{sum(plan.layout(n).numel for n in plan.resident):,} elements")
    lines += _moe_lines(plan, moe_blocks)
    width = max((len(l.name) for l in plan.params), default=9)
    lines.append(f"  {'parameter':<{width}}  {'shape':<16} {'elements':>11} {'per rank':>10} "
                 f"{'padding':>8}")
    for l in plan.params:
        shape = "[" + ", ".join(map(str, l.shape)) + "]"
        per_rank = l.numel if plan.replicated else l.shard_numel
        flag = ("  resident" if l.name in plan.resident else "") + ("" if l.requires_grad else "  frozen")
        lines.append(f"  {l.name:<{width}}  {shape:<16} {l.numel:>11,} {per_rank:>10,} "
                     f"{0 if plan.replicated else l.padding:>8,}{flag}")
    return "\n".join(lines)


def _collectives_section(e: Explanation) -> str:
    lines = [f"Collectives per step, in issue order ({len(e.timings)} launches; times on "
             f"{e.estimate.hardware.split(':')[0]})"]
    if not e.timings:
        lines.append("  none (one rank)")
        return "\n".join(lines)
    lines.append(f"  {'#':>3}  {'kind':<14} {'bytes':>10}  {'phase':<10} {'issued':>6} "
                 f"{'waited':>6}  {'compute between':>22}  {'exposed':>9}  bucket")
    for i, t in enumerate(e.timings):
        c = t.collective
        between = (f"{t.ops_between} ops, {format_seconds(t.compute_between)}"
                   if c.issued_at is not None else "-")
        lines.append(
            f"  {i:>3}  {c.kind:<14} {format_bytes(c.bytes):>10}  {c.phase:<10} "
            f"{_at(c.issued_at):>6} {_at(c.waited_at):>6}  {between:>22}  "
            f"{format_seconds(t.exposed):>9}  {_bucket(c.bucket)}"
            + (" (across replicas)" if c.group == REPLICATE_GROUP else
               f" ({c.group})" if c.group in (NODE_GROUP, ACROSS_NODES) else ""))
    lines.append("  issued/waited: node index in the rewritten graph (see the graph dump); "
                 "exposed: time compute loses to it (waiting, or sharing its core)")
    order = e.compilations[-1].order if e.compilations else None
    if order is not None:
        lines.append(f"  as lowered: {order}")
    return "\n".join(lines)


def _host_copies_section(copies: Sequence[HostCopy]) -> str:
    if not copies:
        return ""
    lines = [f"Copies to the host: {len(copies)} gradient shard(s), {format_bytes(sum(c.bytes for c in copies))} "
             f"a step, each issued in the graph right after its reduction's wait, on a side stream "
             f"([Note: gradients streamed to the host])",
             f"  {'#':>3}  {'bytes':>10} {'waited':>6} {'copied':>6}  {'compute after':>13}  bucket"]
    for i, c in enumerate(copies):
        lines.append(f"  {i:>3}  {format_bytes(c.bytes):>10} {_at(c.after_wait):>6} {c.at:>6}  "
                     f"{c.compute_after:>13}  {_bucket(c.bucket)}")
    lines.append("  compute after: matmuls, attention and convolutions the graph runs after the "
                 "copy is issued, which it overlaps; the host reads the shards after the graph")
    return "\n".join(lines)


def _device_copies_section(copies: Sequence[DeviceCopy]) -> str:
    if not copies:
        return ""
    lines = [f"Copies from the host: {len(copies)} bucket(s) of shards, "
             f"{format_bytes(sum(c.bytes for c in copies))} a step, each issued one bucket ahead "
             f"of its all-gather on a side stream, waited for where the gather is issued "
             f"([Note: shards brought from the host])",
             f"  {'#':>3}  {'bytes':>10} {'copied':>6} {'waited':>6}  {'compute between':>15}  bucket"]
    for i, c in enumerate(copies):
        lines.append(f"  {i:>3}  {format_bytes(c.bytes):>10} {c.at:>6} {c.waited:>6}  "
                     f"{c.compute_between:>15}  {_bucket(c.bucket)}")
    lines.append("  compute between: matmuls, attention and convolutions the graph runs between "
                 "the copy's issue and its wait, which it can overlap (the graph's order; not "
                 "measured on a GPU)")
    return "\n".join(lines)


def _lifetimes_section(e: Explanation) -> str:
    if not e.lifetimes:
        what = ("stage 0 keeps whole parameters" if e.plan.replicated else
                f"stage {e.plan.stage} keeps whole parameters between its collectives")
        return f"Gathered parameters\n  none in the graph: {what}"
    width = max(len(l.param) for l in e.lifetimes)
    lines = ["Gathered parameters: where each full parameter lives (node indices)",
             f"  {'parameter':<{width}}  {'phase':<8} {'bytes':>10} {'ready':>6} {'first use':>9} "
             f"{'last use':>8}  released after"]
    for l in e.lifetimes:
        lines.append(f"  {l.param:<{width}}  {l.phase:<8} {format_bytes(l.bytes):>10} "
                     f"{l.ready_at:>6} {l.first_use:>9} {l.last_use:>8}  "
                     f"{l.released_after} ({l.released_node})"
                     + (f"  kept {l.kept}" if l.kept else ""))
    return "\n".join(lines)


def _memory_section(m: MemoryTimeline, compilations: Sequence[Compilation] = (),
                    recompute: Optional[RecomputeSummary] = None) -> str:
    peak = m.peak_index
    lines = ["Memory per rank over the step (estimated, [Note: the memory timeline])",
             f"  persistent {format_bytes(m.persistent_bytes)} (graph inputs and optimizer "
             f"state); peak {format_bytes(m.peak_bytes)} at node {peak} ({m.node_names[peak]}, "
             f"{m.phases[peak]})",
             f"  {sparkline(m.total)}  0 … {len(m.total) - 1}"]
    live = m.live_at(peak)
    lines.append(f"  alive at the peak, besides the persistent bytes: {len(live)} tensors, "
                 f"{format_bytes(sum(t.bytes for t in live))}; the largest:")
    for t in live[:LIVE_AT_PEAK_SHOWN]:
        lines.append(f"    {format_bytes(t.bytes):>10}  {t.node} ({t.what}, {t.phase}; "
                     f"nodes {t.index}–{t.last_use})")
    if recompute is not None:
        lines.append(f"  {describe_recompute(recompute)}")
    lowered = compilations[-1].memory if compilations else None
    if lowered is not None:
        graph_peak = m.peak_bytes - m.persistent_bytes
        lines.append(f"  as lowered: Inductor's program peaks at {format_bytes(lowered.peak_bytes)} "
                     f"besides the persistent bytes ({lowered.peak_bytes / max(graph_peak, 1):.2f}x "
                     f"the graph's {format_bytes(graph_peak)}; read from its code, [Note: reading "
                     f"buffer lifetimes from generated code])")
    return "\n".join(lines)


def describe_recompute(summary: RecomputeSummary) -> str:
    """One line on what ``recompute_activations`` did (explain() and the graph dumps)."""
    cost = (f", about {format_seconds(summary.recompute_seconds)} more compute per step "
            f"(cost model)" if summary.recompute_seconds is not None else "")
    return (f"recompute ({summary.mode}): {summary.recomputed_ops} ops recomputed in the "
            f"backward; the backward keeps {format_bytes(summary.kept_bytes)} of the forward's "
            f"values instead of {format_bytes(summary.kept_bytes_before)} (saves "
            f"{format_bytes(summary.dropped_bytes)}){cost}")


def _compilations_section(compilations: Sequence[Compilation]) -> str:
    if not compilations:
        return ""
    lines = [f"Compilations: {len(compilations)}"]
    for i, c in enumerate(compilations):
        lines.append(f"  {i}: {c.seconds:.1f} s, {c.reason}")
        if c.regions is not None:
            lines.extend(f"     {line}" for line in str(c.regions).splitlines())
    return "\n".join(lines)


def sparkline(values: Sequence[int], width: int = SPARKLINE_WIDTH) -> str:
    """``values`` squeezed into ``width`` block characters (each the max of its span)."""
    if not values:
        return ""
    top = max(values) or 1
    n = len(values)
    columns = [max(values[i * n // width:max((i + 1) * n // width, i * n // width + 1)])
               for i in range(min(width, n))]
    return "".join(_BARS[round(v / top * (len(_BARS) - 1))] for v in columns)


def _at(index: Optional[int]) -> str:
    return "-" if index is None else str(index)


def _bucket(names: tuple[str, ...]) -> str:
    if len(names) <= 2:
        return ", ".join(names)
    return f"{names[0]} … {names[-1]} ({len(names)})"



@dataclass(frozen=True)
class GraphBreakExplanation:
    """``explain()`` of a step that broke the graph and runs eagerly ([Note: eager sharded
    execution] in zero_fx/runtime/eager_fallback.py): where it broke, why, and the cost."""

    title: str
    plan: object
    graph_break: GraphBreak
    costs: str
    """What running eagerly costs, one item a line."""
    eager_calls: int

    def __str__(self) -> str:
        brk = self.graph_break
        lines = [self.title, "",
                 f"The step breaks the graph: it runs eagerly on the sharded state "
                 f"({self.eager_calls} call(s) so far), not compiled.",
                 f"  where: {brk.where or 'dynamo named no line of your code'}"
                 + (f"    {brk.code}" if brk.code else ""),
                 f"  why:   {brk.reason}"]
        if len(brk.stack) > 1:
            lines.append("  stack: " + "\n         ".join(brk.stack))
        lines += ["  costs: " + "\n         ".join(self.costs.splitlines()),
                  "  fix:   make the code at that line traceable (torch.where instead of a "
                  "branch on a value; move the call out of the step) for one compiled graph; "
                  "on_graph_break=\"error\" raises instead of running eagerly"]
        return "\n".join(lines)
