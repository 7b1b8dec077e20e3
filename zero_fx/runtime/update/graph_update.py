"""The optimizer's update inside the graph: each bucket's shards step as soon as that
bucket's gradient reduction has landed, and its gradient shards are freed there.

[Note: the update in the graph]
Without it, the graph returns every gradient shard and the optimizer steps on all of them
after the graph (update.py): each shard lives from its reduction to the end of the step,
and the update cannot overlap the backward's tail. With it (``optimizer_update="auto"``,
where it applies, or ``"graph"``), the pass ``update_in_graph`` puts one call of
``update_bucket`` after each bucket's reduction in the graph (and after the last read of
the bucket's masters: at stage 3 the graph reads them, and the update changes them in
place). That call, run by the graph's own Python (regional compilation, or the "eager"
backend), steps the user's optimizer on the bucket: its param groups narrowed to the
bucket's shards, its own ``step`` called, as ``offload_update="device"`` steps one bucket
at a time (streamed_update.py). So the update is torch's own code with the optimizer's
hyperparameters as they are when it runs: a scheduler's new learning rate is read on the
next call, with nothing recompiled, its state is torch.optim's (checkpoints pass between
the two modes), and its numbers are those of the update after the graph, bit for bit,
since SGD, Adam and AdamW compute each element from that element alone
(``tests/test_update_in_graph.py``). Its hooks, if any, run once per bucket.

With ``accumulation_steps=K`` (stages 2-3, which reduce every call), the call sums the
bucket's reduced gradients into the shards' ``.grad`` on the first K-1 calls, as the
update after the graph does, and on the K-th divides by K and steps.

What needs every bucket's gradient before any element may change stays after the graph:

- clipping by the global norm and fp16 loss scaling (the overflow check is the same
  norm). Stepping early and rolling back exactly would need the bucket's masters and
  state as they were (for AdamW three shards) kept until the norm is known: more memory
  than the one gradient shard that updating early frees. Delaying only the last buckets
  frees nothing either, as the first bucket's update waits for the last reduction. So a
  step that clips, scales its loss or calls a GradScaler updates after the graph, exactly
  as before;
- offload, which has its own update (on the host, or streamed through the device);
- stages 0-1 with accumulation, which reduce once after the last micro-batch, outside
  the graph, and stage 0, whose update after the graph is kept (not built here yet);
- a scheduler stepped before ``opt.step()`` in the step, whose new rate the update after
  the graph uses, and hyperparameters the step writes itself before ``opt.step()``
  ([Note: hyperparameters written inside the step] in capture/step_calls.py);
- ``opt.zero_grad(set_to_none=False)``, whose zero gradients step parameters the call did
  not use ([Note: zero_grad(set_to_none=False)] in update.py);
- optimizers other than SGD, Adam and AdamW on shards and Muon and Adafactor on their
  owners, and those with step hooks;
- whole-tensor updates whose gradients reach their owners after the graph: stage 1 (it
  reduces them at the end of the backward), hybrid sharding, quantized gradients, and an
  owner group too large to reduce at once ([Note: owner groups] in zero_fx/plan/owners.py);
- whole-program lowering ("aot_eager", "inductor" with ``regional=False``, a custom
  backend, dynamic shapes): AOTAutograd would trace through the call. Regional
  compilation, the default, runs it in the outer graph.

``explain()`` says which mode ran and why, and lists each bucket's update in the graph.

[Note: whole-tensor updates in the graph]
At stages 2-3 the graph reduces each owner group's gradients to their owners ([Note: reductions
laid out by owner] in whole_tensor_updates.py), so an owner holds a tensor's whole mean
gradient as soon as its group's reduce-scatter lands, and nothing else is needed to step it:
Muon's update of a matrix reads that matrix alone. So the pass puts one ``update_bucket`` after
each group's reduction, as after any bucket's; in it every rank adds what the reduction
returned to its owners' tensors (``WholeTensorUpdates.receive``, the rest dropped), and each
owner steps Muon on the group's tensors it owns, its Newton-Schulz iterations batched by shape
([Note: Newton-Schulz batched by shape] in batched_muon.py). With several optimizers each
member steps what it holds of the bucket, with its own ``step`` (a scheduler's wrapper
included), so the AdamW buckets step in the same graph. The owner's orthogonalisation of a
group then runs between the backward's blocks, while their collectives are in flight, instead
of all of it after the graph, and each whole gradient is freed there. The values go back after
the graph, as the update after it sends them: stage 2's all-gather laid out by owner, stage 3's
all-to-all into the masters (``OptimizerUpdate.apply``), for the names the window's reductions
delivered, the same on every rank. The numbers are the update after the graph's, bit for bit on
a CPU (``tests/test_optimizers.py``): the same tensors, the same gradients, the same step, per
group instead of all at once, and Muon's step of a matrix does not read the others (on a GPU
the batches, per group here and per owner there, may round differently within bf16). Only
torch.optim's Muon and Adafactor, whose update of a tensor reads that tensor alone, are stepped
so (``WHOLE_STEPS_IN_GRAPH``): another whole-tensor optimizer (LAMB written by hand, Shampoo)
may read across its tensors (a global norm), which stepping per group would change.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch

from ...capture.step_calls import WRITES_GROUPS, ZERO_GRAD_KEEPS_ZEROS
from ...passes.common.update_code import ACTIVE_UPDATE
from ..optimizer import WHOLE, update_rule
from .batched_muon import ShapesBatched, applies, batched_by_shape
from .optimizer_set import OptimizerSet, members

STEPS_IN_GRAPH = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
"""The optimizers whose update the graph runs per bucket, on flat shards."""
WHOLE_STEPS_IN_GRAPH = (torch.optim.Muon, torch.optim.Adafactor)
"""The whole-tensor updates the graph runs on their owners, per owner group, at stages 2-3
([Note: whole-tensor updates in the graph])."""

class GraphUpdate:
    """What ``update_bucket`` does for one step: sum, or step the optimizer on a bucket."""

    def __init__(self, state, accumulation_steps: int, batches: ShapesBatched):
        self.state = state
        self.accumulation_steps = accumulation_steps
        self.batches = batches
        """What Muon's steps batched ([Note: Newton-Schulz batched by shape])."""
        self.micro_step = 0
        """Calls since the last update, as the running call began (``OptimizerUpdate`` counts
        them; ``running`` takes its count)."""
        self.real_steps: Sequence[Callable] = ()
        """Each optimizer's own ``step``, in member order ([Note: several optimizers in one
        step] in optimizer_set.py): the step's ``opt.step()`` only records, inside it."""
        self.changed = False
        """This call's graph has stepped at least one bucket (its failure leaves ranks apart)."""
        self.stepped: set[str] = set()
        """The parameters stepped in the graph since the last update ([Note: what the update
        refreshes] in sharded_state.py)."""
        self.refused = ""
        """Why the first call left the update after the graph (``why_not_in_graph``); "": in
        the graph, unless a compilation says otherwise (``why_not_for_capture``)."""

    def update(self, names: Sequence[str], grads: Sequence[torch.Tensor]) -> None:
        """One bucket's reduced gradients (``grads``, for ``names``) summed into what the
        optimizers step, and at the end of the window stepped: flat shards by every rank,
        whole tensors ([Note: whole-tensor updates on owner ranks]) by their owner, whose
        gradient the bucket (a reduction laid out by owner) brought whole."""
        state, plan = self.state, self.state.plan
        state.grads_seen.update(names)
        flat = [name for name in names if not plan.reduced_to_owner_in_graph(name)]
        with torch.no_grad():
            for name, grad in zip(names, grads):
                if name not in flat:
                    state.whole.receive(name, grad)
                    continue
                shard = state.shards[name]
                # as commit_grads after the graph: the masters' dtype and device, summed
                grad = grad.to(dtype=shard.dtype, device=shard.device)
                shard.grad = grad if shard.grad is None else shard.grad + grad
            if self.micro_step + 1 < self.accumulation_steps:
                return
            held = [state.shards[n] for n in flat if state.shards[n].grad is not None] + [
                state.whole.tensors[n] for n in names if n not in flat and state.whole.owns(n)
                and state.whole.tensors[n].grad is not None]
            if self.accumulation_steps != 1 and held:
                torch._foreach_div_([t.grad for t in held], float(self.accumulation_steps))
        self.changed = True
        self.stepped.update(n for n in flat if state.shards[n].grad is not None)
        with batched_by_shape(self.batches):
            for member, real_step in zip(members(state.optimizer), self.real_steps):
                step_on(member, held, real_step)
        for tensor in held:
            tensor.grad = None

    def take_stepped(self) -> set[str]:
        """The parameters stepped since the last update; forgotten here."""
        stepped, self.stepped = self.stepped, set()
        return stepped

    @contextlib.contextmanager
    def running(self, real_steps: Sequence[Callable], micro_step: int):
        """While the step's graph runs: its ``update_bucket`` calls step this update, with
        each optimizer's ``real_steps``; ``micro_step`` calls have summed their gradients
        since the last update."""
        self.real_steps, self.micro_step, self.changed = real_steps, micro_step, False
        token = ACTIVE_UPDATE.set(self)
        try:
            yield
        finally:
            ACTIVE_UPDATE.reset(token)
            self.real_steps = ()


