"""The shard plan: where every element of every parameter lives. Pure data.

[Note: flat layout]
Each parameter is flattened and padded with zeros to a multiple of the world
size N, so that it splits into N equal, contiguous shards: rank r owns the
flat elements ``[r * shard_numel, (r + 1) * shard_numel)``. This is the layout
``all_gather_into_tensor`` produces (rank-major concatenation), so gathering a
parameter is one collective followed by a slice and a view, and reducing its
gradient is a pad followed by one ``reduce_scatter_tensor``.

Sharding per parameter, not one flat buffer over the whole model, is what
lets stage 3 gather each parameter right before its first use and release it
after its last; a bucket (several parameters in one launch) is a list of
parameters, not a different layout.

Each rank also keeps its shards back to back in one conceptual flat buffer;
``ParamLayout.shard_offset`` is a parameter's position there, which is what a
checkpoint or a bucket needs.

The plan holds no tensors, so a model built on the meta device can be planned
without memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from .expert_parallel import ExpertParallel
from .secondary import SecondaryPartition
from .tensor_parallel import TensorParallel


@dataclass(frozen=True)
class ParamLayout:
    """Where one parameter's elements live."""

    name: str
    """Fully qualified name in the model (the first name, for tied parameters)."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    numel: int
    """Elements of the unpadded parameter."""
    shard_numel: int
    """Elements each rank holds: ceil(numel / N); the last rank's tail is padding."""
    shard_offset: int
    """Start of this parameter's shard in a rank's flat shard buffer (-1: this rank holds
    none of it, a routed expert of another rank under expert parallelism)."""
    world_size: int
    """Ranks it is sharded over: the shard group's, or a routed expert's expert-data-parallel
    group under expert parallelism ([Note: expert parallelism] in expert_parallel.py)."""
    requires_grad: bool = True

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def owned_range(self, rank: int) -> tuple[int, int]:
        """The unpadded flat elements ``[start, stop)`` that ``rank`` owns (may be empty)."""
        start = min(rank * self.shard_numel, self.numel)
        stop = min((rank + 1) * self.shard_numel, self.numel)
        return start, stop


BLOCKS = "blocks"
"""``bucket_bytes`` value: one bucket per repeated block of the model (stage 3's default)."""
RESIDENT_BUCKET_BYTES = 16 << 20
"""With ``BLOCKS``: the cap of a bucket of resident parameters (norm weights and biases of
many blocks, gathered once per step)."""


OWNER_GROUP_BYTES = 256 << 20
"""Stages 2-3: the largest owner group's gradients (bytes) that the graph reduces to the owners
laid out by owner; above it, shards and an all-to-all after the graph ([Note: owner groups]
in owners.py)."""


def block_of(name: str) -> str:
    """The unit a parameter is bucketed with ([Note: buckets by block]): its path up to the
    first numeric part, the index into the model's repeated blocks ("blocks.3.attn.qkv.weight"
    -> "blocks.3", "model.layers.0.mlp.up_proj.weight" -> "model.layers.0"); outside any
    block, its own module ("wte.weight" -> "wte", "lm_head.weight" -> "lm_head").

    [Note: buckets by block]
    A byte cap fits no model: 16 MiB gathers several blocks of a small model at once
    (more memory in flight than needed) and splits one block of a large model into
    many launches. Stage 3 gathers and reduce-scatters one repeated block per
    collective instead, what FSDP2 calls a unit (torchtitan wraps each block): the
    parameter names say which block a parameter is in, the same on every rank and
    on a meta model, so the passes and the planner cut the same buckets
    (``ShardPlan.buckets``). The embedding and the head are units of their own.
    A block with routed experts is two units: its experts' module and the rest. Its
    experts are most of its bytes (E feed-forwards), and the backward reaches them first:
    as one unit, the next block's gather (prefetched while this one computes) is the
    size of a whole block again, on top of this block's gathered experts, their copies
    stacked for the grouped matmuls and the previous block's gradient bucket still being
    reduced. As two, what is prefetched during the experts' compute is the block's
    attention, and the next block's experts are gathered during this block's attention.
    On the MoE peer benchmark (Mixtral, 4 layers of 8 experts, 2 gloo ranks) the peak
    went from 235 to 207.5 MiB a rank (FSDP2: 241), at the same step time within the
    CPU's noise (A/B, 20 steps each, twice). torchtitan makes a MoE block's experts an
    FSDP unit of their own too. Which modules hold routed experts is what the capture
    recognises (``routed_expert_modules``, kept in ``ShardPlan.expert_units``).
    ``bucket_bytes=<bytes>`` still overrides.
    """
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1]) or name


