"""Peak live tensor bytes during a step, counted on the tensors themselves.

[Note: measuring peak memory on CPU]
CPU has no allocator statistics like ``torch.cuda.max_memory_allocated``, and
the process's resident size mixes in the Python heap, compiled code and what
the C allocator keeps cached. ``LiveTensorBytes`` counts exactly the bytes of
tensor storages that are alive: it is told what exists when it starts (the
shards, optimizer state, inputs), sees every tensor an op creates while it is
active (a dispatch mode), and subtracts a storage's bytes when the storage is
freed (a weakref finalizer). Views share their base's storage and are counted
once. Its peak is what ``torch.cuda.max_memory_allocated`` would say, minus the
allocator's rounding. It sees only tensors created through Python dispatch:
under aot_eager and eager everything; not Inductor's generated buffers.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    """``live`` and ``peak``: bytes of tensor storage alive, now and at most, since ``track``."""

    def __init__(self, existing: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._bytes: dict[int, int] = {}  # storage identity -> bytes counted
        self.track(existing)

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors that already exist (each storage once)."""
        for tensor in tensors:
            self._add(tensor)

    def reset_peak(self) -> None:
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._add(leaf)
        return out

    def _add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._bytes:
            return
        nbytes = storage.nbytes()
        self._bytes[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._drop, key)

    def _drop(self, key: int) -> None:
        self.live -= self._bytes.pop(key, 0)
