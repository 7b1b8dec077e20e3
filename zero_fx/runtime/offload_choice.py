"""``offload="auto"``: the least offload whose step fits the device's memory.

[Note: choosing what to offload]
``zero_compile(offload="auto", device_memory=None)`` runs the first of None, "optimizer" and
(stage 3) "parameters" ([Note: optimizer offload] in offload.py) whose step fits the budget:
``device_memory`` bytes, or the training GPU's capacity. Every rank takes the smallest
budget any rank has, so all pick the same mode and run the same graph. On the CPU, without
``device_memory``, nothing is offloaded: host and device are one memory there.

The mode is decided twice, and only ever toward more offload, because moving state to the
host never needs device memory that is not already in use:

1. **When the model is sharded**, before anything is placed (``choose_before_placing``).
   A mode whose model state alone is over the budget cannot fit. That state is the device's
   share of parameters, masters and optimizer state, counted exactly from the plan. The
   state is placed for the first mode whose model state fits. So a model whose fp32 masters
   would not fit on the device trains at all: they go to the host before they are ever on
   the device.
2. **At the first compilation**, from the rewritten graph (``device_peak``). The device's
   peak is its masters and optimizer state (from the plan) plus the graph's inputs and its
   working set at the timeline's peak ([Note: the memory timeline]); the copies already on
   their way to the host are not counted. If the peak is over the budget, the state moves
   to the host for the next mode (``ShardedState.move_to_host``), the step is rewritten for
   that mode, and the check runs again. It stops when a mode fits, or when none is left;
   then a warning says so and the most offload runs.

Later compilations (new input shapes) keep the mode. The timeline is an estimate: it does
not model the allocator's caching and fragmentation, so leave headroom in
``device_memory``. ``explain()`` lists each mode's bytes and the verdict.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.fx import GraphModule

from ..analysis.memory_timeline import memory_timeline, peak_alive
from ..base.formatting import format_bytes
from ..passes.common.host_copies import is_host_copy
from ..passes.common.predicates import is_param_input, tensor_bytes

log = logging.getLogger("zero_fx")


def modes_for(plan) -> tuple[Optional[str], ...]:
    """The modes ``offload="auto"`` chooses from for ``plan``'s stage, least offload first:
    the parameters' shards can move to the host only where they are shards (stage 3)."""
    return (None, "optimizer", "parameters") if plan.params_sharded else (None, "optimizer")


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> int:
    """How many tensors of state, each the size of the parameter, the optimizer keeps for a
    parameter: Adam's two moments; 2 for an optimizer not listed (Adam's count)."""
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    name = type(optimizer).__name__
    if name in ("Adam", "AdamW"):
        return 3 if group.get("amsgrad") else 2
    if name == "SGD":
        return 1 if group.get("momentum") else 0
    if name == "RMSprop":
        return 1 + bool(group.get("momentum")) + bool(group.get("centered"))
    if name in ("Adagrad", "ASGD"):
        return 1
    return 2  # Adamax, NAdam, RAdam, Adadelta, Rprop, and optimizers zero_fx does not know


def state_bytes(plan, mode: Optional[str], state_tensors: int) -> dict[str, int]:
    """The model state on the device of one rank in ``mode`` (bytes by kind), from ``plan``:
    the parameters the graph reads (stage 3: shards, in the compute dtype once the masters
    are offloaded; stages 1-2: the whole parameters), the masters, the optimizer state."""
    params = masters = optimizer = 0
    compute = plan.compute_dtype
    for layout in plan.params:
        if not plan.holds(layout.name):
            continue
        shard, dtype = layout.shard_numel, layout.dtype
        if plan.params_sharded:
            if mode is None:
                params += shard * dtype.itemsize  # the graph reads the masters themselves
            elif mode == "optimizer":
                params += shard * (compute or dtype).itemsize
        else:
            params += layout.numel * (compute or dtype).itemsize
        if mode is None:
            masters += 0 if plan.params_sharded else shard * dtype.itemsize
            optimizer += state_tensors * shard * dtype.itemsize if layout.requires_grad else 0
    return {"parameters": params, "masters": masters, "optimizer": optimizer}


