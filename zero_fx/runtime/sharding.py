"""The first call of a compiled step: find its model and optimizer, plan the layout, shard
them, and make what runs around the graph (the optimizer update, the loss scaler, the
ranks' agreement check)."""

from __future__ import annotations

import dataclasses

import logging
import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch.utils._pytree import tree_leaves

from ..analysis.hardware import hardware_for
from ..capture.experts.moe_blocks import RoutedExperts
from ..config import ZeroConfig
from ..base.formatting import ranks_phrase
from ..materialize import PretrainedWeights, materialize
from ..plan import PlanRanks, ShardPlan, plan_for_module
from ..plan.owners import assign_owners_by_group
from ..plan.tensor_parallel import local_tensor, tensor_parallel_of
from .distributed.expert_groups import keep_place_rows, split_experts
from .distributed.gloo_all_gather import use_gloo_single_tensor_all_gather
from .update.graph_update import why_not_in_graph
from .update.precision import LossScaler, cast_at_model_edge
from .distributed.process_group import (check_current_cuda_device, check_devices_match_backend,
                            collectives_average, current_world, keeping_collectives,
                            training_device, world_of)
from .optimizer import WHOLE, parameter_updates, update_rule, whole_tensor_costs
from .update.optimizer_set import OptimizerSet, members
from .offload_choice import (OffloadChoice, agreed_budget, bucket_state_bytes,
                             choose_before_placing, device_budget, optimizer_state_tensors,
                             with_mode)
from .distributed.rank_agreement import RankAgreement
from .distributed.secondary_groups import with_secondary_partition
from .sharded_state import ShardedState
from .update.update import OptimizerUpdate

log = logging.getLogger("zero_fx")


@dataclass
class Sharded:
    """What a step's first call set up; it lives as long as the step."""

    plan: ShardPlan
    state: ShardedState
    update: OptimizerUpdate
    scaler: Optional[LossScaler]
    """The fp16 loss scaler; None without loss scaling."""
    agreement: RankAgreement
    offload_choice: Optional[OffloadChoice] = None
    """With offload: the mode (``"auto"``'s choice) and where the update runs, and from what
    ([Note: choosing what to offload])."""
    config: Optional[ZeroConfig] = None
    """The options of the step that sharded the model (an evaluation step runs with them)."""
    step_name: str = ""
    """The name of that step."""

    def offload_more(self, mode: str) -> None:
        """``offload="auto"`` at the first compilation: move the state to the host for
        ``mode``, which offloads more than the plan's ([Note: choosing what to offload])."""
        self.plan = with_mode(self.plan, mode)
        self.state.move_to_host(self.plan)

    def choose_update(self, requested: str, delayed: bool) -> None:
        """Where the offloaded optimizer steps ([Note: the update streamed through the
        device]), once the step's peak is known (the first compilation)."""
        choice = self.offload_choice
        choice.choose_update(requested, bucket_state_bytes(self.plan, self.optimizer_state_tensors),
                             delayed)
        self.update.steps_through_device = choice.update == "device" and self.plan.offloads_optimizer

    @property
    def optimizer_state_tensors(self) -> int:
        return optimizer_state_tensors(self.state.optimizer)


def check_real_parameters(model: torch.nn.Module, replicated: bool) -> None:
    """Stages 1-3 move parameters and gradients through all-gathers and reduce-scatters of
    flat real buffers (gloo has no complex all-gather): a complex parameter is refused
    before anything is sharded. Complex activations (a rotary embedding in complex
    arithmetic) are not parameters and train at every stage."""
    complex_names = [name for name, p in model.named_parameters() if p.is_complex()]
    if not replicated and complex_names:
        raise ValueError(
            f"parameter {complex_names[0]!r} is complex ({len(complex_names)} complex "
            f"parameter(s) in all); zero_fx shards only real parameters at stages 1-3. Hold it "
            f"as real pairs (nn.Parameter(torch.view_as_real(c)), and torch.view_as_complex(p) "
            f"where the model reads it), or train at stage=0")


def find_model_and_optimizer(args, kwargs, model: Optional[torch.nn.Module], optimizer):
    """The model and optimizer the step shards: those named to ``zero_compile``, else the one
    model among the call's arguments and its optimizers. Several optimizers (given as a list to
    ``optimizer=``, or among the arguments) are one ``OptimizerSet`` ([Note: several optimizers
    in one step] in optimizer_set.py)."""
    leaves = tree_leaves((args, kwargs), is_leaf=lambda x: isinstance(
        x, (torch.nn.Module, torch.optim.Optimizer)))
    if model is None:
        model = _the_one(leaves, torch.nn.Module, "model", "model=")
    if optimizer is None:
        found = list({id(x): x for x in leaves if isinstance(x, torch.optim.Optimizer)}.values())
        if not found:
            raise ValueError("no optimizer among the step's arguments; pass it as an argument or "
                             "name it with @zero_compile(optimizer=...)")
        optimizer = found
    if isinstance(optimizer, (list, tuple)):
        optimizer = optimizer[0] if len(optimizer) == 1 else OptimizerSet(optimizer)
    return model, optimizer


