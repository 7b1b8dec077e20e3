"""A step that breaks the graph, run eagerly on the sharded state.

[Note: eager sharded execution]
Dynamo cannot trace some steps as one graph: a branch on a value (``if loss > 100:
loss = loss * 0.5``), a call it cannot trace. With ``on_graph_break="eager"`` (the
default) such a step still trains, as DeepCompile's ``z3_eager_fallback`` does: the
user's function runs as plain PyTorch on the model zero_fx has sharded, and what the
compiled graph would have done around it is done here, in the same form, so everything
after it (``OptimizerUpdate``: accumulation, loss scale, clipping, the deferred
``opt.step()``) is unchanged:

- stage 3 gathers every parameter into the model (the compute dtype, one all-gather per
  bucket in plan order) before the call and frees them after it, as
  ``gathered_parameters()`` does (``whole_in_model``), its gradients kept;
- stages 0-2 keep whole parameters and need nothing before the call;
- after the call, each trainable parameter's whole local gradient is reduced exactly as
  the graph reduces it (``passes.reduce_grads.reduction``: a bucketed reduce-scatter in
  stages 1-3, an all-reduce in stage 0, SUM then divide: never gloo's AVG,
  pytorch#162338), or kept whole when the plan reduces outside the graph (stages 0-1
  under accumulation), and handed to the state as the graph's gradient outputs are
  (``ShardedState.receive_grad``); the whole gradients are then dropped.

Every rank issues the same collectives in the same order whatever the step did: all
trainable parameters, in plan order, a parameter without a gradient on this rank
reduced as zeros. So a branch taken on one rank and not on another cannot deadlock the
ranks (it may change the gradient, as it would under DDP); a parameter no rank used gets
a zero gradient, where plain PyTorch leaves ``.grad`` None (a weight-decaying optimizer
then decays it).

What it costs: no compiled kernels and no overlap: every collective is waited for where
it is issued, after the whole backward; stage 3 holds the whole model on every rank for
the call, ``ShardedState.gathered_bytes()`` on top of the shards (the memory stage 3
exists to save), and the whole gradients until they are reduced (as stage 1 does).
Traffic per step is the stage's (stage 3: one gather of Ψ instead of two, plus the
reduce-scatter). Gathering each module's parameters in forward pre-hooks and again for
its backward (FSDP's way) would bound the memory to a few modules; not done yet.

Not run eagerly (the break is raised as a ``CaptureError`` instead): fp16 loss scaling
(the graph scales the backward's seed, which an eager ``loss.backward()`` does not),
tensor parallelism and expert parallelism (their collectives are the graph's).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch
from torch.utils._pytree import tree_map_only

from ..capture.graph_breaks import GraphBreak
from ..base.formatting import format_bytes
from ..passes.common.host_copies import wait_for_host_copies
from ..passes.reduce_grads import owner_reduction, reduction
from .distributed.rank_agreement import CallSignature, RankAgreement
from .sharded_state import ShardedState
from .step_runner import entered


def why_not_eager(state: ShardedState) -> Optional[str]:
    """Why this state's step cannot run eagerly after a graph break; None if it can."""
    plan = state.plan
    if plan.loss_scaled:
        return ("fp16 loss scaling scales the backward inside the graph; a step that breaks "
                "it cannot run eagerly with it (bf16 mixed precision needs no loss scale)")
    if plan.tensor_parallel is not None:
        return "a tensor-parallel step runs its collectives in the graph only"
    if plan.expert_parallel is not None:
        return "an expert-parallel step runs its all-to-alls in the graph only"
    return None


EAGER_FINGERPRINT = 0x7A65726F5F657667
"""A rank running its step eagerly, as ``RankAgreement`` compares it: no graph's fingerprint
(a 64-bit hash) is likely to equal it."""


class EagerFallback:
    """Runs the user's step eagerly on ``state``; made once, at the step's first break."""

    def __init__(self, state: ShardedState, graph_break: GraphBreak,
                 agreement: Optional[RankAgreement] = None):
        self.state = state
        self.graph_break = graph_break
        self.agreement = agreement
        """Checks every rank runs eagerly too before the first collective: a break on some
        ranks only (a branch on the rank around code dynamo refuses) would otherwise hang,
        the other ranks running their graph ([Note: checking that ranks agree])."""
        self.calls = 0
        """Calls run eagerly so far."""

    def __call__(self, fn: Callable, args: tuple, kwargs: dict, observers: list):
        state = self.state
        if self.agreement is not None:
            self.agreement.check(self.signature)
        for param in state.params.values():
            param.grad = None
        with entered(observers):
            with self._whole_parameters():
                out = fn(*args, **kwargs)
            self._hand_over_gradients()
        self.calls += 1
        # as the compiled step's: the backward has run, what is returned is a value
        return tree_map_only(torch.Tensor, torch.Tensor.detach, out)

    @property
    def signature(self) -> CallSignature:
        """What this rank tells the others it runs: the step, eagerly, and why."""
        eagerly = f"no graph: the step runs eagerly after a graph break ({self.graph_break})"
        return CallSignature(fingerprint=EAGER_FINGERPRINT, inputs=(eagerly,),
                             collectives=(eagerly,))

    @contextlib.contextmanager
    def _whole_parameters(self) -> Iterator[None]:
        """Stage 3: every parameter gathered into the model (compute dtype) for the call and
        freed after it, its gradient kept; stages 0-2: nothing to do."""
        if not self.state.plan.params_sharded:
            yield
            return
        with self.state.whole_in_model():
            yield

    @torch.no_grad()
    def _hand_over_gradients(self) -> None:
        """Each trainable parameter's whole gradient, reduced as the graph would (or kept
        whole where the plan reduces outside it), handed to the state; in plan order."""
        state, plan = self.state, self.state.plan
        names = [layout.name for layout in plan.params if layout.requires_grad]
        wholes = {}
        for name in names:
            param = state.local(name)
            grad = param.grad
            wholes[name] = grad if grad is not None else torch.zeros_like(param)
            param.grad = None
        if not plan.reduces_in_graph:  # [Note: gradient accumulation] in update.py
            for name in names:
                state.receive_grad(name, wholes.pop(name))
            return
        for name in [n for n in names if plan.reduced_by_owner(n)]:  # reduced to its owner
            state.receive_grad(name, wholes.pop(name))
        for group in plan.owner_groups([n for n in names if plan.reduced_to_owner_in_graph(n)]):
            reduced = owner_reduction(plan, group)(*(wholes.pop(name) for name in group))
            for name, grad in zip(group, reduced):
                state.receive_grad(name, grad)
        for bucket in plan.buckets([n for n in names if n in wholes]):
            reduced = reduction(plan, bucket)(*(wholes.pop(name) for name in bucket))
            for name, grad in zip(bucket, reduced):
                state.receive_grad(name, grad)
        if state.offloaded:  # [Note: gradients streamed to the host]
            wait_for_host_copies()

    def costs(self) -> str:
        """What running eagerly costs, per call, in words."""
        state, plan = self.state, self.state.plan
        lines = ["runs as plain PyTorch: no compiled kernels, no overlap of collectives "
                 "with compute (each waited for where it is issued, after the backward)"]
        if plan.params_sharded:
            lines.append(f"holds every parameter whole for the call: "
                         f"{format_bytes(state.gathered_bytes())} gathered on this rank "
                         "(stage 3's memory saving is lost during the step)")
        if plan.grads_sharded:
            lines.append("holds the whole gradients until the end of the backward "
                         "(the graph reduces each bucket as it is produced)")
        return "\n".join(lines)

