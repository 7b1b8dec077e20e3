"""Joining the job's process group from what torchrun sets, or running as one process.

    import zero_fx

    dist = zero_fx.init_distributed()          # torchrun: joins the group; python: a world of one
    model = GPT(cfg).to(dist.device)           # cuda:LOCAL_RANK where there are GPUs, else cpu
    ...
    if dist.is_main:
        print(loss.item())

torchrun starts ``--nproc_per_node`` processes per node and gives each ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``. ``init_distributed`` reads them, picks the device (one GPU per
local rank) and the backend (``"cpu:gloo,cuda:nccl"`` on GPUs: NCCL moves CUDA
tensors and gloo the few CPU ones, such as the ranks' agreement check; ``"gloo"``
on CPUs), and initialises the default group with a timeout that fails a job with
a dead rank in minutes, not PyTorch's 10 (NCCL) or 30 (gloo). Started with plain
``python`` (no ``RANK``), it creates no group: zero_fx then runs as a world of one,
so the same script runs on a laptop.

[Note: a store prefix per restart]
Under ``torchrun --max-restarts``, torchrun's store outlives a restart (static
rendezvous, the default on one node) with the dead attempt's keys still in it. A
restarted rank that reads a dead peer's address fails with "Gloo connectFullMesh
failed ... Connection refused" (on NCCL it reads a stale unique id; pytorch#135712 is
the same for shared stores). So each attempt's group sets up under keys of its own,
``attempt<TORCHELASTIC_RESTART_COUNT>/``, which every rank of one attempt agrees on
(torchrun restarts all of a node's workers together). Measured on the example's
elastic-restart test: 2 of 4 restarts failed this way before the prefix, 5 of 5 clean
after.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Union

import torch
import torch.distributed as dist

from .process_group import backend_serving
from ...errors import DistributedSetupError

GROUP_TIMEOUT = timedelta(minutes=5)
"""How long a rank waits at a collective for its peers before the step fails (gloo raises
zero_fx's CollectiveFailedError; on NCCL the watchdog ends the process: README, "When a
collective fails"). PyTorch's defaults, 10 minutes for NCCL and 30 for gloo, leave a job
with a dead rank idle that long. It must cover the longest a rank waits for a slower
one: the first call's compilation and a checkpoint save included; raise it for big models."""

DEVICES = ("auto", "cpu", "cuda")
"""What ``init_distributed(device=...)`` takes: ``"auto"`` is CUDA where torch sees enough
GPUs for this node's ranks (one each), else the CPU; ``"cpu"`` trains on CPUs over gloo
even where there are GPUs; ``"cuda"`` insists on one GPU per local rank."""

_TORCHRUN_VARIABLES = ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Distributed:
    """Where this process trains, as ``init_distributed`` found or set it up."""

    rank: int
    """This process's rank in the job (0 to world_size - 1)."""
    world_size: int
    """Processes in the job (1 without torchrun)."""
    local_rank: int
    """This process's index on its node (torchrun's ``LOCAL_RANK``): its GPU's index."""
    device: torch.device
    """Where to put the model and the batches: ``cuda:<local_rank>`` or ``cpu``."""
    backend: str
    """Which backend the default group runs for each device type, as
    ``dist.get_backend_config()`` says (``"cpu:gloo,cuda:nccl"``; ``"cpu:gloo,cuda:gloo"``
    for a gloo group), "" when there is no group (one process)."""

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints and writes files."""
        return self.rank == 0


def init_distributed(*, device: Union[str, torch.device] = "auto",
                     timeout: timedelta = GROUP_TIMEOUT) -> Distributed:
    """Join the job's default process group as torchrun describes it, and say where to train.

    Without ``RANK`` in the environment (``python train.py``), no group is created and
    the result is a world of one on ``cuda:0`` or the CPU. Under torchrun, this process's
    GPU is ``cuda:LOCAL_RANK`` (made the current device); the group uses
    ``"cpu:gloo,cuda:nccl"`` bound to it (``device_id``: NCCL connects now, not at the first
    collective), or ``"gloo"`` on CPUs. If a default group already exists (yours, or an
    earlier call's), nothing is changed: the result describes it.

    Args:
        device: ``"auto"`` (default): CUDA if torch sees at least as many GPUs as this node
            has ranks (``LOCAL_WORLD_SIZE``), else the CPU, with a warning when GPUs were
            there but too few. ``"cpu"``: CPUs and gloo even on a GPU machine (tests, or
            several ranks on one GPU, which NCCL refuses). ``"cuda"``: GPUs or an error.
        timeout: how long a collective waits for a peer before the job fails
            (``GROUP_TIMEOUT``: 5 minutes; it must cover a slow rank's first compilation).

    Raises:
        DistributedSetupError: ``RANK`` is set without the rest of torchrun's variables,
            ``device="cuda"`` without CUDA, or more ranks on this node than GPUs.
    """
    kind = _device_kind(device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_available() and dist.is_initialized():
        return _describe_existing_group(kind, local_rank)
    if "RANK" not in os.environ:
        chosen = resolve_device(kind, local_rank=0, local_world_size=1)
        if chosen.type == "cuda":
            torch.cuda.set_device(chosen)
        return Distributed(rank=0, world_size=1, local_rank=0, device=chosen, backend="")
    missing = [name for name in _TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise DistributedSetupError(
            f"RANK is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: "
            "start the script with torchrun (which sets RANK, WORLD_SIZE, LOCAL_RANK, "
            "MASTER_ADDR and MASTER_PORT), or unset RANK to run it as one process")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
    chosen = resolve_device(kind, local_rank=local_rank, local_world_size=local_world)
    backend = "cpu:gloo,cuda:nccl" if chosen.type == "cuda" else "gloo"
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)  # before NCCL: its communicator lives on the current GPU
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # [Note: a store prefix per restart]
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt{attempt}", store), rank=rank,
                            world_size=world_size, timeout=timeout,
                            device_id=chosen if chosen.type == "cuda" else None)
    return Distributed(rank=rank, world_size=world_size, local_rank=local_rank, device=chosen,
                       backend=str(dist.get_backend_config()))


def resolve_device(device: str, *, local_rank: int, local_world_size: int) -> torch.device:
    """The device for local rank ``local_rank`` of ``local_world_size`` on this node.

    Every rank of a node decides alike (``"auto"`` compares the node's rank count with
    its GPUs, not this rank's index), so no node mixes CUDA and CPU ranks. Nodes decide
    on their own: give a job with unequal nodes ``device`` explicitly.
    """
    kind = _device_kind(device)
    if kind == "cpu":
        return torch.device("cpu")
    available = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if available else 0
    if kind == "auto":
        if not available:
            return torch.device("cpu")
        if local_world_size > gpus:
            warnings.warn(
                f"{local_world_size} ranks on this node but {gpus} GPU(s): training on the CPU "
                f"over gloo (NCCL needs a GPU of its own per rank); start torchrun with "
                f"--nproc_per_node ≤ {gpus} to train on the GPUs, or pass device='cpu' to "
                "silence this", stacklevel=3)
            return torch.device("cpu")
    if not available:
        raise DistributedSetupError(
            "device='cuda', but torch sees no CUDA device (torch.cuda.is_available() is False: "
            "a CPU-only torch build, no GPU, or CUDA_VISIBLE_DEVICES hides them); pass "
            "device='cpu' or 'auto' to train on the CPU")
    if local_rank >= gpus or local_world_size > gpus:
        raise DistributedSetupError(
            f"more ranks per node than GPUs: local rank {local_rank} of {local_world_size} on "
            f"this node, and torch sees {gpus} GPU(s); start torchrun with --nproc_per_node ≤ "
            f"{gpus} (one GPU per rank: NCCL refuses two ranks on one GPU), or pass "
            "device='cpu' to train on CPUs over gloo")
    return torch.device("cuda", local_rank)


def _device_kind(device: Union[str, torch.device]) -> str:
    kind = device.type if isinstance(device, torch.device) else str(device).lower()
    if kind not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    return kind


def _describe_existing_group(kind: str, local_rank: int) -> Distributed:
    """The default group someone already initialised, as a ``Distributed``: the device is
    the one its backends can move that ``kind`` allows ([Note: the backend by device] in
    zero_fx/base/collective_backends.py: the group's configuration says which backend serves
    which device)."""
    cuda_backend, cpu_backend = backend_serving("cuda"), backend_serving("cpu")
    config = str(dist.get_backend_config())
    trains_cuda = cuda_backend not in ("", "gloo") and torch.cuda.is_available()
    if kind == "cuda" and not trains_cuda:
        raise DistributedSetupError(
            f"device='cuda', but the process group already initialised ({config}) has no "
            "backend zero_fx runs CUDA collectives on (NCCL), or torch sees no GPU: initialise "
            "it with 'cpu:gloo,cuda:nccl' (or call init_distributed before anything else does)")
    if kind == "cpu" and not cpu_backend:
        raise DistributedSetupError(
            f"device='cpu', but the process group already initialised ({config}) moves no CPU "
            "tensors: initialise it with 'gloo' (or 'cpu:gloo,cuda:nccl') to train on CPUs")
    if kind != "cpu" and trains_cuda:
        chosen = torch.device("cuda", torch.cuda.current_device())
    else:
        chosen = torch.device("cpu")
    return Distributed(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                       device=chosen, backend=config)