def owner_groups(names: Sequence[str], world_size: int) -> list[list[str]]:
    """``names`` (plan order) cut into groups of ``world_size`` consecutive blocks (``block_of``),
    the last group the blocks left over ([Note: owner groups] in owners.py)."""
    groups: list[list[str]] = []
    blocks: list[str] = []
    for name in names:
        block = block_of(name)
        if not blocks or blocks[-1] != block:
            if len(blocks) == world_size or not groups:
                groups.append([])
                blocks = []
            blocks.append(block)
        groups[-1].append(name)
    return groups


def in_block(name: str) -> bool:
    """Whether parameter ``name`` is inside one of the model's repeated blocks."""
    return any(part.isdigit() for part in block_of(name).split("."))


class StageConsequences:
    """What a ZeRO stage shards and when it reduces, read from ``stage``: properties of the
    plan (``ShardPlan``), and of the configuration (``ZeroConfig``) before a plan exists.
    Code asks these, not the stage's number."""

    stage: int

    @property
    def replicated(self) -> bool:
        """Stage 0 (DDP): every rank holds whole parameters, gradients and optimizer state."""
        return self.stage == 0

    @property
    def params_sharded(self) -> bool:
        """Stage 3: parameters live as shards and are gathered where used; in stages
        0-2 every rank keeps whole parameters."""
        return self.stage == 3

    @property
    def grads_sharded(self) -> bool:
        """Stages 2-3: each gradient is reduce-scattered as soon as it exists and only this
        rank's shard is kept ([Note: where gradients are reduced] in passes/reduce_grads.py)."""
        return self.stage >= 2

    @property
    def reduces_after_backward(self) -> bool:
        """Stage 1: every whole gradient is kept until the end of the backward and
        reduce-scattered there ([Note: where gradients are reduced])."""
        return not self.replicated and not self.grads_sharded

    @property
    def gathers_after_step(self) -> bool:
        """Stages 1-2: whole parameters are kept, so after the optimizer steps on the
        shards each is all-gathered back into its parameter."""
        return not self.replicated and not self.params_sharded


