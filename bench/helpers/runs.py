"""What every benchmark does around its measurements: join the gloo group (under torchrun
or as a spawned rank), collect each rank's rows on rank 0, write bench/out/<name>.json."""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "out")

GROUP_TIMEOUT = timedelta(minutes=10)
"""How long a rank waits at a collective for its peers before the run fails, instead of
PyTorch's 10 (NCCL) or 30 (gloo) minutes: long enough for the slowest rank's cold compile
of the largest benchmark model (about 2 minutes for GPT-2 125M on 2 CPU cores)."""


def join_group() -> tuple[int, int]:
    """``(rank, world size)``: gloo under torchrun, else one rank."""
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo", timeout=GROUP_TIMEOUT)
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def free_port() -> int:
    """A TCP port on loopback no one listens on now, for a group whose ranks this process spawns."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_spawned_group(rank: int, world_size: int, port: int) -> None:
    """A rank this process spawned joins gloo at ``port`` on one thread (one core per rank)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)


def rows_of_every_rank(rows) -> list:
    if not dist.is_initialized():
        return [rows]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    return everyone


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"


def write_json(name: str, result: dict) -> str:
    path = os.path.join(OUT, f"{name}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)  # a --name may hold a folder
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


def median_step_seconds(step, steps: int) -> float:
    """The median of ``steps`` calls of ``step()``, every rank starting each call together."""
    times = []
    for _ in range(steps):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
