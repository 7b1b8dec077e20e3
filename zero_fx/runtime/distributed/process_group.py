"""Which ranks we run on: the default process group, a world of one, or the user's device mesh
(hybrid sharding: [Note: hybrid sharding])."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from ...base.collective_backends import backend_serving
from ...plan.secondary import SecondaryPartition


@dataclass(frozen=True)
class World:
    size: int
    rank: int
    group_name: str
    """Name the functional collectives use to find the group ("" for a world of one)."""
    simulated: bool = False
    """The fake process group: one process stands for every rank (shapes and memory
    are real, collectives return nothing), so there are no other ranks to ask."""
    backends: tuple[tuple[str, str], ...] = ()
    """The default group's backend for each device type it serves, as (device type, backend)
    pairs: (("cpu", "gloo"), ("cuda", "nccl")); empty for a world of one ([Note: the backend
    by device])."""
    replicas: int = 1
    """Hybrid sharding: how many copies of the shards there are (the mesh's "replicate"
    dimension); ``size``, ``rank`` and ``group_name`` are then the shard group's."""
    replica: int = 0
    """Which copy this rank holds (its index on the "replicate" dimension)."""
    replicate_group_name: str = ""
    """The group of this rank's copies, one per replica ("" without replicas)."""
    tp: int = 1
    """Tensor parallelism: ranks of the mesh's "tp" dimension, each holding a different piece
    of the model's DTensor parameters ([Note: ZeRO over tensor parallelism])."""
    tp_rank: int = 0
    """This rank's place on the "tp" dimension."""
    tp_group_name: str = ""
    """The "tp" group's name ("" without tensor parallelism)."""
    secondary: Optional[SecondaryPartition] = None
    """Stage 3 with ``secondary_partition``: the nodes the ranks split into and their groups
    ([Note: the secondary partition] in zero_fx/plan/secondary.py)."""
    mesh: Any = field(default=None, compare=False)
    """The user's multi-dimensional ``DeviceMesh`` (None: flat), for checkpoints' DTensors."""
    keeps_collectives: bool = False
    """A world of one rank that issues every collective a world of N would, on its group of
    one ([Note: collectives kept at a world of one])."""

    def backend_for(self, device_type: str) -> str:
        """The backend that moves ``device_type`` tensors ("" if none does)."""
        return dict(self.backends).get(device_type, "")

    @property
    def ranks(self) -> int:
        """Every rank of the step: shard group size times replicas times tensor-parallel ranks."""
        return self.size * self.replicas * self.tp

    @property
    def global_rank(self) -> int:
        """This rank in the default group (mesh ranks are laid out replica-major, "tp" the
        fastest dimension, as ``init_device_mesh`` lays them out)."""
        return (self.replica * self.size + self.rank) * self.tp + self.tp_rank


def _backends(group: Optional[dist.ProcessGroup] = None) -> tuple[tuple[str, str], ...]:
    return tuple((device, backend) for device in ("cpu", "cuda")
                 if (backend := backend_serving(device, group)))


