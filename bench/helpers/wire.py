"""Bytes this process has sent, for gloo's traffic on the wire.

[Note: counting gloo's bytes on the wire]
gloo's TCP transport sends with ``writev``, which the kernel counts in
``wchar`` of /proc/self/io (its receives, with ``recv``, are not in ``rchar``).
So the growth of ``wchar`` over a step is what this rank put on the wire,
whichever library issued the collectives and however it chose its algorithms:
an all-reduce of B bytes over 2 ranks sends B, an all-gather of B bytes of
output B/2 per rank, and gloo's reduce-scatter sends what an all-reduce would
(it is implemented as one). File and terminal writes count too; the benchmark
writes nothing while it times a step. NCCL moves data without syscalls, so on
CUDA this counter stays at zero and the table shows no wire column.
"""

from __future__ import annotations

import os


def supported() -> bool:
    return os.path.exists("/proc/self/io")


def bytes_sent() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")
