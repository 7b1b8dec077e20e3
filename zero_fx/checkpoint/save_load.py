"""Sharded checkpoints: save and load a compiled step's state with ``torch.distributed.checkpoint``.

What is saved, and how a run at another world size, stage or split reads it: [Note:
checkpoint layout] and the notes after it, in checkpoint/contents.py."""

from __future__ import annotations

import logging
import os
import pickle
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..plan.layout import cut_shard
from ..runtime.distributed.cpu_group import cpu_group
from ..runtime.sharded_state import ShardedState
from .contents import (manifest_of, object_entries, persistent_buffers, rng_states,
                       set_rng_states, shard_mesh, tensor_entries, tensor_parallel_split,
                       training_device, whole_shape)
from .files import (CheckpointError, check_files, clear_staging, prepare_save, publish,
                    raise_if_damaged, read_manifest, staging_path)
from .offline import read_whole, readable_checkpoint, single_process_quietly

log = logging.getLogger("zero_fx")


def save(state: ShardedState, path: str, counters: dict, extra: Any = None) -> None:
    """Write ``state`` (and the runtime's ``counters``, ``extra``) to ``path``; a collective."""
    with state.optimizer_state_as_shards():  # [Note: checkpoints of whole-tensor updates]
        _save(state, os.fspath(path), counters, extra)


def _save(state: ShardedState, path: str, counters: dict, extra: Any) -> None:
    world = state.world
    _on_rank_0(world, path, prepare_save, path)
    entries = tensor_entries(state, shard_mesh(state))
    entries.update(object_entries(state, counters, extra))
    entries.update(rng_states(world.global_rank, training_device(state)))
    try:
        with single_process_quietly():
            dcp.save(entries, checkpoint_id=staging_path(path), no_dist=world.ranks == 1,
                     process_group=cpu_group())
    except CheckpointException as failed:  # every rank gets it, with each rank's cause
        _on_rank_0(world, path, clear_staging, path)
        causes = "; ".join(f"rank {rank}: {type(error).__name__}: {error}"
                           for rank, (error, _) in sorted(failed.failures.items()))
        raise _not_saved(path, causes) from None
    _barrier(world)
    try:
        _on_rank_0(world, path, publish, path, manifest_of(state))
    except CheckpointError:
        _on_rank_0(world, path, clear_staging, path)
        raise
    log.info("zero_fx: saved a checkpoint of %d parameters at %s", len(state.plan.params), path)


def load(state: ShardedState, path: str) -> tuple[dict, Any]:
    """Read ``path`` into ``state`` (any world size or stage it was saved at); return the
    saved runtime counters and ``extra``. A collective."""
    path = readable_checkpoint(os.fspath(path))
    manifest = read_manifest(path)
    _check_files_on_all_ranks(state, path, manifest)
    _check_same_model(state, manifest)
    _initialize_optimizer_state(state)
    with state.optimizer_state_as_shards(loading=True):  # [Note: checkpoints of whole-tensor updates]
        return _load(state, path, manifest)


def _load(state: ShardedState, path: str, manifest: dict) -> tuple[dict, Any]:
    saved_keys = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    entries = tensor_entries(state, shard_mesh(state))
    _check_same_optimizer(entries, saved_keys, manifest, state)
    resplit = _split_otherwise(state, manifest, entries)
    entries.update({k: None for k in ("zero_fx.runtime", "zero_fx.extra", "optim.param_groups")})
    rng = rng_states(state.world.global_rank, training_device(state))
    if rng.keys() <= saved_keys:
        entries.update(rng)
    else:
        log.warning("zero_fx: the checkpoint was saved at %d rank(s) and holds no RNG state "
                    "for rank %d (or its CUDA device); its RNG is left as it is",
                    manifest["world_size"], state.world.global_rank)
    with single_process_quietly():
        dcp.load(entries, checkpoint_id=path, no_dist=state.world.ranks == 1,
                 process_group=cpu_group())
    _load_split_otherwise(state, path, manifest, resplit)
    _restore_param_groups(state.optimizer, pickle.loads(entries["optim.param_groups"]), state)
    if rng.keys() <= entries.keys():
        set_rng_states(state.world.global_rank, entries, training_device(state))
    state.zero_grad()
    state.refresh_parameters(frozen=True)
    return pickle.loads(entries["zero_fx.runtime"]), pickle.loads(entries["zero_fx.extra"])


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
        whole = read_whole(path, manifest, [key], shape_of=name)[key]
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
    trainable = [p for g in optimizer.param_groups for p in g["params"]
                 if p.requires_grad and state.steps_here(p)]
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