@dataclass(frozen=True)
class ShardPlan(StageConsequences):
    """The whole model's layout for one world size and stage. Computed once."""

    world_size: int
    rank: int
    stage: int
    group_name: str
    """Process group the collectives run on ("" for a world of one without a process group):
    with a mesh, the shard group, and ``world_size`` and ``rank`` are its."""
    params: tuple[ParamLayout, ...]
    resident: frozenset = frozenset()
    """Stage 3: parameters gathered once per step and kept whole through forward
    and backward (selective residency): they cost memory, not backward traffic."""
    bucket_bytes: Union[int, str] = 0
    """Byte cap of one fused collective (``bucket_collectives``); 0: one per parameter;
    ``BLOCKS``: one per repeated block of the model ([Note: buckets by block])."""
    prefetch: int = 0
    """How many all-gathers ``schedule_collectives`` lets run ahead of the compute
    that needs them; 0: issue each right before its first use."""
    reduce_overlap_buckets: Optional[int] = None
    """How many reductions later ``schedule_collectives`` waits for each gradient
    reduction; 0: right after its issue. None: ``prefetch``."""
    memory_budget_bytes: Optional[int] = None
    """Stage 3: cap on gathered bytes alive at once; prefetch stops where it would pass it."""
    compute_dtype: Optional[torch.dtype] = None
    """Mixed precision: parameters are gathered (cast before the all-gather, so it
    moves this dtype) and computed in this dtype, while shards keep ``dtype``
    (the fp32 master). None: parameters are used in their own dtype."""
    reduce_dtype: Optional[torch.dtype] = None
    """Gradients are cast to this dtype before they are reduced; None: their own."""
    loss_scaled: bool = False
    """The backward's seed is multiplied by a loss scale, a graph input after
    the step's own (``scale_loss``; fp16 training)."""
    accumulation_steps: int = 1
    """Calls of the step per optimizer step. Above 1, stages 0 and 1 keep whole
    gradients across calls and reduce them once, outside the graph
    (``reduces_in_graph`` is False); see [Note: gradient accumulation]."""
    replicas: int = 1
    """Hybrid sharding: copies of the shards, one per shard group; each reduced gradient
    shard is all-reduced across them ([Note: hybrid sharding] in runtime/distributed/process_group.py)."""
    replicate_group_name: str = ""
    """The group of this rank's copies ("" when ``replicas`` is 1)."""
    collectives_average: bool = False
    """The gradient reductions average in the collective (``"avg"``: NCCL, whose AVG of
    floating types multiplies by 1/N before it sums), so no division op runs; False: SUM,
    divided by the bucket code (gloo, whose AVG returns sums in some paths). [Note: divide
    before the sum] in passes/common/collective_code.py."""
    recompute: Any = None
    """What the backward recomputes instead of keeping (``recompute_activations``): None,
    ``"blocks"``, a policy ``fn(node) -> "save" | "recompute"`` or an ``ActivationBudget``."""
    expert_parallel: Optional[ExpertParallel] = None
    """Stage 3: routed experts split over ranks ([Note: expert parallelism])."""
    expert_units: frozenset = frozenset()
    """The routed experts' modules (``model.layers.0.block_sparse_moe.experts``): in stage 3's
    buckets by block, each is a unit of its own ([Note: buckets by block])."""
    tensor_parallel: Optional[TensorParallel] = None
    """The model's DTensor parameters over the mesh's "tp" dimension: shapes here are their
    local pieces ([Note: ZeRO over tensor parallelism] in tensor_parallel.py)."""
    offload: Optional[str] = None
    """``"optimizer"``: masters and optimizer state in host memory ([Note: optimizer
    offload] in zero_fx/runtime/offload.py); ``"parameters"``: the stage-3 shards the graph
    reads too; None: on the training device."""
    offload_step: str = "sync"
    """``"overlap"``: the host's optimizer step overlaps the next call, whose parameters are
    one step stale ([Note: the delayed update] in zero_fx/runtime/update/update.py)."""
    updates_in_graph: bool = False
    """The graph steps the optimizer on each bucket right after its reduction (the pass
    ``update_in_graph``; [Note: the update in the graph] in zero_fx/runtime/update/graph_update.py);
    False: after the graph."""
    device_type: str = "cpu"
    """The training device's type ("cuda", "cpu"): where a shard kept on the host is copied
    to (offload="parameters"). Not its index, which differs by rank."""
    quantize_weights: tuple = (None, None)
    """Stage 3: the format (``"int8"``, ``"fp8"``) the forward's and the backward's
    all-gathers move, or None for the parameters' own dtype ([Note: quantized blocks on
    the wire] in passes/common/quantized_code.py)."""
    quantize_gradients: Optional[str] = None
    """The format (``"int8"``, ``"int4"``) gradient reductions move, summed in fp32 on
    arrival ([Note: reductions as all-to-alls] in passes/common/quantized_code.py); None: their
    own dtype."""
    quantize_block: int = 256
    """Elements per block of a quantized collective (one fp32 scale each)."""
    secondary: Optional[SecondaryPartition] = None
    """Stage 3: the forward's gathers also leave a copy of each parameter sharded within the
    node, which the backward gathers from ([Note: the secondary partition] in secondary.py)."""
    owners: tuple = ()
    """``(name, rank)`` for each parameter whose update needs the whole tensor (an optimizer
    that is not elementwise, stages 1-3): the rank that steps it ([Note: whole-tensor updates
    on owner ranks] in zero_fx/runtime/update/whole_tensor_updates.py; chosen by ``plan/owners.py``).
    Every other parameter is stepped on its flat shards by every rank."""
    keeps_collectives_at_one: bool = False
    """A world of one rank whose collectives are issued on its group of one all the same
    (``DebugOptions.keep_collectives_at_world_one``; [Note: collectives kept at a world of one]
    in zero_fx/runtime/distributed/process_group.py); False: at one rank they are left out."""

    def owner_of(self, name: str) -> "Optional[int]":
        """The rank that steps parameter ``name`` whole, or None where every rank steps its
        shard ([Note: whole-tensor updates on owner ranks])."""
        return self._owner_by_name.get(name)

    @property
    def _owner_by_name(self) -> Mapping[str, int]:
        cache = self.__dict__.get("_owner_cache")
        if cache is None:
            cache = dict(self.owners)
            object.__setattr__(self, "_owner_cache", cache)
        return cache

    @property
    def reduces_to_owners(self) -> bool:
        """Stage 1 with whole-tensor updates over more than one rank, shards not replicated:
        their gradients leave the graph whole and, at the end of the backward, one
        reduce-scatter laid out by owner gives each owner its tensors' whole mean gradients
        ([Note: reductions laid out by owner] in zero_fx/runtime/update/whole_tensor_updates.py)."""
        return (bool(self.owners) and self.reduces_after_backward and self.world_size > 1
                and self.replicas == 1)

    def reduced_by_owner(self, name: str) -> bool:
        """Whether parameter ``name``'s gradient is reduced to its owner outside the graph
        (``reduces_to_owners``) rather than by the graph into every rank's shard."""
        return self.reduces_to_owners and self.owner_of(name) is not None

    @property
    def reduces_to_owners_in_graph(self) -> bool:
        """Stages 2-3 with whole-tensor updates over more than one rank, shards not
        replicated, gradients not quantized: the graph reduces their gradients to their owners,
        one reduction laid out by owner per group of N blocks ([Note: owner groups] in
        owners.py), as the last gradient of the group lands; each owner gets its tensors'
        whole mean gradients ([Note: reductions laid out by owner])."""
        return (bool(self.owners) and self.grads_sharded and self.world_size > 1
                and self.replicas == 1 and self.quantize_gradients is None
                and self.owner_group_bytes <= OWNER_GROUP_BYTES)

    @property
    def owner_group_bytes(self) -> int:
        """The gradient bytes of the largest owner group ([Note: owner groups] in owners.py):
        what a reduction laid out by owner at stages 2-3 waits to have whole."""
        cache = self.__dict__.get("_owner_group_bytes")
        if cache is None:
            cache = max((sum(self.layout(n).numel * (self.reduce_dtype or self.layout(n).dtype
                                                      ).itemsize for n in group)
                         for group in self.owner_groups([n for n, _ in self.owners])), default=0)
            object.__setattr__(self, "_owner_group_bytes", cache)
        return cache

    def reduced_to_owner_in_graph(self, name: str) -> bool:
        """Whether the graph reduces parameter ``name``'s gradient to its owner, whole
        (``reduces_to_owners_in_graph``), rather than into every rank's shard."""
        return self.reduces_to_owners_in_graph and self.owner_of(name) is not None

    @property
    def delivers_to_owners(self) -> bool:
        """The reduction itself brings each whole-tensor update's gradient to its owner, in
        the graph or after it: no exchange of shards to the owners follows."""
        return self.reduces_to_owners or self.reduces_to_owners_in_graph

    def rows_by_owner(self, names: Sequence[str]) -> tuple[int, dict[str, tuple[int, int]]]:
        """A buffer laid out by owner for ``names`` (plan order): its rows' width, and each
        name's ``(owner, start)``. Row r holds the tensors rank r owns, flattened, one after
        the other, padded to the widest row: the layout of the reduce-scatters and
        all-gathers that carry whole-tensor updates ([Note: reductions laid out by owner] in
        zero_fx/runtime/update/whole_tensor_updates.py), and of ``traffic()``'s count of them."""
        used, where = [0] * self.world_size, {}
        for name in names:
            owner = self.owner_of(name)
            where[name] = (owner, used[owner])
            used[owner] += self.layout(name).numel
        return max(used), where

    def owner_groups(self, names: Sequence[str]) -> list[list[str]]:
        """Those of ``names`` (plan order) with an owner, in the groups their owners were
        chosen in and the graph reduces them in ([Note: owner groups] in owners.py)."""
        present = set(names)
        groups = owner_groups([n for n, _ in self.owners], self.world_size)
        return [kept for kept in ([n for n in group if n in present] for group in groups) if kept]

    @property
    def owner_row_groups(self) -> tuple[tuple[str, ...], ...]:
        """The owner groups whose shards hold their owners' rows, so one all-gather of a group
        brings each owner's updated tensors whole: at stage 3 the graph's, and nothing returns
        them after the step; at stages 1-2 under mixed precision the stage's, cast, into the
        parameters ([Note: owners' rows as the shards] in
        zero_fx/runtime/update/whole_tensor_updates.py). Where ``may_store_owner_rows``;
        per group: one dtype, every member resident or none
        (``resident``: one gather serves the step), no expert or empty member, and the widest
        row no wider than the group's shards together."""
        cache = self.__dict__.get("_owner_row_groups")
        if cache is None:
            cache = tuple(tuple(group) for group in self.owner_groups([n for n, _ in self.owners])
                          if self._rows_fit_shards(group)) if self.may_store_owner_rows else ()
            object.__setattr__(self, "_owner_row_groups", cache)
            object.__setattr__(self, "_owner_row_group_of",
                               {name: group for group in cache for name in group})
        return cache

    def owner_row_group(self, name: str) -> Optional[tuple[str, ...]]:
        """The group of ``owner_row_groups`` that holds ``name``; None if none does."""
        self.owner_row_groups  # fills the cache
        return self.__dict__["_owner_row_group_of"].get(name)

    def stored_as_rows(self, name: str) -> bool:
        return self.owner_row_group(name) is not None

    @property
    def may_store_owner_rows(self) -> bool:
        """Whether ``owner_row_groups`` may hold any group: the conditions on the whole plan.
        Stage 3 where the graph reduces to the owners, with no secondary partition or quantized
        weights; stages 1-2 under mixed precision (fp32 masters, which the stage's all-gather
        laid out by owner cannot write: [Note: reductions laid out by owner]) where the
        reduction brings the gradients to the owners; never with offload or tensor
        parallelism."""
        stage_3 = (self.params_sharded and self.reduces_to_owners_in_graph
                   and self.secondary is None and self.quantize_weights == (None, None))
        stages_1_2 = (self.gathers_after_step and self.compute_dtype is not None
                      and self.delivers_to_owners)
        return ((stage_3 or stages_1_2) and self.world_size > 1 and self.tensor_parallel is None
                and not self.offloads_optimizer and not self.offloads_parameters)

    def _rows_fit_shards(self, group: Sequence[str]) -> bool:
        layouts = [self.layout(n) for n in group]
        width, _ = self.rows_by_owner(group)
        return (len({l.dtype for l in layouts}) == 1
                and len({l.name in self.resident for l in layouts}) == 1
                and all(l.numel > 0 and not self.is_expert(l.name) for l in layouts)
                and width <= sum(l.shard_numel for l in layouts))

    @property
    def returns_owners_whole(self) -> bool:
        """Stages 1-2 with whole-tensor updates over more than one rank, shards not
        replicated, no mixed precision: one all-gather laid out by owner brings each owner's
        updated tensors whole into every rank's parameters (and masters), in place of the
        stage's all-gather of their shards ([Note: reductions laid out by owner])."""
        return (bool(self.owners) and self.gathers_after_step and self.world_size > 1
                and self.replicas == 1 and self.compute_dtype is None)

    @property
    def issues_collectives(self) -> bool:
        """Whether the shard group's gathers and reductions are issued: it has more than one
        rank, or a world of one keeps them ([Note: collectives kept at a world of one])."""
        return self.world_size > 1 or self.keeps_collectives_at_one

    @property
    def offloads_optimizer(self) -> bool:
        """Masters and optimizer state in host memory (offload "optimizer" or "parameters")."""
        return self.offload in ("optimizer", "parameters")

    @property
    def offloads_parameters(self) -> bool:
        """Stage 3's shards, the graph's inputs, in host memory too."""
        return self.offload == "parameters"

    def input_dtype(self, layout: "ParamLayout") -> torch.dtype:
        """The dtype of the shard the stage-3 graph reads for a parameter: the master's, or
        with the masters offloaded the compute dtype, in which the device (or the host, for
        offload="parameters") keeps a copy ([Note: optimizer offload])."""
        return (self.compute_dtype if self.offloads_optimizer and self.compute_dtype
                else layout.dtype)

    def holds(self, name: str) -> bool:
        """Whether this rank holds a shard of parameter ``name`` (all but the routed experts
        of other ranks under expert parallelism)."""
        return self.expert_parallel is None or self.expert_parallel.holds(name)

    def is_expert(self, name: str) -> bool:
        """Whether ``name`` is a routed expert's parameter split by expert parallelism."""
        return self.expert_parallel is not None and self.expert_parallel.splits(name)

    def is_expert_rows(self, name: str) -> bool:
        """Whether ``name`` holds this rank's rows of every expert's 3-D parameter ([Note:
        experts held as 3-D parameters, split by rows] in expert_parallel.py)."""
        return self.expert_parallel is not None and name in self.expert_parallel.rows

    def whole_shape(self, name: str) -> tuple[int, ...]:
        """Parameter ``name``'s shape on a model that is not split by expert parallelism:
        its layout's, or for expert rows every place's rows (tensor parallelism's pieces are
        the checkpoint's to put together)."""
        shape = self.layout(name).shape
        if self.is_expert_rows(name):
            return (shape[0] * self.expert_parallel.degree, *shape[1:])
        return shape

    def shard_rank(self, name: str) -> int:
        """This rank's place among the ranks parameter ``name`` is sharded over."""
        return self.expert_parallel.data_rank if self.is_expert(name) else self.rank

    def collective_group(self, name: str) -> tuple[int, str]:
        """(ranks, group name) that gather and reduce parameter ``name``: the shard group,
        or for a routed expert its expert-data-parallel group."""
        if self.is_expert(name):
            return self.expert_parallel.data_size, self.expert_parallel.data_group_name
        return self.world_size, self.group_name

    @property
    def ranks_averaged(self) -> int:
        """Every gradient is the mean over this many ranks' batches."""
        return self.world_size * self.replicas

    def bucket_unit(self, name: str) -> str:
        """The unit a parameter is bucketed with in buckets by block: its routed experts'
        module (``expert_units``), else its block ([Note: buckets by block])."""
        parts = name.split(".")
        for end in range(1, len(parts)):  # its enclosing modules' names, outermost first
            if ".".join(parts[:end]) in self.expert_units:
                return ".".join(parts[:end])
        return block_of(name)

    def unit_of(self, name: str) -> str:
        """The block a parameter belongs to ([Note: buckets by block]); the recompute pass
        finds the model's repeated blocks with it."""
        return block_of(name)

    @property
    def reduces_in_graph(self) -> bool:
        """Gradients are reduced inside the compiled graph: always but in stages 0-1 with
        gradient accumulation, which accumulate locally and reduce once per optimizer step."""
        return self.grads_sharded or self.accumulation_steps <= 1

    def gather_dtype(self, layout: "ParamLayout") -> torch.dtype:
        """The dtype a parameter is all-gathered and computed in."""
        return self.compute_dtype or layout.dtype

    @property
    def shard_numel(self) -> int:
        """Elements in one rank's flat shard buffer (same on every rank)."""
        return sum(p.shard_numel for p in self.params if self.holds(p.name))

    @property
    def total_numel(self) -> int:
        """Ψ: elements in the unsharded model."""
        return sum(p.numel for p in self.params)

    @property
    def padding_numel(self) -> int:
        return sum(p.padding for p in self.params)

    def buckets(self, names: Sequence[str], *, resident: bool = False) -> list[list[str]]:
        """``names``, in order, cut into buckets: by block (``bucket_bytes == BLOCKS``: runs
        of the same ``block_of``; resident parameters, gathered once for the whole step, in
        runs of at most ``RESIDENT_BUCKET_BYTES`` instead) or into runs of at most
        ``bucket_bytes`` (padded, whole parameters; one larger than the cap is a bucket of
        its own). A bucket holds one dtype. The same on every rank: it reads only the plan.
        The passes and the planner both cut with this."""
        by_block = self.bucket_bytes == BLOCKS and not resident
        cap = RESIDENT_BUCKET_BYTES if self.bucket_bytes == BLOCKS else self.bucket_bytes
        buckets: list[list[str]] = []
        filled = 0
        for name in names:
            layout = self.layout(name)
            size = layout.padded_numel * self.gather_dtype(layout).itemsize
            last = buckets[-1][0] if buckets else None
            same_dtype = buckets and self.layout(last).dtype == layout.dtype and (
                self.is_expert(last) == self.is_expert(name)
                and self.is_expert_rows(last) == self.is_expert_rows(name))
            fits = (self.bucket_unit(buckets[-1][-1]) == self.bucket_unit(name) if by_block
                    else filled + size <= cap) if buckets else False
            if same_dtype and fits:
                buckets[-1].append(name)
                filled += size
            else:
                buckets.append([name])
                filled = size
        return buckets

    def layout(self, name: str) -> ParamLayout:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no parameter named {name!r} in the shard plan") from None

    @property
    def _by_name(self) -> Mapping[str, ParamLayout]:
        cache = self.__dict__.get("_by_name_cache")
        if cache is None:
            cache = {p.name: p for p in self.params}
            object.__setattr__(self, "_by_name_cache", cache)
        return cache