def device_peak(gm: GraphModule, plan, state_tensors: int) -> int:
    """The device's peak over the step ``gm`` (rewritten for ``plan``): what stays on the
    device (``device_between_steps``) and the most bytes the graph's own tensors hold at
    once, less the copies on their way to the host."""
    host = {node.name for node in gm.graph.nodes if is_host_copy(node)}
    timeline = memory_timeline(gm)
    working = peak_alive(len(timeline.transient), ((t.index, t.last_use, t.bytes)
                                                   for t in timeline.tensors if t.node not in host))
    return device_between_steps(gm, plan, state_tensors) + working


def device_between_steps(gm: GraphModule, plan, state_tensors: int) -> int:
    """What stays on the device around the step ``gm``: the masters and the optimizer state
    left there, and the graph's inputs on the device (shards or parameters, the batch)."""
    kept = state_bytes(plan, plan.offload, state_tensors)
    inputs = sum(tensor_bytes(node.meta.get("val")) for node in gm.graph.find_nodes(op="placeholder")
                 if not (is_param_input(node) and plan.offloads_parameters))
    return kept["masters"] + kept["optimizer"] + inputs


@dataclass
class ModeVerdict:
    """One mode as ``offload="auto"`` saw it."""

    mode: Optional[str]
    state: int
    """Model state on the device (bytes, from the plan)."""
    peak: Optional[int] = None
    """The step's device peak (bytes, from the rewritten graph); None: not traced."""
    between_steps: Optional[int] = None
    """What stays on the device around the step (bytes, from the rewritten graph)."""

    def fits(self, budget: int) -> bool:
        return (self.peak if self.peak is not None else self.state) <= budget


@dataclass
class OffloadChoice:
    """What offload mode runs and where its optimizer steps, and from what ([Note: choosing
    what to offload])."""

    budget: Optional[int]
    """Bytes of device memory the step may fill; None: no budget (the CPU)."""
    budget_source: str
    """Where the budget comes from, in words."""
    verdicts: list[ModeVerdict] = field(default_factory=list)
    mode: Optional[str] = None
    auto: bool = True
    """``offload="auto"``; False: the mode was given, and only the update's place is chosen."""
    decided: bool = False
    """Whether the rewritten graph has been checked (the first compilation)."""
    update: str = "host"
    """Where the offloaded optimizer steps: "host", or "device" ([Note: the update streamed
    through the device] in streamed_update.py)."""
    update_reason: str = ""

    @classmethod
    def given(cls, mode: str, plan, optimizer: torch.optim.Optimizer, budget: Optional[int],
              budget_source: str) -> "OffloadChoice":
        """An offload mode the user chose: only where its update runs is left to choose."""
        state = sum(state_bytes(plan, mode, optimizer_state_tensors(optimizer)).values())
        return cls(budget, budget_source, [ModeVerdict(mode, state)], mode, auto=False)

    def next_mode(self, gm: GraphModule, plan, state_tensors: int) -> Optional[str]:
        """Records the device peak of ``gm`` (rewritten for the current mode); returns the
        next mode to try, or None when this one fits (or is the last, or was given)."""
        verdict = next(v for v in self.verdicts if v.mode == self.mode)
        verdict.peak = device_peak(gm, plan, state_tensors)
        verdict.between_steps = device_between_steps(gm, plan, state_tensors)
        following = self.verdicts[self.verdicts.index(verdict) + 1:]
        if self.budget is None or verdict.fits(self.budget) or not following:
            self.decided = True
            if self.auto and self.budget is not None and not verdict.fits(self.budget):
                log.warning("zero_fx: offload='auto': the step's estimated device peak, %s, is over "
                            "the budget of %s (%s) even with offload=%r; running with it",
                            format_bytes(verdict.peak), format_bytes(self.budget),
                            self.budget_source, self.mode)
            return None
        self.mode = following[0].mode
        log.info("zero_fx: offload='auto': with offload=%r the step's estimated device peak is "
                 "%s, over the budget of %s; moving to offload=%r", verdict.mode,
                 format_bytes(verdict.peak), format_bytes(self.budget), self.mode)
        return self.mode

    @property
    def chosen(self) -> ModeVerdict:
        return next(v for v in self.verdicts if v.mode == self.mode)

    def choose_update(self, requested: str, bucket_state: int, delayed: bool) -> None:
        """Where the offloaded optimizer steps: ``requested`` ("host" or "device"), or for
        "auto" the device where the budget has room for two buckets of ``bucket_state``
        bytes beside what stays on the device between steps (the update runs after the
        graph, whose working set is free by then)."""
        if self.mode is None:
            self.update, self.update_reason = "device", "nothing offloaded"
        elif requested != "auto":
            self.update, self.update_reason = requested, f"offload_update={requested!r}"
        elif delayed:
            self.update, self.update_reason = "host", "offload_step='overlap' steps on a host thread"
        elif self.budget is None:
            self.update, self.update_reason = "host", self.budget_source
        else:
            room, need = self.budget - self.chosen.between_steps, 2 * bucket_state
            self.update = "device" if room >= need else "host"
            self.update_reason = (f"offload_update='auto': {format_bytes(max(room, 0))} of the "
                                  f"budget free after the graph, {format_bytes(need)} for two "
                                  "buckets of state")

    def lines(self) -> list[str]:
        """``explain()``'s account of the choice."""
        out = self._mode_lines() if self.auto else []
        if self.mode is not None:
            where = ("on the device, its state streamed in from the host bucket by bucket and "
                     "back ([Note: the update streamed through the device])"
                     if self.update == "device" else "on the host")
            out.append(f"  optimizer step: {where} ({self.update_reason})")
        return out

    def _mode_lines(self) -> list[str]:
        if self.budget is None:
            return [f"  offload='auto': nothing offloaded ({self.budget_source})"]
        out = [f"  offload='auto' chose offload={self.mode!r} for a device budget of "
               f"{format_bytes(self.budget)} ({self.budget_source}); least offload first "
               "([Note: choosing what to offload]):",
               f"    {'offload':<12} {'model state on the device':>26} {'device peak':>12}  verdict"]
        for v in self.verdicts:
            peak = format_bytes(v.peak) if v.peak is not None else "-"
            if v.mode == self.mode:
                verdict = "chosen" + ("" if v.fits(self.budget) else " (over the budget: no mode fits)")
            elif v.peak is None and not v.fits(self.budget):
                verdict = "model state alone over the budget"
            elif v.peak is None:
                verdict = "not needed"
            else:
                verdict = "peak over the budget"
            out.append(f"    {str(v.mode):<12} {format_bytes(v.state):>26} {peak:>12}  {verdict}")
        return out


