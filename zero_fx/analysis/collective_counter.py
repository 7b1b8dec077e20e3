"""Count the collectives that actually run, as they run: the check on the traffic report."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

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
        kind = _KIND_OF.get(func.overloadpacket)
        if kind is not None:
            # the whole buffer: what is gathered, what is reduced
            buffers = tree_leaves(out if kind == "all_gather" else args[0])
            self.numel[kind] += sum(b.numel() for b in buffers)
            self.bytes[kind] += sum(b.numel() * b.element_size() for b in buffers)
            self.launches[kind] += 1
        return out


# Functional variants, in-place and out= ones (what Inductor calls) and coalesced ones.
_KIND_OF = {
    _c10d.all_gather_into_tensor: "all_gather",
    _c10d.all_gather_into_tensor_out: "all_gather",
    _c10d.all_gather_into_tensor_coalesced: "all_gather",
    _c10d.reduce_scatter_tensor: "reduce_scatter",
    _c10d.reduce_scatter_tensor_out: "reduce_scatter",
    _c10d.reduce_scatter_tensor_coalesced: "reduce_scatter",
    _c10d.all_reduce: "all_reduce",
    _c10d.all_reduce_: "all_reduce",
    _c10d.all_reduce_coalesced: "all_reduce",
}
