"""Count the collectives that actually run, as they run: the check on the traffic report."""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..passes.common.predicates import collective_group, is_token_exchange_op, token_exchange_numel
from .traffic import (ALL_TO_ALL, KIND_OF_COLLECTIVE, KINDS, TP_PREFIX, dtype_name,
                      tensor_parallel_kind)

_c10d = torch.ops._c10d_functional


class CollectiveCounter(TorchDispatchMode):
    """Sums the buffers that functional collectives move while the mode is active.

    In the units of the traffic report (see [Note: counting traffic] in
    traffic.py). Around a compiled step, use ``step.counting_collectives()``
    (dynamo runs no compiled code under a dispatch mode entered outside it);
    around eager code, ``with CollectiveCounter() as counted:``.
    """

    def __init__(self, tensor_parallel_group: Callable[[], str] = lambda: ""):
        """``tensor_parallel_group()``: the "tp" group's name ("" for none; asked as each
        collective runs, since a step's first call makes its groups); what runs on it
        counts as the ``tp_`` kinds, apart from ZeRO's ([Note: counting traffic])."""
        super().__init__()  # all_to_all (expert parallelism) appears once one runs
        self.tensor_parallel_group = tensor_parallel_group
        self.numel: Counter = Counter({kind: 0 for kind in KINDS})
        self.bytes: Counter = Counter({kind: 0 for kind in KINDS})
        self.launches: Counter = Counter({kind: 0 for kind in KINDS})
        self.bytes_by_dtype: Counter = Counter()
        """Bytes per dtype moved ("float32", "uint8" for quantized blocks), all kinds together."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if is_token_exchange_op(func):
            numel = token_exchange_numel(args[0], out)
            self.numel[ALL_TO_ALL] += numel
            self.bytes[ALL_TO_ALL] += numel * args[0].element_size()
            self.bytes_by_dtype[dtype_name(args[0].dtype)] += numel * args[0].element_size()
            self.launches[ALL_TO_ALL] += 1
            return out
        kind = KIND_OF_COLLECTIVE.get(func.overloadpacket)
        if kind is None and func.overloadpacket != _c10d.all_to_all_single:
            return out
        if kind is None:  # a quantized reduction ([Note: reductions as all-to-alls])
            kind = ALL_TO_ALL
        tensor_parallel = self.tensor_parallel_group()
        if tensor_parallel and collective_group((*args, *(kwargs or {}).values())) == tensor_parallel:
            kind = tensor_parallel_kind(func)
        if kind is not None:
            # the whole buffer: what is gathered, what is reduced
            gathers = kind.removeprefix(TP_PREFIX) == "all_gather"
            buffers = tree_leaves(out if gathers else args[0])
            self.numel[kind] += sum(b.numel() for b in buffers)
            self.bytes[kind] += sum(b.numel() * b.element_size() for b in buffers)
            for b in buffers:
                self.bytes_by_dtype[dtype_name(b.dtype)] += b.numel() * b.element_size()
            self.launches[kind] += 1
        return out


