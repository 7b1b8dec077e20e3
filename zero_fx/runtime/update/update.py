"""After each call's graph: accumulate gradients; every K-th call unscale, clip and step.

[Note: gradient accumulation]
With ``accumulation_steps=K`` the decorated step is called once per
micro-batch, as before, and its ``opt.step()`` / ``opt.zero_grad()`` take
effect on every K-th call only (as with DeepSpeed's
``gradient_accumulation_steps``); the gradient the optimizer sees is the mean
over the K micro-batches, so K micro-batches of B equal one batch of K·B.
Where the sum is kept depends on the stage:

- stages 2 and 3 reduce-scatter each call's gradients inside the graph, as
  without accumulation, and sum the 1/N shards: memory stays that of a shard;
- stages 0 and 1 hold whole gradients anyway, so their graph does not reduce
  at all (``ShardPlan.reduces_in_graph``): each call adds its whole gradients
  to a local sum, and the K-th call reduces the sum once, outside the graph,
  one collective per bucket. That moves K times fewer bytes than reducing
  every call, at the price of not overlapping that one reduction with the
  last backward.

[Note: clipping and overflow]
The global gradient norm is computed on each rank's shards, all-reduced once
as a single scalar (the sum of squares), and square-rooted: the norm of the
whole gradient, as ``torch.nn.utils.clip_grad_norm_`` computes it on one
process (``torch._foreach_norm`` per gradient, then the norm of those: a few
kernels, not a few per parameter). In stage 0, and in stages 1-2 at one rank,
every rank holds the whole gradient and no collective is needed. The same
norm detects overflow under fp16 loss scaling: it is inf or NaN exactly when
some gradient element is (or, as for ``clip_grad_norm_``, when the sum of
squares itself overflows fp32), and equal on every rank, so every rank skips
the same steps.

[Note: the delayed update]
With ``offload_step="overlap"`` (and an offloaded optimizer), ``apply()`` only starts the
optimizer's step, on a host thread (PyTorch's CPU kernels release the GIL), and returns:
the next call's graph runs meanwhile, on the parameters the step before had, as
ZeRO-Offload's delayed parameter update does. That call waits for the update once its
graph has returned, before its gradients are committed: the gradients are cleared, the
updated masters copied into the shards the graph reads, and the new gradients taken in.
So call k's gradient is computed with the parameters after update k - 2, and update k
steps from those after k - 1 (``tests/test_offload.py`` applies this by hand). Anything
that reads the masters (a checkpoint, ``full_parameters``) waits for the update first
(``settle()``); the update's errors surface there or at the next call.

[Note: zero_grad(set_to_none=False)]
torch.optim steps every parameter whose ``.grad`` is a tensor, a zero one included: with
momentum or weight decay a parameter the call did not use still moves. Eager holds a
``.grad`` tensor for every parameter given a gradient since the last ``zero_grad()`` that
set gradients to None; ``zero_grad(set_to_none=False)`` zeroes them and keeps them. zero_fx's
shards hold a gradient only for what the call's graph differentiated, so the state counts
the parameters eager would hold a ``.grad`` for (``grads_seen``), and when the step's
``zero_grad`` keeps zeros (``keeps_zero_grads``, read from the call's recorded calls) each of
them without a gradient this window steps with a zero one, as in eager. The update then
runs after the graph (graph_update.py, ``why_not_for_capture``): the update in the graph
steps only the buckets whose gradients the graph reduces.

Nothing of this reads a value on the host: the gradients are divided by the
scale (a device tensor), the overflow flag and the new scale are computed on
the device (``LossScaler``). Skipping the optimizer step is the one place
that may need the flag on the host: a fused ``Adam``/``AdamW``
(``fused=True``) takes it as ``optimizer.found_inf`` and skips on the device,
as under GradScaler, so an fp16 step reads nothing; any other optimizer
reads the flag once per optimizer step (GradScaler does the same). Not
fused SGD: with momentum, a skipped first step leaves its momentum buffers
uninitialised (``torch.optim.sgd._fused_sgd`` allocates them with
``empty_like`` and then skips the kernel that would fill them).
"""

from __future__ import annotations

import contextlib
import math
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch

from ..distributed.failures import completion_check
from .batched_muon import ShapesBatched, batched_by_shape
from .graph_update import GraphUpdate, step_on
from .precision import LossScaler
from ..sharded_state import ShardedState
from .streamed_update import step_through_device

_c10d = torch.ops._c10d_functional


