"""Which tensors an init event writes, seen on the ops themselves."""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class WriteWatch(TorchDispatchMode):
    """Records in-place writes to the tensors bound for an event (by storage, so a write
    through ``.data``, a view or ``nn.init`` counts), and refuses a write to a meta tensor:
    on a meta model that is another module's unbuilt tensor, and the write would be lost.

    ``bound``: storage identity -> a label; ``written`` collects the labels written.
    ``name_of_meta``: storage identity -> a name, for the refusal's message."""

    def __init__(self, bound: dict[int, object], name_of_meta: Callable[[int], str]):
        super().__init__()
        self.bound = bound
        self.written: set = set()
        self._name_of_meta = name_of_meta

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for tensor in _written_arguments(func, args, kwargs):
            key = tensor.untyped_storage()._cdata
            if key in self.bound:
                self.written.add(self.bound[key])
            elif tensor.device.type == "meta":
                raise ForeignWrite(self._name_of_meta(key), str(func))
        return func(*args, **kwargs)


class ForeignWrite(RuntimeError):
    def __init__(self, name: str, op: str):
        super().__init__(name, op)
        self.name = name
        self.op = op


def _written_arguments(func, args, kwargs):
    schema = func._schema
    for index, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(tensor, torch.Tensor):
                yield tensor
