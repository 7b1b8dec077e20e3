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

[Note: planning tensor parallelism]
``--tp T`` plans Megatron-LM's tensor parallelism over T consecutive ranks with ZeRO over
the other dimension of a (dp, tp) mesh, D = W/T ranks at stride T ([Note: ZeRO over
tensor parallelism] in zero_fx/plan/tensor_parallel.py), and sets it beside data
parallelism alone (T = 1) on the same W ranks. Which parameters are split
(``tensor_parallel_split``): every matrix of a repeated block (attention's q, k, v by
heads and its output by rows, the MLP's first matrices by columns and its last by rows)
and, as Megatron does, the vocabulary-parallel embedding and head (a matrix with a
vocabulary-sized side); norms, biases and a learned position table stay whole on every
tensor-parallel rank. Each split parameter counts ceil(numel/T) elements a rank (Megatron
pads a vocabulary T does not divide; a column-parallel bias, split in Megatron, is
counted whole: a few MB). A rank's piece, Ψ_T, is then ZeRO-sharded over D ranks like any
model of Ψ_T parameters: the model-state and traffic tables are ``model_state_breakdown``
and ``TRAFFIC_IN_PSI`` of Ψ_T over D. Stage 3 keeps 16Ψ/W whatever T (Ψ/T over W/T
ranks); stages 0-2, which keep whole parameters, hold 1/T of them.

The working set is not traced under tensor parallelism: the step traced at T = 1 (its
memory timeline, as above) is priced again, as for expert parallelism. A tensor holding
a bucket's whole parameters or gradients (gathered, or about to be reduced) counts 1 - s +
s/T of its bytes, s the split parameters' share of its elements; a shard (a reduced
gradient, Ψ/W) is the same size either way, a piece's Ψ/T over W/T ranks. An activation
counts 1/T where Megatron splits it. Walking the graph in order, a product (mm, addmm,
bmm) of a parameter with a whole activation is column-parallel and its output split; of
a parameter with a split activation, row-parallel and its output whole again (after the
all-reduce); every other op's output is split where one of its inputs is (attention,
SwiGLU, GELU, the logits of the vocabulary-parallel head and their softmax; in the
backward the same rule follows the gradients, and a weight's gradient from a split
activation is split). The residual stream, the norms and their outputs stay whole, on
every rank; with ``--sequence-parallel`` they are split over the sequence too, so every
activation counts 1/T. What is approximated: the transient all-gathered input of a
column-parallel product under sequence parallelism (one b·s·h buffer at a time) and the
vocabulary-parallel cross-entropy's own buffers are left out, and the peak is taken again
on the T = 1 order of nodes. Checked where it runs: the step zero_compile builds for the
tests' GPT split by PyTorch's ColwiseParallel and RowwiseParallel on a (shard 2, tp 2)
mesh peaks within 0.5 % of this price (1 to 4 blocks of width 128 and 256). Sequence
parallelism is priced as Megatron runs it, gathering a product's input again for the
backward; PyTorch's SequenceParallel keeps the gathered input of each column-parallel
product (q, k, v and the MLP's first each gather their own), and that compiled step
peaked 1.30x and 1.37x this price (2 and 4 blocks of width 256).

The seeds' question is whether one layer fits: the largest block's gathered parameters,
its gradients before they are reduced (both in the compute dtype, 1/T of its matrices)
and the activations it keeps for the backward (what one more block adds to the tensors
the traced forward leaves to the backward, priced again for T), beside the estimated peak
of the whole step. Checked against Megatron's count (Korthikanti et al. 2022: a GPT
block keeps 34·sbh bytes in 16-bit with flash attention, 2·sbh of them dropout masks, and
10·sbh of them stay whole under tensor parallelism): gpt-64k (no dropout) at 2048 tokens
in fp16 keeps 32.0·sbh a block at T = 1, 11.0·sbh at T = 8 (8 + 24/8) and 4.0·sbh with
sequence parallelism (32/8). The step time is the cost model's compute divided by T (the
norms' share is not split without sequence parallelism: an approximation), beside which
ZeRO's collectives run on the data-parallel group, plus tensor parallelism's own, which
nothing hides ([Note: pricing tensor parallelism] in zero_fx/analysis/cost_model.py).

[Note: planning offload]
``--offload`` plans ``zero_compile(offload=...)`` and sets every mode the stage allows side
by side, per rank (Ψ parameters, N ranks, p bytes of the compute dtype, o of optimizer
state, K = 4 + o + 4; ``offload_states``):

- ``none``: ``model_state_breakdown`` as above; stage 3 under mixed precision 16Ψ/N.
- ``optimizer`` (stages 1-3): the fp32 masters, the optimizer state and the fp32 gradient
  the optimizer reads live in host memory, KΨ/N (12Ψ/N + 4Ψ/N for Adam). The device keeps
  the compute-dtype parameters, its pΨ/N shard in stage 3 (whole, pΨ, in stages 1-2) and,
  as its gradients, two buckets' reduced shards on their way to the host (stage 1: the
  whole gradients it holds to the end of the backward). Stage 3 in bf16 goes from 16Ψ/N
  to 2Ψ/N plus those buckets.
- ``parameters`` (stage 3): the compute-dtype shards live on the host too ((p + K)Ψ/N,
  or KΨ/N in fp32 where the master is the parameter), and the device keeps two buckets'
  shards on their way to their gathers beside the gradients' two: its model states are
  buffers, and its peak the gathered working set.
- ``auto``: the first of these whose device peak (its model states without ``--seq``)
  fits ``--device-memory`` and whose host states fit the host memory.

Stage 0 is not offloaded (it shards nothing). The working set is not traced again: the
step traced without offload is priced again, as for tensor and expert parallelism. Its
outputs, the reduced gradients, live to the end of the step in the trace; offloaded, each
goes to the host as soon as it is reduced, so each counts until the next is made (one on
its way while the next is reduced). On one rank that is the difference between 27 GB and
1 GB of zero-offload-13b's working set with recompute of blocks: its 25.7 GB of fp16
gradients no longer pile up. The peak is then ``peak_of`` of the device states and that
working set. The gathers' buffers are the same with ``parameters``: a shard copied from
the host is gathered as one on the device would be.

