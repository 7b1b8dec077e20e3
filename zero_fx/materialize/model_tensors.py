"""The model's parameters and buffers as unique tensors, each with every place it is registered."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn


@dataclass(frozen=True)
class Slot:
    """One place a tensor is registered: ``getattr(module, kind)[attr]``."""

    module: nn.Module
    kind: str
    """``"_parameters"`` or ``"_buffers"``."""
    attr: str
    name: str
    """Its full name in the model (``blocks.0.attn.qkv.weight``)."""

    def get(self) -> torch.Tensor:
        return getattr(self.module, self.kind)[self.attr]

    def set(self, tensor: torch.Tensor) -> None:
        getattr(self.module, self.kind)[self.attr] = tensor


@dataclass
class ModelTensor:
    """A parameter or buffer; tied ones (one tensor under several names) appear once."""

    tensor: torch.Tensor
    slots: list[Slot] = field(default_factory=list)
    """Where it is registered, in ``named_modules()`` order: the first is its owner."""

    @property
    def name(self) -> str:
        """Its first name: the one ``named_parameters()`` and the shard plan use."""
        return self.slots[0].name

    @property
    def names(self) -> list[str]:
        return [slot.name for slot in self.slots]

    @property
    def is_param(self) -> bool:
        return self.slots[0].kind == "_parameters"

    @property
    def persistent(self) -> bool:
        """In ``state_dict()`` (parameters, and buffers not registered with persistent=False)."""
        slot = self.slots[0]
        return self.is_param or slot.attr not in slot.module._non_persistent_buffers_set

    @property
    def is_meta(self) -> bool:
        return self.tensor.device.type == "meta"


def model_tensors(model: nn.Module) -> list[ModelTensor]:
    """Every parameter and buffer of ``model``, once each, in ``named_modules()`` order."""
    found: dict[int, ModelTensor] = {}
    for path, module in model.named_modules():
        for kind in ("_parameters", "_buffers"):
            for attr, tensor in getattr(module, kind).items():
                if tensor is None:
                    continue
                entry = found.setdefault(id(tensor), ModelTensor(tensor))
                entry.slots.append(Slot(module, kind, attr, f"{path}.{attr}" if path else attr))
    return list(found.values())


def own_slots(module: nn.Module, by_id: dict[int, ModelTensor]) -> list[tuple[Slot, ModelTensor]]:
    """The parameters and buffers registered on ``module`` itself (not its children)."""
    slots = []
    for kind in ("_parameters", "_buffers"):
        for attr, tensor in getattr(module, kind).items():
            if tensor is not None:
                entry = by_id[id(tensor)]
                slots.append((next(s for s in entry.slots if s.module is module and s.attr == attr
                                   and s.kind == kind), entry))
    return slots
