"""Where a rank's model state lives, read from the rewritten graph: device and host bytes.

The graph's parameter inputs are the shards the device holds between steps (under
``offload="optimizer"`` at stage 3, in the compute dtype: [Note: optimizer offload]); its
gradient outputs are on the device, or on the host when the graph streams them there
([Note: gradients streamed to the host]). The masters and the optimizer's state are not in
the graph, but their elements are the inputs' elements: each input element has a master
(in the plan's parameter dtype) and ``optimizer_state_bytes_per_element`` of state
(AdamW: two fp32 moments, 8), on the host when offloaded, else on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule

from ..passes.common.predicates import grad_slots, is_param_input, param_name
from ..passes.common.host_copies import HOST


@dataclass(frozen=True)
class ModelStateBytes:
    """A rank's model state by where it lives (bytes)."""

    device: int
    """Parameter shards the graph reads, gradients it returns on the device, and the masters
    and optimizer state when not offloaded."""
    host: int
    """The masters and optimizer state when offloaded (and the shards the graph reads, with
    offload="parameters")."""
    streamed: int
    """Gradient bytes the graph streams to the host each step (read there by the optimizer,
    not kept: the step's masters take them in)."""


def model_state_bytes(gm: GraphModule, plan, *,
                      optimizer_state_bytes_per_element: int = 8) -> ModelStateBytes:
    """The model state of one rank running ``gm`` (a graph rewritten for ``plan``; for a GPU's
    devices, planned with ``rewritten_step_on_fake(..., device="cuda")``)."""
    device = host = streamed = 0
    for node in gm.graph.find_nodes(op="placeholder"):
        if not is_param_input(node):
            continue
        val = node.meta["val"]
        if val.device == HOST and plan.offloads_parameters:
            host += val.numel() * val.element_size()
        else:
            device += val.numel() * val.element_size()
        master = plan.layout(param_name(node)).dtype
        kept = val.numel() * optimizer_state_bytes_per_element
        if plan.offloads_optimizer:
            host += kept + val.numel() * master.itemsize
        else:  # the inputs are the masters unless they are fed in another dtype
            device += kept + (0 if val.dtype == master else val.numel() * master.itemsize)
    outputs = gm.graph.output_node().args[0]
    for index in grad_slots(gm):
        val = outputs[index].meta.get("val") if outputs[index] is not None else None
        if isinstance(val, torch.Tensor):
            if val.device == HOST and plan.offloads_optimizer:
                streamed += val.numel() * val.element_size()
            else:
                device += val.numel() * val.element_size()
    return ModelStateBytes(device=device, host=host, streamed=streamed)
