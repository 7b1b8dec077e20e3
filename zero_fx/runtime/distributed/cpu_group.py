"""``cpu_group()``: the group that carries CPU tensors and pickled objects beside training's.

[Note: object traffic goes over the CPU]
``all_gather_object``, ``broadcast_object_list``, ``barrier`` and the coordination
inside ``torch.distributed.checkpoint`` (DCP: its plans and metadata are pickled
objects gathered to and scattered from the coordinator) pickle into tensors and move
them with the group's backend for the tensors' device. On a pure NCCL group those
tensors are CUDA tensors on the *current* device (``torch.cuda.current_device()``),
which need not be the device this rank trains on (a script that never called
``torch.cuda.set_device``: every rank's objects land on cuda:0, in one GPU's memory,
and NCCL may hang on the shared device); each one is also a host-device copy and a
kernel launch for a few bytes, and it queues behind the training stream's work. So
zero_fx sends them over gloo, on the CPU:

- a default group that serves CPU tensors already (``init_process_group("gloo")``,
  ``"cpu:gloo,cuda:nccl"``, or no backend named, which torch makes gloo for the CPU
  and NCCL for CUDA) is used as it is: objects given to it with
  ``device=cpu`` ride its CPU backend;
- a group with no CPU backend (``init_process_group("nccl")``) gets a gloo group over
  the same ranks, ``dist.new_group(backend="gloo")``, made once on the first call
  and kept as long as that default group lives. ``new_group`` is a collective of the
  default group: every rank calls ``cpu_group()`` at the same point, which the
  checkpoint's collectives (its only callers) guarantee.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from .process_group import world_timeout

_made: Optional[tuple[object, dist.ProcessGroup]] = None
"""(the default group it was made beside, the gloo group) for a default group with no CPU
backend; replaced when the default group is (destroyed and initialised again)."""


def cpu_group() -> Optional[dist.ProcessGroup]:
    """The group to use for CPU tensors and object collectives over every rank of the default
    group ([Note: object traffic goes over the CPU]): the default group itself when one of its
    backends serves CPU tensors, else a gloo group over the same ranks, made on the first call
    (a collective then: call it on every rank). None without a process group (a world of
    one), which the collectives read as the default group."""
    global _made
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    if serves_cpu(world):
        return world
    if _made is None or _made[0] is not world:
        _made = (world, dist.new_group(backend="gloo", timeout=world_timeout()))
    return _made[1]


def serves_cpu(group: Optional[dist.ProcessGroup] = None) -> bool:
    """Whether ``group`` (None: the default group) has a backend for CPU tensors, read from
    its configuration (``"cpu:gloo,cuda:nccl"``; a name alone says nothing: a group made
    with no backend named is called "undefined" and serves both devices)."""
    config = str(dist.get_backend_config(group)).lower()
    return any(entry.partition(":")[0].strip() == "cpu" for entry in config.split(","))
