"""What a checkpoint holds: every tensor entry as a view of the live state (saved from it,
loaded into it), the objects, the RNG states and the manifest, and the meshes that describe
the shards to DCP.

[Note: checkpoint layout]
Every parameter is saved as one logical tensor, flat and unpadded (Ψ elements
in all): ``model.<name>``, the fp32 master. Rank r writes only the elements
it owns, described as a ``DTensor`` sharded on dimension 0; our flat layout
(``ceil(numel / N)`` elements per rank, the tail short or empty) is exactly
``Shard(0)``'s chunking, so DCP can read the same checkpoint back at any world
size: each rank asks for its own range and DCP reads the overlapping pieces.
Stage 0 (replicated) saves the same logical tensors, whole, written once, and
reads back into whole ones: the layout does not depend on the stage either.
Optimizer state follows the same rule per parameter (``optim.<name>.<key>``:
parameter-sized state sharded like the parameter, scalars such as ``step``
replicated), with the hyper-parameters of each parameter group; then the
persistent buffers (rank 0's), each rank's RNG state, zero_fx's counters (loss
scale, optimizer steps) and the caller's ``extra`` object. Files:
[Note: atomic checkpoints] in checkpoint/files.py.

[Note: checkpoints of a tensor-parallel model]
Under tensor parallelism ([Note: ZeRO over tensor parallelism] in
zero_fx/plan/tensor_parallel.py) each rank shards its *piece* of a split parameter, and a
ZeRO shard of a piece split by columns is no rectangle of the whole parameter, which is
all DCP can describe. So a split parameter is saved as one logical tensor of shape
``[tp, piece numel]``: row t is "tp" rank t's piece, flat, and its columns are split over
the shard group as any flat parameter (``Shard(0)`` on "tp", ``Shard(1)`` on "shard").
The manifest records the whole shape and the split (``tensor_parallel``: degree and
dimension). A run that splits the parameter the same way loads it as DCP reshards
anything (any shard group); a run that splits it otherwise (another "tp" degree, or
none: a flat world, one rank) reads the whole ``[tp, piece numel]`` entry on every rank,
puts the pieces back together along the split dimension and cuts its own piece and
shard: one whole parameter (and state tensor) at a time in host memory on each rank.

[Note: checkpoints under expert parallelism]
A routed expert under expert parallelism lives on the ranks of one expert-data-parallel
group only (the ``W/P`` ranks at its place: [Note: expert parallelism] in
zero_fx/plan/expert_parallel.py), sharded over them as any parameter is over the world.
It is saved under the same key and logical shape as without expert parallelism (flat,
unpadded), by those ranks alone: a ``DTensor`` sharded on dimension 0 over a mesh of that
group, and no entry at all on the ranks that do not hold it, parameter and optimizer state
alike. DCP's metadata then holds the whole expert, pieced from the group's chunks, and
any run reads it back as it reads any parameter: at another degree (each rank asks for
its range over its own group), without expert parallelism (over the world), at one rank
(whole). Nothing is gathered, and a rank writes only what it holds.

Experts held as 3-D parameters keep each place's rows on every rank ([Note: experts held as
3-D parameters, split by rows] in zero_fx/plan/expert_parallel.py). Such a parameter is saved
whole too, under its key and whole shape: a ``DTensor`` on a mesh of the expert-parallel group
by the expert-data-parallel group, sharded on dimension 0 over both, so the flat elements of
place ``i``'s rows are cut into its group's shards, as the plan cuts them. Read back the same
way, or over the world, or whole.
"""

from __future__ import annotations

import pickle
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..runtime.sharded_state import ShardedState


def tensor_entries(state: ShardedState, mesh) -> dict[str, Any]:
    """Every tensor entry, each a view of the tensor it is saved from or loaded into."""
    entries: dict[str, Any] = {}
    parallel = state.plan.expert_parallel
    expert_mesh = _expert_mesh(state) if parallel is not None else None
    rows_mesh = _expert_rows_mesh(state) if parallel is not None and parallel.rows else None
    for layout in state.plan.params:
        if not state.plan.holds(layout.name):  # [Note: checkpoints under expert parallelism]
            continue
        shard = state.shards[layout.name]
        its_mesh = (rows_mesh if state.plan.is_expert_rows(layout.name) else expert_mesh
                    if state.plan.is_expert(layout.name) else mesh)
        entries[f"model.{layout.name}"] = _logical(shard, layout, state, its_mesh)
        for key, value in state.optimizer.state.get(shard, {}).items():
            if not isinstance(value, torch.Tensor):
                continue
            per_element = value.ndim > 0 and value.numel() == shard.numel()
            entries[f"optim.{layout.name}.{key}"] = (_logical(value, layout, state, its_mesh)
                                                     if per_element else value)
    for name, buffer in persistent_buffers(state.model).items():
        entries[f"buffers.{name}"] = buffer
    return entries