def step_on(optimizer: torch.optim.Optimizer, shards: Sequence[torch.Tensor],
            step: Callable) -> None:
    """``step()`` of ``optimizer`` on ``shards`` only: its param groups narrowed to them for
    the call (each shard in its own group, with that group's hyperparameters). Not called
    where the optimizer holds none of them (another member of several optimizers')."""
    chosen = {id(s) for s in shards}
    groups = optimizer.param_groups
    every_group = [group["params"] for group in groups]
    narrowed = [[p for p in params if id(p) in chosen] for params in every_group]
    if not any(narrowed):
        return
    try:
        for group, params in zip(groups, narrowed):
            group["params"] = params
        step()
    finally:
        for group, params in zip(groups, every_group):
            group["params"] = params


def kernels_of(optimizer: torch.optim.Optimizer, batches: Optional[ShapesBatched] = None) -> str:
    """Which of torch.optim's implementations the optimizer's ``step`` runs, from its first
    group's settings and where its shards are (torch's default: foreach kernels on a GPU, a
    loop of element-wise operations over each tensor on a CPU); for Muon, how its iterations
    were batched (``batches``: [Note: Newton-Schulz batched by shape])."""
    if isinstance(optimizer, OptimizerSet):
        return "; ".join(kernels_of(member, batches) for member in optimizer.members)
    group = optimizer.param_groups[0]
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.Muon):
        if not applies():
            return (f"{name}'s loop over each matrix (its orthogonalisation was replaced, which "
                    "batching by shape would not call)")
        return f"{name}'s " + (batches.describe() if batches is not None and batches.last
                               else "Newton-Schulz batched by shape")
    if group.get("fused"):
        return f"{name}'s fused kernel (fused=True)"
    if group.get("foreach"):
        return f"{name}'s foreach kernels (foreach=True)"
    on_gpu = any(p.device.type != "cpu" for g in optimizer.param_groups for p in g["params"])
    default = group.get("foreach") is None
    kernels = "foreach kernels" if on_gpu and default else "loop over each tensor"
    chosen = (f"torch's default on a {'GPU' if on_gpu else 'CPU'}" if default
              else "foreach=False")
    hint = ("; fused=True runs one fused kernel instead (docs/training-features.md has the "
            "figures)") if "fused" in group else ""
    return f"{name}'s {kernels} ({chosen}){hint}"