def bucket_state_bytes(plan, state_tensors: int) -> int:
    """The largest bucket's masters, gradients and optimizer state (bytes): what the update
    streamed through the device holds of one bucket."""
    names = [l.name for l in plan.params if l.requires_grad and plan.holds(l.name)]
    return max((sum(plan.layout(name).shard_numel * plan.layout(name).dtype.itemsize
                    for name in bucket) * (2 + state_tensors)
                for bucket in plan.buckets(names)), default=0)


def choose_before_placing(plan, optimizer: torch.optim.Optimizer, budget: Optional[int],
                          budget_source: str) -> OffloadChoice:
    """The first check ([Note: choosing what to offload]): the least offload whose model
    state fits ``budget``, before the state is placed."""
    state_tensors = optimizer_state_tensors(optimizer)
    choice = OffloadChoice(budget, budget_source, verdicts=[
        ModeVerdict(mode, sum(state_bytes(plan, mode, state_tensors).values()))
        for mode in modes_for(plan)])
    if budget is None:
        choice.verdicts, choice.decided = choice.verdicts[:1], True
    else:
        choice.mode = next((v.mode for v in choice.verdicts if v.fits(budget)),
                           choice.verdicts[-1].mode)
    return choice


def device_budget(device_memory: Optional[float], device: torch.device) -> tuple[Optional[int], str]:
    """The budget ``offload="auto"`` fits the step into, and where it comes from."""
    if device_memory is not None:
        return int(device_memory), "device_memory="
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"{device}'s capacity"
    return None, (f"training on the {device.type}: host and device are one memory; give "
                  "device_memory= to choose as if they were apart")


def agreed_budget(budget: Optional[int], world, device: torch.device) -> Optional[int]:
    """The smallest ``budget`` of any rank, so that every rank chooses the same mode."""
    import torch.distributed as dist

    if budget is None or world.simulated or world.ranks == 1 or not dist.is_initialized():
        return budget
    smallest = torch.tensor([float(budget)], dtype=torch.float64,
                            device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    return int(smallest.item())


def with_mode(plan, mode: Optional[str]):
    """``plan`` with ``offload=mode``."""
    return dataclasses.replace(plan, offload=mode)
