"""Which ranks we run on: the default process group, a world of one, or the user's device mesh
(hybrid sharding: [Note: hybrid sharding])."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Iterable, Optional

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
    replicas: int = 1
    """Hybrid sharding: how many copies of the shards there are (the mesh's "replicate"
    dimension); ``size``, ``rank`` and ``group_name`` are then the shard group's."""
    replica: int = 0
    """Which copy this rank holds (its index on the "replicate" dimension)."""
    replicate_group_name: str = ""
    """The group of this rank's copies, one per replica ("" without replicas)."""
    mesh: Any = field(default=None, compare=False)
    """The user's 2-D ``DeviceMesh`` (None: flat), for checkpoints' DTensors."""

    @property
    def ranks(self) -> int:
        """Every rank of the step: shard group size times replicas."""
        return self.size * self.replicas

    @property
    def global_rank(self) -> int:
        """This rank in the default group (mesh ranks are laid out replica-major)."""
        return self.replica * self.size + self.rank


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


def world_of(mesh, stage: int) -> World:
    """The ranks a step with ``mesh`` (``zero_compile(mesh=...)``) shards over.

    [Note: hybrid sharding]
    A 2-D mesh ``(replicas, shards)`` named ``("replicate", "shard")`` is what FSDP2 calls
    HSDP: parameters, gradients and optimizer states are sharded within the shard group
    (one node: its fast links carry every all-gather and reduce-scatter), and each shard
    group holds the same shards. A reduced gradient shard is then all-reduced (SUM, then
    divided with the rest) across the replicate group, the only traffic between nodes:
    Ψ/shards elements per rank per step instead of every gather crossing the slow links.
    Everything that cuts shards reads ``size`` and ``rank`` (the shard group's); what
    speaks for the whole job (checkpoint files, RNG states, the ranks' agreement) reads
    ``ranks`` and ``global_rank``. Stage 0 shards nothing, so it ignores the mesh and
    all-reduces over every rank. A 1-D mesh is flat sharding over its ranks.
    """
    world = current_world()
    if mesh is None or stage == 0:
        return world
    if mesh.size() != world.size:
        raise ValueError(f"the mesh has {mesh.size()} ranks and the default process group "
                         f"{world.size}: build the mesh over every rank (init_device_mesh(device, "
                         f"(replicas, shards)) with replicas * shards == world size)")
    if mesh.ndim == 1:
        group = mesh.get_group()
        return replace(world, size=group.size(), rank=mesh.get_local_rank(),
                       group_name=group.group_name)
    shard_group, replicate_group = mesh.get_group("shard"), mesh.get_group("replicate")
    replica, shard = mesh.get_local_rank("replicate"), mesh.get_local_rank("shard")
    if world.rank != replica * shard_group.size() + shard:
        raise ValueError("the mesh's ranks must be laid out replica-major, as init_device_mesh lays "
                         "them out (rank = replica * shards + shard); build it with init_device_mesh")
    return replace(world, size=shard_group.size(), rank=shard,
                   group_name=shard_group.group_name, replicas=replicate_group.size(),
                   replica=replica,
                   replicate_group_name=replicate_group.group_name, mesh=mesh)


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
