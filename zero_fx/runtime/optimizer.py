"""Rebinding the user's optimizer to parameter shards, and which rule updates each parameter.

[Note: update rules]
An optimizer updates a parameter by one of two rules here:

- "flat": each element's update reads only that element's gradient, state and
  hyperparameters (SGD, Adam, AdamW, ...: ``ELEMENTWISE``, or any optimizer declared so with
  ``elementwise_optimizer=True``). Every rank steps its flat 1/N shard of the parameter, which
  equals stepping the whole tensor and slicing;
- "whole": anything else (Muon, Adafactor, LAMB, Shampoo, an optimizer of your own). Its update
  reads the whole tensor (a norm, a factorisation, an orthogonalisation), so it runs once, on
  one rank, the parameter's owner, on the whole tensor ([Note: whole-tensor updates on owner
  ranks] in whole_tensor_updates.py). Stage 0 holds every tensor whole on every rank and steps
  them as DDP does.

Nothing falls back silently: an optimizer that cannot run either way (LBFGS's closure,
SparseAdam's sparse gradients) is refused, and a parameter Muon would refuse is named.
``explain()`` lists each parameter's rule and owner.
"""

from __future__ import annotations

import collections
from typing import Mapping, Optional, Sequence

import torch

from ..plan.owners import NEWTON_SCHULZ_STEPS, ParameterUpdate, element_cost, newton_schulz_cost

# Optimizers whose update of each element reads only that element's gradient,
# state and hyper-parameters, so stepping on a flat shard equals stepping on
# the full tensor and slicing.
ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.ASGD,
    torch.optim.Rprop,
)

FLAT = "flat"
"""The update rule of an elementwise optimizer: every rank steps its flat shard."""
WHOLE = "whole"
"""The update rule of any other: the owner steps the whole tensor."""

# Why the optimizers that neither rule can run are refused.
REFUSED = {
    "LBFGS": "it needs a closure and runs a line search over the whole parameter vector, "
    "re-evaluating the loss inside opt.step()",
    "SparseAdam": "it needs sparse gradients, and the reduced gradients are dense",
}

MATRICES_ONLY = ("Muon",)
"""Optimizers (by class name, subclasses included) that update 2-D parameters only."""


def update_rule(optimizer: torch.optim.Optimizer, declared: Optional[bool]) -> str:
    """``FLAT`` or ``WHOLE`` for the parameters of ``optimizer`` ([Note: update rules]); raises
    for an optimizer neither can run. ``declared``: ``elementwise_optimizer``."""
    name = type(optimizer).__name__
    if name in REFUSED:
        raise TypeError(f"zero_fx cannot run {name}: {REFUSED[name]}. Any other torch.optim "
                        f"optimizer works (an elementwise one on shards, any other whole on an "
                        f"owner rank)")
    if isinstance(optimizer, ELEMENTWISE) or declared:
        return FLAT
    return WHOLE


def rule_reason(optimizer: torch.optim.Optimizer, rule: str, declared: Optional[bool]) -> str:
    """Why ``optimizer``'s parameters take ``rule`` (``explain()``'s table)."""
    name = type(optimizer).__name__
    if rule == FLAT:
        return (f"{name} is elementwise" if isinstance(optimizer, ELEMENTWISE)
                else f"{name} declared elementwise (elementwise_optimizer=True)")
    return f"{name} is not known to be elementwise: it may read the whole tensor"


def check_shapes(optimizer: torch.optim.Optimizer, name_of: Mapping[int, str]) -> None:
    """Raise, naming the parameter, where ``optimizer`` holds one it cannot update: Muon a
    parameter that is not 2-D (as ``torch.optim.Muon`` raises at construction, which
    ``add_param_group`` skips). ``name_of``: ``{id(param): name}``."""
    if not any(cls.__name__ in MATRICES_ONLY for cls in type(optimizer).__mro__):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.ndim != 2:
                raise ValueError(
                    f"{type(optimizer).__name__} updates 2-D parameters only, and it was given "
                    f"{name_of.get(id(p), 'a tensor')!r} of shape {tuple(p.shape)}. Give it the "
                    f"hidden weight matrices, and the embeddings, head, norms and biases to a "
                    f"second optimizer (AdamW), as torch.optim.Muon's documentation does")


