"""Tensor parallelism under ZeRO: which parameters are DTensors, and which of them every
tensor-parallel rank holds whole.

[Note: ZeRO over tensor parallelism]
The user splits the model's layers over the mesh's "tp" dimension with PyTorch's own
``parallelize_module`` (Megatron-LM's column- and row-parallel GEMMs, sequence
parallelism), and compiles the step with ``zero_compile(mesh=mesh)`` on a mesh named
``("shard", "tp")`` or ``("replicate", "shard", "tp")``. To ZeRO, each rank's *local*
piece of a parameter is the parameter: the plan lays out local shapes, shards them flat
over the "shard" group (stages 1-3; a ``Shard(0)`` and a ``Shard(1)`` piece alike, by
their flat elements) and all-gathers and reduce-scatters them there, so each of ZeRO's
collectives carries Ψ/tp elements. Parameters ``parallelize_module`` left alone (or made
``Replicate``: norms, a replicated embedding) are ZeRO-sharded like any other, each "tp"
rank holding the same values. The tensor-parallel collectives are DTensor's, traced into
the step where its placements need them ([Note: capturing a tensor-parallel step] in
zero_fx/capture/tensor_parallel.py) and left there: ZeRO's collectives are scheduled
around them as around compute.

What needs to know the difference:
- the gradient norm: a piece split over "tp" is summed over the "tp" ranks, a whole one
  counted once (``TensorParallel.replicated``);
- whole values (``full_state_dict()``, ``full_parameters()``): a parameter's local piece,
  gathered over "shard", is then made whole over "tp" from its placements;
- the ranks' agreement and the reports: the "tp" group is named by its role.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ..capture.dtensors import is_dtensor, local_tensor  # here too: the runtime reads them here


def set_values(param: torch.nn.Parameter, values: torch.Tensor) -> None:
    """``param.data = values``, for a DTensor too: ``.data`` swaps the outer tensor's dtype
    and shape but leaves the DTensor's own local tensor and spec, which its ops read."""
    param.data = values
    if is_dtensor(param):
        param._local_tensor, param._spec = values._local_tensor, values._spec


@dataclass(frozen=True)
class TensorParallel:
    """The model's DTensor parameters over the mesh's "tp" dimension."""

    degree: int
    """Ranks of the "tp" dimension."""
    rank: int
    """This rank's place on it."""
    group_name: str
    """The "tp" group's name."""
    replicated: frozenset
    """Parameters every "tp" rank holds whole (``Replicate`` on "tp", or not DTensors)."""
    specs: Mapping[str, Any] = field(default_factory=dict, compare=False)
    """``name -> (mesh, placements, global shape, global stride)`` of each DTensor parameter,
    to make its whole value from its local piece."""

    def whole(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """Parameter ``name``'s whole value from this rank's whole local piece (a collective
        over "tp" for a split one: call it on every rank)."""
        if name not in self.specs:
            return local
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = self.specs[name]
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                                  stride=stride).full_tensor()


def tensor_parallel_of(module: torch.nn.Module, world) -> "TensorParallel | None":
    """``module``'s ``TensorParallel`` on ``world`` (its "tp" size, rank and group); None
    without a "tp" dimension."""
    dtensors = [(name, p) for name, p in module.named_parameters() if is_dtensor(p)]
    if not world.tp_group_name:
        if dtensors:
            raise ValueError(
                f"the model's parameters are DTensors ({dtensors[0][0]!r}: parallelize_module?) "
                "but zero_compile's mesh has no 'tp' dimension, so ZeRO would average different "
                "ranks' pieces: build the mesh with one, init_device_mesh(device, (shards, tp), "
                "mesh_dim_names=('shard', 'tp')), parallelize over mesh['tp'] and pass "
                "zero_compile(mesh=mesh)")
        return None
    specs, replicated = {}, set()
    for name, param in module.named_parameters():
        if not is_dtensor(param):
            replicated.add(name)
            continue
        mesh = param.device_mesh
        if mesh.ndim != 1 or mesh.get_group().group_name != world.tp_group_name:
            raise ValueError(f"parameter {name!r} is a DTensor on a mesh of dimensions "
                             f"{mesh.mesh_dim_names} that is not the 'tp' dimension of "
                             "zero_compile's mesh; zero_fx shards DTensors parallelized over "
                             "it: parallelize_module(model, mesh['tp'], plan)")
        if all(p.is_replicate() for p in param.placements):
            replicated.add(name)
        specs[name] = (param.device_mesh, param.placements, param.shape, param.stride())
    return TensorParallel(degree=world.tp, rank=world.tp_rank, group_name=world.tp_group_name,
                          replicated=frozenset(replicated), specs=specs)
