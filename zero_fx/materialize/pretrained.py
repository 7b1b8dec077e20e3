"""``load_pretrained``: HuggingFace safetensors weights, read straight into each rank's shards."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Protocol, Union, runtime_checkable

import torch
import torch.nn as nn

from ..errors import CheckpointError
from ..base.formatting import format_bytes
from ..plan import PlanOptions, PlanRanks, plan_for_module
from .materialize import materialize
from .model_tensors import ModelTensor, model_tensors
from .safetensors_files import WeightFiles

log = logging.getLogger("zero_fx")

Rename = Union[Mapping[str, Optional[str]], Callable[[str], Optional[str]], None]


@runtime_checkable
class StepToShard(Protocol):
    """What ``load_pretrained`` uses of a ``@zero_compile`` step (``zero_fx.api.CompiledStep``).

    The step is known by what it has, not by its class: the api sits above materialize/
    (docs/architecture.md, "The layers"), and importing it from here closed a cycle
    (api -> compiler -> runtime -> materialize -> api)."""

    state: object
    """None until the step has sharded its model."""
    model: Optional[nn.Module]
    """The model named with ``zero_compile(model=...)``, or None."""
    optimizer: Optional[torch.optim.Optimizer]
    """The optimizer named with ``zero_compile(optimizer=...)``, or None."""

    def shard_model(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                    pretrained: Optional[PretrainedWeights] = None) -> None: ...


@dataclass(frozen=True)
class LoadedWeights:
    """What ``load_pretrained`` read on this rank."""

    files: int
    tensors: int
    """Tensors loaded (a tied one once)."""
    file_bytes: int
    """Bytes those tensors take in the files."""
    bytes_read: int
    """Bytes this rank read of them: in stage 3 about ``file_bytes / world_size``."""


def load_pretrained(target, path: str, model: Optional[nn.Module] = None,
                    optimizer: Optional[torch.optim.Optimizer] = None, *,
                    rename: Rename = None) -> LoadedWeights:
    """Load HuggingFace safetensors weights (as ``save_pretrained`` writes them: one
    ``model.safetensors``, or several files and ``model.safetensors.index.json``).

    ``load_pretrained(step, path, model, opt)``: ``step`` is a ``@zero_compile`` step
    before its first call; the model (ideally built on the meta device: ``with
    torch.device("meta"): model = ...``) is sharded now, as the first call would, and
    each rank reads only what it keeps: in stage 3 its slice of every parameter (rows of
    the file, memory-mapped, copied into its shard), in stages 0-2 whole parameters.
    Besides what it keeps, a rank allocates one tensor at a time. The model and
    optimizer may be left out when the step names them (``zero_compile(model=...,
    optimizer=...)``). A collective, as sharding is: call it on every rank.

    ``load_pretrained(model, path)``: a model no step has sharded: whole tensors, read
    one at a time into it (meta tensors are created on the CPU), like ``from_pretrained``.

    Names: the file's names are the model's ``state_dict()`` names (they are when the
    model is the HuggingFace model that saved them; a tied parameter may be saved under
    any of its names). ``rename`` maps a file name to the model's name, or to None to
    skip it: a dict, or a function. Every parameter and persistent buffer must be in the
    files, every name in the files must be in the model, and shapes must be equal, or a
    ``CheckpointError`` says which; floating-point tensors are converted to the model's
    dtype. Buffers the model computes (non-persistent, like rotary ``inv_freq``) are
    computed as its construction would. Reading draws no random numbers. With
    ``zero_fx.set_logs("info")``, rank 0 logs a line per file.

    Returns what this rank read (``LoadedWeights``).
    """
    if isinstance(target, StepToShard):
        if target.state is not None:
            raise RuntimeError(
                f"load_pretrained after {target.__name__} has sharded its model (its first call, "
                "load_checkpoint or load_pretrained): it has trained or loaded other weights, and "
                "its optimizer may hold state for them. Load pretrained weights before the first "
                "call; to resume a run, use step.load_checkpoint")
        model = model if model is not None else target.model
        optimizer = optimizer if optimizer is not None else target.optimizer
        if model is None or optimizer is None:
            raise ValueError("load_pretrained(step, ...) shards the model now, so it needs the model "
                             "and optimizer: load_pretrained(step, path, model, opt)")
        weights = PretrainedWeights(path, model, rename)
        target.shard_model(model, optimizer, pretrained=weights)
        return weights.loaded
    if not isinstance(target, nn.Module):
        raise TypeError(f"load_pretrained takes a @zero_compile step or an nn.Module, got "
                        f"{type(target).__name__}")
    if model is not None or optimizer is not None:
        raise TypeError("load_pretrained(model, path) takes no other model or optimizer; to load "
                        "into shards, pass the step: load_pretrained(step, path, model, opt)")
    owner = next((getattr(p, "_zero_fx_sharded_by", None) for p in target.parameters()), None)
    if owner is not None:
        raise RuntimeError(f"this model is sharded by the compiled step {owner!r}: load pretrained "
                           "weights through the step, before its first call")
    weights = PretrainedWeights(path, target, rename)
    materialize(target, plan_for_module(target, PlanRanks(1), PlanOptions(stage=0)),
                pretrained=weights, device=torch.device("cpu"))
    return weights.loaded


class PretrainedWeights:
    """The files at ``path`` matched to ``model``'s tensors (headers only; checked on creation)."""

    def __init__(self, path: str, model: nn.Module, rename: Rename = None):
        self.files = WeightFiles(path)
        self.key_of: dict[int, str] = _match(self.files, model_tensors(model), rename)
        """id(tensor) -> the key holding its values."""
        self.loaded: Optional[LoadedWeights] = None
        """Set by ``read_into``."""

    def read_into(self, tensors: list[ModelTensor], sink) -> None:
        """Read every matched tensor into ``sink``: a stage-3 parameter's shard directly
        (only its rows), anything else whole."""
        plan = sink.plan
        by_key = {self.key_of[id(mt.tensor)]: mt for mt in tensors if id(mt.tensor) in self.key_of}
        groups = self.files.by_file(by_key)
        total = sum(self.files.tensors[key].nbytes for key in by_key)
        for number, (file, keys) in enumerate(groups, 1):
            before = self.files.bytes_read
            with self.files.opened(file) as opened, torch.no_grad():
                for key in keys:
                    self._read(opened, key, by_key[key], sink)
            if plan.rank == 0:
                log.info("zero_fx: load_pretrained: file %d of %d, %s: %d tensor(s); this rank "
                         "read %s", number, len(groups), os.path.basename(file), len(keys),
                         format_bytes(self.files.bytes_read - before))
        self.loaded = LoadedWeights(files=len(groups), tensors=len(by_key), file_bytes=total,
                                    bytes_read=self.files.bytes_read)
        if plan.rank == 0:
            log.info("zero_fx: load_pretrained: %d tensor(s), %s in %s; this rank read %s",
                     len(by_key), format_bytes(total), self.files.path,
                     format_bytes(self.files.bytes_read))

    def _read(self, opened, key: str, mt: ModelTensor, sink) -> None:
        if sink.sharded(mt):
            sink.put_shard(mt, lambda out, start, stop: opened.read_range(key, start, stop, out))
        elif mt.is_meta:
            full = torch.empty(mt.tensor.shape, dtype=mt.tensor.dtype, device=sink.device)
            opened.read_whole(key, full)
            sink.put_full(mt, full)
        else:
            opened.read_whole(key, mt.tensor.data)