def update_cost(optimizer: torch.optim.Optimizer, group: dict, shape: tuple[int, ...]) -> float:
    """The work of one whole-tensor update of a parameter of ``shape``, the weight its owner's
    load counts it with: for Muon, its Newton-Schulz iterations' multiply-adds,
    ``ns_steps * s^2 * (2l + s)`` for a matrix of sides ``s <= l``; for any other, its
    elements."""
    if any(cls.__name__ in MATRICES_ONLY for cls in type(optimizer).__mro__) and len(shape) == 2:
        return newton_schulz_cost(shape, group.get("ns_steps", NEWTON_SCHULZ_STEPS))
    return element_cost(shape)


def whole_tensor_costs(optimizer: torch.optim.Optimizer, name_of: Mapping[int, str],
                       declared: Optional[bool]) -> dict[str, float]:
    """``{name: update cost}`` of the parameters ``optimizer`` steps by the ``WHOLE`` rule
    (none for an elementwise one). ``name_of``: ``{id(param): name}``."""
    if update_rule(optimizer, declared) == FLAT:
        return {}
    return {name_of[id(p)]: update_cost(optimizer, group, tuple(p.shape))
            for group in optimizer.param_groups for p in group["params"] if id(p) in name_of}


def parameter_updates(optimizers: Sequence[torch.optim.Optimizer], named: Sequence[tuple],
                      plan, declared: Optional[bool]) -> tuple[ParameterUpdate, ...]:
    """Each parameter's update rule, where it runs and why (``explain()``'s table); ``named``:
    the model's ``(name, parameter)`` pairs, ``plan``: with its owners chosen."""
    held = {}
    for index, optimizer in enumerate(optimizers):
        label = type(optimizer).__name__ + (f" ({index + 1} of {len(optimizers)})"
                                            if len(optimizers) > 1 else "")
        for group in optimizer.param_groups:
            for p in group["params"]:
                held[id(p)] = (optimizer, group, label)
    rows = []
    for name, param in named:
        if id(param) not in held:
            rows.append(ParameterUpdate(name, "", "none", None, "no optimizer holds it"))
            continue
        optimizer, group, label = held[id(param)]
        rule = update_rule(optimizer, declared)
        reason = rule_reason(optimizer, rule, declared)
        cost = update_cost(optimizer, group, tuple(param.shape)) if rule == WHOLE else 0.0
        if rule == WHOLE and plan.replicated:
            rows.append(ParameterUpdate(name, label, "whole, every rank", None,
                                        reason + "; stage 0 holds it whole on every rank", cost))
        elif rule == WHOLE:
            rows.append(ParameterUpdate(name, label, WHOLE, plan.owner_of(name), reason, cost))
        else:
            rows.append(ParameterUpdate(name, label, FLAT, None, reason))
    return tuple(rows)


def rebind_to_shards(
    optimizer: torch.optim.Optimizer,
    shard_of: Mapping[torch.nn.Parameter, torch.nn.Parameter],
    shard_like,
    stateless: frozenset = frozenset(),
) -> None:
    """Make ``optimizer`` step on shards instead of full parameters.

    ``shard_of`` maps each full parameter to what the optimizer steps instead (its flat shard,
    or for a whole-tensor update its owner's tensor); ``shard_like(param, tensor)`` cuts a
    parameter-shaped state tensor the same way. State that already exists (a resumed
    optimizer) is cut along with its parameter.
    """
    for group in optimizer.param_groups:
        group["params"] = [shard_of[p] for p in group["params"]]
    old_state = optimizer.state
    new_state = collections.defaultdict(dict)  # what torch.optim.Optimizer uses
    for param, state in old_state.items():
        if param in stateless:
            continue
        new_state[shard_of[param]] = {
            key: shard_like(param, value)
            if isinstance(value, torch.Tensor) and value.shape == param.shape and value.ndim > 0
            else value
            for key, value in state.items()
        }
    optimizer.state = new_state
