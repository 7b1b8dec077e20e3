"""reduce_grads: each full gradient becomes the mean over ranks (stage 0) or this rank's shard of it.

[Note: where gradients are reduced]
Stage 0 (DDP) all-reduces each gradient right after it exists; every rank keeps
the whole averaged gradient for its replicated optimizer. Stages 2 and 3
reduce-scatter each gradient right after it exists, so its full-size buffer dies
at once and only the 1/N shard is kept. Stage 1 keeps every full gradient until
the end of the backward and reduce-scatters them there: that is what separates
stage 1 from stage 2 in memory (ZeRO-1 shards optimizer states, not gradients),
and it still moves Ψ, not the 2Ψ of an all-reduce.
"""

from __future__ import annotations

import functools

import torch
from torch.fx import GraphModule

from .predicates import CARRIES_META, Phase, grad_slots
from .splice import splice

_c10d = torch.ops._c10d_functional


def reduce_grad_shard(grad: torch.Tensor, *, padding: int, world_size: int, group_name: str):
    """Flatten, pad to the plan's layout, reduce-scatter with SUM, divide by N.

    SUM-then-divide, not AVG: gloo's AVG returns sums in some paths
    (pytorch#162338).
    """
    flat = grad.reshape(-1)
    if padding:
        flat = torch.nn.functional.pad(flat, (0, padding))
    if world_size == 1:
        return flat
    shard = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(flat, "sum", world_size, group_name))
    return _average(shard, world_size)


def all_reduce_grad(grad: torch.Tensor, *, world_size: int, group_name: str):
    """The whole gradient, averaged over ranks: all-reduce with SUM, divide by N."""
    if world_size == 1:
        return grad
    summed = _c10d.wait_tensor(_c10d.all_reduce(grad, "sum", group_name))
    return _average(summed, world_size)


def _average(summed: torch.Tensor, world_size: int) -> torch.Tensor:
    return summed / world_size


def reduce_grads(gm: GraphModule, plan) -> GraphModule:
    """Replace every gradient output with the mean gradient over ranks, or this rank's shard of it.

    Requires: ``gm.meta["zero_grad_slots"]`` names the parameter of each
    gradient output. Ensures: in stage 0 each such output is the whole mean
    gradient, parameter-shaped; in stages 1-3 it is a 1-D tensor of
    ``shard_numel`` elements holding this rank's slice of it. Where the
    collectives go: [Note: where gradients are reduced]. A ``None`` gradient
    (parameter unused by the loss) stays None. Does nothing when the graph
    has no gradient outputs.
    """
    slots = grad_slots(gm)
    if not slots:
        return gm
    output = gm.graph.output_node()
    outs = list(output.args[0])
    for index, name in slots.items():
        grad = outs[index]
        if grad is None:
            continue
        outs[index] = splice(gm.graph, _reduction(plan, name), [grad],
                             before=output if plan.stage == 1 else grad.next,
                             phase=Phase.BACKWARD, meta={CARRIES_META: (name,)})
    output.args = (type(output.args[0])(outs),)
    gm.graph.lint()
    gm.recompile()
    return gm


def _reduction(plan, name: str):
    if plan.stage == 0:
        return functools.partial(all_reduce_grad, world_size=plan.world_size,
                                 group_name=plan.group_name)
    return functools.partial(reduce_grad_shard, padding=plan.layout(name).padding,
                             world_size=plan.world_size, group_name=plan.group_name)
