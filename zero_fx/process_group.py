"""Which ranks we run on: the default process group, or a world of one."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class World:
    size: int
    rank: int
    group_name: str
    """Name the functional collectives use to find the group ("" for a world of one)."""


def current_world() -> World:
    """The default process group if one is initialised; otherwise world size 1."""
    if not (dist.is_available() and dist.is_initialized()):
        return World(size=1, rank=0, group_name="")
    group = dist.group.WORLD
    return World(size=dist.get_world_size(group), rank=dist.get_rank(group), group_name=group.group_name)
