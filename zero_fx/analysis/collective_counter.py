"""Count the collectives that actually run, as they run: the check on the traffic report."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..passes.predicates import is_token_exchange_op, token_exchange_numel
from .traffic import ALL_TO_ALL, KINDS

_c10d = torch.ops._c10d_functional


class CollectiveCounter(TorchDispatchMode):
    """Sums the buffers that functional collectives move while the mode is active.

    In the units of the traffic report (see [Note: counting traffic] in
    traffic.py). Around a compiled step, use ``step.counting_collectives()``
    (dynamo runs no compiled code under a dispatch mode entered outside it);
    around eager code, ``with CollectiveCounter() as counted:``.
    """

    def __init__(self):
        super().__init__()  # all_to_all (expert parallelism) appears once one runs
        self.numel: Counter = Counter({kind: 0 for kind in KINDS})
        self.bytes: Counter = Counter({kind: 0 for kind in KINDS})
        self.launches: Counter = Counter({kind: 0 for kind in KINDS})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if is_token_exchange_op(func):
            numel = token_exchange_numel(args[0], out)
            self.numel[ALL_TO_ALL] += numel
            self.bytes[ALL_TO_ALL] += numel * args[0].element_size()
            self.launches[ALL_TO_ALL] += 1
            return out
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