def _logical(tensor: torch.Tensor, layout, state: ShardedState, mesh):
    """The flat, unpadded logical parameter that ``tensor`` (a shard, or a whole tensor in
    stage 0) holds this rank's part of, as a view of it ([Note: checkpoint layout]); a
    parameter split by tensor parallelism: ``[tp, piece numel]`` ([Note: checkpoints of a
    tensor-parallel model])."""
    flat = tensor.detach().view(-1)
    if state.plan.replicated or mesh is None:
        return flat[:layout.numel]
    start, stop = layout.owned_range(state.plan.shard_rank(layout.name))
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if state.plan.is_expert_rows(layout.name):  # rows of every expert, over (ep, edp)
        return DTensor.from_local(flat[:stop - start], mesh, [Shard(0)] * mesh.ndim,
                                  run_check=False, stride=(1,), shape=torch.Size(
                                      [layout.numel * state.plan.expert_parallel.degree]))
    split = tensor_parallel_split(state.plan, layout.name) is not None
    names = mesh.mesh_dim_names or ("shard",)
    placements = [Replicate() if dim == "replicate" else Shard(1 if split else 0)
                  if dim == "shard" else Shard(0) if split else Replicate() for dim in names]
    if not split:
        return DTensor.from_local(flat[:stop - start], mesh, placements, run_check=False,
                                  shape=torch.Size([layout.numel]), stride=(1,))
    degree = state.plan.tensor_parallel.degree
    return DTensor.from_local(flat[:stop - start].view(1, -1), mesh, placements, run_check=False,
                              shape=torch.Size([degree, layout.numel]), stride=(layout.numel, 1))


def tensor_parallel_split(plan, name: str) -> Optional[dict]:
    """How tensor parallelism splits parameter ``name``: ``{"degree", "dim", "shape"}`` (the
    whole shape), or None for a parameter every rank holds whole or a run without it."""
    parallel = plan.tensor_parallel
    if parallel is None or name in parallel.replicated or name not in parallel.specs:
        return None
    _, placements, shape, _ = parallel.specs[name]
    dims = [p.dim for p in placements if p.is_shard()]
    if len(dims) != 1:
        raise NotImplementedError(f"parameter {name!r} has placements {placements}: checkpoints "
                                  "hold a parameter split over 'tp' along one dimension")
    if shape[dims[0]] % parallel.degree:
        raise NotImplementedError(
            f"parameter {name!r} of shape {list(shape)} splits unevenly over {parallel.degree} "
            f"'tp' ranks along dimension {dims[0]}: checkpoints hold even pieces only")
    return {"degree": parallel.degree, "dim": dims[0], "shape": list(shape)}


