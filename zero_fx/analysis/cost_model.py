"""The cost model: how long a rewritten step takes on given hardware, and how much
of its communication the compute does not hide.

[Note: the cost model]
Each node of the rewritten graph gets a duration from its shapes alone:

- matrix products (mm, addmm, bmm, baddbmm) and attention: FLOPs / ``flops``
  (2·M·N·K per product; attention 4·B·H·L·S·D forward, twice that backward); the
  grouped products of routed experts (``zero_fx::grouped_mm``, its weight gradient,
  ``aten._grouped_mm``) likewise, 2·rows·K·N over all their rows (each row is
  multiplied by one group's matrix; the T·k rows of top-k routing);
- views cost nothing; every other op moves its inputs and output once through
  memory: bytes / ``memory_bandwidth``; plus ``op_overhead`` per op that runs;
- a collective over N ranks of B bytes (ring): all-gather and reduce-scatter
  ``(N-1)/N·B / link_bandwidth``, all-reduce twice that, plus
  ``link_latency·(N-1)``. Over several nodes (``ranks_per_node``, ranks laid
  out node by node as torchrun does) a group whose ranks are on more than one
  node runs at ``inter_node_bandwidth`` and ``inter_node_latency``: a ring is as
  fast as its slowest hop. That is what hybrid sharding avoids: its gathers and
  reduce-scatters stay on one node, only the all-reduce of gradient shards
  crosses ([Note: hybrid sharding] in runtime/distributed/process_group.py). So does the
  secondary partition's backward gather, on the node's ``n`` ranks; its forward
  gather across nodes runs on the ranks at stride ``n`` ([Note: the secondary
  partition] in zero_fx/plan/secondary.py).
- expert parallelism ([Note: expert parallelism] in zero_fx/plan/expert_parallel.py): the
  experts' gathers and reduce-scatters run on the expert-data-parallel group (``D = W /
  P`` ranks at stride ``P``; the functional collective's last argument names the group);
  the token exchanges (``zero_fx::exchange_rows`` and ``exchange_counts``) on the
  expert-parallel group of ``P`` consecutive ranks. An exchange of B bytes (its token
  side, ``token_exchange_numel``: T·k rows, [Note: exchanging rows in fixed shapes]) sends
  (P-1)/P of them: ``link_latency + (P-1)/P·B / link_bandwidth``, at the network's speed
  when the group spans nodes (P above ``ranks_per_node``). It issues and waits for its
  collective itself, so nothing hides it: compute stands blocked for all of it.
- tensor parallelism ([Note: pricing tensor parallelism] below).

The graph is then replayed in its order on two streams: compute runs nodes one
after another; communication runs collectives one after another (as one NCCL
or gloo process group does; with hybrid sharding the replicate group is a
stream of its own, and so are expert parallelism's two groups), each starting when it is
issued and the previous one has finished. A wait blocks compute until its collective has finished;
the time compute spends blocked is the *exposed* communication. Where
communication shares the compute's core (``communication_overlap`` below 1:
gloo on a CPU with no idle core), the share of a collective it cannot hide
is taken from compute when it is issued, and counts as exposed. The optimizer
step (memory-bound over the shards: parameter, gradient and two Adam moments
read, three written) and, in stages 1-2, the gathers after it follow the graph.

Peak memory: the bytes of every tensor the graph creates, alive from its node
to its last reader (a collective's input until its wait; a view is its base),
on top of what lives through the step: the graph's inputs (shards or
parameters, the batch) and the optimizer state.

[Note: pricing tensor parallelism]
Megatron-LM's tensor parallelism over T ranks (``python -m zero_fx.plan --tp T``; [Note:
planning tensor parallelism] in zero_fx/planner/features/tensor_parallel.py) splits each block's attention and
MLP products by columns then rows, so a block's forward ends each of its two halves with
an all-reduce of the block's activations, b·s·h elements, and its backward does the same
for their gradients: 4 per block (``TP_COLLECTIVES_PER_BLOCK``), 2 more where recompute
runs the forward again, and 2 for the vocabulary-parallel embedding (its output) and head
(its input's gradient). With sequence parallelism each all-reduce becomes an all-gather
before the column-parallel product and a reduce-scatter after the row-parallel one: the
same bytes on the wire, so the same time. A rank sends 2(T-1)/T of each collective's
bytes: ``tensor_parallel_seconds`` is an all-reduce's ring over the tensor-parallel group,
T consecutive ranks (within a node while T <= ``ranks_per_node``). Nothing hides them:
the next product needs the sum, so compute stands blocked for all of them (exposed).
ZeRO's gathers and reduce-scatters then carry each rank's 1/T piece over the data-parallel
group, the W/T ranks at stride T (``data_parallel_ranks``), which spans nodes as soon as
W/T ranks do not fit on one.

[Note: pricing offload]
With ``zero_compile(offload=...)`` ([Note: planning offload] in zero_fx/planner/features/offload.py)
the fp32 masters and optimizer state live in host memory, and the optimizer steps there.
A step then adds, per rank:

- copies over the host link (PCIe or Grace-Hopper's C2C, ``host_device_bandwidth`` each
  way, the two directions at once): the reduced gradients to the host (in the reduction's
  dtype, 16-bit under mixed precision, widened to fp32 on the host), bucket by bucket as
  the backward reduces them, and the updated parameters back (in the compute dtype):
  ``host_device_seconds``. With ``"parameters"`` the compute-dtype shards stay on the host
  too and each gather starts with a copy of its shard to the device, prefetched like the
  gather; nothing is copied back after the step.
- the optimizer step on the host's CPUs, memory-bound as on the device: Adam reads an
  element's fp32 gradient, master and two moments and writes the master, the moments and
  the compute-dtype copy, 30 bytes in bf16 (``host_optimizer_bytes``), at
  ``host_optimizer_bandwidth``: ``host_optimizer_seconds``. The device waits for it.

The presets' host fields are assumptions written beside ``PRESETS``, not measurements;
the planner states which preset it priced.

It is a model: no fusion (Inductor fuses elementwise ops, so memory-bound time
is an upper bound), no contention between the streams beyond the share that
cannot overlap, two link speeds at most (within a node, between nodes).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from ..capture.experts import grouped_mm as _grouped_mm  # noqa: F401 - registers torch.ops.zero_fx
from ..base.formatting import format_bytes
from ..passes.common.predicates import is_collective, is_token_exchange, is_wait
from .hardware import Hardware, hardware
from .memory_timeline import MemoryTimeline, hint, is_view, memory_timeline, tensor_bytes, vals
from .traffic import (
    ACROSS_NODES,
    EXPERT_DATA_GROUP,
    EXPERT_GROUP,
    NODE_GROUP,
    REPLICATE_GROUP,
    SHARD_GROUP,
    Collective,
    traffic_report,
)
from .transfer_seconds import collective_seconds

aten = torch.ops.aten


@dataclass(frozen=True)
class Estimate:
    """The cost model's answer for one step."""

    hardware: str
    step_seconds: float
    compute_seconds: float
    """Compute stream busy time (graph and optimizer)."""
    communication_seconds: float
    """Communication stream busy time."""
    exposed_seconds: float
    """Time compute waits for communication: the part no compute hides."""
    peak_bytes: int
    collectives: int

    @property
    def exposed_fraction(self) -> float:
        return self.exposed_seconds / self.step_seconds if self.step_seconds else 0.0

    def __str__(self) -> str:
        return (f"estimated on {self.hardware}: step {1e3 * self.step_seconds:.2f} ms "
                f"(compute {1e3 * self.compute_seconds:.2f} ms, communication "
                f"{1e3 * self.communication_seconds:.2f} ms in {self.collectives} launches, "
                f"exposed {1e3 * self.exposed_seconds:.2f} ms = {100 * self.exposed_fraction:.1f}% "
                f"of the step); peak memory {format_bytes(self.peak_bytes)} per rank")


