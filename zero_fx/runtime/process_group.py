"""Which ranks we run on: the default process group, or a world of one."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    size: int
    rank: int
    group_name: str
    """Name the functional collectives use to find the group ("" for a world of one)."""
    simulated: bool = False
    """The fake process group: one process stands for every rank (shapes and memory
    are real, collectives return nothing), so there are no other ranks to ask."""
    backend: str = ""
    """The default group's backend ("gloo", "nccl", "fake"; "" for a world of one)."""


def default_backend() -> str:
    """The default group's backend in lower case ("gloo", "nccl", "cpu:gloo,cuda:nccl",
    "fake"), or "" when no group is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return ""
    return str(dist.get_backend()).lower()


def current_world() -> World:
    """The default process group if one is initialised; otherwise world size 1."""
    backend = default_backend()
    if not backend:
        return World(size=1, rank=0, group_name="")
    group = dist.group.WORLD
    return World(size=dist.get_world_size(group), rank=dist.get_rank(group), group_name=group.group_name,
                 simulated=backend == "fake", backend=backend)


def world_timeout() -> Optional[timedelta]:
    """The timeout the default group was initialised with (``init_process_group(timeout=)``),
    for the groups zero_fx creates beside it; None if it cannot be read."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    for device in ("cpu", "cuda"):
        try:  # private: the backend's options hold the timeout
            return dist.group.WORLD._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return None


def check_devices_match_backend(params: Iterable[torch.Tensor]) -> None:
    """Parameters on one device type, and one the default group's backend can move."""
    devices = sorted({p.device.type for p in params})
    if len(devices) > 1:
        raise ValueError(f"the model's parameters are on several device types {devices}; zero_fx "
                         f"shards a model that lives on one (call model.to(device) first)")
    backend = default_backend()
    if not devices or not backend:
        return
    device = devices[0]
    if device == "cuda" and backend == "gloo":
        raise ValueError("the model is on CUDA but the process group uses gloo, which zero_fx's "
                         "collectives do not run on CUDA tensors with: init_process_group('nccl')")
    if device == "cpu" and backend == "nccl":
        raise ValueError("the model is on the CPU but the process group uses NCCL, which moves CUDA "
                         "tensors only: model.to('cuda') (one GPU per rank), or "
                         "init_process_group('gloo') to train on CPUs")


def training_device() -> torch.device:
    """Where this rank trains: its CUDA device under NCCL, else the CPU."""
    if "nccl" in default_backend():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