Copies over the host link ([Note: pricing offload] in zero_fx/analysis/cost_model.py):
the reduced gradients go to the host in the compute dtype, pΨ/N (the host widens them to
fp32), during the backward; with ``optimizer`` the updated parameters come back after the
host's step, pΨ/N, which the next forward waits for; with ``parameters`` nothing comes
back, but each gather's shard comes over ahead of it (stage 3 gathers twice: about 2pΨ/N),
prefetched beside the compute. The step is max(compute without the device's optimizer
step, ZeRO's collectives, the copies that overlap) + the host's optimizer step + (with
``optimizer``) the copy back. What is approximated: the copies are not scheduled against
the traced order (a backward shorter than its gradients' copy is exposed only through the
max), the host step is not overlapped with the backward or delayed a step as
ZeRO-Offload's delayed parameter update does, and host memory counts model states only
(no pinned staging buffers, no allocator). ``largest_model`` inverts ``offload_states``:
the most parameters whose model states fit the device and the host, before activations.
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

from ..analysis.memory_timeline import memory_timeline, peak_alive
from ..config import DEFAULT_BUCKET_BYTES, DEFAULT_PERSISTENCE_THRESHOLD
from .build import PlanOptions, PlanRanks, plan_for_module
from .layout import BLOCKS, ShardPlan, block_of
from .models import ModelSource, on_meta
from .quantization import (QuantizedRow, check_quantizable, format_quantization,
                           price_quantization)
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


def expert_blocks(model: torch.nn.Module) -> Optional[ExpertBlocks]:
    """The mixture-of-experts blocks of ``model`` as zero_fx's capture recognises them
    (zero_fx/capture/routed_experts.py), or None for a dense model."""
    from ..capture.fused_experts import splittable_fused_experts
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
    from ..capture.fused_experts import holds_stacked_experts
    from ..capture.routed_experts import TOP_K_NAMES, _shared_expert

    if block is None or not holds_stacked_experts(module):
        return None
    # the config last: transformers 4's configs also hold generation's `top_k` (50)
    places = [block, *block.children(), getattr(module, "config", None)]
    top_k = next((k for place in places for name in TOP_K_NAMES
                  if isinstance(k := getattr(place, name, None), int)), None)
    if top_k is None:
        return None
    num_experts = module.down_proj.shape[0]
    return num_experts, min(top_k, num_experts), _shared_expert(block) is not None


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


OFFLOAD_MODES = ("none", "optimizer", "parameters")
"""``zero_compile(offload=...)``'s modes, least offload first; ``"auto"`` picks the first
that fits ([Note: planning offload])."""


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
    ([Note: expert capacity] in zero_fx/capture/expert_exchange.py); None: the worst case."""
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
               expert_capacity_factor: Optional[float] = None, tensor_parallel: int = 1,
               sequence_parallel: bool = False, offload: str = "none",
               host_memory: Optional[float] = None,
               device_memory: Optional[float] = None, quantize: bool = False) -> PlanReport:
    """Plan ``source``'s model on ``world_size`` ranks; trace the working set when ``seq`` is
    given, with ``recompute`` (and its budget) as ``zero_compile`` takes them. ``nodes`` > 1:
    also set flat and hybrid sharding side by side ([Note: what the planner counts]).
    ``expert_parallel``: degrees of expert parallelism to compare (stage 3, with ``seq``),
    their step times on ``hardware`` (a cost-model preset; default 8xH100 over NVLink up
    to 8 ranks, nodes of 8 over InfiniBand above; [Note: planning expert parallelism]),
    their buffers of received rows sized by ``expert_capacity_factor`` (None: the worst
    case; [Note: expert capacity] in zero_fx/capture/expert_exchange.py).
    ``tensor_parallel`` T > 1: each rank holds its Megatron piece of the model, ZeRO-sharded
    over ``world_size / T`` ranks, and the report sets it beside data parallelism alone
    (``sequence_parallel``: the norms' activations split too; [Note: planning tensor
    parallelism]).
    ``offload``: ``"optimizer"``, ``"parameters"`` or ``"auto"`` sets every mode the stage
    allows side by side, device and host bytes, copies and the host's optimizer step, with
    ``host_memory`` bytes a rank (default: the preset's) and ``device_memory`` bytes a device
    (``"auto"`` picks the least offload that fits it; [Note: planning offload]).
    ``quantize``: ZeRO++'s quantized collectives, each configuration the stage allows,
    priced on ``hardware`` ([Note: when quantizing pays] in zero_fx/plan/quantization.py)."""
    check_offload(offload, stage=stage, device_memory=device_memory,
                  others=tensor_parallel > 1 or bool(expert_parallel))
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    tp = tensor_parallel
    if tp < 1 or world_size % tp:
        raise ValueError(f"tensor parallelism of {tp} ranks must divide the {world_size} ranks "
                         f"(--tp must divide --world): use one of {_divisors(world_size)}")
    if tp > 1 and expert_parallel:
        raise ValueError("plan tensor parallelism (--tp) and expert parallelism "
                         "(--expert-parallel) one at a time")
    if tp > 1 and nodes > 1:
        raise ValueError("--tp with --nodes is not planned: leave out --nodes (the "
                         "tensor-parallel group is T ranks of a node; --hardware 4x8xh100-ib "
                         "prices ZeRO's data-parallel group across nodes)")
    if sequence_parallel and tp == 1:
        raise ValueError("sequence parallelism splits what tensor parallelism leaves whole: "
                         "give --tp > 1 too")
    if nodes < 1 or world_size % nodes:
        raise ValueError(f"{world_size} ranks do not split evenly over {nodes} nodes")
    degrees = tuple(dict.fromkeys(expert_parallel))
    if degrees and stage != 3:
        raise ValueError(f"planning expert parallelism needs stage 3: the planner estimates it "
                         f"there only (training runs it at stages 1 and 2 too), got stage {stage}")
    if degrees and seq is None:
        raise ValueError("expert parallelism is planned from the step's working set: give seq "
                         "(--seq) too")
    if quantize:
        check_quantizable(stage, world_size)
    if quantize and seq is None:
        raise ValueError("quantized collectives are priced on the traced step: give seq "
                         "(--seq) too")
    if quantize and (degrees or tp > 1 or offload != "none" or nodes > 1):
        raise ValueError("plan --quantize without --tp, --expert-parallel, --offload and "
                         "--nodes (one question at a time)")
    start = time.perf_counter()
    model = on_meta(lambda: source.build(None))
    item = dtype.itemsize
    mixed = item < 4

    def plan_over(ranks: int) -> ShardPlan:
        return plan_for_module(model, PlanRanks(ranks), PlanOptions(
            stage=stage, resident_max_numel=DEFAULT_PERSISTENCE_THRESHOLD,
            bucket_bytes=DEFAULT_BUCKET_BYTES[stage], compute_dtype=dtype if mixed else None,
            reduce_dtype=dtype if mixed else None))

    experts = expert_blocks(model)
    shape, split = None, frozenset()
    if tp > 1:
        shape = tensor_parallel_shape(model)
        check_tensor_parallel(tp, world_size, shape, experts)
        split = tensor_parallel_split(model, shape.vocab)
    plan = plan_over(world_size // tp)
    stages = [_stage_plan(s, plan, item, mixed, optimizer, tp, split) for s in range(4)]
    report = PlanReport(
        model=source.description, world_size=world_size, stage=stage, dtype=dtype,
        optimizer=optimizer, psi=plan.total_numel, tensors=len(plan.params),
        padding=plan.padding_numel, stages=stages,
        buckets=_buckets(plan, item, tp, split), bucket_cap=plan.bucket_bytes,
        resident=len(plan.resident), experts=experts, tensor_parallel=tp,
        sequence_parallel=sequence_parallel, psi_per_rank=_psi_per_rank(plan, tp, split))
    offloading = offload != "none"
    if degrees or tp > 1 or offloading or quantize:
        report.hardware = hardware or ("8xh100-nvlink" if world_size <= 8 else "4x8xh100-ib")
    if degrees:
        _check_degrees(degrees, world_size, report.experts)
        report.expert_capacity_factor = expert_capacity_factor
    traced = per_block = None
    if seq is not None:
        report.tokens_per_rank = (batch or 1) * seq
        traced, report.working_set_how, per_block = _working_set(
            source, world_size=world_size, stage=stage, dtype=dtype, batch=batch or 1, seq=seq,
            recompute={"recompute": recompute, **_budget_option(activation_memory_budget)},
            experts=report.experts if degrees else None, degrees=degrees,
            hardware=report.hardware, capacity_factor=expert_capacity_factor,
            tensor_parallel=(tp, split, sequence_parallel) if tp > 1 else None,
            offload=offloading)
        report.working_set = traced["tp" if tp > 1 else 1]
        if degrees:
            report.expert_parallel = [
                _expert_parallel_row(report, plan, p, traced, (batch or 1) * seq)
                for p in degrees]
    if tp > 1:
        flat = plan_over(world_size)
        count = _tensor_parallel_collectives(flat, recompute)
        report.tensor_parallel_rows = [
            _tensor_parallel_row(report, on, degree, chosen, shape, count, traced, per_block,
                                 mixed)
            for on, degree, chosen in ((flat, 1, frozenset()), (plan, tp, split))]
        report.largest_block = _largest_block(plan, tp, split)[0]
    if offloading:
        _plan_offload(report, offload, traced, host_memory, device_memory)
    if quantize:
        report.quantized = price_quantization(
            source, world_size=world_size, stage=stage, dtype=dtype, batch=batch or 1, seq=seq,
            hardware=report.hardware, steady_from=STEADY_FROM)
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


# -- offload ([Note: planning offload]) ------------------------------------------------------


def check_offload(offload: str, *, stage: int, device_memory: Optional[float] = None,
                  others: bool = False) -> None:
    """A ValueError that says what to do instead where ``offload`` cannot apply."""
    if offload not in (*OFFLOAD_MODES, "auto"):
        raise ValueError(f"offload must be one of {', '.join(OFFLOAD_MODES)} or auto, got "
                         f"{offload!r}")
    if offload == "none":
        return
    if stage == 0:
        raise ValueError("offload moves a rank's shard of the optimizer state to the host; "
                         "stage 0 shards nothing: plan --stage 1, 2 or 3 (on one rank they "
                         "hold the same states)")
    if offload == "parameters" and stage != 3:
        raise ValueError(f"offload 'parameters' keeps the parameter shards on the host, and "
                         f"only stage 3 shards parameters (stage {stage} keeps them whole on "
                         f"every device): use --stage 3, or --offload optimizer")
    if offload == "auto" and device_memory is None:
        raise ValueError("--offload auto picks the least offload that fits the device: give "
                         "--device-memory GB")
    if others:
        raise ValueError("plan --offload with --tp or --expert-parallel one at a time")


def offload_modes(stage: int) -> tuple[str, ...]:
    """The modes ``stage`` allows, least offload first."""
    return OFFLOAD_MODES if stage == 3 else OFFLOAD_MODES[:2]


def offload_states(stage: int, psi: float, world_size: int, mode: str, *, optimizer_bytes: int,
                   param_bytes: int, staging: tuple[float, float] = (0.0, 0.0)
                   ) -> tuple[dict[str, float], dict[str, float]]:
    """(device, host) model-state bytes per rank by kind under ``mode`` ([Note: planning
    offload]). ``staging``: bytes of the device's buffers for gradients on their way to the
    host and (``"parameters"``) for shards on their way to the device."""
    p, o, n = param_bytes, optimizer_bytes, world_size
    device = model_state_breakdown(stage, psi, n, optimizer_bytes=o, param_bytes=p,
                                   reduce_bytes=p)
    host = dict.fromkeys(device, 0.0)
    if mode == "none":
        return device, host
    grads, shards = staging
    whole = stage < 3  # stages 1 and 2 keep whole parameters on the device
    device = {"parameters": (p * psi if whole else p * psi / n) if mode == "optimizer" else shards,
              # stage 1 holds the whole gradients to the end of the backward
              "gradients": p * psi if stage == 1 else grads,
              "masters": 0.0, "optimizer": 0.0}
    host = {"parameters": p * psi / n if mode == "parameters" and p < 4 else 0.0,
            "gradients": 4 * psi / n, "masters": 4 * psi / n, "optimizer": o * psi / n}
    return device, host


def largest_model(stage: int, world_size: int, mode: str, *, optimizer_bytes: int,
                  param_bytes: int, device_memory: float, host_memory: float
                  ) -> tuple[float, str]:
    """The most parameters whose model states fit ``device_memory`` and ``host_memory`` bytes
    a rank under ``mode``, before activations and the working set, and which memory bounds
    them ("device" or "host"; [Note: planning offload])."""
    device, host = offload_states(stage, 1.0, world_size, mode, optimizer_bytes=optimizer_bytes,
                                  param_bytes=param_bytes)
    per_device, per_host = sum(device.values()), sum(host.values())
    on_device = device_memory / per_device if per_device else math.inf
    on_host = host_memory / per_host if per_host else math.inf
    return (on_device, "device") if on_device <= on_host else (on_host, "host")


def _streamed_peak(gm: GraphModule) -> float:
    """The working set of ``gm`` with its gradient outputs streamed to the host: each output
    lives until the next one is made (one on its way while the next is reduced), not to the
    end of the step ([Note: planning offload])."""
    timeline = memory_timeline(gm)
    end = len(timeline.transient) - 1
    outputs = sorted(t.index for t in timeline.tensors if t.last_use == end)
    following = dict(zip(outputs, outputs[1:] + [end]))
    return peak_alive(len(timeline.transient),
                 ((t.index, following[t.index] if t.last_use == end else t.last_use, t.bytes)
                  for t in timeline.tensors))


def _device_optimizer_seconds(plan: ShardPlan, preset: str) -> float:
    """The device's optimizer step as the cost model's replay prices it ([Note: the cost
    model]): what offload takes off the device."""
    from ..analysis.cost_model import hardware

    hw = hardware(preset)
    shard = sum(l.shard_numel * l.dtype.itemsize for l in plan.params if plan.holds(l.name))
    return 7 * shard * (plan.world_size if plan.replicated else 1) / hw.memory_bandwidth \
        + hw.op_overhead * len(plan.params)


def _plan_offload(report: PlanReport, offload: str, traced: Optional[dict],
                  host_memory: Optional[float], device_memory: Optional[float]) -> None:
    """Every mode the stage allows, side by side in ``report.offload_rows``, and the mode
    planned in ``report.offload`` (``"auto"``: the least offload that fits)."""
    from ..analysis.cost_model import (hardware, host_device_seconds, host_optimizer_seconds,
                                       ring_seconds)

    hw = hardware(report.hardware)
    host_budget = hw.host_memory if host_memory is None else host_memory
    if not host_budget:
        raise ValueError(f"the preset {report.hardware} states no host memory: give "
                         "--host-memory GB")
    n, psi, p = report.world_size, report.psi, report.dtype.itemsize
    o, stage = OPTIMIZER_BYTES[report.optimizer], report.stages[report.stage]

    def largest(kind: str) -> int:
        return max((b.bytes for b in report.buckets.get(kind, [])), default=0)

    # double-buffered: one bucket's shard on its way while the next is reduced (gathered)
    staging = (2 * largest("reduce_scatter") / n, 2 * largest("all_gather") / n)
    collectives = sum(ring_seconds(size, range(n), hw) * (2 if kind == "all_reduce" else 1)
                      for kind, size in stage.traffic.items())
    rows = []
    for mode in offload_modes(report.stage):
        device, host = offload_states(report.stage, psi, n, mode, optimizer_bytes=o,
                                      param_bytes=p, staging=staging)
        working = None if traced is None else traced[1 if mode == "none" else "streamed"]
        shard = psi / n  # a rank's elements of masters, optimizer state, reduced gradients
        to_host = 0.0 if mode == "none" else p * shard
        to_device = {"none": 0.0, "optimizer": p * shard,
                     "parameters": stage.traffic.get("all_gather", 0) / n}[mode]
        compute = None
        if traced is not None:
            compute = traced["compute"] - (0.0 if mode == "none" else traced["device_optimizer"])
        rows.append(OffloadRow(
            mode=mode, device=device, host=host, working_set=working,
            peak_bytes=None if working is None else peak_of(device, working),
            to_host=to_host, to_device=to_device,
            copy_seconds=(0.0, 0.0) if mode == "none" else
            (host_device_seconds(to_host, hw), host_device_seconds(to_device, hw)),
            host_step_seconds=0.0 if mode == "none" else host_optimizer_seconds(
                shard, hw, optimizer_bytes=o, param_bytes=p),
            compute_seconds=compute, collective_seconds=collectives))
    report.offload_rows, report.host_memory = rows, host_budget
    report.device_memory = device_memory if device_memory is not None else (
        hw.device_memory or None)
    report.offload_auto = offload == "auto"
    if offload == "auto":
        report.offload = next((r.mode for r in rows if offload_fits(report, r)), rows[-1].mode)
    else:
        report.offload = offload


def offload_fits(report: PlanReport, row: OffloadRow) -> bool:
    """Whether ``row``'s device peak (its model states without ``seq``) fits the report's
    device memory and its host states the host memory."""
    device = row.device_bytes if row.peak_bytes is None else row.peak_bytes
    return ((report.device_memory is None or device <= report.device_memory)
            and row.host_bytes <= report.host_memory)


# -- tensor parallelism ([Note: planning tensor parallelism]) -------------------------------


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def tensor_parallel_shape(model: torch.nn.Module) -> Optional[TensorParallelShape]:
    """Heads, key/value heads, width, feed-forward width and vocabulary of a HuggingFace
    model (its ``config``) or of zero_fx's torch GPT or Llama (its ``cfg``); None for any
    other model."""
    hf = getattr(model, "config", None)
    if hf is not None and hasattr(hf, "num_attention_heads"):
        heads, hidden = hf.num_attention_heads, hf.hidden_size
        ffn = getattr(hf, "intermediate_size", None) or getattr(hf, "n_inner", None) or 4 * hidden
        return TensorParallelShape(heads, getattr(hf, "num_key_value_heads", None) or heads,
                                   hidden, ffn, hf.vocab_size)
    cfg = getattr(model, "cfg", None)
    if hasattr(cfg, "n_embd"):  # GPTConfig
        return TensorParallelShape(cfg.n_head, cfg.n_head, cfg.n_embd, 4 * cfg.n_embd,
                                   cfg.vocab_size)
    if hasattr(cfg, "ffn_dim"):  # LlamaConfig
        return TensorParallelShape(cfg.n_head, cfg.n_kv_head, cfg.dim, cfg.ffn_dim,
                                   cfg.vocab_size)
    return None


def check_tensor_parallel(degree: int, world_size: int, shape: Optional[TensorParallelShape],
                          experts: Optional[ExpertBlocks]) -> None:
    """A ValueError that says what to change where ``degree`` cannot split the model."""
    if experts is not None:
        raise ValueError("tensor parallelism is planned for dense models: split a mixture of "
                         "experts with --expert-parallel instead of --tp")
    if shape is None:
        raise ValueError("tensor parallelism reads the heads, width and feed-forward width "
                         "from a named model or a HuggingFace config.json; this model has "
                         "neither (give --model a name or a config)")
    sizes = (("attention heads", shape.heads), ("key/value heads", shape.kv_heads),
             ("width", shape.hidden), ("feed-forward width", shape.ffn))
    for what, size in sizes:
        if size % degree:
            common = math.gcd(world_size, *(n for _, n in sizes))
            raise ValueError(f"--tp {degree} does not divide the model's {size} {what} "
                             f"(Megatron splits heads, width and feed-forward width evenly): "
                             f"use --tp {_divisors(common)}")


def tensor_parallel_split(model: torch.nn.Module, vocab: int) -> frozenset:
    """Names of the parameters tensor parallelism splits: every matrix of a repeated block,
    and a matrix with a side of ``vocab`` (the vocabulary-parallel embedding and head);
    norms, biases, position tables stay whole ([Note: planning tensor parallelism])."""
    return frozenset(name for name, p in model.named_parameters()
                     if p.ndim == 2 and (_in_block(name) or vocab in p.shape))


def _in_block(name: str) -> bool:
    return any(part.isdigit() for part in block_of(name).split("."))


def _piece(numel: int, degree: int) -> int:
    """Elements of one rank's piece of a split parameter."""
    return -(-numel // degree)


def _pieces(plan: ShardPlan, tp: int, split: frozenset) -> dict[str, int]:
    """Each parameter's elements on a rank: its piece if ``split``, else all of it."""
    return {layout.name: _piece(layout.numel, tp) if layout.name in split else layout.numel
            for layout in plan.params}


def _psi_per_rank(plan: ShardPlan, tp: int, split: frozenset) -> int:
    return sum(_pieces(plan, tp, split).values())


def _largest_block(plan: ShardPlan, tp: int, split: frozenset) -> tuple[str, int]:
    """The repeated block of the most elements a rank holds, and their count."""
    blocks: dict[str, int] = {}
    for name, numel in _pieces(plan, tp, split).items():
        if _in_block(name):
            blocks[block_of(name)] = blocks.get(block_of(name), 0) + numel
    if not blocks:
        return "", 0
    name = max(blocks, key=blocks.get)
    return name, blocks[name]


def _tensor_parallel_collectives(plan: ShardPlan, recompute: Optional[str]) -> int:
    """Tensor parallelism's collectives of b·s·h per step ([Note: pricing tensor
    parallelism]): 4 a block, 6 with the recompute of blocks (the forward again), and 2 for
    the vocabulary-parallel embedding and head."""
    from ..analysis.cost_model import TP_COLLECTIVES_PER_BLOCK

    blocks = len({block_of(layout.name) for layout in plan.params if _in_block(layout.name)})
    return (TP_COLLECTIVES_PER_BLOCK + (2 if recompute == "blocks" else 0)) * blocks + 2


def _tensor_parallel_row(report: PlanReport, plan: ShardPlan, degree: int, split: frozenset,
                         shape: TensorParallelShape, collectives: int, traced: Optional[dict],
                         per_block: Optional[dict], mixed: bool) -> TensorParallelRow:
    """Degree ``degree``'s states, largest block, working set, bytes and time per rank
    ([Note: planning tensor parallelism]); ``plan`` shards over the data-parallel ranks."""
    from ..analysis.cost_model import (data_parallel_ranks, hardware, ring_seconds,
                                       tensor_parallel_seconds)

    hw, item, key = hardware(report.hardware), report.dtype.itemsize, "tp" if degree > 1 else 1
    stage = _stage_plan(report.stage, plan, item, mixed, report.optimizer, degree, split)
    pieces = _pieces(plan, degree, split)
    matrix = max((pieces[layout.name] for layout in plan.params
                  if len(layout.shape) == 2 and _in_block(layout.name)), default=0)
    working = None if traced is None else traced[key]
    ranks = data_parallel_ranks(report.world_size, degree)
    activation = report.tokens_per_rank * shape.hidden * item  # b·s·h
    return TensorParallelRow(
        degree=degree, params_per_rank=sum(pieces.values()), state_bytes=stage.state_bytes,
        block_params=_largest_block(plan, degree, split)[1] * item,
        block_activations=None if per_block is None else per_block[("kept", key)],
        largest_matrix=matrix * item, working_set=working,
        peak_bytes=None if working is None else peak_of(stage.states, working),
        tp_bytes=collectives * activation if degree > 1 else 0.0,
        tp_seconds=collectives * tensor_parallel_seconds(activation, degree, hw) if activation
        else 0.0,
        zero_bytes=sum(stage.traffic.values()),
        zero_seconds=sum(ring_seconds(size, ranks, hw) * (2 if kind == "all_reduce" else 1)
                         for kind, size in stage.traffic.items()),
        compute_seconds=None if traced is None else traced["compute"] / degree)


_PRODUCTS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
             torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default)


def _tensor_parallel_shares(gm: GraphModule, plan: ShardPlan, split: frozenset,
                            sequence_parallel: bool) -> tuple[dict[str, float], set[str]]:
    """Node name -> the share of its bytes that tensor parallelism splits ([Note: planning
    tensor parallelism]): a parameter tensor's split elements; an activation's 1 where
    Megatron splits it (or everywhere, with ``sequence_parallel``), else 0. Then the names
    of the nodes that hold parameters or their gradients' buckets."""
    from ..passes.predicates import carried_params, is_param_input, is_view, param_name

    def of_bucket(node, names) -> float:
        sizes = [(plan.layout(n).padded_numel, n in split) for n in names]
        whole = sum(s for s, _ in sizes)
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.numel() < whole:
            return 0.0  # a shard: Ψ/W of the bucket, a piece's Ψ/T over W/T ranks alike
        return sum(s for s, is_split in sizes if is_split) / max(1, whole)

    params: dict = {}  # node -> split share, for nodes that are parameters (or views of them)
    cut: dict = {}  # node -> whether Megatron splits the activation
    for node in gm.graph.nodes:
        inputs = node.all_input_nodes
        if carried_params(node):
            params[node] = of_bucket(node, carried_params(node))
        elif is_param_input(node):
            params[node] = float(param_name(node) in split)
        elif inputs and inputs[0] in params and (
                is_view(node) or node.target is torch.ops.aten._to_copy.default):
            params[node] = params[inputs[0]]
        else:
            acts = [n for n in inputs if n not in params]
            if node.target in _PRODUCTS and acts and len(acts) < len(inputs):
                # parameter x whole activation: column-parallel, its output split;
                # parameter x split activation: row-parallel, its output whole (all-reduced)
                cut[node] = not cut.get(acts[0], False)
            elif node.target is torch.ops.aten.embedding_dense_backward.default:
                cut[node] = True  # the vocabulary-parallel embedding's gradient
            else:
                cut[node] = any(cut.get(n, False) for n in acts)
    shares = {node.name: float(sequence_parallel or is_cut) for node, is_cut in cut.items()}
    shares.update({node.name: share for node, share in params.items()})
    return shares, {node.name for node in params}


def _tensor_parallel_prices(gm: GraphModule, plan: ShardPlan, split: frozenset, degree: int,
                            sequence_parallel: bool) -> dict:
    """The working set of ``gm`` (traced without tensor parallelism) priced again for
    ``degree``, ``"tp"``, and the activations the forward keeps for the backward at 1 and
    at ``degree``, ``("kept", 1)`` and ``("kept", "tp")`` ([Note: planning tensor
    parallelism])."""
    timeline = memory_timeline(gm)
    shares, params = _tensor_parallel_shares(gm, plan, split, sequence_parallel)

    def priced(t) -> float:
        return t.bytes * (1 - shares.get(t.node, 0.0) * (1 - 1 / degree))

    kept = [t for t in timeline.tensors if t.node not in params and t.phase == "forward"
            and t.last_use < len(timeline.phases) and timeline.phases[t.last_use] == "backward"]
    return {"tp": peak_alive(len(timeline.transient),
                        ((t.index, t.last_use, priced(t)) for t in timeline.tensors)),
            ("kept", 1): float(sum(t.bytes for t in kept)),
            ("kept", "tp"): sum(priced(t) for t in kept)}


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

    def scale(p: int, share: float, rows) -> float:
        if rows is None:
            return 1 - share + share / p
        e, k = rows
        rows_scale = _buffer_rows(tokens, p, e, k, capacity_factor) / (tokens * k)
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


def _stage_plan(stage: int, plan: ShardPlan, item: int, mixed: bool, optimizer: str,
                tp: int = 1, split: frozenset = frozenset()) -> StagePlan:
    """The stage's states and traffic per rank; with ``tp`` > 1, of a rank's tensor-parallel
    piece (``split`` parameters 1/tp each) over ``plan``'s ranks ([Note: planning tensor
    parallelism])."""
    psi, n = _psi_per_rank(plan, tp, split), plan.world_size
    states = model_state_breakdown(stage, psi, n, optimizer_bytes=OPTIMIZER_BYTES[optimizer],
                                   param_bytes=item, reduce_bytes=item)
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
    paper = zero_paper_bytes(stage, psi, n) if mixed else float("nan")
    return StagePlan(stage=stage, states=states, paper_bytes=paper, traffic=traffic,
                     wire_bytes=wire)


def _padded_pieces(plan: ShardPlan, tp: int, split: frozenset) -> dict[str, int]:
    """Each parameter's elements on a rank, padded to a multiple of ``plan``'s ranks."""
    n = plan.world_size
    return {layout.name: -(-_piece(layout.numel, tp) // n) * n if layout.name in split
            else layout.padded_numel for layout in plan.params}


def _buckets(plan: ShardPlan, item: int, tp: int = 1,
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


def _working_set(source: ModelSource, *, world_size: int, stage: int, dtype: torch.dtype,
                 batch: int, seq: int, recompute: dict, experts: Optional[ExpertBlocks] = None,
                 degrees: Sequence[int] = (), hardware: str = "",
                 capacity_factor: Optional[float] = None,
                 tensor_parallel: Optional[tuple[int, frozenset, bool]] = None,
                 offload: bool = False) -> tuple[dict, str, Optional[dict]]:
    """The working set extrapolated to the model's depth, ``{1: bytes}``; with ``experts``,
    also each degree of ``degrees`` and the cost model's ``"compute"`` seconds on
    ``hardware`` ([Note: planning expert parallelism]); with ``tensor_parallel`` (degree,
    split parameters, sequence parallelism), ``"tp"``: the working set priced again for it,
    and ``"compute"`` ([Note: planning tensor parallelism]); with ``offload``,
    ``"streamed"``: the working set with the reduced gradients streamed to the host,
    ``"compute"`` and ``"device_optimizer"``, the part of it the device's optimizer step
    takes ([Note: planning offload]). Then how it was had, and what one more block adds to
    each (None where the model was traced whole)."""
    from ..plan.offline import rewritten_step_on_fake  # traces through the passes: import on use

    def traced_peak(layers: Optional[int], dense_layers: Optional[int] = None) -> dict:
        build = ((lambda: source.build(layers)) if dense_layers is None
                 else (lambda: source.build(layers, dense_layers)))
        gm, plan = rewritten_step_on_fake(
            build, batch=batch, seq=seq, vocab_size=source.vocab_size,
            world_size=world_size, stage=stage, dtype=dtype, loss_fn=_causal_lm_loss, **recompute)
        if experts is None and tensor_parallel is None and not offload:
            return {1: float(max(memory_timeline(gm).transient))}
        from ..analysis.cost_model import replay

        if offload:
            out = {1: float(max(memory_timeline(gm).transient)), "streamed": _streamed_peak(gm),
                   "device_optimizer": _device_optimizer_seconds(plan, hardware)}
        elif experts is not None:
            out: dict = _peaks_by_degree(gm, plan, experts, batch * seq,
                                         sorted({1, *degrees}), capacity_factor)
        else:
            degree, split, sequence_parallel = tensor_parallel
            out = {1: float(max(memory_timeline(gm).transient)),
                   **_tensor_parallel_prices(gm, plan, split, degree, sequence_parallel)}
        out["compute"] = replay(gm, plan, hardware).estimate.compute_seconds
        return out

    def grow(base: dict, *more: tuple[int, dict]) -> dict:  # base + n x (traced - base), by key
        return {key: base[key] + sum(n * (t[key] - base[key]) for n, t in more) for key in base}

    if source.vocab_size is None:
        raise SystemExit("the model has no nn.Embedding to read a vocabulary size from")
    if source.max_positions is not None and seq > source.max_positions:
        raise SystemExit(f"--seq {seq} is longer than the model's {source.max_positions} positions")
    chosen = recompute["recompute"] or ("auto" if len(recompute) > 1 else None)
    # tensor parallelism asks what one block adds: a model of STEADY_FROM + 1 blocks is
    # traced with STEADY_FROM and with all of them, which is tracing it whole
    if source.layers is None or source.layers <= STEADY_FROM + (tensor_parallel is None):
        return traced_peak(None), (f"batch {batch} x {seq} tokens per rank, recompute "
                                   f"{chosen or 'none'}; traced whole"), None
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
        return total, how, None
    base, grown = traced_peak(first), traced_peak(first + 1)
    total = grow(base, (source.layers - first, grown))
    how = (f"batch {batch} x {seq} tokens per rank, recompute {chosen or 'none'}; "
           f"traced with {first} and {first + 1} of {source.layers} blocks on fake tensors: "
           f"{base[1] / GB:.2f} GB + {source.layers - first} x {(grown[1] - base[1]) / GB:.3f} GB")
    return total, how, {key: grown[key] - base[key] for key in base}


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
    tp, dp = report.tensor_parallel, n // report.tensor_parallel
    lines = [
        f"zero_fx plan: {report.model} on {n} ranks, {precision}, {report.optimizer}",
        f"{report.psi / 1e9:.3f}B parameters (Ψ) in {report.tensors} tensors; padding to {dp} "
        f"ranks adds {report.padding:,} elements. Planned in {report.seconds:.1f} s. "
        "GB = 10^9 bytes.",
        *_format_experts(report),
        *([] if tp == 1 else [
            f"Tensor parallelism {tp} x ZeRO over {dp} ranks: a rank holds 1/{tp} of every "
            f"block's matrices and of the vocabulary-parallel embedding and head, the norms "
            f"whole: Ψ_T = {report.psi_per_rank / 1e9:.3f}B elements, sharded over the {dp} "
            "data-parallel ranks. The tables below are per rank, of that piece."]),
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
              "| stage | all-reduce | reduce-scatter | all-gather | sent over a ring | in Ψ"
              + ("_T |" if tp > 1 else " |"),
              "|---|---|---|---|---|---|"]
    for s in report.stages:
        cells = [f"{s.traffic[k] / GB:.2f}" if k in s.traffic else "—"
                 for k in ("all_reduce", "reduce_scatter", "all_gather")]
        in_psi = sum(s.traffic.values()) / (report.psi_per_rank * report.dtype.itemsize)
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
                  f"reduced), stage {report.stage}"
                  + (f", tensor parallelism {tp} (the traced step priced again)" if tp > 1 else "")
                  + f": {report.working_set / GB:.2f} GB",
                  f"    ({report.working_set_how})",
                  f"Estimated peak per rank, stage {report.stage}"
                  + (", without offload" if report.offload_rows else "")
                  + f": {peak / GB:.2f} GB"]
        if device_memory_gb is not None:
            verdict = "fits" if peak <= device_memory_gb * GB else "does NOT fit"
            lines.append(f"    {verdict} in {device_memory_gb:g} GB per device")
    if report.expert_parallel:
        lines += ["", *_format_expert_parallel(report, device_memory_gb)]
    if report.tensor_parallel_rows:
        lines += ["", *_format_tensor_parallel(report, device_memory_gb)]
    if report.offload_rows:
        lines += ["", *_format_offload(report)]
    if report.quantized:
        lines += ["", *format_quantization(report.quantized, report.hardware, report.world_size)]
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


def _format_tensor_parallel(report: PlanReport, device_memory_gb: Optional[float]) -> list[str]:
    """The seeds' question: does the largest block fit one device, with data parallelism
    alone and with tensor parallelism ([Note: planning tensor parallelism])."""
    tp, n = report.tensor_parallel, report.world_size
    sp = "on" if report.sequence_parallel else "off (--sequence-parallel)"

    def gb(x: Optional[float]) -> str:
        return "—" if x is None else f"{x / GB:.2f} GB"

    def fits(x: Optional[float]) -> str:
        if x is None or device_memory_gb is None:
            return ""
        return " (fits)" if x <= device_memory_gb * GB else " (does NOT fit)"

    lines = [f"Tensor parallelism against data parallelism alone, stage {report.stage}, {n} "
             f"ranks (tp {tp}: Megatron's column and row split of each block over {tp} "
             f"consecutive ranks, ZeRO over the {n // tp} at stride {tp}; sequence parallelism "
             f"{sp}; per rank; times on {report.hardware}; [Note: planning tensor "
             "parallelism] in zero_fx/plan/planner.py):", "",
             "| tp | parameters per rank | model states | largest block: parameters + "
             "gradients + activations | largest matrix | working set | estimated peak | "
             "TP collectives | ZeRO collectives | step (compute, ZeRO, TP) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in report.tensor_parallel_rows:
        name = f"{row.degree}" + (" (data parallel only)" if row.degree == 1 else "")
        kept = "—" if row.block_activations is None else f"{row.block_activations / GB:.2f}"
        block = (f"{row.block_params / GB:.2f} + {row.block_params / GB:.2f} + {kept} = "
                 f"{row.block_bytes / GB:.2f} GB{fits(row.block_bytes)}")
        tp_cell = ("—" if not report.tokens_per_rank else
                   f"{row.tp_bytes / GB:.2f} GB, {1e3 * row.tp_seconds:.0f} ms")
        step = ("—" if row.step_seconds is None else
                f"{1e3 * row.step_seconds:.0f} ms ({1e3 * row.compute_seconds:.0f}, "
                f"{1e3 * row.zero_seconds:.0f}, {1e3 * row.tp_seconds:.0f})")
        lines.append(
            f"| {name} | {row.params_per_rank / 1e9:.2f}B | {row.state_bytes / GB:.2f} GB | "
            f"{block} | {row.largest_matrix / GB:.2f} GB | {gb(row.working_set)} | "
            f"{gb(row.peak_bytes)}{fits(row.peak_bytes)} | {tp_cell} | "
            f"{row.zero_bytes / GB:.2f} GB, {1e3 * row.zero_seconds:.0f} ms | {step} |")
    tokens = report.working_set_how.split(" tokens")[0].removeprefix("batch ")
    lines.append(
        f"The largest block is {report.largest_block}: its parameters gathered and its "
        "gradients before they are reduced (the compute dtype), and the activations it keeps "
        "for the backward"
        + (f" at {tokens} tokens per rank" if report.tokens_per_rank else " (give --seq)")
        + ". TP collectives: 4 all-reduces of b·s·h a block (2 forward, 2 backward), 2 for "
        "the embedding and head, none hidden; ZeRO's carry a rank's piece over the "
        "data-parallel ranks. The step is max(compute/T, ZeRO) + TP.")
    return lines


def _format_offload(report: PlanReport) -> list[str]:
    """Every offload mode the stage allows, device and host side by side, and the largest
    model each fits ([Note: planning offload])."""
    n, stage, device = report.world_size, report.stage, report.device_memory
    dtype = str(report.dtype).removeprefix("torch.")
    ranks = f"{n} rank" + ("s" if n > 1 else "")
    budget = (f"device {device / GB:g} GB" if device is not None else "device memory not given")
    lines = [f"Offload, stage {stage}, {ranks} (per rank per step; {budget}, host "
             f"{report.host_memory / GB:g} GB; copies and the host's optimizer step on "
             f"{report.hardware}; [Note: planning offload] in zero_fx/plan/planner.py):", "",
             "| offload | device: model states | working set | device: estimated peak | "
             "host: model states | to host + to device | copies | host optimizer step | "
             "step |", "|---|---|---|---|---|---|---|---|---|"]

    def verdict(fits: bool) -> str:
        return " (fits)" if fits else " (does NOT fit)"

    for row in report.offload_rows:
        mark = " ←" if row.mode == report.offload else ""
        on_device = row.device_bytes if row.peak_bytes is None else row.peak_bytes
        device_fits = "" if device is None else verdict(on_device <= device)
        states = f"{row.device_bytes / GB:.2f} GB" + (device_fits if row.peak_bytes is None
                                                       else "")
        working = "—" if row.working_set is None else f"{row.working_set / GB:.2f} GB"
        peak = "—" if row.peak_bytes is None else f"{row.peak_bytes / GB:.2f} GB{device_fits}"
        host = f"{row.host_bytes / GB:.2f} GB{verdict(row.host_bytes <= report.host_memory)}"
        to_host, to_device = row.copy_seconds
        off = row.mode == "none"
        step = ("—" if row.step_seconds is None else
                f"{1e3 * row.step_seconds:.0f} ms" + (
                    "" if off else f" (compute {1e3 * row.compute_seconds:.0f}, host step "
                                   f"{1e3 * row.host_step_seconds:.0f})"))
        lines.append(
            f"| {row.mode}{mark} | {states} | {working} | {peak} | {host} | "
            + ("— | — | —" if off else
               f"{row.to_host / GB:.2f} + {row.to_device / GB:.2f} GB | {1e3 * to_host:.0f} + "
               f"{1e3 * to_device:.0f} ms | {1e3 * row.host_step_seconds:.0f} ms")
            + f" | {step} |")
    lines.append(
        f"Offloaded, the device keeps the {dtype} parameters ("
        + ("its shard" if stage == 3 else "whole") + ", none with 'parameters') and two "
        "buckets of reduced gradients on their way to the host; the host keeps the fp32 "
        "masters, the optimizer state and the fp32 gradients the reduced buckets are added "
        "into. Gradients go to the host in the compute dtype during the backward; updated "
        "parameters come back after the host's step ('parameters': each gather's shard comes "
        "over ahead of it instead). The step is max(compute, collectives, copies that "
        "overlap) + the host's step + the copy back.")
    if report.offload_auto:
        chosen = next(r for r in report.offload_rows if r.mode == report.offload)
        lines.append(f"--offload auto: '{report.offload}', the least offload that fits."
                     if offload_fits(report, chosen) else
                     f"--offload auto: no mode fits; '{report.offload}' is the most offload.")
    if device is not None:
        largest = []
        for row in report.offload_rows:
            psi, bound = largest_model(stage, n, row.mode,
                                       optimizer_bytes=OPTIMIZER_BYTES[report.optimizer],
                                       param_bytes=report.dtype.itemsize,
                                       device_memory=device, host_memory=report.host_memory)
            largest.append(f"{row.mode} {psi / 1e9:.2f}B ({bound})")
        lines.append(f"Largest model these budgets hold at {ranks}, stage {stage}, {dtype}, "
                     f"{report.optimizer}, model states only (before activations and the "
                     f"gathered working set): " + ", ".join(largest) + ".")
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
