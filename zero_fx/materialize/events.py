"""The initialization a model's construction ran, as a list of events to replay on the meta model.

[Note: replaying construction]
``Model(cfg)`` initializes its parameters while it is built, drawing from the
random generator in a fixed order; seeded the same way, materializing a meta
model must draw the same numbers into the same tensors. zero_fx cannot see a
construction that already happened on the meta device, so it replays a model
of it, derived from the module tree (``construction_events``):

1. Modules are built children first, in registration order, which is the order
   their ``__init__`` ran in for ordinary code (``named_modules()`` order for the
   leaves). A module with parameters or buffers of its own and a
   ``reset_parameters()`` ran it at the end of its ``__init__``, as every
   ``torch.nn`` layer does: that is one event, at the module's exit of the walk.
2. The model-level initialization that code runs after its modules exist:
   - ``init_fn`` (``zero_compile(init_fn=...)``), applied like
     ``model.apply(init_fn)`` at the end of the root's construction (nanoGPT's
     ``self.apply(self._init_weights)``): one event per module, children first.
   - HuggingFace models without ``init_fn``: each ``PreTrainedModel`` in the tree
     runs ``post_init()`` at the end of its own ``__init__``, which applies its
     ``_init_weights`` to the modules of its subtree not initialized yet (so a
     ``LlamaModel`` inside ``LlamaForCausalLM`` is initialized before the
     ``lm_head`` is even built). ``hf.post_init_events`` replays exactly that.

An event writes only tensors registered on its own module (``replay.py``
refuses anything else: a write to another module's tensor would land on a meta
tensor and be lost). Tied tensors (``lm_head.weight is wte.weight``): when
``reset_parameters()`` and HuggingFace's ``post_init`` ran, the tie did not
exist yet (a module resets the tensor it created; HuggingFace ties output to
input embeddings after initializing), so these events write only the tensor's
first registration and give the later ones a throwaway of the same shape,
drawing the same numbers into it. ``init_fn`` runs on the built model, ties
included, so it writes the tied tensor through every name, as
``model.apply`` would. How each event's random draws reach its tensors while
only one module is built at a time: [Note: building one module at a time] in
replay.py.

What this cannot reproduce, and says so where it can tell: random draws made
in an ``__init__`` outside ``reset_parameters()`` (HuggingFace's ``Conv1D``)
shift the stream (values are still initialized, by ``init_fn`` or
``_init_weights``, but not equal to a normal build's); a module whose
construction never calls its ``reset_parameters()`` gets an extra draw; a draw
from an explicit ``generator=`` is not tracked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch.nn as nn

from . import hf


@dataclass(frozen=True)
class InitEvent:
    module: nn.Module
    path: str
    """The module's name in the model ("" for the root)."""
    fn: Callable[[nn.Module], None]
    what: str
    """What runs, for messages: ``Linear.reset_parameters()``, ``init_fn``, ..."""
    writes_tied: bool
    """True: it writes a tied tensor through every name (the tie exists when it runs).
    False: only through the tensor's first name; other names get a throwaway."""

    def describe(self) -> str:
        return f"{self.what} on {self.path or 'the model'} ({type(self.module).__name__})"


def construction_events(model: nn.Module,
                        init_fn: Optional[Callable[[nn.Module], None]]) -> list[InitEvent]:
    """The events that building ``model`` normally runs, in order ([Note: replaying construction])."""
    paths = {id(m): path for path, m in model.named_modules()}
    events: list[InitEvent] = []
    initialized: set[int] = set()  # HuggingFace's _is_hf_initialized, tracked here
    seen: set[int] = set()

    def exit_of(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child in module.children():
            exit_of(child)
        reset = getattr(module, "reset_parameters", None)
        if callable(reset) and _has_own_tensors(module):
            events.append(InitEvent(module, paths[id(module)], _call_reset,
                                    f"{type(module).__name__}.reset_parameters()", writes_tied=False))
        if init_fn is None and hf.is_pretrained_model(module):
            events.extend(InitEvent(m, paths[id(m)], fn, what, writes_tied=False)
                          for m, fn, what in hf.post_init_visits(module, initialized))

    exit_of(model)
    if init_fn is not None:
        name = getattr(init_fn, "__name__", "init_fn")
        events.extend(InitEvent(m, paths[id(m)], init_fn, f"init_fn {name}", writes_tied=True)
                      for m in _apply_order(model))
    return events


def _call_reset(module: nn.Module) -> None:
    module.reset_parameters()


def _has_own_tensors(module: nn.Module) -> bool:
    return any(t is not None for t in (*module._parameters.values(), *module._buffers.values()))


def _apply_order(module: nn.Module):
    """The modules ``module.apply(fn)`` calls ``fn`` on, in its order (children first)."""
    for child in module.children():
        yield from _apply_order(child)
    yield module