def why_not_in_graph(config, optimizer: torch.optim.Optimizer, plan) -> Optional[str]:
    """Why this step updates after the graph ([Note: the update in the graph]); None: in the
    graph. Read at the first call; what only the capture shows is ``why_not_for_capture``."""
    if config.optimizer_update == "eager":
        return "optimizer_update='eager'"
    if plan.replicated:
        return "stage 0 keeps the update after the graph"
    if config.offload.mode is not None:
        return "offload has its own update (on the host, or streamed through the device)"
    if config.max_grad_norm is not None:
        return ("max_grad_norm clips by the global norm, which needs every bucket's gradient "
                "before any element is updated")
    if plan.loss_scaled:
        return ("fp16 loss scaling skips an overflowed step, which needs every bucket's gradient "
                "before any element is updated")
    if not plan.reduces_in_graph:
        return (f"stage {plan.stage} with accumulation_steps={plan.accumulation_steps} reduces "
                "the summed gradients once, after the last micro-batch, outside the graph")
    if plan.owners and not plan.reduces_to_owners_in_graph:
        return ("whole-tensor updates get their gradients after the graph here ("
                + _why_owners_after(plan) + "), and step there")
    for member in members(optimizer):
        whole = bool(plan.owners) and update_rule(member, config.elementwise_optimizer) == WHOLE
        if type(member) not in (WHOLE_STEPS_IN_GRAPH if whole else STEPS_IN_GRAPH):
            return (f"{type(member).__name__} is not one the graph steps per bucket (SGD, Adam, "
                    "AdamW; Muon and Adafactor on their owners at stages 2-3)")
        if _has_step_hooks(member):
            return (f"{type(member).__name__} has step hooks, which would run once per bucket")
    backend = config.backend
    if not isinstance(backend, str) or not (backend == "eager" or config.regional):
        return (f"backend {getattr(backend, '__name__', backend)!r} without regional compilation "
                "traces the whole graph again, through the update's call")
    return None


