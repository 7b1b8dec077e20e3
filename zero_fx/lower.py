"""Lowering: compile the rewritten graph with the backend the user chose."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule
from torch.fx.experimental.symbolic_shapes import ShapeEnv

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
        return _lower_dynamic(gm, example_inputs, backend)
    # Outside dynamo's tracing context: the shards are not dynamo's inputs, and
    # its shape environment would make their sizes symbols without a source.
    with outside_dynamo_tracing(), torch._functorch.config.patch(cse=False):
        if backend == "aot_eager":
            from torch._dynamo.backends.debugging import aot_eager

            return aot_eager(gm, list(example_inputs))
        if backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            fake_mode = FakeTensorMode(shape_env=ShapeEnv())
            fakes = [fake_mode.from_tensor(t, static_shapes=True) if isinstance(t, torch.Tensor)
                     else t for t in example_inputs]
            with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
                return compile_fx(gm, fakes)
    raise ValueError(f"unknown backend {backend!r}")



def _lower_dynamic(gm: GraphModule, example_inputs: Sequence, backend) -> Callable:
    """A graph with symbolic sizes: lowered in dynamo's own tracing context, on fakes of
    dynamo's fake mode (``fakes_like_dynamo``: shards static, the step's inputs as dynamo
    traced them), so that
    whatever lowering assumes about a size is a guard dynamo checks ([Note: dynamic shapes]
    in capture.py)."""
    fakes = list(example_inputs)
    with torch._functorch.config.patch(cse=False):
        if backend == "aot_eager":
            from torch._dynamo.backends.debugging import aot_eager

            return aot_eager(gm, fakes)
        if backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, fakes)
    raise ValueError(f"unknown backend {backend!r}")
