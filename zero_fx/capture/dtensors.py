"""Whether a value is a DTensor, and its local piece: read by capture (a tensor-parallel
step's graph) and by the plan and runtime above it (``plan/tensor_parallel.py``)."""

from __future__ import annotations


def is_dtensor(value) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def local_tensor(value):
    """A DTensor's local piece (what zero_fx shards); any other value as it is."""
    return value._local_tensor if is_dtensor(value) else value
