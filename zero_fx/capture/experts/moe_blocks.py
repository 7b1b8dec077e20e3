"""Which modules are mixture-of-experts blocks, read from their structure alone, and the
records of one rewritten: recognition for [Note: routed experts with fixed shapes] in
routed_experts.py. Reads no tensor values: works on the meta device and on fake tensors."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

TOP_K_NAMES = ("top_k", "num_experts_per_tok")


@dataclasses.dataclass(frozen=True)
class RoutedExperts:
    """One mixture-of-experts block zero_fx rewrote (``step.moe_blocks``, ``explain()``)."""

    name: str
    """The block's module name."""
    experts: str
    """The module name of its list of routed experts (their parameters start with it)."""
    num_experts: int
    top_k: int
    routing: str
    """How the block routes, in words (for example "softmax, top-2, renormalised")."""
    expert_parameters: int
    """Elements of all routed experts' parameters."""
    shared_expert: Optional[str]
    """The shared expert's module name, if the block has one."""
    identity_experts: int = 0
    """``nn.Identity`` experts after the ``num_experts`` routed ones (LongCat-Flash's
    "zero-computation experts"): a row routed to one passes through as it is."""
    stacked: bool = False
    """The experts are one module holding them as 3-D parameters (``name`` and ``experts``
    are that module's), called by its block with the routing ([Note: fused experts that
    loop] in fused_experts.py); listed only for expert parallelism, which splits their rows."""


@dataclasses.dataclass(frozen=True)
class MoeShape:
    """What a block shaped like a mixture of experts holds (``moe_shape``)."""

    experts: str
    """The child ``nn.ModuleList`` of experts."""
    router: str
    num_experts: int
    top_k: Optional[int]
    shared_expert: Optional[str]


def moe_shape(block: nn.Module) -> Optional[MoeShape]:
    """The parts of ``block`` if it is shaped like a mixture of experts (the note), else None.
    Reads only structure: works on the meta device and on fake tensors."""
    parts = _moe_parts(block)
    if parts is None:
        return None
    experts, router = (getattr(block, name) for name in parts)
    return MoeShape(parts[0], parts[1], routed_count(experts), _top_k(block, router),
                    shared_expert_name(block))


def routed_expert_modules(model: nn.Module) -> tuple[str, ...]:
    """The names of ``model``'s routed experts' modules (a block's expert list, or its
    experts held as 3-D parameters), as the rewrite recognises them; structure only."""
    from .fused_experts import holds_stacked_experts

    names = []
    for path, module in model.named_modules():
        moe = moe_shape(module)
        if moe is not None:
            names.append(f"{path}.{moe.experts}" if path else moe.experts)
        elif holds_stacked_experts(module) and path:
            names.append(path)
    return tuple(names)


@dataclasses.dataclass(frozen=True)
class LocalExperts:
    """Expert parallelism for one block: this rank runs experts ``first`` to ``first + E /
    degree`` and exchanges tokens with the ``degree`` ranks of ``group_name``."""

    degree: int
    first: int
    group_name: str
    capacity_factor: Optional[float] = None
    """Rows each expert takes, as a multiple of an even spread's ([Note: expert capacity]
    in expert_exchange.py); None: every row."""


# -- recognition ----------------------------------------------------------------------------

def _moe_parts(block: nn.Module) -> Optional[tuple[str, str]]:
    """(experts child, router child) of a block shaped like a mixture of experts, else None."""
    for experts_name, experts in block.named_children():
        if not (isinstance(experts, nn.ModuleList) and (routed := routed_count(experts)) >= 2
                and _same_structure(experts[:routed])):
            continue
        for router_name, router in block.named_children():
            if router is not experts and _routes_over(router, len(experts)):
                return experts_name, router_name
    return None


def routed_count(experts: nn.ModuleList) -> int:
    """The experts before the trailing ``nn.Identity`` ones (all of them, usually)."""
    count = len(experts)
    while count and isinstance(experts[count - 1], nn.Identity):
        count -= 1
    return count


def _same_structure(modules) -> bool:
    shapes = [[(n, p.shape) for n, p in m.named_parameters()] for m in modules]
    return bool(shapes[0]) and all(s == shapes[0] for s in shapes)


def tensor_without_running(module: nn.Module, name: str) -> Optional[torch.Tensor]:
    """``module``'s tensor attribute ``name`` as recognition reads it, without running code.

    [Note: recognition runs no parametrization]
    Reading a parametrized attribute (``spectral_norm``'s ``weight``) runs its
    parametrization, and spectral norm's, in training mode, takes a step of its power
    iteration and writes its buffers ``_u`` and ``_v`` in place: one more step than eager
    takes, before the first call's graph has run. So structure is read from what the
    module holds: a parametrized attribute is its ``original`` (the tensor the
    parametrization is applied to, of the same shape for spectral norm and orthogonal
    maps), or None where it has several (weight norm's ``original0`` and ``original1``)."""
    from torch.nn.utils import parametrize

    if parametrize.is_parametrized(module, name):
        return getattr(module.parametrizations[name], "original", None)
    value = getattr(module, name, None)
    return value if isinstance(value, torch.Tensor) else None


def _routes_over(router: nn.Module, num_experts: int) -> bool:
    """An nn.Linear of one output per expert, a module with such a ``weight``, or a module
    whose scoring layer is one (LongCat-Flash's ``router.classifier``)."""
    if isinstance(router, nn.Linear):
        return router.out_features == num_experts
    weight = tensor_without_running(router, "weight")  # [Note: recognition runs no parametrization]
    if isinstance(weight, torch.Tensor):
        return weight.dim() == 2 and weight.shape[0] == num_experts
    return any(isinstance(c, nn.Linear) and c.out_features == num_experts
               for c in router.children())


def _top_k(block: nn.Module, router: nn.Module) -> Optional[int]:
    for owner in (block, router):
        for attr in TOP_K_NAMES:
            value = getattr(owner, attr, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def shared_expert_name(block: nn.Module) -> Optional[str]:
    for name in ("shared_expert", "shared_experts"):
        if isinstance(getattr(block, name, None), nn.Module):
            return name
    return None
