"""Memory of the program Inductor generated: when each of its buffers is born and freed.

[Note: reading buffer lifetimes from generated code]
Inductor decides its own buffer lifetimes: it fuses kernels, inlines views,
reuses a dead buffer for a new one, and frees a buffer where its program says
``del bufN``. What our graph's memory timeline (memory_timeline.py) says about
the step holds for Inductor only if those decisions keep each buffer's life
within the graph's. To check it we read the Python wrapper Inductor writes
(``def call(self, args)``), one statement a line, and replay its allocations:

- ``bufN = empty_strided_cpu((sizes), (strides), dtype)`` (or ``_cuda``) is a
  new storage of the bytes those sizes and strides span;
- ``bufN = torch.ops...(...)`` (a collective or a fallback op) is a new storage
  of the size its ``assert_size_stride`` line states, in the dtype of its first
  tensor argument; an op with several outputs returns a tuple, unpacked as
  ``bufM = bufN[i]`` (each a storage the tuple also holds);
- ``bufM = bufN`` and ``bufM = reinterpret_tensor(bufN, ...)`` are the same
  storage under another name (Inductor's "reuse" and "alias");
- ``del bufN`` drops a name; a storage is freed when no name holds it.

The inputs (``argN_1``: shards, the batch) are the caller's and not counted;
what is counted is comparable with ``MemoryTimeline.transient``. The peak and
the buffers alive there, each with the graph nodes it came from (Inductor's
"Source Nodes" comment above it), say which buffer to chase when Inductor's
peak exceeds the graph's. Not modelled, as in the graph's timeline: a kernel's
internal temporaries, the allocator's caching, and what a communication
library allocates while a collective runs (gloo copies a collective's buffer:
one more buffer per collective in flight).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch

_NAME = r"(?:buf\d+|arg\d+_\d+)"
_ALLOC = re.compile(r"(buf\d+) = empty_strided(?:_\w+)?\(\(([^()]*)\), \(([^()]*)\), torch\.(\w+)\)")
_CALL = re.compile(r"(buf\d+) = (?:torch\.ops\.|extern_kernels\.)[\w.]+\((.*)")
_ASSERT = re.compile(r"(?:assert_size_stride|assert_tensor_metadata)\((buf\d+), \(([^()]*)\), "
                     r"\(([^()]*)\)")
"""A buffer's size and stride as Inductor asserts them: ``assert_size_stride`` in torch 2.11
and 2.13, ``assert_tensor_metadata`` (the dtype after them) in 2.15 ([Note: what differs
between torch releases] in zero_fx/base/compat.py)."""
_ALIAS = re.compile(rf"(buf\d+) = (?:reinterpret_tensor\()?({_NAME})\b(?!\[)")
_ITEM = re.compile(r"(buf\d+) = (buf\d+)\[\d+\]")
_DEL = re.compile(rf"\bdel ({_NAME})")
_SOURCE = re.compile(r"# (?:Topologically Sorted|Unsorted) Source Nodes: \[([^\]]*)\]")
_ARG_DTYPE = re.compile(r"(arg\d+_\d+) = rand_strided\(.*dtype=torch\.(\w+)\)")


@dataclass(frozen=True)
class Buffer:
    name: str
    bytes: int
    source: str
    """The graph nodes it was computed from, as Inductor names them ("mm_7, t_3")."""


@dataclass(frozen=True)
class LoweredMemory:
    """Bytes of the buffers a generated program allocates, over its statements."""

    peak_bytes: int
    peak_statement: str
    alive_at_peak: tuple[Buffer, ...]
    """Largest first."""

    def summary(self, top: int = 3) -> str:
        largest = ", ".join(f"{b.name} {b.bytes / 2**20:.2f} MiB [{b.source}]"
                            for b in self.alive_at_peak[:top])
        return (f"peak {self.peak_bytes / 2**20:.2f} MiB at `{self.peak_statement[:80]}`; "
                f"largest alive: {largest}")


def lowered_memory(source: str) -> Optional[LoweredMemory]:
    """Replay the allocations of Inductor's Python wrapper ([Note: reading buffer lifetimes
    from generated code]); None where there is none (a C++ wrapper) or a size is symbolic."""
    start = source.find("def call(self, args)")
    if start < 0:
        return None
    dtypes = {m[1]: _dtype(m[2]) for m in _ARG_DTYPE.finditer(source)}
    storage_of: dict[str, int] = {}   # name -> storage
    tuple_of: dict[str, list[str]] = {}  # a multi-output result -> the names of its items
    named: dict[int, tuple[str, str]] = {}  # storage -> (its latest name, its source nodes)
    sizes: dict[int, int] = {}
    unsourced: list[int] = []  # storages whose kernel's "Source Nodes" comment comes next
    holders: dict[int, int] = {}
    pending: dict[str, torch.dtype] = {}  # op results waiting for their assert_size_stride
    calls: dict[str, str] = {}  # an op's result -> the source nodes of its call
    live = peak = 0
    peak_statement, alive_at_peak = "", ()
    source_nodes = ""

    def born(name: str, nbytes: int, source: Optional[str] = None) -> None:
        """``source`` None: the next "Source Nodes" comment names it (its kernel follows)."""
        nonlocal live
        sid = len(sizes)
        sizes[sid], named[sid] = nbytes, (name, source or "")
        storage_of[name], holders[sid] = sid, 1
        live += nbytes
        if source is None:
            unsourced.append(sid)

    def release(sid: int) -> None:
        nonlocal live
        holders[sid] -= 1
        if holders[sid] == 0:
            live -= sizes[sid]

    for line in source[start:].splitlines()[1:]:
        statement = line.strip()
        if statement.startswith(("return", "def ")):
            break
        if m := _SOURCE.match(statement):
            source_nodes = m[1]
            for sid in unsourced:
                named[sid] = (named[sid][0], source_nodes)
            unsourced.clear()
        elif m := _ALLOC.match(statement):
            nbytes = _storage_bytes(m[2], m[3], _dtype(m[4]))
            if nbytes is None:
                return None
            born(m[1], nbytes)
            dtypes[m[1]] = _dtype(m[4])
        elif m := _ITEM.match(statement):
            pending[m[1]] = dtypes.get(m[2], torch.float32)
            tuple_of.setdefault(m[2], []).append(m[1])
        elif m := _CALL.match(statement):
            first = re.search(_NAME, m[2])
            pending[m[1]] = dtypes[m[1]] = dtypes.get(first[0], torch.float32) if first else torch.float32
            calls[m[1]] = source_nodes
        elif (m := _ALIAS.match(statement)) and m[2] in storage_of:
            sid = storage_of[m[1]] = storage_of[m[2]]
            holders[sid] += 1
            if statement.endswith("# reuse"):  # a new tensor in a dead one's storage
                named[sid] = (m[1], "")
                unsourced.append(sid)
            dtypes[m[1]] = dtypes.get(m[2], torch.float32)
        elif (m := _ASSERT.match(statement)) and m[1] in pending:
            dtype = pending.pop(m[1])
            nbytes = _storage_bytes(m[2], m[3], dtype)
            if nbytes is None:
                return None
            born(m[1], nbytes, calls.get(m[1], ""))  # its call's comment came before it
            dtypes[m[1]] = dtype
            if any(m[1] in items for items in tuple_of.values()):
                holders[storage_of[m[1]]] += 1  # the tuple holds it too, until deleted
        for name in _DEL.findall(statement):
            if name in tuple_of:
                for item in tuple_of.pop(name):
                    if item in storage_of:
                        release(storage_of[item])
            if name in storage_of:
                release(storage_of.pop(name))
        if live > peak:
            peak, peak_statement = live, statement
            alive_at_peak = tuple(sorted((Buffer(named[s][0], sizes[s], named[s][1])
                                          for s, n in holders.items() if n),
                                         key=lambda b: -b.bytes))
    return LoweredMemory(peak, peak_statement, alive_at_peak)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _storage_bytes(sizes: str, strides: str, dtype: torch.dtype) -> Optional[int]:
    """Bytes a tensor of these sizes and strides spans; None if one is symbolic."""
    try:
        size = [int(s) for s in sizes.replace(" ", "").split(",") if s]
        stride = [int(s) for s in strides.replace(" ", "").split(",") if s]
    except ValueError:
        return None
    if 0 in size:
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(size, stride))) * dtype.itemsize