def _match(files: WeightFiles, tensors: list[ModelTensor], rename: Rename) -> dict[int, str]:
    """Which key holds each parameter and persistent buffer; a ``CheckpointError`` for a
    missing or unexpected name, a shape or a dtype that does not fit."""
    by_name = {name: mt for mt in tensors if mt.persistent for name in mt.names}
    key_of: dict[int, str] = {}
    unexpected = []
    for key in files.tensors:
        name = _renamed(key, rename)
        if name is None:
            continue
        mt = by_name.get(name)
        if mt is None:
            unexpected.append(key if name == key else f"{key} (renamed {name})")
        elif id(mt.tensor) not in key_of or name == mt.name:  # a tied tensor saved twice: its first name
            key_of[id(mt.tensor)] = key
    missing = [mt.name for mt in tensors if mt.persistent and id(mt.tensor) not in key_of]
    if missing or unexpected:
        raise CheckpointError(_mismatch(files, missing, unexpected, by_name))
    for mt in tensors:
        key = key_of.get(id(mt.tensor))
        if key is None:
            continue
        stored = files.tensors[key]
        if stored.shape != tuple(mt.tensor.shape):
            raise CheckpointError(f"{key} in {stored.file} has shape {list(stored.shape)}, the "
                                  f"model's {mt.name} {list(mt.tensor.shape)}: the weights are for "
                                  "another configuration of the model")
        if stored.dtype != mt.tensor.dtype and not (
                stored.dtype.is_floating_point and mt.tensor.dtype.is_floating_point):
            raise CheckpointError(f"{key} in {stored.file} is {stored.dtype}, the model's "
                                  f"{mt.name} {mt.tensor.dtype}; only floating-point tensors are "
                                  "converted")
    return key_of


def _renamed(key: str, rename: Rename) -> Optional[str]:
    if rename is None:
        return key
    if callable(rename):
        return rename(key)
    return rename.get(key, key)


def _mismatch(files: WeightFiles, missing: list[str], unexpected: list[str], by_name) -> str:
    parts = []
    if missing:
        parts.append(f"{len(missing)} of the model's tensor(s) are not in the files "
                     f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''})")
    if unexpected:
        parts.append(f"{len(unexpected)} tensor(s) in the files are not in the model "
                     f"({', '.join(unexpected[:5])}{', ...' if len(unexpected) > 5 else ''})")
    advice = ("pass rename= to map the files' names onto the model's (a dict, or a function "
              "returning the model's name or None to skip the tensor)")
    if missing and unexpected:
        advice = (f"the files name tensors like {unexpected[0]!r}, the model like "
                  f"{missing[0]!r}: {advice}")
    return f"the weights at {files.path} do not fit the model: {'; '.join(parts)}. {advice}"
