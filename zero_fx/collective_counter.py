"""Count the collectives that actually run, as they run: the check on the traffic report."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .traffic import KINDS

_c10d = torch.ops._c10d_functional


class CollectiveCounter(TorchDispatchMode):
    """Sums the buffers that functional collectives move while the mode is active.

    In the units of the traffic report (see [Note: counting traffic] in
    traffic.py). Around a compiled step, use ``step.counting_collectives()``
    (dynamo runs no compiled code under a dispatch mode entered outside it);
    around eager code, ``with CollectiveCounter() as counted:``.
    """

    def __init__(self):
        super().__init__()
        self.numel: Counter = Counter({kind: 0 for kind in KINDS})
        self.bytes: Counter = Counter({kind: 0 for kind in KINDS})
        self.launches: Counter = Counter({kind: 0 for kind in KINDS})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind, buffer = _collective_buffer(func, args, out)
        if kind is not None:
            self.numel[kind] += buffer.numel()
            self.bytes[kind] += buffer.numel() * buffer.element_size()
            self.launches[kind] += 1
        return out


def _collective_buffer(func, args, out):
    if func is _c10d.all_gather_into_tensor.default:
        return "all_gather", out
    if func is _c10d.reduce_scatter_tensor.default:
        return "reduce_scatter", args[0]
    if func is _c10d.all_reduce.default:
        return "all_reduce", out
    return None, None
