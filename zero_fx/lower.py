"""Lowering: compile the rewritten graph with the backend the user chose."""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from .capture import static_fakes
from .passes.splice import outside_dynamo_tracing


def lower(gm: GraphModule, example_inputs: Sequence[torch.Tensor], backend, *,
          dynamic: bool = False) -> Callable:
    """A callable running ``gm``: "eager" runs it as is; "aot_eager" and "inductor"
    trace it again through AOTAutograd; a callable backend gets it directly.

    [Note: no CSE across phases]
    In stage 3 the forward and the backward gather the same shard with two
    identical functional all-gathers. Common-subexpression elimination would
    merge them into one, keeping the full parameter alive from the forward to
    the end of the backward: AOTAutograd's CSE is switched off while lowering.
    """
    if callable(backend) and not isinstance(backend, str):
        return backend(gm, list(example_inputs))
    if backend == "eager":
        return gm
    if dynamic:
        # [Note: dynamic shapes] in capture.py: in dynamo's own tracing context, on
        # fakes of its fake mode, so what lowering assumes about a size is a guard.
        context = contextlib.nullcontext(list(example_inputs))
    else:
        context = _static_tracing_context(example_inputs)
    with context as fakes, torch._functorch.config.patch(cse=False):
        if backend == "aot_eager":
            from torch._dynamo.backends.debugging import aot_eager

            return aot_eager(gm, fakes)
        if backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, fakes)
    raise ValueError(f"unknown backend {backend!r}")


@contextlib.contextmanager
def _static_tracing_context(example_inputs: Sequence):
    """Outside dynamo's tracing context (the shards are not dynamo's inputs, and its shape
    environment would make their sizes symbols without a source), inside one of our own
    with a shape environment ([Note: the FX graph cache]); yields the inputs as its static
    fakes."""
    with outside_dynamo_tracing():
        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
        fakes = static_fakes(example_inputs, fake_mode)
        with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
            yield fakes
