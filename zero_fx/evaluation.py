"""Evaluation steps: a ``zero_compile`` function that takes the model and no optimizer runs
its forward on the shards of the training step of that model.

[Note: evaluation steps]
An evaluation (or generation) step is the training step's forward without its backward:

    @zero_compile(stage=3)
    def eval_step(model, x, y):
        with torch.no_grad():
            logits = model(x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten()), logits.argmax(-1)

It has no state of its own. The training step that sharded the model registered its
``Sharded`` (plan, shards, update) under the model (``runtime.sharding.sharded_of``); the
evaluation step reads the same shards, so it sees every optimizer step taken so far (an
update still running on the host is waited for first), and is compiled as a training step
is: captured on fakes, rewritten by the same passes for the same plan, lowered. The passes
need no change: a graph without a gradient seed is all forward (``annotate_phases``), so
stage 3 gathers each bucket right before its forward use and frees it after its last one,
as in training, and there is nothing to reduce. It never holds the whole model, unlike
``gathered_parameters()``. Its graph takes the plan's graph inputs (shards at stage 3,
whole parameters at stages 0-2, both in the dtype training reads), so mixed precision
computes in the training's compute dtype.

Its options are the training step's: one plan shards a model. An option the evaluation
step sets itself must equal the training step's, except those that only choose how its own
graph is compiled and inspected (``EVALUATION_OWN_OPTIONS``).

Before the model's training step has run (an evaluation at step 0), nothing is sharded and
every rank holds the whole model, as it was built: the function then runs as written,
eagerly, on the model's own parameters, under ``torch.no_grad()`` (a training step that
closes over its optimizer looks like an evaluation step, and must not train the unsharded
model here: its ``loss.backward()`` raises instead). A model built on the meta device has
no values until its training step's first call initializes them, so there it is refused.

The model's ``train()``/``eval()`` mode is the user's: dynamo guards on it, and each mode
compiles once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
from torch.utils._pytree import tree_leaves

from .capture.step_graph import BACKWARD_WITHOUT_OPTIMIZER, CaptureError
from .config import ZeroConfig
from .runtime.sharding import Sharded, find_model, sharded_of, sharding_owner

EVALUATION_OWN_OPTIONS = ("backend", "regional", "debug", "passes")
"""Options an evaluation step may set to other values than its training step's: how its own
graph is lowered, dumped and rewritten by the user's passes. Every other option is the
training step's."""


def takes_no_optimizer(args: tuple, kwargs: dict, optimizer: Optional[torch.optim.Optimizer]) -> bool:
    """The call is an evaluation step's: no optimizer named to ``zero_compile`` and none among
    the arguments."""
    if optimizer is not None:
        return False
    leaves = tree_leaves((args, kwargs), is_leaf=lambda x: isinstance(
        x, (torch.nn.Module, torch.optim.Optimizer)))
    return not any(isinstance(x, torch.optim.Optimizer) for x in leaves)


def training_sharding(args: tuple, kwargs: dict, model: Optional[torch.nn.Module],
                      step_name: str) -> tuple[torch.nn.Module, Optional[Sharded]]:
    """The evaluation step's model and what its training step set up (None before that step's
    first call, while the model is whole)."""
    model = find_model(args, kwargs, model)
    sharded = sharded_of(model)
    if sharded is not None:
        return model, sharded
    owner = sharding_owner(model)
    if owner is not None:
        raise RuntimeError(
            f"the model of {step_name!r} was sharded by the compiled step {owner!r}, which no "
            f"longer exists, so its shards are gone: keep the training step alive while "
            f"{step_name!r} runs")
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise RuntimeError(
            f"{step_name!r} takes no optimizer, so it evaluates the model on the shards of its "
            f"training step; the model is on the meta device (parameter {meta[0]!r}) and holds "
            f"no values until that step's first call initializes it: call the training step "
            f"(or its load_checkpoint) first")
    return model, None


def run_before_training(fn: Callable, args: tuple, kwargs: dict, step_name: str) -> Any:
    """Before the training step's first call: the model is whole on every rank, as built; the
    function runs as written ([Note: evaluation steps]), without autograd: a training step
    whose optimizer is not among its arguments must not train here, eagerly, unsharded."""
    try:
        with torch.no_grad():
            return fn(*args, **kwargs)
    except RuntimeError as err:
        if "does not require grad" not in str(err):
            raise
        raise CaptureError(BACKWARD_WITHOUT_OPTIMIZER.format(step=step_name)) from err


def evaluation_config(own: ZeroConfig, given: frozenset, sharded: Sharded,
                      step_name: str) -> ZeroConfig:
    """The training step's options, with the evaluation step's own ``EVALUATION_OWN_OPTIONS``
    where it sets them. ``given``: the options it was given as keywords. Raises
    ``ValueError`` for any other option it sets to something else than its training step."""
    training = sharded.config
    default = ZeroConfig()
    changes = {}
    for field in dataclasses.fields(ZeroConfig):
        name = field.name
        value = getattr(own, name)
        was_set = name in given or not _equal(value, getattr(default, name))
        if not was_set:
            continue
        if name in EVALUATION_OWN_OPTIONS:
            changes[name] = value
        elif not _equal(value, getattr(training, name)):
            raise ValueError(
                f"{step_name!r} sets {name}={value!r}, but it runs on the model sharded by "
                f"{sharded.step_name!r}, which has {name}={getattr(training, name)!r}: an "
                f"evaluation step uses its training step's plan and options (it may set only "
                f"{', '.join(EVALUATION_OWN_OPTIONS)}). Drop {name} from {step_name!r} or give "
                f"it the same value")
    return dataclasses.replace(training, **changes) if changes else training


def _equal(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # a value without a plain == (a mesh, a tensor): only identity counts
        return False