@dataclass(frozen=True)
class CollectiveTiming:
    """One collective in the replay: when the communication stream ran it, and what hid it."""

    collective: Collective
    start: float
    finish: float
    compute_between: float
    """Seconds of compute issued between the collective and its wait: what can hide it."""
    ops_between: int
    exposed: float
    """Seconds compute stood blocked at its wait."""


@dataclass(frozen=True)
class Replay:
    """The replay of one step: the estimate and each collective's timing."""

    estimate: Estimate
    timings: tuple[CollectiveTiming, ...]
    memory: MemoryTimeline


def estimate(gm: GraphModule, plan, hw="cpu-gloo", *, optimizer_state_bytes_per_param: int = 8
             ) -> Estimate:
    """Replay ``gm`` (rewritten for ``plan``) on ``hw`` ([Note: the cost model])."""
    return replay(gm, plan, hw, optimizer_state_bytes_per_param=optimizer_state_bytes_per_param
                  ).estimate


def replay(gm: GraphModule, plan, hw="cpu-gloo", *, optimizer_state_bytes_per_param: int = 8
           ) -> Replay:
    """``estimate``, plus each collective's timing on the two streams."""
    hw = hardware(hw)
    n = plan.world_size
    report = traffic_report(gm, plan)
    in_graph = {c.node: c for c in report.collectives if c.node}
    compute = busy_compute = busy_comm = exposed = 0.0
    # one stream per process group
    comm_free = dict.fromkeys((SHARD_GROUP, REPLICATE_GROUP, EXPERT_GROUP, EXPERT_DATA_GROUP,
                               NODE_GROUP, ACROSS_NODES), 0.0)
    # per collective: start, finish, busy compute and ops at issue, compute time it shared
    issued: dict[Node, tuple[float, float, float, int, float]] = {}
    ops = 0
    timings = []
    for node in gm.graph.nodes:
        if is_collective(node):
            collective = in_graph[node.name]
            start = max(compute, comm_free[collective.group])
            seconds = collective_seconds(collective, plan, hw)
            comm_free[collective.group] = start + seconds
            shared = (1.0 - hw.communication_overlap) * seconds  # compute's core, taken now
            compute += shared
            exposed += shared
            issued[node] = (start, start + seconds, busy_compute, ops, shared)
            busy_comm += seconds
        elif is_token_exchange(node):  # priced as blocking, the issued dispatch too (shared
            # expert overlap not counted: [Note: the dispatch issued, then waited for])
            collective = in_graph[node.name]
            start = max(compute, comm_free[EXPERT_GROUP])
            seconds = collective_seconds(collective, plan, hw)
            comm_free[EXPERT_GROUP] = start + seconds
            blocked = start + seconds - compute
            timings.append(CollectiveTiming(collective=collective, start=start,
                                            finish=start + seconds, compute_between=0.0,
                                            ops_between=0, exposed=blocked))
            compute += blocked
            exposed += blocked
            busy_comm += seconds
        elif is_wait(node) and node.args[0] in issued:
            start, finish, compute_at_issue, ops_at_issue, shared = issued[node.args[0]]
            blocked = max(0.0, finish - compute)
            timings.append(CollectiveTiming(
                collective=in_graph[node.args[0].name], start=start, finish=finish,
                compute_between=busy_compute - compute_at_issue, ops_between=ops - ops_at_issue,
                exposed=shared + blocked))
            exposed += blocked
            compute += blocked
        else:
            seconds = node_seconds(node, hw)
            compute += seconds
            busy_compute += seconds
            ops += seconds > 0
    # what this rank holds: under expert parallelism, its shards of its own experts only
    shard_bytes = sum(l.shard_numel * l.dtype.itemsize for l in plan.params if plan.holds(l.name))
    if plan.replicated:
        shard_bytes *= n
    optimizer = 7 * shard_bytes / hw.memory_bandwidth + hw.op_overhead * len(plan.params)
    compute = max(compute, *comm_free.values()) + optimizer
    busy_compute += optimizer
    # stages 1-2: the gathers after the optimizer, eager, exposed
    for c in report.collectives:
        if not c.node:
            seconds = collective_seconds(c, plan, hw)
            timings.append(CollectiveTiming(collective=c, start=compute, finish=compute + seconds,
                                            compute_between=0.0, ops_between=0, exposed=seconds))
            compute += seconds
            exposed += seconds
            busy_comm += seconds
    # offloaded, the optimizer's state is in host memory ([Note: optimizer offload])
    on_device = 0 if plan.offloads_optimizer else shard_bytes * optimizer_state_bytes_per_param // 4
    timeline = memory_timeline(gm, persistent_bytes=on_device)
    timings.sort(key=lambda t: t.start)
    return Replay(
        estimate=Estimate(hardware=hw.name, step_seconds=compute, compute_seconds=busy_compute,
                          communication_seconds=busy_comm, exposed_seconds=exposed,
                          peak_bytes=timeline.peak_bytes, collectives=len(report.collectives)),
        timings=tuple(timings), memory=timeline)


