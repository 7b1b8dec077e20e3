"""Capture of a tensor-parallel model: dynamo's graph over DTensors -> an aten graph over
their local pieces, with the TP collectives DTensor issues in it.

[Note: capturing a tensor-parallel step]
A model parallelized with ``parallelize_module`` holds ``DTensor`` parameters, and dynamo
hands our backend a graph whose inputs are those DTensors (and the ``DeviceMesh`` its
hooks read). zero_fx shards, gathers and reduces *local* tensors: each rank's
tensor-parallel piece of a parameter is, to ZeRO, the parameter. So the step is traced
through a wrapper that takes each DTensor's local tensor, rebuilds the DTensor around it
(``__tensor_unflatten__``, with the parameter's placements and global shape) and runs
dynamo's graph; ``make_fx`` sees through DTensor's dispatch, which runs the local ops
and issues the functional collectives its placements need (the column-parallel
all-reduce of the input gradient, the row-parallel all-reduce of the output, sequence
parallelism's all-gathers and reduce-scatters, the all-reduce that turns a replicated
parameter's partial gradient whole). The wrapper returns each DTensor result's local
tensor: a parameter's gradient comes out in its placements, as ZeRO needs it.

Those collectives run on the mesh's "tp" group and are data: their results feed the next
op as a matmul's do. ``mark_tensor_parallel`` tags them, with their waits, as
``TP_COLLECTIVE_META``; the predicates of ZeRO's own collectives (passes/predicates.py)
then do not match them, so no pass moves, buckets or drops them, and the schedule moves
ZeRO's gathers and reductions around them as around any compute.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.fx import GraphModule

from ..passes.predicates import TP_COLLECTIVE_META
from ..plan.tensor_parallel import is_dtensor

_c10d = torch.ops._c10d_functional

def has_dtensors(values: Sequence) -> bool:
    return any(is_dtensor(v) for v in values)


def over_local_tensors(dynamo_gm: GraphModule, example_inputs: Sequence) -> Callable:
    """``dynamo_gm`` as a function of the local tensors of its DTensor inputs (the other
    inputs as they are), returning the local tensors of its DTensor results."""
    specs = {i: (v.__tensor_flatten__()[1], v.device_mesh, v.shape, v.stride())
             for i, v in enumerate(example_inputs) if is_dtensor(v)}

    def step_over_local_tensors(*flat):
        args = list(flat)
        for i, (spec, mesh, shape, stride) in specs.items():
            args[i] = type(example_inputs[i]).__tensor_unflatten__(
                {"_local_tensor": flat[i], "device_mesh": mesh}, spec, shape, stride)
        outs = dynamo_gm(*args)
        return type(outs)(o._local_tensor if is_dtensor(o) else o for o in outs)

    return step_over_local_tensors


def mark_tensor_parallel(gm: GraphModule) -> int:
    """Tag every functional collective already in a just-captured graph, and its wait, as
    tensor parallelism's (ZeRO's own come later, from our passes); return how many
    collectives were tagged."""
    count = 0
    for node in gm.graph.nodes:
        if (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
                and node.target.namespace == "_c10d_functional"
                and node.target != _c10d.wait_tensor.default):
            node.meta[TP_COLLECTIVE_META] = _group_of(node)
            count += 1
            for user in node.users:
                if user.target == _c10d.wait_tensor.default:
                    user.meta[TP_COLLECTIVE_META] = node.meta[TP_COLLECTIVE_META]
    return count


def _group_of(node: torch.fx.Node) -> str:
    """The group name a functional collective runs on (its last string argument)."""
    names = [a for a in node.args if isinstance(a, str)]
    return names[-1] if names else ""

