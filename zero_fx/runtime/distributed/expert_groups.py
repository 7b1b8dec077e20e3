"""The process groups of expert parallelism, made on the first call ([Note: expert
parallelism] in zero_fx/plan/expert_parallel.py)."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ...capture.experts.fused_experts import holds_stacked_experts
from ...capture.experts.moe_blocks import RoutedExperts
from ...capture.experts.routed_experts import hold_local_experts
from ...materialize.materialize import storageless
from ...plan import ShardPlan
from ...plan.expert_parallel import ExpertParallel, expert_slices
from ...plan.layout import place_rows
from .process_group import World, world_timeout


def split_experts(model: torch.nn.Module, blocks: Sequence[RoutedExperts], world: World,
                  degree: int, capacity_factor: Optional[float] = None, *,
                  loading: bool = False, left_alone: Sequence[str] = (),
                  exchanges_at_one: bool = False) -> Optional[ExpertParallel]:
    """Expert parallelism of ``degree`` over ``world``: make its groups (on every rank, in
    the same order), point each block's forward at this rank's experts (each taking at most
    ``capacity_factor`` times an even spread's rows: [Note: expert capacity]), and say which
    rank holds which expert. None for ``degree`` 1. ``loading``: the model's values are to be
    read from pretrained weights. ``left_alone``: why the rewrite left modules that look like
    experts as they are (``ExpertsRewrite.unrecognised``), for the error when none splits.
    ``exchanges_at_one``: a world of one that keeps its collectives ([Note: collectives kept
    at a world of one] in process_group.py): degree 1 is an expert-parallel group of this
    rank alone, whose rows still go through the exchanges, where the blocks can be split."""
    if degree == 1:
        return _group_of_one(model, blocks, world, loading) if exchanges_at_one else None
    if not blocks:
        stacked = next((n for n, m in model.named_modules() if holds_stacked_experts(m)), None)
        why = (f"; {left_alone[0]}" if left_alone else "" if stacked is None else
               f"; {stacked} holds its experts as 3-D parameters in a layout expert "
               "parallelism does not split (it splits transformers 5's concatenated [gate; up] "
               "without biases, not transposed, with an act_fn of the gate alone)")
        raise ValueError(f"expert_parallel={degree}, but zero_fx found no mixture-of-experts "
                         "block to split in this model (step.moe_blocks is empty; "
                         f"zero_fx.set_logs('info') says which blocks were left alone and why"
                         f"{why}): use expert_parallel=1")
    identity = [b for b in blocks if b.identity_experts]
    if identity:
        raise ValueError(f"expert_parallel={degree}: {identity[0].name} has "
                         f"{identity[0].identity_experts} identity experts beside its "
                         f"{identity[0].num_experts} routed ones, which expert parallelism does "
                         "not split yet: use expert_parallel=1")
    uneven = [b for b in blocks if b.num_experts % degree]
    if uneven:
        raise ValueError(f"expert_parallel={degree} splits each block's experts evenly over "
                         f"{degree} ranks, but {uneven[0].name} has {uneven[0].num_experts} "
                         f"experts: choose a degree that divides {uneven[0].num_experts}")
    stacked = [b for b in blocks if b.stacked]
    if stacked and loading:  # [Note: experts held as 3-D parameters, split by rows]
        raise ValueError(f"expert_parallel={degree}: {stacked[0].name} holds its experts as 3-D "
                         "parameters, of which each rank keeps its own experts' rows, and "
                         "load_pretrained does not read a place's rows yet: build the model on "
                         "the meta device and load the weights with load_checkpoint, or use "
                         "expert_parallel=1")
    if world.size % degree:
        raise ValueError(f"expert_parallel={degree} must divide the {world.size} ranks: each "
                         f"group of {degree} consecutive ranks splits the experts")
    size = world.size // degree
    timeout = world_timeout()
    mine_parallel = mine_data = None
    # every rank makes every group, in one order (new_group is a collective of the default
    # group); on a hybrid mesh, those of each replica's shard group
    for ranks in _shard_groups(world):
        for first in range(0, len(ranks), degree):  # consecutive ranks exchange tokens
            group = dist.new_group(ranks[first:first + degree], timeout=timeout)
            if world.global_rank in ranks[first:first + degree]:
                mine_parallel = group
        for place in range(degree):  # the ranks at one place hold the same experts
            group = dist.new_group(ranks[place::degree], timeout=timeout)
            if world.global_rank in ranks[place::degree]:
                mine_data = group
    return _held_experts(model, blocks, ExpertParallel(
        degree=degree, rank=world.rank % degree, group_name=mine_parallel.group_name,
        data_size=size, data_rank=world.rank // degree, data_group_name=mine_data.group_name,
        capacity_factor=capacity_factor))


def _group_of_one(model: torch.nn.Module, blocks: Sequence[RoutedExperts], world: World,
                  loading: bool) -> Optional[ExpertParallel]:
    """Expert parallelism of degree 1 over a world of one that keeps its collectives: both
    its groups are the world's; None where no block would be split (no blocks, or blocks
    that expert parallelism refuses: identity experts, experts held as 3-D parameters when
    loading pretrained weights)."""
    if not blocks or any(b.identity_experts or (b.stacked and loading) for b in blocks):
        return None
    return _held_experts(model, blocks, ExpertParallel(
        degree=1, rank=0, group_name=world.group_name, data_size=1, data_rank=0,
        data_group_name=world.group_name))


def _held_experts(model: torch.nn.Module, blocks: Sequence[RoutedExperts],
                  parallel: ExpertParallel) -> ExpertParallel:
    """``parallel`` with which rank holds which expert filled in, once each block's forward
    runs this rank's experts and exchanges the other rows over its group."""
    parallel = dataclasses.replace(
        parallel,
        slices=expert_slices({b.experts: b.num_experts for b in blocks if not b.stacked},
                             [n for n, _ in model.named_parameters()], parallel.degree),
        rows=frozenset(f"{b.experts}.{name}" for b in blocks if b.stacked
                       for name in ("gate_up_proj", "down_proj")))
    hold_local_experts(model, list(blocks), parallel.degree, parallel.rank, parallel.group_name,
                       parallel.capacity_factor)
    return parallel


def keep_place_rows(model: torch.nn.Module, plan: ShardPlan) -> None:
    """Experts held as 3-D parameters keep only this rank's place's rows from here on, the
    same Parameter objects ([Note: experts held as 3-D parameters, split by rows]): values
    cut from the whole (its construction, or the model as given), a stage-3 parameter
    without storage given one of the rows' shape."""
    parallel = plan.expert_parallel
    if parallel is None:
        return
    with torch.no_grad():
        for name in parallel.rows:
            param = model.get_parameter(name)
            if tuple(param.shape) != plan.whole_shape(name):
                continue  # already cut (a step sharding the model again)
            if param.untyped_storage().nbytes() == 0:  # a view of it would be out of bounds
                shape = torch.empty(plan.layout(name).shape, dtype=param.dtype, device="meta")
                param.data = storageless(shape, param.device)
            else:
                param.data = place_rows(plan, name, param.data).clone()


def _shard_groups(world: World) -> list[list[int]]:
    """The global ranks of every shard group: the world's, or on a hybrid mesh
    ``("replicate", "shard")`` one per replica, each sharding the model the same way (the
    replicas' experts then line up: each expert's replicas all-reduce over "replicate")."""
    mesh = world.mesh
    if mesh is None or mesh.ndim == 1:
        return [dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(
            world.group_name))]
    return mesh.mesh.tolist()  # ("replicate", "shard"): config.check_expert_parallel
