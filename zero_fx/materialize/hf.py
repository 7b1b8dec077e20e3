"""HuggingFace ``transformers`` models: their ``post_init`` initialization, and their computed buffers.

Imports nothing from ``transformers`` unless the model is one of its models
(``transformers`` is then imported already).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator

import torch
import torch.nn as nn


def _pretrained_model_class():
    transformers = sys.modules.get("transformers")
    return getattr(transformers, "PreTrainedModel", None) if transformers is not None else None


def is_pretrained_model(module: nn.Module) -> bool:
    cls = _pretrained_model_class()
    return cls is not None and isinstance(module, cls)


def post_init_visits(model: nn.Module, initialized: set[int]
                     ) -> Iterator[tuple[nn.Module, Callable[[nn.Module], None], str]]:
    """What ``model.post_init()`` runs: ``PreTrainedModel.initialize_weights``'s
    ``smart_apply`` (children first; a nested ``PreTrainedModel``'s subtree with its own
    ``_init_weights``), skipping modules an earlier ``post_init`` initialized (HuggingFace
    marks them ``_is_hf_initialized``; on a meta model every module is marked already, so
    the set of initialized modules is kept here)."""
    def visit(module: nn.Module, owner: nn.Module):
        for child in module.children():
            yield from visit(child, child if is_pretrained_model(child) else owner)
        if id(module) not in initialized:
            initialized.add(id(module))
            yield module, owner._init_weights, f"{type(owner).__name__}._init_weights"

    yield from visit(model, model)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Build modules with their parameters on the meta device and their buffers computed
    (accelerate's ``init_empty_weights(include_buffers=False)``): each parameter is moved
    to meta as it is registered, so at most one is ever allocated."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            kept = module._parameters[name]
            module._parameters[name] = type(kept)(kept.to("meta"), requires_grad=kept.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def computed_buffers(model: nn.Module, names: list[str], device: torch.device) -> dict[str, torch.Tensor]:
    """Values for buffers ``model`` (a HuggingFace model built on meta) computes in its
    ``__init__`` (rotary ``inv_freq``, causal masks): the model is built again from its
    config with parameters on meta, buffers computed, on the CPU and without touching the
    random generator; its buffers of those names are returned, on ``device``."""
    with torch.random.fork_rng(devices=[]), torch.device("cpu"), _parameters_on_meta():
        fresh = type(model)(model.config)
    buffers = dict(fresh.named_buffers(remove_duplicate=False))
    return {name: buffers[name].to(device) for name in names if name in buffers}
