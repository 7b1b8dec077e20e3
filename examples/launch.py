"""Distributed setup shared by the examples: ``zero_fx.init_distributed`` reads torchrun's
environment (without it the example runs as one process, world size 1), and ``--device``
picks CUDA (NCCL, one GPU per rank) or the CPU (gloo)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from zero_fx import init_distributed
from zero_fx.runtime.distributed.init_distributed import DEVICES, GROUP_TIMEOUT

__all__ = ["GROUP_TIMEOUT", "Launch", "add_device_argument", "launch"]


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """``--device {auto,cpu,cuda}``: auto trains on the GPUs when there is one per rank of
    this node, else on the CPU (zero_fx.init_distributed's ``device``)."""
    parser.add_argument("--device", default="auto", choices=DEVICES,
                        help="auto: one GPU per rank where there are enough, else the CPU; "
                             "cpu: gloo even on a GPU machine; cuda: GPUs or an error")


@dataclass(frozen=True)
class Launch:
    rank: int
    world: int
    device: torch.device
    log: Callable[..., None]
    """``print`` on rank 0, nothing elsewhere."""

    def mean_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of ``value`` over ranks (SUM then divide: gloo's AVG is unreliable)."""
        if dist.is_initialized():
            value = value.detach().clone()
            dist.all_reduce(value, op=dist.ReduceOp.SUM)
            value /= self.world
        return value

    def finish(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(timeout: timedelta = GROUP_TIMEOUT, device: str = "auto") -> Launch:
    """Join torchrun's group (each restart attempt in store keys of its own: [Note: a store
    prefix per restart] in zero_fx/runtime/distributed/init_distributed.py), or run as one process."""
    run = init_distributed(device=device, timeout=timeout)
    return Launch(rank=run.rank, world=run.world_size, device=run.device,
                  log=print if run.is_main else (lambda *a, **k: None))