def find_model(args, kwargs, model: Optional[torch.nn.Module]) -> torch.nn.Module:
    """The model of a step without an optimizer (an evaluation step): the one named to
    ``zero_compile``, else the one among the call's arguments."""
    if model is not None:
        return model
    leaves = tree_leaves((args, kwargs), is_leaf=lambda x: isinstance(x, torch.nn.Module))
    return _the_one(leaves, torch.nn.Module, "model", "model=")


def shard(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: ZeroConfig,
          step_name: str, pretrained: Optional[PretrainedWeights] = None,
          moe_blocks: Sequence[RoutedExperts] = (), left_alone: Sequence[str] = ()) -> Sharded:
    """Plan and shard ``model`` and ``optimizer`` over the default process group (a world of
    one if none) or ``config.mesh``; in place: the model and optimizer are the user's,
    rebound to shards. ``moe_blocks``: the model's rewritten mixture-of-experts blocks,
    whose experts ``config.expert_parallel`` splits over ranks; ``left_alone``: why the
    rewrite left others as they are."""
    world = with_secondary_partition(world_of(config.mesh, config.replicated),
                                     config.secondary_partition, current_world())
    world = keeping_collectives(world, config.debug.keep_collectives_at_world_one)
    experts = split_experts(model, moe_blocks, world, config.expert_parallel,
                            config.expert_capacity_factor, loading=pretrained is not None,
                            left_alone=left_alone,
                            exchanges_at_one=world.keeps_collectives and not config.replicated)
    check_devices_match_backend(model.parameters())
    check_real_parameters(model, config.replicated)
    device = training_device(model.parameters())
    check_current_cuda_device(device)
    # gloo moving CPU tensors, whatever the group's name: [Note: gloo's coalesced all-gather
    # corrupts the heap], [Note: the backend by device]
    if world.backend_for("cpu") == "gloo":
        use_gloo_single_tensor_all_gather()
    claim(model, optimizer, step_name)
    ranks = PlanRanks(world.size, world.rank, world.group_name, replicas=world.replicas,
                      replicate_group_name=world.replicate_group_name,
                      collectives_average=collectives_average(world, device),
                      expert_parallel=experts, tensor_parallel=tensor_parallel_of(model, world),
                      secondary=world.secondary, keeps_collectives_at_one=world.keeps_collectives)
    plan = plan_for_module(model, ranks, config.plan_options(hardware_for(model)))
    plan = dataclasses.replace(plan, device_type=device.type)
    choice = None
    offload = config.offload
    if offload.mode is not None:  # [Note: choosing what to offload]
        budget, source = device_budget(offload.device_memory, device)
        budget = agreed_budget(budget, world, device)
        if offload.mode == "auto":
            choice = choose_before_placing(plan, optimizer, budget, source)
            plan = with_mode(plan, choice.mode)
        else:
            choice = OffloadChoice.given(offload.mode, plan, optimizer, budget, source)
    plan = with_owners(plan, model, optimizer, config)  # [Note: whole-tensor updates on owner ranks]
    update_refused = why_not_in_graph(config, optimizer, plan)  # [Note: the update in the graph]
    if update_refused is None:
        plan = dataclasses.replace(plan, updates_in_graph=True)
    elif config.optimizer_update == "graph":
        claim(model, optimizer, None)
        raise ValueError(f"optimizer_update='graph' cannot step the optimizer in the graph: "
                         f"{update_refused}. Use optimizer_update='auto' (or 'eager') to step "
                         f"it after the graph")
    if plan.tensor_parallel is not None and (pretrained is not None or any(
            local_tensor(p).is_meta for p in model.parameters())):
        claim(model, optimizer, None)
        raise NotImplementedError(
            "a tensor-parallel model built on the meta device, or loaded with load_pretrained, "
            "is not supported yet: zero_fx would cut shards of whole parameters, not of this "
            "rank's pieces. Build the model with its values (to_empty and your init, or "
            "load_state_dict) before parallelize_module")
    try:  # a meta model, or pretrained weights: this rank's values (the model is unchanged on error)
        masters = materialize(model, plan, init_fn=config.init_fn, pretrained=pretrained,
                              device=device)
    except Exception:
        claim(model, optimizer, None)
        raise
    keep_place_rows(model, plan)  # [Note: experts held as 3-D parameters, split by rows]
    updates = parameter_updates(members(optimizer), list(model.named_parameters()), plan,
                                config.elementwise_optimizer)  # before the groups hold shards
    state = ShardedState(model, optimizer, plan, world, masters=masters, device=device)
    state.updates = updates
    precision = config.mixed_precision
    if precision is not None:
        cast_at_model_edge(model, precision)
    scaler = (LossScaler(precision, next(model.parameters()).device)
              if precision is not None and precision.scales_loss else None)
    update = OptimizerUpdate(state, accumulation_steps=config.accumulation_steps,
                             max_grad_norm=config.max_grad_norm, scaler=scaler,
                             delayed=offload.delayed)
    update.in_graph.refused = update_refused or ""
    agreement = RankAgreement(world.ranks, checked=config.debug.check_ranks and not world.simulated
                              and (world.ranks > 1 or world.keeps_collectives))
    _log_plan(plan, world)
    sharded = Sharded(plan, state, update, scaler, agreement, choice, config, step_name)
    _SHARDED[model] = weakref.ref(sharded)
    return sharded


