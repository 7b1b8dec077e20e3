"""Durations by formula: a collective on the links of the group it runs on, tensor
parallelism's block collectives ([Note: pricing tensor parallelism] in cost_model.py), and
offload's copies between host and device and its optimizer step on the host ([Note: pricing
offload] in cost_model.py). The replay (cost_model.py) and the planner price with them."""

from __future__ import annotations

from .hardware import Hardware
from .traffic import (
    ACROSS_NODES,
    ALL_TO_ALL,
    EXPERT_DATA_GROUP,
    EXPERT_GROUP,
    NODE_GROUP,
    REPLICATE_GROUP,
    Collective,
)


def collective_seconds(collective: Collective, plan, hw: Hardware) -> float:
    """A ring collective's duration on the group it runs on (the links of one node, or the
    network when the group spans nodes); an all-reduce is a reduce-scatter plus an all-gather;
    an all-to-all of expert parallelism one latency and (P-1)/P of its bytes (the note)."""
    ranks = group_ranks(plan, collective.group)
    if collective.kind == ALL_TO_ALL:
        return all_to_all_seconds(collective.bytes, ranks, hw)
    seconds = ring_seconds(collective.bytes, ranks, hw)
    return 2 * seconds if collective.kind == "all_reduce" else seconds


def group_ranks(plan, group: str) -> range:
    """The ranks of the first ``group`` of ``plan`` (every group of a kind is laid out alike):
    ranks ``0..N-1`` flat or for the shard group, every shard group's first rank for the
    replicate group ([Note: hybrid sharding]); under expert parallelism ([Note: expert
    parallelism] in zero_fx/plan/expert_parallel.py) ``P`` consecutive ranks for the
    expert-parallel group, the ranks at stride ``P`` for the expert-data-parallel group."""
    if group == REPLICATE_GROUP:
        return range(0, plan.world_size * plan.replicas, plan.world_size)
    if group in (NODE_GROUP, ACROSS_NODES):  # [Note: the secondary partition]
        size = plan.secondary.size
        return range(size) if group == NODE_GROUP else range(0, plan.world_size, size)
    parallel = getattr(plan, "expert_parallel", None)
    degree = parallel.degree if parallel is not None else 1
    if group == EXPERT_GROUP:
        return range(degree)
    if group == EXPERT_DATA_GROUP:
        return range(0, plan.world_size, degree)
    return range(plan.world_size)


def ring_seconds(nbytes: int, ranks: range, hw: Hardware) -> float:
    """A ring reduce-scatter's or all-gather's duration over ``ranks``, ``nbytes`` in all."""
    n = len(ranks)
    if n == 1:
        return 0.0
    bandwidth, latency = hw.link(ranks)
    return (n - 1) * (latency + nbytes / n / bandwidth)


TP_COLLECTIVES_PER_BLOCK = 4
"""Megatron's all-reduces of b·s·h elements per transformer block and step: 2 forward, 2
backward ([Note: pricing tensor parallelism])."""


def tensor_parallel_seconds(nbytes: int, degree: int, hw: Hardware) -> float:
    """One of tensor parallelism's block collectives, ``nbytes`` = b·s·h activations, over
    the ``degree`` consecutive ranks of a tensor-parallel group: an all-reduce (a
    reduce-scatter and an all-gather), or with sequence parallelism an all-gather and a
    reduce-scatter, which take the same time ([Note: pricing tensor parallelism])."""
    return 2 * ring_seconds(nbytes, range(degree), hw)


def host_device_seconds(nbytes: float, hw: Hardware) -> float:
    """Copying ``nbytes`` one way between a rank's host memory and its device ([Note:
    pricing offload])."""
    if not hw.host_device_bandwidth:
        raise ValueError(f"the preset {hw.name!r} states no host-device bandwidth; pick one "
                         "that does (8xh100-nvlink, 1xv100-32gb-pcie3, 1xgh200-c2c)")
    return nbytes / hw.host_device_bandwidth


def host_optimizer_bytes(*, optimizer_bytes: int, param_bytes: int) -> int:
    """Host-memory bytes the optimizer step moves per element: the fp32 gradient, master and
    optimizer state read, the master and state written, and the ``param_bytes`` copy the
    device gets back ([Note: pricing offload]): 30 for Adam under bf16."""
    return (4 + 4 + optimizer_bytes) + (4 + optimizer_bytes) + param_bytes


def host_optimizer_seconds(elements: float, hw: Hardware, *, optimizer_bytes: int,
                           param_bytes: int) -> float:
    """The optimizer step over ``elements`` on the host's CPUs ([Note: pricing offload])."""
    if not hw.host_optimizer_bandwidth:
        raise ValueError(f"the preset {hw.name!r} states no host optimizer throughput; pick "
                         "one that does (8xh100-nvlink, 1xv100-32gb-pcie3, 1xgh200-c2c)")
    return elements * host_optimizer_bytes(optimizer_bytes=optimizer_bytes,
                                           param_bytes=param_bytes) / hw.host_optimizer_bandwidth


def data_parallel_ranks(world_size: int, tensor_parallel: int) -> range:
    """The first data-parallel group of a (dp, tp) mesh whose tensor-parallel groups are
    consecutive ranks: the ranks at stride ``tensor_parallel``."""
    return range(0, world_size, tensor_parallel)


def all_to_all_seconds(nbytes: int, ranks: range, hw: Hardware) -> float:
    """An all-to-all over ``ranks`` of ``nbytes`` (what one rank sends and receives in all,
    its own share included): one latency, and the (N-1)/N of the bytes that leave the rank."""
    n = len(ranks)
    if n == 1:
        return 0.0
    bandwidth, latency = hw.link(ranks)
    return latency + nbytes * (n - 1) / n / bandwidth
