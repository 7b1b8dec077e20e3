"""Rebinding the user's optimizer to parameter shards, and who may be rebound."""

from __future__ import annotations

import collections
from typing import Mapping, Optional

import torch

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

# Why the optimizers we know to be unsafe cannot step on shards.
NOT_ELEMENTWISE = {
    "LBFGS": "it needs a closure and runs a line search over the whole parameter vector",
    "SparseAdam": "it needs sparse gradients, and sharded gradients are dense",
    "Adafactor": "it factors the second moment over rows and columns of each full matrix, "
    "which a flat shard does not have",
    "Muon": "it orthogonalises each full weight matrix, which a flat shard does not have",
}


def check_elementwise(optimizer: torch.optim.Optimizer, declared: Optional[bool]) -> None:
    """Raise unless ``optimizer`` can step on flat 1-D shards of its parameters."""
    name = type(optimizer).__name__
    if name in NOT_ELEMENTWISE:
        raise TypeError(
            f"zero_fx cannot shard {name}: {NOT_ELEMENTWISE[name]}. zero_fx steps the optimizer "
            "on flat slices of each parameter, so it needs an elementwise optimizer "
            "(SGD, Adam, AdamW, ...)."
        )
    if isinstance(optimizer, ELEMENTWISE) or declared:
        return
    raise TypeError(
        f"zero_fx does not know whether {name} is elementwise. It steps the optimizer on flat "
        "slices of each parameter, which is only correct when each element's update reads "
        f"only that element. If {name} is elementwise, pass "
        "zero_compile(..., elementwise_optimizer=True); known ones: "
        + ", ".join(cls.__name__ for cls in ELEMENTWISE)
    )


def rebind_to_shards(
    optimizer: torch.optim.Optimizer,
    shard_of: Mapping[torch.nn.Parameter, torch.nn.Parameter],
    shard_like,
) -> None:
    """Make ``optimizer`` step on shards instead of full parameters.

    ``shard_of`` maps each full parameter to its shard; ``shard_like(param,
    tensor)`` cuts a parameter-shaped state tensor the same way. State that
    already exists (a resumed optimizer) is sharded along with its parameter.
    """
    for group in optimizer.param_groups:
        group["params"] = [shard_of[p] for p in group["params"]]
    old_state = optimizer.state
    new_state = collections.defaultdict(dict)  # what torch.optim.Optimizer uses
    for param, state in old_state.items():
        new_state[shard_of[param]] = {
            key: shard_like(param, value)
            if isinstance(value, torch.Tensor) and value.shape == param.shape and value.ndim > 0
            else value
            for key, value in state.items()
        }
    optimizer.state = new_state