def environment_world_size() -> int:
    """WORLD_SIZE as torchrun sets it (1 when unset or unreadable)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def current_world() -> World:
    """The default process group if one is initialised; otherwise world size 1.

    Under torchrun (WORLD_SIZE > 1) with no process group, each rank would train its own copy
    of the model, silently: that is an error."""
    if not (dist.is_available() and dist.is_initialized()):
        if environment_world_size() > 1:
            raise RuntimeError(
                f"WORLD_SIZE is {environment_world_size()} (torchrun started several ranks) but no "
                "process group is initialised, so each rank would train its own copy of the model: "
                "call zero_fx.init_distributed() (or torch.distributed.init_process_group()) "
                "before the step's first call")
        return World(size=1, rank=0, group_name="")
    group = dist.group.WORLD
    backends = _backends(group)
    return World(size=dist.get_world_size(group), rank=dist.get_rank(group), group_name=group.group_name,
                 simulated=any(backend == "fake" for _, backend in backends), backends=backends)


def keeping_collectives(world: World, keep: bool) -> World:
    """``world``, keeping its collectives if it is one rank and ``keep`` is set
    (``DebugOptions.keep_collectives_at_world_one``); at more ranks, ``world`` as it is.

    [Note: collectives kept at a world of one]
    At one rank every collective is an identity (a sum of one value, a division by 1, a
    gather of the only shard), so the passes and the runtime leave them out: on a machine
    with one GPU an NCCL group of one would run none of zero_fx's collectives, and a test
    there would say nothing about them. ``keep_collectives_at_world_one`` keeps each where a
    world of N issues it, on the group of one: the plan says so
    (``ShardPlan.keeps_collectives_at_one``), and each place that leaves a collective out at
    one rank asks it first: the gather and reduction code (passes/common/collective_code.py),
    the bucket, schedule and quantize passes, the gathers after the optimizer step (stages
    1-2) and of whole parameters, the clipping norm's all-reduce, the scheduler's mean, the
    ranks' check and NCCL's fences. Reductions average in the collective where NCCL moves the
    tensors (``ShardPlan.collectives_average``), and sum on gloo, as at N ranks. Stages 1-3 of
    a model whose routed experts zero_fx rewrites from a list of expert modules split them
    over an expert-parallel group of one, so that the dispatch and combine all-to-alls run
    ([Note: expert parallelism] in zero_fx/plan/expert_parallel.py); such a step cannot then
    run eagerly after a graph break, as an expert-parallel one cannot. Experts held as 3-D
    parameters keep transformers' own forward, which expert parallelism would replace, and
    exchange nothing.

    The values are the step's without the option, bit for bit: every kept collective
    computes the identity it stands for (the clipping norm is summed as it is, not as the
    root of its square, which is not the norm where the square overflows or underflows),
    and the graphs hold nothing of the rank or the device's index that they would not at N
    ranks. Quantized collectives are the exception: their values go through the quantized
    blocks as at N ranks (a round trip through int8 at one rank), which is what the option is
    for. A world of one without a process group has no group to run them on: an error.
    """
    if not keep or world.ranks > 1:
        return world
    if not world.group_name:
        raise ValueError(
            "debug=DebugOptions(keep_collectives_at_world_one=True) issues zero_fx's "
            "collectives on the process group of one rank, but no process group is initialised: "
            "call zero_fx.init_distributed() (or torch.distributed.init_process_group with "
            "world_size=1: 'gloo' on the CPU, 'nccl' on a GPU) before the step's first call, or "
            "leave the option out")
    return replace(world, keeps_collectives=True)


def world_of(mesh, replicated: bool) -> World:
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
    ``ranks`` and ``global_rank``. Stage 0 (``replicated``) shards nothing, so it ignores the
    mesh and all-reduces over every rank. A 1-D mesh is flat sharding over its ranks.
    """
    world = current_world()
    if mesh is None or replicated:
        return world
    if mesh.size() != world.size:
        raise ValueError(f"the mesh has {mesh.size()} ranks and the default process group "
                         f"{world.size}: build the mesh over every rank (init_device_mesh(device, "
                         f"(replicas, shards)) with replicas * shards == world size)")
    if mesh.ndim == 1:
        group = mesh.get_group()
        return replace(world, size=group.size(), rank=mesh.get_local_rank(),
                       group_name=group.group_name)
    names = tuple(mesh.mesh_dim_names)
    shard_group = mesh.get_group("shard")
    sharded = replace(world, size=shard_group.size(), rank=mesh.get_local_rank("shard"),
                      group_name=shard_group.group_name, mesh=mesh)
    if "replicate" in names:
        replicate_group = mesh.get_group("replicate")
        sharded = replace(sharded, replicas=replicate_group.size(),
                          replica=mesh.get_local_rank("replicate"),
                          replicate_group_name=replicate_group.group_name)
    if "tp" in names:
        tp_group = mesh.get_group("tp")
        sharded = replace(sharded, tp=tp_group.size(), tp_rank=mesh.get_local_rank("tp"),
                          tp_group_name=tp_group.group_name)
    if world.rank != sharded.global_rank:
        raise ValueError("the mesh's ranks must be laid out as init_device_mesh lays them out "
                         f"(rank = (replica * shards + shard) * tp + tp for dimensions {names}); "
                         "build it with init_device_mesh")
    return sharded


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
    """Parameters on one device type, and one the default group has a backend for that
    zero_fx's collectives run on ([Note: the backend by device])."""
    devices = sorted({p.device.type for p in params})
    if len(devices) > 1:
        raise ValueError(f"the model's parameters are on several device types {devices}; zero_fx "
                         f"shards a model that lives on one (call model.to(device) first)")
    if not devices or devices[0] == "meta" or not (dist.is_available() and dist.is_initialized()):
        return
    device = devices[0]
    backend = backend_serving(device)
    if device == "cuda" and backend in ("", "gloo"):
        serves = "no backend for CUDA tensors" if not backend else "gloo for CUDA tensors"
        raise ValueError(f"the model is on CUDA but the process group has {serves}, and zero_fx's "
                         "collectives move CUDA tensors with NCCL: zero_fx.init_distributed(), or "
                         "init_process_group('cpu:gloo,cuda:nccl')")
    if device == "cpu" and not backend:
        raise ValueError("the model is on the CPU but the process group has no backend for CPU "
                         "tensors (it uses NCCL, which moves CUDA tensors only): model.to('cuda') "
                         "(one GPU per rank), or init_process_group('gloo') to train on CPUs")


