"""What the planner answers: ``PlanReport`` and its rows, one type per question (stages,
nodes, experts, tensor parallelism, offload, quantization), and the peak they add up to.

[Note: what the planner counts]
Model states follow ``zero_fx.planner.table.model_state_breakdown``: what zero_fx holds per
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
sharding ([Note: hybrid sharding] in zero_fx/runtime/distributed/process_group.py): one replica
per node, sharded over the node's ranks, and fewer replicas of shard groups that
span several nodes. It counts the bytes each rank sends per step on each level. A
ring over ranks on several nodes is as fast as its slowest hop, the network, so
all of its bytes count as crossing nodes: flat's, and a multi-node shard group's.
One replica per node keeps gathers and reduce-scatters within the node, and only
the all-reduce of the gradient shards (2(R-1)/R·Ψ/S elements per rank) crosses.
Hybrid's price is memory: its states are sharded S ways, not N.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from .features.quantization import QuantizedRow
from .features.whole_updates import WholeUpdates

GB = 1e9
OPTIMIZER_BYTES = {"adamw": 8, "sgd-momentum": 4, "sgd": 0}
"""fp32 optimizer state per trainable element (``--optimizer muon``: Muon's 4 on the blocks'
matrices, AdamW's 8 on the rest; zero_fx/planner/features/whole_updates.py)."""


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
    stacked: int = 0
    """Of ``blocks``, those holding their experts as 3-D parameters (transformers 5's
    ``gate_up_proj``, ``down_proj``) in a layout expert parallelism does not split (it splits
    transformers 5's concatenated one: [Note: fused experts that loop])."""

    def is_expert(self, name: str) -> bool:
        """Whether parameter ``name`` is a routed expert's, in this model or in one of fewer
        blocks built from the same config (layer indices read as any index)."""
        patterns = {_any_index(prefix) + "." for prefix, *_ in self.routed}
        return _any_index(name).startswith(tuple(patterns))


def _any_index(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".#", name)


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


@dataclass(frozen=True)
class TensorParallelShape:
    """The sizes Megatron splits over T ranks, read from the model's configuration
    (``tensor_parallel_shape``); T must divide each."""

    heads: int
    kv_heads: int
    hidden: int
    ffn: int
    vocab: int


@dataclass
class TensorParallelRow:
    """Data parallelism alone (degree 1) or tensor parallelism of ``degree`` beside ZeRO on
    the other ranks, per rank per step ([Note: planning tensor parallelism])."""

    degree: int
    params_per_rank: int
    """Ψ_T: elements of a rank's tensor-parallel piece of the model."""
    state_bytes: float
    """Model states per rank in the chosen stage."""
    block_params: float
    """Bytes of the largest block's parameters, gathered in the compute dtype (its piece)."""
    block_activations: Optional[float]
    """Bytes the block keeps for its backward: what one more block adds to the activations
    the traced forward leaves to the backward (None without ``seq``)."""
    largest_matrix: float
    """Bytes of the largest matrix of a block in the compute dtype (its piece)."""
    working_set: Optional[float] = None
    peak_bytes: Optional[float] = None
    tp_bytes: float = 0.0
    """Bytes tensor parallelism's collectives work on per step (b·s·h each)."""
    tp_seconds: float = 0.0
    """Those collectives' time, all of it exposed."""
    zero_bytes: float = 0.0
    """Bytes ZeRO's collectives work on per step (the chosen stage's traffic)."""
    zero_seconds: float = 0.0
    """ZeRO's collectives one after another on the data-parallel group."""
    compute_seconds: Optional[float] = None

    @property
    def block_bytes(self) -> Optional[float]:
        """The largest block's working set: its parameters, their gradients before they are
        reduced (as many bytes: the compute dtype), its activations."""
        return 2 * self.block_params + (self.block_activations or 0.0)

    @property
    def step_seconds(self) -> Optional[float]:
        if self.compute_seconds is None:
            return None
        return max(self.compute_seconds, self.zero_seconds) + self.tp_seconds


@dataclass
class OffloadRow:
    """One offload mode's bytes and time per rank per step ([Note: planning offload])."""

    mode: str
    device: dict[str, float]
    """Model-state bytes on the device by kind (``offload_states``)."""
    host: dict[str, float]
    """Model-state bytes in host memory by kind."""
    working_set: Optional[float]
    """The traced working set, priced again for the mode (None without ``seq``)."""
    peak_bytes: Optional[float]
    """Estimated device peak (None without ``seq``)."""
    to_host: float
    """Bytes copied device -> host per step (reduced gradients)."""
    to_device: float
    """Bytes copied host -> device per step (updated parameters, or the gathered shards)."""
    copy_seconds: tuple[float, float]
    """(to host, to device), each at the host link's bandwidth one way."""
    host_step_seconds: float
    """The optimizer step on the host's CPUs (0 without offload)."""
    compute_seconds: Optional[float] = None
    """The traced step's compute on the device, its device optimizer step left out when the
    host steps instead (None without ``seq``)."""
    collective_seconds: float = 0.0
    """ZeRO's collectives one after another on the shard group."""

    @property
    def device_bytes(self) -> float:
        return sum(self.device.values())

    @property
    def host_bytes(self) -> float:
        return sum(self.host.values())

    @property
    def step_seconds(self) -> Optional[float]:
        """Compute beside the collectives and the copies the plan overlaps (gradients to the
        host during the backward; with ``"parameters"``, the shards to the device ahead of
        their gathers), then the host's step and, with ``"optimizer"``, the copy back: the
        device waits for both ([Note: planning offload])."""
        if self.compute_seconds is None:
            return None
        to_host, to_device = self.copy_seconds
        overlapped = max(self.compute_seconds, self.collective_seconds, to_host,
                         to_device if self.mode == "parameters" else 0.0)
        return overlapped + self.host_step_seconds + (
            to_device if self.mode == "optimizer" else 0.0)


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
    ([Note: expert capacity] in zero_fx/capture/experts/expert_exchange.py); None: the worst case."""
    tensor_parallel: int = 1
    """Ranks each block's matrices are split over ([Note: planning tensor parallelism]); the
    stage tables, buckets and working set are then a rank's piece over ``world_size /
    tensor_parallel`` data-parallel ranks."""
    sequence_parallel: bool = False
    psi_per_rank: int = 0
    """Ψ_T: elements of a rank's tensor-parallel piece (Ψ at ``tensor_parallel`` 1)."""
    largest_block: str = ""
    """The block of the most parameters (``block_of``)."""
    tensor_parallel_rows: Optional[list[TensorParallelRow]] = None
    """With ``tensor_parallel`` > 1: degree 1 and the chosen degree, side by side."""
    offload: str = "none"
    """The offload mode planned (``"auto"`` resolved to the one it picked)."""
    offload_rows: Optional[list[OffloadRow]] = None
    """With ``offload``: every mode the stage allows, side by side."""
    host_memory: float = 0.0
    """Bytes of host memory a rank may fill (with ``offload``)."""
    device_memory: Optional[float] = None
    """Bytes of a device (with ``offload``: the budget ``"auto"`` and the verdicts use)."""
    offload_auto: bool = False
    """Whether ``offload`` was picked by ``"auto"``."""
    quantized: Optional[list[QuantizedRow]] = None
    """With ``quantize``: each configuration of quantized collectives, the first none."""
    whole_updates: Optional[WholeUpdates] = None
    """With ``optimizer`` "muon": the owners' Newton-Schulz work, memory and exchanges
    ([Note: planning whole-tensor updates] in zero_fx/planner/features/whole_updates.py)."""

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