_MATMULS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2), aten.bmm.default: (0, 1),
            aten.baddbmm.default: (1, 2),
            # grouped: x (rows, K) by w (groups, K, N), the weight gradient x (rows, K) by
            # grad (rows, N), and _grouped_mm's 2-D/3-D forms: 2·numel(a)·N each
            torch.ops.zero_fx.grouped_mm.default: (0, 1),
            torch.ops.zero_fx.grouped_mm_weight_grad.default: (0, 1),
            aten._grouped_mm.default: (0, 1)}


def node_seconds(node: Node, hw: Hardware) -> float:
    """One compute node's duration ([Note: the cost model])."""
    if node.op != "call_function" or is_view(node) or node.target is operator.getitem:
        return 0.0
    flops = _flops(node)
    if flops:
        return flops / hw.flops + hw.op_overhead
    return _bytes_moved(node) / hw.memory_bandwidth + hw.op_overhead


def _flops(node: Node) -> float:
    if node.target in _MATMULS:
        a, b = (node.args[i].meta["val"] for i in _MATMULS[node.target])
        return 2.0 * math.prod(map(hint, a.shape)) * hint(b.shape[-1])
    name = str(node.target)
    if "scaled_dot_product" in name:
        q, k = node.args[0].meta["val"], node.args[1].meta["val"]
        if "backward" in name:
            q, k = node.args[1].meta["val"], node.args[2].meta["val"]
        forward = 4.0 * math.prod(map(hint, q.shape[:-1])) * hint(k.shape[-2]) * hint(q.shape[-1])
        return 2 * forward if "backward" in name else forward
    return 0.0


def _bytes_moved(node: Node) -> int:
    return sum(tensor_bytes(v) for v in vals(node.all_input_nodes) + vals([node]))