def collectives_average(world: World, device: torch.device) -> bool:
    """Whether the gradient reductions can average in the collective: NCCL moves this
    device's tensors (its AVG of floating types is a sum pre-multiplied by 1/N; gloo's AVG
    returns sums in some paths). [Note: divide before the sum] in
    passes/common/collective_code.py."""
    return world.backend_for(device.type) == "nccl"


def serves_cuda() -> bool:
    """Whether a model on CUDA can train here: CUDA is available, and either there is no
    process group (one GPU) or the default group moves CUDA tensors with a backend zero_fx's
    collectives run on (NCCL; the fake group)."""
    if not torch.cuda.is_available():
        return False
    if not (dist.is_available() and dist.is_initialized()):
        return True
    return backend_serving("cuda") not in ("", "gloo")


def local_cuda_device() -> torch.device:
    """This rank's GPU: ``cuda:LOCAL_RANK`` (torchrun's local rank; 0 without torchrun)."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def training_device(params: Iterable[torch.Tensor]) -> torch.device:
    """Where this rank trains: the parameters' device. For a model on the meta device (it has
    no values yet), ``cuda:LOCAL_RANK`` where CUDA can serve ([``serves_cuda``]: a GPU with no
    process group, or a group with NCCL for CUDA tensors), else the CPU."""
    devices = {p.device for p in params if p.device.type != "meta"}
    if devices:
        return next(iter(devices))
    return local_cuda_device() if serves_cuda() else torch.device("cpu")


def check_current_cuda_device(device: torch.device) -> None:
    """CUDA kernels, NCCL's communicator and the caching allocator work on the *current* CUDA
    device; training on another one puts every rank's work on cuda:0 (or fails in NCCL)."""
    if device.type != "cuda":
        return
    current = torch.cuda.current_device()
    if device.index is not None and device.index != current:
        raise ValueError(
            f"this rank trains on {device} but the current CUDA device is cuda:{current}: call "
            f"torch.cuda.set_device(local_rank) before building the model (zero_fx.init_distributed() "
            f"does it), so that each rank's kernels and NCCL's communicator use its own GPU")
