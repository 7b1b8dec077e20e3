"""A checkpoint read in one process, without a run: every tensor whole (``load_full``), or the
model's ``state_dict()`` (``model_state_dict``, for ``python -m zero_fx.export``)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import warnings
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp

from .files import check_files, raise_if_damaged, read_manifest, readable_path

log = logging.getLogger("zero_fx")


@contextlib.contextmanager
def single_process_quietly():
    """DCP warns that it "assumes the intent" of a single process even when told so."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def readable_checkpoint(path: str) -> str:
    found = readable_path(path)
    if found != path:
        log.warning("zero_fx: a save into %s was interrupted after moving the previous checkpoint "
                    "aside; loading it from %s (the next save puts it back)", path, found)
    return found


def load_full(path: str) -> dict[str, torch.Tensor]:
    """Offline, one process: every tensor of the checkpoint, whole (parameters reshaped),
    keyed as saved. Checks the files first."""
    path = readable_checkpoint(os.fspath(path))
    manifest = read_manifest(path)
    raise_if_damaged(path, check_files(path, manifest, lambda index: True))
    return read_whole(path, manifest, list(_tensor_keys(path)))


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
    path = readable_checkpoint(os.fspath(path))
    manifest = read_manifest(path)
    raise_if_damaged(path, check_files(path, manifest, lambda index: True))
    metadata = _tensor_keys(path)
    state: dict[str, torch.Tensor] = {}
    for group in _groups(manifest["params"], metadata, group_bytes if dtype is not None else None):
        read = read_whole(path, manifest, [f"model.{name}" for name in group])
        for name in group:
            value = read.pop(f"model.{name}")
            state[name] = (value.to(dtype) if dtype is not None and value.is_floating_point()
                           else value)
    for alias, name in manifest["aliases"].items():
        state[alias] = state[name]
    buffers = read_whole(path, manifest, [f"buffers.{name}" for name in manifest["buffers"]])
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


def read_whole(path: str, manifest: dict, keys: list[str],
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
    with single_process_quietly():
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
