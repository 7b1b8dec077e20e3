"""The collective backend (gloo, nccl, fake, ...) that serves each device type on a process
group. A leaf: capture (the expert exchange's simulated world) and the runtime both ask."""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist


def backend_serving(device_type: str, group: Optional[dist.ProcessGroup] = None) -> str:
    """The backend that moves ``device_type`` tensors ("cpu", "cuda") on ``group`` (None: the
    default group), in lower case: "gloo", "nccl", "fake", ...; "" when no group is
    initialised or none of its backends serves that device.

    [Note: the backend by device]
    A process group holds one backend per device type, and its name does not say which:
    ``init_process_group()`` with no backend (the usual call under torchrun) names itself
    "undefined" and serves CPU tensors with gloo and, where CUDA is available, CUDA tensors
    with NCCL; ``init_process_group("cpu:gloo,cuda:nccl")`` names itself that string;
    ``init_process_group("gloo")`` serves both device types with gloo. So zero_fx asks the
    group's own configuration (``dist.get_backend_config``) which backend serves the device
    in question, and never compares the name: the training device, the NCCL completion
    check and the gloo all-gather workaround all read this.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return ""
    for entry in str(dist.get_backend_config(group)).split(","):
        device, _, backend = entry.partition(":")
        if device.strip().lower() == device_type:
            return backend.strip().lower()
    return ""
