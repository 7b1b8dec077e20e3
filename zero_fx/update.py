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
The global gradient norm is computed on each rank's shards (sum of squares),
all-reduced once as a single scalar, and square-rooted: the norm of the whole
gradient, as ``torch.nn.utils.clip_grad_norm_`` computes it on one process.
In stage 0, and in stages 1-2 at one rank, every rank holds the whole
gradient and no collective is needed. The same norm detects overflow under
fp16 loss scaling: it is inf or NaN exactly when some gradient element is.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .precision import LossScaler
from .sharded_state import ShardedState

_c10d = torch.ops._c10d_functional


class OptimizerUpdate:
    """Runs after each call's graph. ``accumulate()`` then, when it says so, ``apply()``."""

    def __init__(self, state: ShardedState, *, accumulation_steps: int = 1,
                 max_grad_norm: Optional[float] = None, scaler: Optional[LossScaler] = None):
        self.state = state
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm = max_grad_norm
        self.scaler = scaler
        self.micro_step = 0
        """Calls since the last optimizer step (or skipped step)."""
        self.optimizer_steps = 0
        """Optimizer steps taken (skipped ones not counted)."""
        self.last_grad_norm: Optional[torch.Tensor] = None
        """The global gradient norm of the latest optimizer step, before clipping (computed
        when clipping or loss scaling, else None)."""

    def accumulate(self) -> bool:
        """Take this call's gradients; True if this call ends an accumulation window and the
        gradients are ready (reduced, averaged, unscaled, clipped) for ``apply()``. False also
        when an overflowed fp16 step was skipped."""
        self.state.commit_grads()
        self.micro_step += 1
        if self.micro_step < self.accumulation_steps:
            return False
        self.micro_step = 0
        self.state.reduce_accumulated()
        grads = self.state.grads()
        divisor = self.accumulation_steps * (self.scaler.scale.item() if self.scaler else 1.0)
        if divisor != 1.0:
            torch._foreach_div_(grads, divisor)
        if self.max_grad_norm is None and self.scaler is None:
            return True
        norm = self.grad_norm(grads)
        self.last_grad_norm = norm
        if self.scaler is not None:
            overflowed = not math.isfinite(norm.item())
            self.scaler.update(overflowed)
            if overflowed:
                self.state.zero_grad()
                return False
        if self.max_grad_norm is not None:
            coefficient = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, coefficient)
        return True

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
        self.optimizer_steps = saved["optimizer_steps"]
        self.micro_step = 0
        if self.scaler is not None and saved["loss_scale"] is not None:
            self.scaler.scale.fill_(saved["loss_scale"])
            self.scaler.clean_steps = saved["clean_steps"]
            self.scaler.skipped_steps = saved["skipped_steps"]

    def apply(self) -> None:
        """The optimizer steps on the shards; gradients cleared; parameters refreshed."""
        self.state.optimizer.step()
        self.state.zero_grad()
        self.optimizer_steps += 1
        self.state.refresh_parameters()

    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The 2-norm of the whole gradient from this rank's part of it ([Note: clipping and
        overflow]); float32, a scalar, the same on every rank."""
        plan = self.state.plan
        if grads:
            squares = torch.stack([g.float().square().sum() for g in grads]).sum()
        else:
            squares = torch.zeros((), device=next(iter(self.state.shards.values())).device)
        if not plan.replicated and plan.world_size > 1:
            squares = _c10d.wait_tensor(_c10d.all_reduce(squares, "sum", plan.group_name))
        return squares.sqrt()
