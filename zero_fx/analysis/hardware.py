"""The hardware the cost model prices a step on: what it knows about one rank and its
links (``Hardware``), and the named presets (``PRESETS``), some measured by
``python -m bench.helpers.calibrate`` (presets/*.json). [Note: the cost model] in cost_model.py says
how each field is used."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Hardware:
    """What the cost model knows about one rank and its links."""

    name: str
    flops: float
    """Matrix-product FLOP/s one rank sustains (at the graph's dtype)."""
    memory_bandwidth: float
    """Bytes/s for memory-bound ops."""
    link_bandwidth: float
    """Bytes/s each rank sends in a ring collective (NCCL's "bus bandwidth")."""
    link_latency: float
    """Seconds per ring step; a collective over N ranks takes N-1 steps."""
    op_overhead: float
    """Seconds each op costs beyond its work (launch, dispatch)."""
    communication_overlap: float = 1.0
    """The share of a collective's time that can run beside compute: 1 where communication
    has its own engine (NCCL's copy engines and SMs), less where it shares a core with
    compute (gloo's threads on a CPU with no idle core). The rest is compute's time too."""
    ranks_per_node: int = 0
    """Ranks of one node, joined by ``link_bandwidth``; 0: every rank is on one node."""
    inter_node_bandwidth: float = 0.0
    """Bytes/s each rank sends to other nodes (its share of the network), for a group
    whose ranks are on more than one node."""
    inter_node_latency: float = 0.0
    """Seconds per ring step between nodes."""
    device_memory: float = 0.0
    """Bytes of one rank's device memory (0: not stated)."""
    host_memory: float = 0.0
    """Bytes of host memory one rank may fill: the node's, divided by its ranks ([Note:
    pricing offload]; 0: not stated)."""
    host_device_bandwidth: float = 0.0
    """Bytes/s one rank copies between host and device, each direction (PCIe or C2C)."""
    host_optimizer_bandwidth: float = 0.0
    """Bytes/s of host memory one rank's share of the CPUs moves through when it runs the
    optimizer step on the host (CPU Adam is memory-bound: ``host_optimizer_seconds``)."""

    def link(self, ranks: range) -> tuple[float, float]:
        """(bandwidth, latency) of a ring over ``ranks``: the network's if they are on more
        than one node, else the node's links."""
        per_node = self.ranks_per_node
        if per_node and ranks and ranks[0] // per_node != ranks[-1] // per_node:
            return self.inter_node_bandwidth, self.inter_node_latency
        return self.link_bandwidth, self.link_latency


PRESET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets")
"""Presets measured by ``python -m bench.helpers.calibrate`` (JSON, committed)."""


def _measured_preset(name: str) -> Hardware:
    with open(os.path.join(PRESET_DIR, f"{name}.json")) as f:
        fields = json.load(f)
    return Hardware(**{k: v for k, v in fields.items() if k in Hardware.__dataclass_fields__})


_DGX_H100_HOST = dict(device_memory=80e9, host_memory=2e12 / 8, host_device_bandwidth=50e9,
                      host_optimizer_bandwidth=35e9)
"""One rank's share of a DGX H100's host ([Note: pricing offload])."""

PRESETS = {
    "cpu-gloo": _measured_preset("cpu-gloo"),
    "8xh100-nvlink": Hardware(
        name="8xH100 SXM, NVLink 4 / NVSwitch, NCCL, bf16",
        flops=0.6 * 989e12, memory_bandwidth=0.8 * 3.35e12, link_bandwidth=360e9,
        link_latency=3e-6, op_overhead=5e-6, **_DGX_H100_HOST),
    "4x8xh100-ib": Hardware(
        name="nodes of 8xH100 SXM, NVLink 4 within a node, 400 Gb/s InfiniBand per GPU "
             "between nodes, NCCL, bf16",
        flops=0.6 * 989e12, memory_bandwidth=0.8 * 3.35e12, link_bandwidth=360e9,
        link_latency=3e-6, op_overhead=5e-6, ranks_per_node=8,
        inter_node_bandwidth=0.8 * 50e9, inter_node_latency=10e-6, **_DGX_H100_HOST),
    "1xv100-32gb-pcie3": Hardware(
        name="one V100 SXM2 32 GB of a DGX-2 with the node's host to itself (ZeRO-Offload's "
             "single-GPU runs), PCIe gen3 x16, fp16",
        flops=40e12, memory_bandwidth=0.8 * 900e9, link_bandwidth=120e9, link_latency=5e-6,
        op_overhead=5e-6, device_memory=32e9, host_memory=1.5e12,
        host_device_bandwidth=12e9, host_optimizer_bandwidth=100e9),
    "1xgh200-c2c": Hardware(
        name="one GH200: H100 96 GB HBM3 and a 72-core Grace with 480 GB LPDDR5X, NVLink-C2C, "
             "bf16",
        flops=0.6 * 989e12, memory_bandwidth=0.8 * 4e12, link_bandwidth=360e9,
        link_latency=3e-6, op_overhead=5e-6, device_memory=96e9, host_memory=480e9,
        host_device_bandwidth=0.8 * 450e9, host_optimizer_bandwidth=0.4 * 500e9),
}
"""cpu-gloo: this project's 2-core CI machine as ``python -m bench.helpers.calibrate`` measured it
(one core's fp32 matmul, a copy's bandwidth, gloo all-gathers over loopback between two
ranks; presets/cpu-gloo.json says when and on what). 8xH100: 60% of the 989 TFLOP/s
dense bf16 peak, 80% of 3.35 TB/s HBM3, 360 GB/s NCCL bus bandwidth (of NVLink 4's
450 GB/s per direction), 3 µs per ring step. 4x8xH100-IB: such nodes (4 of them for the
name; the plan's ranks say how many), 8 GPUs each,
joined by one 400 Gb/s (50 GB/s) NIC per GPU, of which NCCL sustains about 80 %, and
10 µs per ring step between nodes.

Host fields ([Note: pricing offload]; assumptions, not measurements). 8xH100 and
4x8xH100-IB: a DGX H100's 2 TB of host memory and two 56-core Xeons (8 DDR5-4800 channels
each, 614 GB/s) shared by 8 GPUs, 250 GB and 35 GB/s of the optimizer's memory traffic a
rank (under half the peak); PCIe gen5 x16, 64 GB/s a direction, about 50 effective.
1xV100-32GB-PCIe3: ZeRO-Offload's single-GPU setup (Ren et al. 2021): one V100 SXM2 32 GB
of a DGX-2, its 1.5 TB of host memory and two 24-core Xeon 8168 (256 GB/s of DDR4) to
itself; 40 TFLOP/s, what the paper reports ZeRO-Offload sustaining for a 10B model (32 %
of the 125 TFLOP/s fp16 tensor peak); PCIe gen3 x16, 15.75 GB/s a direction, about 12
effective; 100 GB/s for CPU Adam, about the 4B parameters a second (at 30 bytes each) the
paper's CPU-Adam table reports for 10B parameters (our reading of it, not checked against
a run). 1xGH200-C2C: NVLink-C2C's 450 GB/s a direction, 80 % of it, and 40 % of Grace's
500 GB/s LPDDR5X for the optimizer. cpu-gloo states none (0): on a CPU the host is the
device, and there is nothing to offload to."""


def hardware(preset_or_hardware) -> Hardware:
    if isinstance(preset_or_hardware, Hardware):
        return preset_or_hardware
    try:
        return PRESETS[preset_or_hardware]
    except KeyError:
        raise ValueError(f"unknown hardware preset {preset_or_hardware!r}; "
                         f"presets: {sorted(PRESETS)}, or pass a Hardware(...)") from None


def hardware_for(model: torch.nn.Module) -> str:
    """The preset for where ``model`` runs: a GPU preset on CUDA, ``cpu-gloo`` otherwise."""
    param = next(model.parameters(), None)
    return "8xh100-nvlink" if param is not None and param.device.type == "cuda" else "cpu-gloo"
