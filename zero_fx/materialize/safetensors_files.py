"""HuggingFace safetensors weights on disk: which files, what each holds, and reading part of a tensor.

``save_pretrained`` writes ``model.safetensors``, or, above its shard size,
``model-0000k-of-0000n.safetensors`` files and ``model.safetensors.index.json``
mapping every tensor name to its file. A safetensors file is a JSON header
(name, dtype, shape, byte range) followed by the tensors' bytes, row-major.
``safe_open(...).get_slice(name)[a:b]`` returns rows ``a:b`` of a tensor as a
view of the memory-mapped file: only the pages of those rows are read from
disk, and nothing is allocated until the caller copies them.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass
from typing import Iterator

import torch

from ..errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def safe_open(file: str, framework: str):
    """``safetensors.safe_open``, imported when first needed: zero_fx itself needs torch only."""
    try:
        from safetensors import safe_open as open_file
    except ImportError:
        raise ImportError("reading pretrained weights needs the safetensors package: pip install "
                          "safetensors (HuggingFace transformers installs it)") from None
    return open_file(file, framework=framework)


@dataclass(frozen=True)
class StoredTensor:
    """One tensor in a weights file, as its header describes it."""

    key: str
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class WeightFiles:
    """The safetensors files at ``path`` (a folder ``save_pretrained`` wrote, one
    ``.safetensors`` file, or a ``.safetensors.index.json``) and the tensors they hold.
    Reads the headers only."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        self.files = _resolve(self.path)
        self.tensors: dict[str, StoredTensor] = {}
        for file in self.files:
            for stored in _headers(file):
                if stored.key in self.tensors:
                    raise CheckpointError(
                        f"{stored.key!r} is in two weight files, {self.tensors[stored.key].file} "
                        f"and {file}; one of them does not belong to this model")
                self.tensors[stored.key] = stored
        self._check_index()
        self.bytes_read = 0
        """Bytes of tensor data read so far through ``read_range`` and ``read_whole``."""

    def _check_index(self) -> None:
        if not self.path.endswith(".json") and not os.path.isfile(os.path.join(self.path, INDEX_FILE)):
            return
        index = self.path if self.path.endswith(".json") else os.path.join(self.path, INDEX_FILE)
        folder = os.path.dirname(index)
        for key, name in _weight_map(index).items():
            stored = self.tensors.get(key)
            if stored is None or os.path.normpath(stored.file) != os.path.normpath(
                    os.path.join(folder, name)):
                raise CheckpointError(f"{index} maps {key!r} to {name}, which does not hold it; "
                                      "the index and its files are from different saves")

    def by_file(self, keys) -> list[tuple[str, list[str]]]:
        """``keys`` grouped by the file holding them, files in order."""
        grouped: dict[str, list[str]] = {file: [] for file in self.files}
        for key in keys:
            grouped[self.tensors[key].file].append(key)
        return [(file, found) for file, found in grouped.items() if found]

    @contextlib.contextmanager
    def opened(self, file: str) -> Iterator["_OpenFile"]:
        with safe_open(file, framework="pt") as handle:
            yield _OpenFile(self, handle)


class _OpenFile:
    def __init__(self, files: WeightFiles, handle):
        self._files = files
        self._handle = handle

    def read_range(self, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Copy flat elements ``[start, stop)`` of tensor ``key`` into the 1-D ``out``
        (converting to its dtype), reading only the rows that hold them."""
        if stop <= start:
            return
        stored = self._files.tensors[key]
        if len(stored.shape) == 0:
            rows, first = self._handle.get_tensor(key).reshape(1), 0
        else:
            row = math.prod(stored.shape[1:])
            first, last = start // row, -(-stop // row)
            rows = self._handle.get_slice(key)[first:last].reshape(-1)
            first *= row
        out.copy_(rows[start - first: stop - first])
        self._files.bytes_read += rows.numel() * stored.dtype.itemsize

    def read_whole(self, key: str, out: torch.Tensor) -> None:
        """Copy tensor ``key`` into ``out`` (same shape; converting to its dtype)."""
        self.read_range(key, 0, out.numel(), out.view(-1))


def _resolve(path: str) -> list[str]:
    if os.path.isfile(path):
        if path.endswith(".json"):
            return _files_of_index(path)
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no weights at {path}: pass the folder model.save_pretrained() "
                                f"wrote, a .safetensors file or a {INDEX_FILE}")
    if os.path.isfile(os.path.join(path, INDEX_FILE)):
        return _files_of_index(os.path.join(path, INDEX_FILE))
    if os.path.isfile(os.path.join(path, SINGLE_FILE)):
        return [os.path.join(path, SINGLE_FILE)]
    present = sorted(os.listdir(path))
    advice = ("zero_fx reads safetensors only: load it with from_pretrained once and "
              "save_pretrained it again (safetensors is the default)"
              if any(n.endswith((".bin", ".pt", ".pth")) for n in present) else
              "save the model with model.save_pretrained(folder)")
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path} (it holds "
                            f"{', '.join(present[:8]) or 'nothing'}); {advice}")


def _weight_map(index: str) -> dict[str, str]:
    with open(index) as f:
        try:
            weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index} is not a safetensors index (no weight_map): {err}") from None
    return weight_map


def _files_of_index(index: str) -> list[str]:
    folder = os.path.dirname(index)
    names = sorted(set(_weight_map(index).values()))
    missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
    if missing:
        raise FileNotFoundError(f"{index} names {len(missing)} file(s) that are not in {folder}: "
                                f"{', '.join(missing[:4])}; copy every file save_pretrained wrote")
    return [os.path.join(folder, n) for n in names]


def _headers(file: str) -> list[StoredTensor]:
    try:
        with safe_open(file, framework="pt") as handle:
            found = []
            for key in handle.keys():
                view = handle.get_slice(key)
                dtype = DTYPES.get(view.get_dtype())
                if dtype is None:
                    raise CheckpointError(f"{file}: tensor {key!r} has dtype {view.get_dtype()}, "
                                          f"which zero_fx does not read ({', '.join(DTYPES)})")
                found.append(StoredTensor(key, file, tuple(view.get_shape()), dtype))
            return found
    except CheckpointError:
        raise
    except Exception as err:  # safetensors' own error for a truncated or foreign file
        raise CheckpointError(f"{file} is not a readable safetensors file: {err}") from None
