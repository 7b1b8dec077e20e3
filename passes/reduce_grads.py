"""reduce_grads: each full gradient becomes this rank's averaged gradient shard."""

from __future__ import annotations

import functools

import torch
from torch.fx import GraphModule

from .predicates import Phase, grad_slots
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


def _average(summed: torch.Tensor, world_size: int) -> torch.Tensor:
    return summed / world_size


def reduce_grads(gm: GraphModule, plan) -> GraphModule:
    """Replace every gradient output with its reduce-scattered, averaged shard.

    Requires: ``gm.meta["zero_grad_slots"]`` names the parameter of each
    gradient output. Ensures: each such output is a 1-D tensor of
    ``shard_numel`` elements holding this rank's slice of the mean gradient
    over ranks. A ``None`` gradient (parameter unused by the loss) stays None.
    Does nothing when the graph has no gradient outputs.
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
        layout = plan.layout(name)
        reduce = functools.partial(
            reduce_grad_shard,
            padding=layout.padding,
            world_size=plan.world_size,
            group_name=plan.group_name,
        )
        # right after the gradient exists, so its full-size buffer dies at once
        outs[index] = splice(gm.graph, reduce, [grad], before=grad.next, phase=Phase.BACKWARD)
    output.args = (type(output.args[0])(outs),)
    gm.graph.lint()
    gm.recompile()
    return gm
