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
from ..analysis.memory_timeline import MemoryTimeline
from ..analysis.traffic import ACROSS_NODES, NODE_GROUP, REPLICATE_GROUP
from ..capture.graph_breaks import GraphBreak
from ..capture.experts.moe_blocks import RoutedExperts
from ..base.formatting import format_bytes, format_seconds
from ..plan.owners import loads_of
from ..passes.common.predicates import UPDATES_META, is_update
from ..passes.recompute_activations import RECOMPUTE_META, RecomputeSummary
from .plan_section import format_plan
from .report_sections import (bucket_text, compilations_section, device_copies_section,
                              host_copies_section, memory_section, position_text)
from .step_facts import (DeviceCopy, GatheredLifetime, HostCopy, device_copies_in, host_copies_in,
                         gathered_lifetimes)

if TYPE_CHECKING:  # a type for annotations only: the compiler sits above inspection/
    from ..compiler.compilation import Compilation


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
    updates: tuple[tuple[int, tuple[str, ...]], ...] = ()
    """Each optimizer update in the graph: its node index and the parameters it steps
    ([Note: the update in the graph] in zero_fx/runtime/update/graph_update.py)."""
    update_reason: Optional[str] = None
    """Why the optimizer steps after the graph; "" when in it, None when not known (a graph
    not compiled by a step)."""
    update_kernels: Optional[str] = None
    """Which of the optimizer's implementations each bucket's update runs (``kernels_of``)."""
    parameter_updates: tuple = ()
    """Each parameter's update rule, the rank it runs on and why (``ParameterUpdate``s:
    [Note: update rules] in zero_fx/runtime/optimizer.py)."""

    def __str__(self) -> str:
        plan = format_plan(self.plan, self.moe_blocks)
        if self.offload_choice is not None:
            plan += "\n" + "\n".join(self.offload_choice.lines())
        sections = [self.title, plan,
                    _collectives_section(self), host_copies_section(self.host_copies),
                    device_copies_section(self.device_copies),
                    _lifetimes_section(self), _update_section(self),
                    rules_section(self.parameter_updates, self.plan.world_size, self.plan),
                    memory_section(self.memory, self.compilations, self.recompute),
                    f"Estimate\n  {self.estimate}", compilations_section(self.compilations)]
        return "\n\n".join(s for s in sections if s) + "\n"


def explain_graph(gm: GraphModule, plan, *, hardware="cpu-gloo", title: str = "",
                  compilations: Sequence[Compilation] = (),
                  moe_blocks: Sequence[RoutedExperts] = (),
                  offload_choice: Optional[object] = None,
                  update_reason: Optional[str] = None,
                  update_kernels: Optional[str] = None,
                  parameter_updates: Sequence = ()) -> Explanation:
    """The explanation of ``gm``, a graph our passes rewrote for ``plan`` (from a compiled
    step's ``graphs``, or from ``rewritten_step_on_fake``); ``moe_blocks``: the model's
    mixture-of-experts blocks (``step.moe_blocks``), listed under the plan."""
    replayed = replay(gm, plan, hardware)
    memory = replayed.memory
    return Explanation(
        title=title or f"zero_fx explain: stage {plan.stage} over {plan.world_size} rank(s)",
        plan=plan,
        timings=replayed.timings,
        lifetimes=tuple(gathered_lifetimes(gm, plan, memory)),
        memory=memory,
        estimate=replayed.estimate,
        compilations=tuple(compilations),
        recompute=gm.meta.get(RECOMPUTE_META),
        moe_blocks=tuple(moe_blocks),
        host_copies=tuple(host_copies_in(gm)),
        device_copies=tuple(device_copies_in(gm)),
        offload_choice=offload_choice,
        updates=tuple((i, n.meta[UPDATES_META]) for i, n in enumerate(gm.graph.nodes)
                      if is_update(n)),
        update_reason=update_reason,
        update_kernels=update_kernels,
        parameter_updates=tuple(parameter_updates),
    )