def _why_owners_after(plan) -> str:
    """Why the graph does not reduce whole-tensor updates' gradients to their owners."""
    if not plan.grads_sharded:
        return f"stage {plan.stage} reduces them to their owners at the end of the backward"
    if plan.replicas > 1:
        return "hybrid sharding reduces them into shards"
    if plan.quantize_gradients is not None:
        return "quantized gradients are reduced into shards"
    return (f"the largest owner group's gradients, {plan.owner_group_bytes / 2**20:.0f} MiB, "
            "pass what one reduction laid out by owner may hold")


def _has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Its own step hooks, or those registered for every optimizer."""
    from torch.optim import optimizer as module

    return bool(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
                or getattr(module, "_global_optimizer_pre_hooks", None)
                or getattr(module, "_global_optimizer_post_hooks", None))


def why_not_for_capture(calls: Sequence[str], dynamic: bool, backend) -> Optional[str]:
    """What the captured step shows that keeps its update after the graph: the companions it
    calls (``calls``: the trace's notes, capture/step_calls.py), dynamic shapes."""
    if "reads gradients" in calls:
        return ("the step clips its gradients or calls a GradScaler, which need every bucket's "
                "gradient before any element is updated")
    if "scheduler" in calls and calls.index("scheduler") < calls.index("step"):
        return "the step calls scheduler.step() before opt.step(), which the update must see"
    if WRITES_GROUPS in calls:
        return ("the step sets the optimizer's hyperparameters (param_groups) before "
                "opt.step(), which the graph only writes back after it has run")
    if ZERO_GRAD_KEEPS_ZEROS in calls:
        return ("opt.zero_grad(set_to_none=False) keeps zero gradients, with which every "
                "parameter the call did not use steps too")
    if dynamic and backend != "eager":
        return "dynamic shapes lower the whole graph, not by regions"
    return None