def with_owners(plan: ShardPlan, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                config: ZeroConfig) -> ShardPlan:
    """``plan`` with an owner for each parameter whose update needs the whole tensor (stages
    1-3; [Note: update rules] in optimizer.py), or refused where that cannot run yet."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    costs, whole = {}, []
    for member in members(optimizer):
        costs.update(whole_tensor_costs(member, name_of, config.elementwise_optimizer))
        whole += [type(member).__name__] if update_rule(member, config.elementwise_optimizer) == WHOLE else []
    if plan.replicated or not costs:
        return plan
    what = f"{' and '.join(whole)} update{'s' if len(whole) == 1 else ''} whole tensors on owner ranks"
    refusal = (
        "with offload (the owners' update runs on the device)" if config.offload.mode is not None else
        "with tensor parallelism (a rank holds a piece of each tensor, not the whole)"
        if plan.tensor_parallel is not None else
        "for routed experts split by expert parallelism" if any(plan.is_expert(n) for n in costs)
        else None)
    if refusal is not None:
        claim(model, optimizer, None)
        raise NotImplementedError(
            f"{what}, which zero_fx does not support {refusal} yet. Use an elementwise optimizer "
            f"(AdamW) there, or stage=0")
    order = [layout.name for layout in plan.params]
    owners = assign_owners_by_group(costs, plan.world_size, order)
    return dataclasses.replace(plan, owners=tuple((n, owners[n]) for n in order if n in owners))


_SHARDED: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()
"""Each sharded model -> its step's ``Sharded``, both weakly: the step owns its state, and a
forward-only step of the same model finds it here ([Note: evaluation steps] in
zero_fx/evaluation.py)."""


def sharded_of(model: torch.nn.Module) -> Optional[Sharded]:
    """What the training step that sharded ``model`` set up; None if no living step did."""
    ref = _SHARDED.get(model)
    return ref() if ref is not None else None


def _log_plan(plan: ShardPlan, world) -> None:
    if plan.replicated:
        log.info("zero_fx: stage 0 over %d rank(s): %d parameters, %d elements, replicated",
                 world.ranks, len(plan.params), plan.total_numel)
    else:
        log.info("zero_fx: stage %d over %s: %d parameters, %d elements "
                 "(%d padding), %d elements per rank", plan.stage,
                 ranks_phrase(world.size, world.replicas),
                 len(plan.params), plan.total_numel, plan.padding_numel, plan.shard_numel)


_OWNER_ATTRIBUTE = "_zero_fx_sharded_by"
"""Set on model parameters and optimizers once sharded: the name of the step that did it.
(An attribute, not a weak dictionary: looking a tensor up there compares tensors.)"""


def sharding_owner(model: torch.nn.Module) -> Optional[str]:
    """The name of the step that sharded ``model``; None if none did."""
    return next((getattr(p, _OWNER_ATTRIBUTE) for p in model.parameters()
                 if hasattr(p, _OWNER_ATTRIBUTE)), None)


def claim(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step_name: Optional[str]) -> None:
    """One model and one optimizer belong to one compiled step: a second step would shard
    what is already sharded (in stage 3, parameters whose storage is gone). None: release them."""
    if step_name is None:
        for obj in (*members(optimizer), *model.parameters()):
            obj.__dict__.pop(_OWNER_ATTRIBUTE, None)
        _SHARDED.pop(model, None)
        return
    for name, param in model.named_parameters():
        owner = getattr(param, _OWNER_ATTRIBUTE, None)
        if owner is not None:
            raise ValueError(
                f"parameter {name!r} is already sharded by the compiled step {owner!r}; a model "
                f"(and its optimizer) belong to one @zero_compile step: call that step, or build "
                f"a new model for {step_name!r}")
    for member in members(optimizer):
        owner = getattr(member, _OWNER_ATTRIBUTE, None)
        if owner is not None:
            raise ValueError(f"this optimizer already steps on the shards of {owner!r}; give "
                             f"{step_name!r} its own optimizer over its own model")
    for param in model.parameters():
        setattr(param, _OWNER_ATTRIBUTE, step_name)
    for member in members(optimizer):
        setattr(member, _OWNER_ATTRIBUTE, step_name)


def _the_one(leaves, cls, what: str, keyword: str):
    found = [x for x in leaves if isinstance(x, cls)]
    unique = list({id(x): x for x in found}.values())
    if len(unique) == 1:
        return unique[0]
    if not unique:
        raise ValueError(f"no {what} among the step's arguments; pass it as an argument or name "
                         f"it with @zero_compile({keyword}...)")
    raise ValueError(f"{len(unique)} different {what}s among the step's arguments; name the one "
                     f"to shard with @zero_compile({keyword}...)")