def rules_section(updates: Sequence, world_size: int, plan=None) -> str:
    """Which update rule steps each parameter, on which rank, and why: one line when one
    elementwise optimizer steps them all, else a row per parameter and each owner's load."""
    if not updates:
        return ""
    rules = {(u.optimizer, u.rule) for u in updates if u.rule != "none"}
    if len(rules) == 1 and next(iter(rules))[1] == "flat":
        held = [u for u in updates if u.rule == "flat"]
        return (f"Optimizer rules: {held[0].reason}: every rank steps its 1/N shard of each of "
                f"the {len(held)} parameters it holds ([Note: update rules])")
    width = max(len(u.name) for u in updates)
    kind = max(len(u.optimizer) for u in updates)
    lines = ["Optimizer rules: which update steps each parameter, where, and why "
             "([Note: update rules])",
             f"  {'parameter':<{width}}  {'optimizer':<{kind}}  {'rule':<17}  "
             f"{'runs on':<21}  why"]
    lines += [f"  {u.name:<{width}}  {u.optimizer or '-':<{kind}}  {u.rule:<17}  "
              f"{u.where:<21}  {u.reason}" for u in updates]
    owned = [u for u in updates if u.owner is not None]
    if owned:
        loads = loads_of({u.name: u.owner for u in owned}, {u.name: u.cost for u in owned},
                         world_size)
        total = sum(loads) or 1.0
        lines.append("  whole-tensor work per rank (share of the total): " + ", ".join(
            f"rank {r} {load / total:.0%}" for r, load in enumerate(loads)))
        if plan is not None and world_size > 1:
            lines.append("  " + owner_exchanges(plan))
    return "\n".join(lines)


def owner_exchanges(plan) -> str:
    """How the whole tensors' gradients reach their owners and their values come back
    ([Note: reductions laid out by owner] in zero_fx/runtime/update/whole_tensor_updates.py)."""
    to = ("by the stage's reduce-scatter, laid out by owner" if plan.reduces_to_owners else
          f"by the graph's reduce-scatters, laid out by owner, one per group of {plan.world_size} "
          "blocks"
          if plan.reduces_to_owners_in_graph else
          "by an all-to-all of the reduced shards after the graph")
    rows = len(getattr(plan, "owner_row_groups", ()))
    groups = len(plan.owner_groups([n for n, _ in plan.owners]))
    whose = ("the graph's all-gathers" if getattr(plan, "params_sharded", False) else
             "the stage's all-gathers, cast into the parameters,")
    back = ("by the stage's all-gather, laid out by owner" if plan.returns_owners_whole else
            f"by {whose} of the groups, whose shards hold their owners' rows"
            if rows and rows == groups else
            f"by {whose} of the {rows} of {groups} groups whose shards hold their owners' rows, "
            "the others by an all-to-all into every rank's shards" if rows else
            "by an all-to-all into every rank's shards")
    if not plan.returns_owners_whole and groups and rows < groups:
        back += (f" ({'the other' if rows else 'the'} groups' rows are wider than their shards: "
                 "fewer alike blocks than ranks, or uneven ones)" if getattr(plan, "may_store_owner_rows", False) else
                 " (the shards stay flat where the reduction does not bring the gradients to "
                 "the owners, or under a secondary partition or quantized weights)")
    return f"gradients reach their owners {to}; the updated tensors return {back}"


def _update_section(e: Explanation) -> str:
    """Where the optimizer steps: in the graph, bucket by bucket (each bucket's update and
    its node index), or after it, and why."""
    if e.updates:
        lines = [f"Optimizer update: in the graph, {len(e.updates)} buckets, each stepped right "
                 f"after its gradients are reduced, which frees them there ([Note: the update "
                 f"in the graph])"]
        groups = sum(all(e.plan.owner_of(n) is not None for n in names) for _, names in e.updates)
        if groups:
            lines.append(f"  {groups} of them owner groups: each rank steps the whole tensors it "
                         f"owns there ([Note: whole-tensor updates in the graph])")
        if e.update_kernels:
            lines.append(f"  kernels: {e.update_kernels}")
        lines += [f"  {index:>6}  {bucket_text(names)}" for index, names in e.updates]
        return "\n".join(lines)
    if e.update_reason:
        return (f"Optimizer update: after the graph, on every shard at once, because "
                f"{e.update_reason}")
    return ""


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
            f"{position_text(c.issued_at):>6} {position_text(c.waited_at):>6}  {between:>22}  "
            f"{format_seconds(t.exposed):>9}  {bucket_text(c.bucket)}"
            + (" (across replicas)" if c.group == REPLICATE_GROUP else
               f" ({c.group})" if c.group in (NODE_GROUP, ACROSS_NODES) else ""))
    lines.append("  issued/waited: node index in the rewritten graph (see the graph dump); "
                 "exposed: time compute loses to it (waiting, or sharing its core)")
    order = e.compilations[-1].order if e.compilations else None
    if order is not None:
        lines.append(f"  as lowered: {order}")
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
