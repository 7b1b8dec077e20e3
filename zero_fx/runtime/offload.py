"""Offload: the masters and the optimizer's state (and stage 3's shards) in host memory.

[Note: optimizer offload]
With ``zero_compile(offload="optimizer")`` (stages 1-3) each rank's fp32 master shards,
and with them every tensor of optimizer state (Adam's two moments), live in host memory,
pinned when the device is a GPU: 12 bytes per element of the shard for AdamW never touch
the device. The optimizer steps there (PyTorch's CPU kernels, foreach where it has them),
as ZeRO-Offload does. The device keeps what the step reads:

- stage 3: each parameter's shard in the compute dtype (``ShardedState.device_shards``,
  2 bytes per element in bf16), the graph's input, gathered as before;
- stages 1-2: the whole parameters, as without offload.

Around the step: each gradient shard streams to the host inside the graph, issued right
after its reduction's wait ([Note: gradients streamed to the host] in
passes/common/host_copies.py), and is cast to the master's dtype there; after the optimizer has
stepped, each updated master is cast and copied back into its device shard (stage 3), or
gathered into the whole parameters from a device copy (stages 1-2). What crosses the host
link per step is the gradient shard one way and the parameter shard the other. The
collectives only ever see device tensors; the gradient norm is reduced on the device and
read back for clipping.

``offload="parameters"`` (stage 3) keeps the compute-dtype shards on the host too: the
device holds no model state between steps, and each bucket's shards are copied to it right
before their all-gather ([Note: shards brought from the host]).

Where the optimizer steps (on the host, or on the device with its state streamed through
bucket by bucket) is ``offload_update``'s ([Note: the update streamed through the device] in
streamed_update.py); ``offload="auto"`` picks the least offload that fits a device budget
([Note: choosing what to offload] in offload_choice.py); ``offload_step="overlap"`` runs the
host's update during the next call ([Note: the delayed update] in update.py).
"""

from __future__ import annotations

import torch

from ..passes.common.host_copies import HOST


def to_host(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host copy of ``tensor`` (pinned when the training ``device`` is a GPU, so that the
    copies to and from it can run asynchronously); ``tensor`` itself when already there."""
    if tensor.device == HOST:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device=HOST,
                       pin_memory=device.type == "cuda")
    return host.copy_(tensor)
