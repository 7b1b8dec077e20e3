"""Sharded checkpoints: save and load a compiled step's state with ``torch.distributed.checkpoint``.

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

import contextlib
import logging
import math
import os
import pickle
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..formatting import format_bytes
from ..plan.layout import cut_shard
from ..runtime.cpu_group import cpu_group
from ..runtime.sharded_state import ShardedState
from .files import (CheckpointError, check_files, clear_staging, prepare_save, publish,
                               raise_if_damaged, read_manifest, readable_path, staging_path)

log = logging.getLogger("zero_fx")


def save(state: ShardedState, path: str, counters: dict, extra: Any = None) -> None:
    """Write ``state`` (and the runtime's ``counters``, ``extra``) to ``path``; a collective."""
    path = os.fspath(path)
    world = state.world
    _on_rank_0(world, path, prepare_save, path)
    entries = _tensors(state, _mesh(state))
    entries.update(_objects(state, counters, extra))
    entries.update(_rng_states(world.global_rank, _device(state)))
    try:
        with _single_process_quietly():
            dcp.save(entries, checkpoint_id=staging_path(path), no_dist=world.ranks == 1,
                     process_group=cpu_group())
    except CheckpointException as failed:  # every rank gets it, with each rank's cause
        _on_rank_0(world, path, clear_staging, path)
        causes = "; ".join(f"rank {rank}: {type(error).__name__}: {error}"
                           for rank, (error, _) in sorted(failed.failures.items()))
        raise _not_saved(path, causes) from None
    _barrier(world)
    try:
        _on_rank_0(world, path, publish, path, _manifest(state))
    except CheckpointError:
        _on_rank_0(world, path, clear_staging, path)
        raise
    log.info("zero_fx: saved a checkpoint of %d parameters at %s", len(state.plan.params), path)


def load(state: ShardedState, path: str) -> tuple[dict, Any]:
    """Read ``path`` into ``state`` (any world size or stage it was saved at); return the
    saved runtime counters and ``extra``. A collective."""
    path = _readable(os.fspath(path))
    manifest = read_manifest(path)
    _check_files_on_all_ranks(state, path, manifest)
    _check_same_model(state, manifest)
    _initialize_optimizer_state(state)
    saved_keys = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    entries = _tensors(state, _mesh(state))
    _check_same_optimizer(entries, saved_keys, manifest, state)
    resplit = _split_otherwise(state, manifest, entries)
    entries.update({k: None for k in ("zero_fx.runtime", "zero_fx.extra", "optim.param_groups")})
    rng = _rng_states(state.world.global_rank, _device(state))
    if rng.keys() <= saved_keys:
        entries.update(rng)
    else:
        log.warning("zero_fx: the checkpoint was saved at %d rank(s) and holds no RNG state "
                    "for rank %d (or its CUDA device); its RNG is left as it is",
                    manifest["world_size"], state.world.global_rank)
    with _single_process_quietly():
        dcp.load(entries, checkpoint_id=path, no_dist=state.world.ranks == 1,
                 process_group=cpu_group())
    _load_split_otherwise(state, path, manifest, resplit)
    _restore_param_groups(state.optimizer, pickle.loads(entries["optim.param_groups"]), state)
    if rng.keys() <= entries.keys():
        _set_rng_states(state.world.global_rank, entries, _device(state))
    state.zero_grad()
    state.refresh_parameters(frozen=True)
    return pickle.loads(entries["zero_fx.runtime"]), pickle.loads(entries["zero_fx.extra"])


# -- what is saved ---------------------------------------------------------------------

def _tensors(state: ShardedState, mesh) -> dict[str, Any]:
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


def _rng_states(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
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


def _set_rng_states(rank: int, entries: dict, device: torch.device) -> None:
    """Restore what ``_rng_states`` saved, into the same generators."""
    torch.set_rng_state(entries[f"rng.rank{rank}"])
    if f"rng.rank{rank}.cuda" in entries and device.type == "cuda":
        torch.cuda.set_rng_state(entries[f"rng.rank{rank}.cuda"], device)


def _objects(state: ShardedState, counters: dict, extra: Any) -> dict[str, Any]:
    names = state.shard_names()
    groups = [{"params": [names[id(p)] for p in group["params"]],
               **{k: v for k, v in group.items() if k != "params"}}
              for group in state.optimizer.param_groups]
    # pickled here: DCP would flatten a dict or list into one entry per leaf
    return {key: pickle.dumps(value) for key, value in (
        ("zero_fx.runtime", counters), ("zero_fx.extra", extra), ("optim.param_groups", groups))}


def _manifest(state: ShardedState) -> dict:
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


# -- checks before loading ---------------------------------------------------------------

def _split_otherwise(state: ShardedState, manifest: dict, entries: dict) -> dict:
    """Take out of ``entries`` those of the parameters the checkpoint's run split over
    "tp" otherwise than this run does ([Note: checkpoints of a tensor-parallel model]);
    return ``{key: (parameter name, the tensor this rank's shard goes into)}``."""
    saved = manifest.get("tensor_parallel", {})
    names = {l.name for l in state.plan.params
             if saved.get(l.name) != tensor_parallel_split(state.plan, l.name)}
    resplit = {}
    for layout in state.plan.params:
        if layout.name not in names:
            continue
        shard = state.shards[layout.name]
        targets = {f"model.{layout.name}": shard}
        targets.update({f"optim.{layout.name}.{key}": value
                        for key, value in state.optimizer.state.get(shard, {}).items()
                        if f"optim.{layout.name}.{key}" in entries and isinstance(value, torch.Tensor)
                        and value.ndim > 0 and value.numel() == shard.numel()})
        for key, target in targets.items():
            del entries[key]
            resplit[key] = (layout.name, target)
    return resplit


@torch.no_grad()
def _load_split_otherwise(state: ShardedState, path: str, manifest: dict, resplit: dict) -> None:
    """Each entry of ``resplit`` read whole, made the whole parameter-shaped tensor, and cut
    into this rank's piece and shard, one at a time."""
    if resplit:
        log.info("zero_fx: %d tensor(s) of the checkpoint were split over 'tp' otherwise than "
                 "in this run: each is read whole on every rank and cut anew", len(resplit))
    plan = state.plan
    for key, (name, target) in resplit.items():
        whole = _read_whole(path, manifest, [key], shape_of=name)[key]
        split = tensor_parallel_split(plan, name)
        piece = (whole.chunk(split["degree"], dim=split["dim"])[plan.tensor_parallel.rank]
                 if split is not None else whole)
        layout = plan.layout(name)
        mine = (piece.reshape(-1) if plan.replicated
                else cut_shard(piece, layout, plan.shard_rank(name)))
        target.view(-1).copy_(mine.to(target.dtype))


def _check_files_on_all_ranks(state: ShardedState, path: str, manifest: dict) -> None:
    world = state.world
    problems = check_files(path, manifest, lambda index: index % world.ranks == world.global_rank)
    if world.ranks > 1:
        everyone: list = [None] * world.ranks
        dist.all_gather_object(everyone, problems, group=cpu_group())
        problems = [p for rank_problems in everyone for p in rank_problems]
    raise_if_damaged(path, problems)


def _check_same_model(state: ShardedState, manifest: dict) -> None:
    saved = manifest["params"]
    ours = {l.name: l for l in state.plan.params}
    missing = [n for n in ours if n not in saved]
    unexpected = [n for n in saved if n not in ours]
    misshaped = [f"{n}: checkpoint {saved[n]['shape']}, model {whole_shape(state.plan, n)}"
                 for n in ours if n in saved and saved[n]["shape"] != whole_shape(state.plan, n)]
    problems = ([f"parameter {n} is not in the checkpoint" for n in missing[:5]]
                + [f"the checkpoint has parameter {n}, which the model lacks" for n in unexpected[:5]]
                + [f"parameter {m}" for m in misshaped[:5]])
    if problems:
        raise CheckpointError("the checkpoint was saved from a different model: "
                              + "; ".join(problems))
    buffers = persistent_buffers(state.model)
    wrong = [n for n in buffers if manifest["buffers"].get(n) != list(buffers[n].shape)]
    if wrong:
        raise CheckpointError(f"buffer {wrong[0]} is missing from the checkpoint or has another "
                              "shape: it was saved from a different model")


def _check_same_optimizer(entries: dict, saved_keys: set, manifest: dict,
                          state: ShardedState) -> None:
    ours = type(state.optimizer).__name__
    if manifest["optimizer"] != ours:
        raise CheckpointError(f"the checkpoint holds the state of {manifest['optimizer']}, the "
                              f"optimizer is {ours}: build the optimizer the run was saved with")
    missing = sorted(k for k in entries if k.startswith("optim.") and k not in saved_keys)
    if missing:
        raise CheckpointError(f"the checkpoint has no optimizer state {missing[0]} "
                              f"({len(missing)} missing): it was saved before the optimizer's "
                              "first step, or with other optimizer settings")


def _initialize_optimizer_state(state: ShardedState) -> None:
    """Create the optimizer's state (one step with zero gradients and a zero learning rate)
    so that loading has tensors to read into; the load then overwrites all of it."""
    optimizer = state.optimizer
    trainable = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if all(p in optimizer.state for p in trainable):
        return
    saved_lr = [group["lr"] for group in optimizer.param_groups]
    for shard in trainable:
        shard.grad = torch.zeros_like(shard)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    with torch.no_grad():
        before = [p.detach().clone() for p in trainable]
        optimizer.step()
        for p, value in zip(trainable, before):  # weight decay at lr 0 is a no-op; make sure
            p.copy_(value)
    for group, lr in zip(optimizer.param_groups, saved_lr):
        group["lr"] = lr
    state.zero_grad()


def _restore_param_groups(optimizer: torch.optim.Optimizer, saved: list, state: ShardedState) -> None:
    names = state.shard_names()
    ours = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    if [group["params"] for group in saved] != ours:
        raise CheckpointError("the optimizer's parameter groups differ from the checkpoint's "
                              "(other parameters, or another grouping)")
    for group, values in zip(optimizer.param_groups, saved):
        group.update({k: v for k, v in values.items() if k != "params"})


def _device(state: ShardedState) -> torch.device:
    """Where this rank trains (offloaded masters are on the host: [Note: optimizer offload])."""
    return state.device


def _mesh(state: ShardedState):
    """The device mesh the shards are laid out on: the user's 2-D mesh with hybrid sharding
    (each shard saved once, its replicas skipped by DCP), else a one-dimensional mesh over
    the step's ranks; None at world size 1."""
    if state.world.mesh is not None:
        return state.world.mesh
    if state.world.size == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(_device(state).type, (state.world.size,))


def _expert_mesh(state: ShardedState):
    """The mesh a held routed expert is laid out on under expert parallelism: its
    expert-data-parallel group's; None where that group is this rank alone (it holds the
    expert whole). [Note: checkpoints under expert parallelism]"""
    parallel = state.plan.expert_parallel
    if parallel.data_size == 1:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    group = dist.distributed_c10d._resolve_process_group(parallel.data_group_name)
    return DeviceMesh.from_group(group, _device(state).type)  # no collective: the group exists


def _expert_rows_mesh(state: ShardedState):
    """The mesh expert rows are laid out on: place by holder, the expert-parallel group by the
    expert-data-parallel group ([Note: checkpoints under expert parallelism]); one-dimensional
    where each place has one holder."""
    from torch.distributed.device_mesh import DeviceMesh

    parallel = state.plan.expert_parallel
    resolve = dist.distributed_c10d._resolve_process_group
    if parallel.data_size == 1:
        return DeviceMesh.from_group(resolve(parallel.group_name), _device(state).type)
    shard_ranks = torch.tensor(dist.get_process_group_ranks(resolve(state.plan.group_name)))
    grid = shard_ranks.view(parallel.data_size, parallel.degree).T  # [place, holder]
    return DeviceMesh.from_group(
        [resolve(parallel.group_name), resolve(parallel.data_group_name)], _device(state).type,
        mesh=grid, mesh_dim_names=("expert", "expert_data"))


@contextlib.contextmanager
def _single_process_quietly():
    """DCP warns that it "assumes the intent" of a single process even when told so."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier(world) -> None:
    """Every rank reaches here before any goes on, over the CPU ([Note: object traffic goes
    over the CPU]): an all-reduce of a CPU scalar, since ``dist.barrier()`` on a group with a
    CUDA backend is an NCCL all-reduce on a device it guesses from the rank."""
    if world.ranks > 1:
        dist.all_reduce(torch.zeros(1), group=cpu_group())


def _on_rank_0(world, path: str, fn, *args) -> None:
    """``fn(*args)`` on rank 0, the others waiting for it; a failure is raised on every rank
    as a CheckpointError (rank 0's own as it is, anything else as "could not save"), so no
    rank is left waiting at the next collective."""
    error = None
    if world.global_rank == 0:
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001 - shared with the other ranks, then re-raised
            error = err
    message = [None if error is None else str(error) if isinstance(error, CheckpointError)
               else str(_not_saved(path, f"rank 0: {type(error).__name__}: {error}"))]
    if world.ranks > 1:
        dist.broadcast_object_list(message, src=0, group=cpu_group())
    if message[0] is not None:
        raise CheckpointError(message[0]) from error


def _not_saved(path: str, causes: str) -> CheckpointError:
    return CheckpointError(f"could not save the checkpoint {path} ({causes}); the previous "
                           "checkpoint there, if any, is unchanged. A full disk or a file-size "
                           "limit? Free space or save elsewhere")


def _readable(path: str) -> str:
    found = readable_path(path)
    if found != path:
        log.warning("zero_fx: a save into %s was interrupted after moving the previous checkpoint "
                    "aside; loading it from %s (the next save puts it back)", path, found)
    return found


def load_full(path: str) -> dict[str, torch.Tensor]:
    """Offline, one process: every tensor of the checkpoint, whole (parameters reshaped),
    keyed as saved. Checks the files first."""
    path = _readable(os.fspath(path))
    manifest = read_manifest(path)
    raise_if_damaged(path, check_files(path, manifest, lambda index: True))
    return _read_whole(path, manifest, list(_tensor_keys(path)))


EXPORT_GROUP_BYTES = 256 * 2**20
"""How much of the checkpoint ``model_state_dict`` reads at a time when it casts."""


def model_state_dict(path: str, dtype: Optional[torch.dtype] = None, *,
                     group_bytes: int = EXPORT_GROUP_BYTES) -> dict[str, torch.Tensor]:
    """A full ``model.state_dict()`` from a checkpoint: parameters (tied names too) in
    ``dtype`` (None: as saved, fp32 masters) and buffers; loads into the model with plain
    ``model.load_state_dict``.

    [Note: exporting in bounded memory]
    Only the model's entries are read (the optimizer's state, twice the model for
    Adam, stays on disk), and with ``dtype`` they are read and cast ``group_bytes``
    at a time (whole parameters, in the checkpoint's order), each group's saved
    copy freed before the next is read: host memory is the returned dict plus one
    group as saved, not the checkpoint plus its cast copy. The dict itself must be
    whole, since ``torch.save`` writes one object."""
    if group_bytes <= 0:
        raise ValueError(f"group_bytes must be positive, not {group_bytes}")
    path = _readable(os.fspath(path))
    manifest = read_manifest(path)
    raise_if_damaged(path, check_files(path, manifest, lambda index: True))
    metadata = _tensor_keys(path)
    state: dict[str, torch.Tensor] = {}
    for group in _groups(manifest["params"], metadata, group_bytes if dtype is not None else None):
        read = _read_whole(path, manifest, [f"model.{name}" for name in group])
        for name in group:
            value = read.pop(f"model.{name}")
            state[name] = (value.to(dtype) if dtype is not None and value.is_floating_point()
                           else value)
    for alias, name in manifest["aliases"].items():
        state[alias] = state[name]
    buffers = _read_whole(path, manifest, [f"buffers.{name}" for name in manifest["buffers"]])
    for name in manifest["buffers"]:
        state[name] = buffers[f"buffers.{name}"]
    return state


def _groups(names, metadata: dict, cap: Optional[int]) -> list[list[str]]:
    """``names`` in runs of at most ``cap`` bytes as saved (one larger parameter alone);
    None: one run."""
    groups: list[list[str]] = []
    filled = 0
    for name in names:
        meta = metadata[f"model.{name}"]
        size = math.prod(meta.size) * meta.properties.dtype.itemsize
        if groups and (cap is None or filled + size <= cap):
            groups[-1].append(name)
            filled += size
        else:
            groups.append([name])
            filled = size
    return groups


def _tensor_keys(path: str) -> dict[str, Any]:
    """The checkpoint's tensor entries (key -> DCP's metadata: size, dtype); the rest are
    objects."""
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return {key: meta for key, meta in metadata.items() if hasattr(meta, "size")}


def _read_whole(path: str, manifest: dict, keys: list[str],
                shape_of: Optional[str] = None) -> dict[str, torch.Tensor]:
    """Tensor entries ``keys``, whole, on the CPU; parameters in their shapes (a tensor
    split over "tp" put back together: [Note: checkpoints of a tensor-parallel model]);
    ``shape_of``: give every key parameter ``shape_of``'s shape (its optimizer state)."""
    if not keys:
        return {}
    metadata = _tensor_keys(path)
    entries: dict[str, Any] = {key: torch.empty(metadata[key].size,
                                                dtype=metadata[key].properties.dtype)
                               for key in keys}
    with _single_process_quietly():
        dcp.load(entries, checkpoint_id=path, no_dist=True)
    splits = manifest.get("tensor_parallel", {})
    for name, info in manifest["params"].items():
        for key in (keys if name == shape_of else _keys_of(name, entries, math.prod(info["shape"]))
                    if shape_of is None else []):
            entries[key] = _whole_parameter(entries[key], info["shape"], splits.get(name))
    return entries


def _keys_of(name: str, entries: dict, numel: int) -> list[str]:
    """The entries shaped like parameter ``name``: ``model.<name>`` and its optimizer state
    of one value per element (``optim.<name>.exp_avg``)."""
    prefix = f"optim.{name}."
    return [key for key, value in entries.items() if key == f"model.{name}" or (
        key.startswith(prefix) and "." not in key[len(prefix):] and value.numel() == numel
        and value.ndim > 0)]


def _whole_parameter(saved: torch.Tensor, shape: list, split: Optional[dict]) -> torch.Tensor:
    """A parameter-shaped tensor from its entry: flat, or ``[tp, piece numel]`` with row t
    "tp" rank t's piece, put back together along the split dimension."""
    if split is None:
        return saved.view(shape)
    piece_shape = list(shape)
    piece_shape[split["dim"]] //= split["degree"]
    return torch.cat([row.view(piece_shape) for row in saved], dim=split["dim"])


def full_state_dict(state: ShardedState, dtype: Optional[torch.dtype] = None, *,
                    cpu_offload: Optional[bool] = None) -> dict[str, torch.Tensor]:
    """The live run's ``model.state_dict()``, whole: fp32 masters (or ``dtype`` for the
    floating-point ones) gathered from every rank, tied names, persistent buffers. A
    collective: call it on every rank.

    ``cpu_offload`` ([Note: full state dict on rank 0's host]): True streams the dict to
    rank 0's CPU memory one bucket at a time and returns it there; every other rank gets
    ``{}``. False: every rank gets the whole dict on the training device (fine on the
    CPU, where that is the host). None: True unless the parameters are on the CPU.

    [Note: full state dict on rank 0's host]
    Gathering the whole model on the device, on every rank, needs the memory stage 3
    exists to save: with ``cpu_offload`` the device holds one bucket beyond what
    training holds ([Note: streaming whole parameters] in runtime/sharded_state.py),
    and only rank 0 keeps a copy, in host memory: the one rank that writes the file
    (``torch.save``, ``save_pretrained``). The others return an empty dict, as FSDP2's
    ``get_model_state_dict(options=StateDictOptions(full_state_dict=True,
    cpu_offload=True))`` does, so code written for one runs with the other. Only
    ranks whose values are needed take part: in stages 0-2 without mixed precision
    rank 0 copies its own whole parameters and the others return at once; with a
    hybrid mesh only rank 0's shard group gathers. Host memory on rank 0: the
    model's state dict (in ``dtype``), and nothing more.
    """
    if cpu_offload is not None and not isinstance(cpu_offload, bool):
        raise TypeError(f"cpu_offload must be True, False or None (chosen by the device), not "
                        f"{cpu_offload!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype (torch.bfloat16) or None, "
                        f"not {dtype!r}")
    device = _device(state)
    if cpu_offload is None:
        cpu_offload = device.type != "cpu"
    if not cpu_offload:
        full = state.full_parameters()
        result = {name: value.to(dtype) if dtype is not None and value.is_floating_point()
                  else value for name, value in full.items()}
        _add_aliases_and_buffers(state, result, None)
        return result
    keep = state.world.global_rank == 0
    # every rank of rank 0's shard group gathers with it; under tensor parallelism every
    # "tp" rank of those makes its split parameters whole with it
    needed = keep or (state.world.replica == 0 and (
        state.masters_sharded or state.plan.tensor_parallel is not None))
    result: dict[str, torch.Tensor] = {}
    if needed:
        host = torch.device("cpu")
        for name, value in state.stream_full_parameters(keep, dtype, to=host):
            if keep:
                result[name] = value
    if not keep:
        return {}
    _add_aliases_and_buffers(state, result, torch.device("cpu"))
    log.info("zero_fx: full_state_dict: %d entries, %s on rank 0's host, streamed from %s one "
             "bucket at a time", len(result),
             format_bytes(sum(t.nbytes for t in {id(t): t for t in result.values()}.values())),
             device)
    return result


def _add_aliases_and_buffers(state: ShardedState, result: dict, to: Optional[torch.device]) -> None:
    """Tied names (the same tensor under each) and persistent buffers (copies, on ``to``)."""
    for alias, name in tied_aliases(state.model).items():
        result[alias] = result[name]
    for name, buffer in persistent_buffers(state.model).items():
        result[name] = (buffer.detach().clone() if to is None
                        else buffer.detach().to(to, copy=True))