def plan_shard(plan: ShardPlan, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a tensor shaped like parameter ``name``: its slice among the
    parameter's ranks, or empty for a routed expert another rank holds ([Note: expert
    parallelism] in expert_parallel.py)."""
    if not plan.holds(name):
        return full.detach().new_empty(0)
    return cut_shard(place_rows(plan, name, full), plan.layout(name), plan.shard_rank(name))


def place_rows(plan: ShardPlan, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` shaped like parameter ``name``: for experts held as 3-D parameters and
    given whole, this rank's place's rows of it ([Note: experts held as 3-D parameters,
    split by rows] in expert_parallel.py); else ``tensor`` itself."""
    if not plan.is_expert_rows(name) or tuple(tensor.shape) != plan.whole_shape(name):
        return tensor
    rows = plan.layout(name).shape[0]
    return tensor.narrow(0, plan.expert_parallel.rank * rows, rows)


def cut_shard(full: torch.Tensor, layout: ParamLayout, rank: int) -> torch.Tensor:
    """This rank's flat, padded slice of a parameter-shaped tensor (a fresh copy); ``rank``:
    its place among the parameter's ranks (``ShardPlan.shard_rank``)."""
    flat = full.detach().reshape(-1)
    start, stop = layout.owned_range(rank)
    shard = flat.new_zeros(layout.shard_numel)
    shard[: stop - start] = flat[start:stop]
    return shard