def rng_states(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's random number generators: the CPU's, and the training device's (``device``,
    its parameters' device; none more on the CPU).

    [Note: the training device's generator]
    Dropout in the step draws from the generator of the device it runs on: the
    parameters' device, which is where this rank trains. The *current* CUDA device
    (what ``torch.cuda.get_rng_state()`` reads with no argument) is another one
    whenever a script placed the model with ``model.to(f"cuda:{local_rank}")``
    without ``torch.cuda.set_device``: every rank would then save and restore cuda:0's
    generator, and a resumed run's dropout masks would differ from the uninterrupted
    run's. So the device is named, both ways. The entry keeps its name
    (``rng.rank<r>.cuda``): it is "this rank's training device", whatever its index,
    so a checkpoint loads into a run whose ranks sit on other device indices.
    """
    states = {f"rng.rank{rank}": torch.get_rng_state()}
    if device.type == "cuda":
        states[f"rng.rank{rank}.cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(rank: int, entries: dict, device: torch.device) -> None:
    """Restore what ``rng_states`` saved, into the same generators."""
    torch.set_rng_state(entries[f"rng.rank{rank}"])
    if f"rng.rank{rank}.cuda" in entries and device.type == "cuda":
        torch.cuda.set_rng_state(entries[f"rng.rank{rank}.cuda"], device)


def object_entries(state: ShardedState, counters: dict, extra: Any) -> dict[str, Any]:
    names = state.shard_names()
    groups = [{"params": [names[id(p)] for p in group["params"]],
               **{k: v for k, v in group.items() if k != "params"}}
              for group in state.optimizer.param_groups]
    # pickled here: DCP would flatten a dict or list into one entry per leaf
    return {key: pickle.dumps(value) for key, value in (
        ("zero_fx.runtime", counters), ("zero_fx.extra", extra), ("optim.param_groups", groups))}


def manifest_of(state: ShardedState) -> dict:
    plan = state.plan
    tensor_parallel = plan.tensor_parallel.degree if plan.tensor_parallel is not None else 1
    return {
        "world_size": plan.world_size * plan.replicas * tensor_parallel,
        "mesh": [plan.replicas, plan.world_size] + ([tensor_parallel] if tensor_parallel > 1 else []),
        "stage": plan.stage,
        "params": {l.name: {"shape": whole_shape(plan, l.name),
                            "dtype": str(l.dtype).removeprefix("torch."),
                            "requires_grad": l.requires_grad} for l in plan.params},
        "tensor_parallel": {l.name: split for l in plan.params
                            if (split := tensor_parallel_split(plan, l.name)) is not None},
        "aliases": tied_aliases(state.model),
        "buffers": {name: list(b.shape) for name, b in persistent_buffers(state.model).items()},
        "optimizer": type(state.optimizer).__name__,
        "optimizer_state": {state.shard_names()[id(shard)]: sorted(values)
                            for shard, values in state.optimizer.state.items()},
    }


def whole_shape(plan, name: str) -> list[int]:
    """Parameter ``name``'s whole shape (a tensor-parallel piece's whole parameter's)."""
    split = tensor_parallel_split(plan, name)
    return split["shape"] if split is not None else list(plan.whole_shape(name))


def persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``model.state_dict()`` would hold, by name."""
    found = {}
    for module_name, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                found[f"{module_name}.{name}" if module_name else name] = buffer
    return found


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """``{second name: first name}`` for parameters registered under two names."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def training_device(state: ShardedState) -> torch.device:
    """Where this rank trains (offloaded masters are on the host: [Note: optimizer offload])."""
    return state.device


def shard_mesh(state: ShardedState):
    """The device mesh the shards are laid out on: the user's 2-D mesh with hybrid sharding
    (each shard saved once, its replicas skipped by DCP), else a one-dimensional mesh over
    the step's ranks; None at world size 1."""
    if state.world.mesh is not None:
        return state.world.mesh
    if state.world.size == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(training_device(state).type, (state.world.size,))


def _expert_mesh(state: ShardedState):
    """The mesh a held routed expert is laid out on under expert parallelism: its
    expert-data-parallel group's; None where that group is this rank alone (it holds the
    expert whole). [Note: checkpoints under expert parallelism]"""
    parallel = state.plan.expert_parallel
    if parallel.data_size == 1:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    group = dist.distributed_c10d._resolve_process_group(parallel.data_group_name)
    # no collective: the group exists
    return DeviceMesh.from_group(group, training_device(state).type)


def _expert_rows_mesh(state: ShardedState):
    """The mesh expert rows are laid out on: place by holder, the expert-parallel group by the
    expert-data-parallel group ([Note: checkpoints under expert parallelism]); one-dimensional
    where each place has one holder."""
    from torch.distributed.device_mesh import DeviceMesh

    parallel = state.plan.expert_parallel
    resolve = dist.distributed_c10d._resolve_process_group
    if parallel.data_size == 1:
        return DeviceMesh.from_group(resolve(parallel.group_name), training_device(state).type)
    shard_ranks = torch.tensor(dist.get_process_group_ranks(resolve(state.plan.group_name)))
    grid = shard_ranks.view(parallel.data_size, parallel.degree).T  # [place, holder]
    return DeviceMesh.from_group(
        [resolve(parallel.group_name), resolve(parallel.data_group_name)],
        training_device(state).type,
        mesh=grid, mesh_dim_names=("expert", "expert_data"))
