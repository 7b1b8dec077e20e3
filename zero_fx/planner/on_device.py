"""The rewritten step as it runs on a GPU, read without one.

[Note: a CUDA graph planned on a CPU-only build]
FakeTensorMode makes ``device="cuda"`` tensors on a machine with no GPU, and aten's plain
ops run on them, but autograd aborts the process on a CUDA leaf in a CPU-only build
(``getDeviceGuardImpl``), and the step's graph is traced through autograd. So the step is
traced and rewritten on fake CPU tensors (``rewritten_step_on_fake``), and then moved: the
graph's inputs become fake tensors on ``device``, every op that makes a tensor from
nothing (``full``, ``empty``, ``arange``, ...) is told ``device``, and the fake values are
propagated again. What stays on the host is what zero_fx's own ops put there (the
gradient shards streamed to the host under ``offload="optimizer"``, the parameters' shards
under ``offload="parameters"``) and what derives from it, so every tensor's device in the result is the one a GPU run would give it.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from ..passes.common.host_copies import is_device_copy
from ..passes.common.predicates import is_param_input
from ..runtime.offload import HOST


def moved_to_device(gm: GraphModule, device: str, shards_on_host: bool = False) -> GraphModule:
    """``gm`` (rewritten on fake CPU tensors) with every tensor the step makes on the
    device placed on ``device``, its fake values propagated again; edits ``gm`` in place.
    ``shards_on_host``: the parameters' shards are fed from host memory (offload="parameters")."""
    target = torch.device(device)
    for node in gm.graph.nodes:
        if node.kwargs.get("device") == HOST:
            node.kwargs = {**node.kwargs, "device": target}
        if is_device_copy(node):  # the bucket's shards, copied to the training device
            node.args = (node.args[0], target.type)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs = []
    with mode:
        for node in gm.graph.find_nodes(op="placeholder"):
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                on_host = shards_on_host and is_param_input(node)
                val = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype,
                                          device=HOST if on_host else target)
            inputs.append(val)
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
    gm.recompile()
    return gm