SKIPS_ON_DEVICE = (torch.optim.Adam, torch.optim.AdamW)
"""Optimizers that, built with ``fused=True``, skip their step on the device when given
``found_inf`` ([Note: clipping and overflow])."""


class OptimizerUpdate:
    """Runs after each call's graph. ``accumulate()`` then, when it says so, ``apply()``."""

    def __init__(self, state: ShardedState, *, accumulation_steps: int = 1,
                 max_grad_norm: Optional[float] = None, scaler: Optional[LossScaler] = None,
                 delayed: bool = False):
        self.state = state
        self.delayed = delayed
        """The optimizer steps on a host thread while the next call runs ([Note: the delayed
        update])."""
        self._pending: Optional[Future] = None
        self._host_thread = ThreadPoolExecutor(1, "zero_fx-update") if delayed else None
        self.steps_through_device = False
        """Offloaded: the optimizer steps on the device, its state streamed bucket by bucket
        ([Note: the update streamed through the device] in streamed_update.py)."""
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm = max_grad_norm
        self.scaler = scaler
        self.micro_step = 0
        """Calls since the last optimizer step (or skipped step)."""
        self.windows = 0
        """Accumulation windows ended: optimizer steps taken plus those skipped."""
        self.last_grad_norm: Optional[torch.Tensor] = None
        """The global gradient norm of the latest optimizer step, before clipping (computed
        when clipping or loss scaling, else None)."""
        self.scaler_skips = 0
        """Optimizer steps a ``GradScaler`` in the step skipped (runtime/update/companions.py)."""
        self._found_inf: Optional[torch.Tensor] = None
        """For an optimizer that skips on the device: this window's overflow flag."""
        self.batches = ShapesBatched()
        """What Muon's latest steps batched ([Note: Newton-Schulz batched by shape] in
        batched_muon.py)."""
        self.in_graph = GraphUpdate(state, accumulation_steps, self.batches)
        """The update the graph makes per bucket when the plan says so ([Note: the update in
        the graph] in graph_update.py)."""
        self.graph_stepped = False
        """This call's graph steps the optimizer (or sums the gradients) itself, bucket by
        bucket (its compilation's plan said so; ``StepRunner`` sets it)."""
        self.keeps_zero_grads = False
        """The step's ``opt.zero_grad`` keeps zeroed gradients (``set_to_none=False``: [Note:
        zero_grad(set_to_none=False)]); set from each call's recorded calls."""
        self.groups_at_call: Optional[list[dict]] = None
        """The optimizer's hyperparameters as this call found them, taken only where its graph
        writes the param groups after ``opt.step()``: the update after the graph then steps
        with them ([Note: hyperparameters written inside the step] in capture/step_calls.py;
        ``StepRunner`` takes them, before its graph runs). None: it steps with the groups as
        they are."""
        self.completion = completion_check(state.world, state.device)
        """NCCL: the fences that confirm each call's collectives finished ([Note: failures on
        NCCL] in failures.py); None on gloo, whose collectives raise where they fail."""

    def running_graph(self, real_steps):
        """Around the call of the step's graph: its updates step ``real_steps``, each
        optimizer's own ``step``."""
        self.graph_stepped = False
        self.groups_at_call = None
        return self.in_graph.running(real_steps, self.micro_step)

    def take_groups_at_call(self) -> None:
        """Before a graph that writes the param groups after ``opt.step()`` runs: keep the
        hyperparameters this call found (``groups_at_call``)."""
        self.groups_at_call = hyperparameters(self.state.optimizer)

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps taken (skipped ones not counted)."""
        return self.windows - self.scaler_skips - (
            self.scaler.skipped_steps if self.scaler is not None else 0)

    def accumulate(self) -> bool:
        """Take this call's gradients; True if this call ends an accumulation window and the
        gradients are ready (reduced, averaged, unscaled, clipped) for ``apply()``. False also
        when an overflowed fp16 step was skipped."""
        self.settle()  # the previous call's update, if it still runs: [Note: the delayed update]
        self.state.commit_grads()
        self.micro_step += 1
        if self.micro_step < self.accumulation_steps:
            return False
        self.micro_step = 0
        if self.graph_stepped:  # the graph has stepped every bucket
            self.windows += 1
            return True
        self.state.reduce_accumulated()
        grads = self.state.grads()
        self._unscale(grads)
        norms = self.max_grad_norm is not None or self.scaler is not None
        norm = self.grad_norm(grads) if norms else None
        self.windows += 1
        if norm is None:
            return True
        self.last_grad_norm = norm
        if self.scaler is not None:
            found_inf = norm.isfinite().logical_not().to(torch.float32)
            self.scaler.update(found_inf)
            if self._skips_on_device():
                self._found_inf = found_inf
            elif found_inf.item():  # the one host read ([Note: clipping and overflow])
                self.state.zero_grad()
                return False
        if self.max_grad_norm is not None:
            coefficient = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
            if grads:
                torch._foreach_mul_(grads, coefficient.to(grads[0].device))
        return True

    def _unscale(self, grads: list[torch.Tensor]) -> None:
        """The mean over the window's micro-batches, and the loss scale divided out."""
        if not grads:
            return
        if self.scaler is not None:
            torch._foreach_div_(grads, (self.scaler.scale * self.accumulation_steps).to(
                grads[0].device))
        elif self.accumulation_steps != 1:
            torch._foreach_div_(grads, float(self.accumulation_steps))

    def _skips_on_device(self) -> bool:
        optimizer = self.state.optimizer
        return not self.state.offloaded and type(optimizer) in SKIPS_ON_DEVICE and getattr(
            optimizer, "_step_supports_amp_scaling", False)

    def discard(self) -> None:
        """Drop the gradients of the current accumulation window (a failed call)."""
        self.state.zero_grad()
        self.micro_step = 0

    def counters(self) -> dict:
        """What a checkpoint keeps of this object (saved only between optimizer steps)."""
        scaler = self.scaler
        return {"optimizer_steps": self.optimizer_steps,
                "loss_scale": scaler.scale.item() if scaler else None,
                "clean_steps": scaler.clean_steps if scaler else 0,
                "skipped_steps": scaler.skipped_steps if scaler else 0}

    def restore_counters(self, saved: dict) -> None:
        self.windows = saved["optimizer_steps"]
        self.micro_step = 0
        if self.scaler is not None and saved["loss_scale"] is not None:
            self.scaler.scale.fill_(saved["loss_scale"])
            self.scaler.clean_steps = saved["clean_steps"]
            self.scaler.skipped_steps = saved["skipped_steps"]
            self.windows += saved["skipped_steps"]

    def apply(self) -> None:
        """The optimizer steps on the shards (or skips, on the device, an overflowed fp16
        step); gradients cleared; parameters refreshed."""
        if self.graph_stepped:  # stepped in the graph: the parameters refreshed only
            with batched_by_shape(self.batches):
                self._step_what_the_graph_left()
            self.state.stepped = self.in_graph.take_stepped()
            # whole tensors stepped on their owners return ([Note: whole-tensor updates on
            # owner ranks]): those the window's reductions delivered, the same on every rank
            self.state.after_step(list(self.state.whole.delivered)
                                  if self.state.whole is not None else [])
            self.state.zero_grad()
            self.state.refresh_parameters()
            self._forget_grads()
            self.batches.settle()
            return
        if self.keeps_zero_grads:
            self.state.keep_zero_grads()
        self.state.note_stepped()
        exchanged = self.state.before_step()  # [Note: whole-tensor updates on owner ranks]
        with self._hyperparameters_of_the_call(), batched_by_shape(self.batches):
            fresh = self._step()
        self.batches.settle()
        self.state.after_step(exchanged)
        if self._pending is not None:
            return
        self.state.zero_grad()
        self.state.refresh_parameters(fresh=fresh)
        self._forget_grads()

    def _step_what_the_graph_left(self) -> None:
        """With accumulation, the shards (and owners' whole tensors) that only earlier calls of
        the window gave a gradient (a branch the last micro-batch did not take): the graph's
        update steps only the buckets the last call reduced, so these step here, averaged as
        the graph averages."""
        state = self.state
        left = {name: shard for name, shard in state.shards.items() if shard.grad is not None}
        whole = [] if state.whole is None else [t for t in state.whole.tensors.values()
                                                if t.grad is not None]
        if not left and not whole:
            return
        if self.accumulation_steps != 1:
            torch._foreach_div_([t.grad for t in [*left.values(), *whole]],
                                float(self.accumulation_steps))
        optimizer = state.optimizer
        self.in_graph.stepped.update(left)
        step_on(optimizer, [*left.values(), *whole], optimizer.step)
        for tensor in [*left.values(), *whole]:
            tensor.grad = None

    def _forget_grads(self) -> None:
        """After the update: a ``zero_grad()`` that sets to None forgets which parameters had
        a ``.grad`` ([Note: zero_grad(set_to_none=False)])."""
        if not self.keeps_zero_grads:
            self.state.grads_seen.clear()

    @contextlib.contextmanager
    def _hyperparameters_of_the_call(self):
        """While the optimizer steps after the graph: its groups hold what ``opt.step()`` saw
        in the step. That is what they hold now, unless the step wrote them after its
        ``opt.step()`` only, when it is what they held as the call began ([Note:
        hyperparameters written inside the step] in capture/step_calls.py)."""
        groups = self.state.optimizer.param_groups
        if self.groups_at_call is None or len(groups) != len(self.groups_at_call):
            yield
            return
        written = hyperparameters(self.state.optimizer)
        for group, before in zip(groups, self.groups_at_call):
            group.update(before)
        try:
            yield
        finally:
            for group, after in zip(groups, written):
                group.update(after)

    def _step(self) -> frozenset:
        """The optimizer's step on the shards, after the graph; the shards it already wrote on
        the device (offloaded stage 3, streamed)."""
        optimizer = self.state.optimizer
        fresh = frozenset()
        if self._found_inf is not None:
            optimizer.found_inf = self._found_inf
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf
                self._found_inf = None
        elif self.delayed and self.groups_at_call is None:
            self._pending = self._host_thread.submit(optimizer.step)
        elif self.steps_through_device:
            fresh = step_through_device(self.state)
        else:
            optimizer.step()
        return fresh

    def skip(self) -> None:
        """The window's optimizer step skipped (a ``GradScaler`` found inf or NaN): its
        gradients cleared, nothing stepped."""
        self.scaler_skips += 1
        self.state.zero_grad()

    def settle(self) -> None:
        """Wait for an update still running on the host thread (raising its error), then
        clear the gradients and refresh the parameters from it; a no-op when none runs."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.result()
        self.state.zero_grad()
        self.state.refresh_parameters()
        self._forget_grads()

    def fence(self) -> None:
        """After the call's last collective (NCCL): a fence, not waited for."""
        if self.completion is not None:
            self.completion.issue()

    def confirm(self, *, everything: bool = False) -> None:
        """Settle the fences of earlier calls (``CompletionCheck.settle``): raises
        ``FenceFailed`` if one failed."""
        if self.completion is not None:
            self.completion.settle(everything=everything)

    def grad_norm(self, grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
        """The ``norm_type``-norm (any p > 0, or inf) of the whole gradient from this rank's
        part of it ([Note: clipping and overflow]); float32, a scalar, the same on every rank.
        The ranks' p-norms combine as the p-th root of the sum of their p-th powers."""
        plan = self.state.plan
        parallel = plan.tensor_parallel
        if parallel is not None and parallel.rank != 0:
            # a parameter every "tp" rank holds whole has the same gradient on each: counted
            # on the first ([Note: ZeRO over tensor parallelism] in plan/tensor_parallel.py)
            grads = [shard.grad for name, shard in self.state.shards.items()
                     if shard.grad is not None and name not in parallel.replicated]
        if grads:
            norms = torch._foreach_norm(grads, norm_type, dtype=torch.float32)
        else:
            norms = [torch.zeros((), device=self.state.device)]
        # clip_grad_norm_'s, of this part; reduced on the device (offloaded grads: the host's)
        norm = torch.linalg.vector_norm(torch.stack(norms), norm_type).to(self.state.device)
        if norm_type == math.inf:
            return self.across_ranks(norm, "max")
        if not self._reduce_groups():
            return norm
        if plan.keeps_collectives_at_one:
            # the norm itself: the root of its square is the norm only where the square
            # neither overflows nor underflows ([Note: collectives kept at a world of one])
            return self.across_ranks(norm, "sum")
        if norm_type == 2.0:
            return self.across_ranks(norm.square(), "sum").sqrt()
        return self.across_ranks(norm.pow(norm_type), "sum").pow(1.0 / norm_type)

    def _reduce_groups(self) -> list[str]:
        """The groups whose ranks hold different parts of the gradient (and a world of one's
        that keeps its collectives: [Note: collectives kept at a world of one])."""
        plan = self.state.plan
        groups = [] if plan.replicated or not plan.issues_collectives else [plan.group_name]
        if plan.tensor_parallel is not None:
            groups.append(plan.tensor_parallel.group_name)
        return groups

    def across_ranks(self, value: torch.Tensor, op: str) -> torch.Tensor:
        """``value`` (a scalar on the device) reduced with ``op`` ("sum", "max") over every
        rank holding a part of the gradient: the same on every rank."""
        for group in self._reduce_groups():
            value = _c10d.wait_tensor(_c10d.all_reduce(value, op, group))
        return value


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group of ``optimizer`` less its ``params``: its hyperparameters."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
