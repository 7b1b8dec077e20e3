"""Lowering: compile the rewritten graph with the backend the user chose."""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Collection, NamedTuple, Optional, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule
from torch.fx._lazy_graph_module import _make_graph_module
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ..capture.step_graph import static_fakes
from ..passes.common.predicates import tensor_parallel_groups
from ..passes.common.splice import outside_dynamo_tracing
from .lowered_memory import LoweredMemory, lowered_memory
from .lowered_schedule import (OrderCheck, inductor_keeps_as_kernel, lowered_schedule, order_as_graph,
                               planned_schedule)
from ..base.compat import one_post_grad_pass
from .pin_schedule import PinSchedule, tag_schedule
from .regions import RegionReport, compile_regions
from .realize_readers import StoreReleasedReaders, tag_released_gathers


REGIONAL_BACKENDS = ("eager", "aot_eager", "inductor")
"""The backends that can run a step by regions (``zero_compile(regional=True)``); "eager"
runs each body as traced, compiling nothing."""


def by_regions(backend, regional: bool, dynamic: bool) -> bool:
    """Whether ``lower`` compiles by regions: asked to, with static shapes, by a backend
    that can ([Note: regional compilation] in regions.py)."""
    return regional and not dynamic and isinstance(backend, str) and backend in REGIONAL_BACKENDS


class Lowered(NamedTuple):
    run: Callable
    order: OrderCheck
    """Whether ``run`` keeps the graph's collective schedule ([Note: pinning the schedule
    through Inductor] in pin_schedule.py)."""
    memory: Optional[LoweredMemory] = None
    """The buffers of Inductor's generated program over its statements; None for the
    other backends, which free what the graph frees ([Note: reading buffer lifetimes from
    generated code] in lowered_memory.py)."""
    program: str = ""
    """Inductor's generated Python wrapper (what ``TORCH_LOGS=output_code`` prints); empty for
    the other backends."""
    regions: Optional[RegionReport] = None
    """The compiled bodies and where they run, when the step compiled by regions
    ([Note: regional compilation] in regions.py)."""


def lower(gm: GraphModule, example_inputs: Sequence[torch.Tensor], backend, *,
          dynamic: bool = False, pin_schedule: bool = True,
          resident: Collection[str] = (), regional: bool = False) -> Lowered:
    """``gm`` made runnable: "eager" runs it as is; "aot_eager" and "inductor" trace it again
    through AOTAutograd; a callable backend gets it directly. Under Inductor, with
    ``pin_schedule``, control dependencies keep our collective schedule, and the order
    of its generated program is read back and compared with the graph's; what reads a
    gathered parameter that is not in ``resident`` is stored ([Note: a released gather's
    readers are stored] in realize_readers.py).

    [Note: no CSE across phases]
    In stage 3 the forward and the backward gather the same shard with two
    identical functional all-gathers. Common-subexpression elimination would
    merge them into one, keeping the full parameter alive from the forward to
    the end of the backward: AOTAutograd's CSE is switched off while lowering.

    With ``regional`` (and static shapes), "aot_eager" and "inductor" compile each
    distinct run of compute between collectives once and run the graph itself as
    Python ([Note: regional compilation] in regions.py); ``pin_schedule`` is then moot.
    "eager" by regions runs the same outer graph with each body as traced: the same ops in
    the same order as the whole graph, without AOTAutograd's second trace of each body (the
    quickest start, and what most of the test suite runs).
    """
    if callable(backend) and not isinstance(backend, str):
        return Lowered(backend(gm, list(example_inputs)), order_as_graph(
            getattr(backend, "__name__", "the backend"), gm,
            "a custom backend compiled the graph: its order is not checked"))
    if by_regions(backend, regional, dynamic):
        return _regional(gm, backend)
    if backend == "eager":
        return Lowered(gm, order_as_graph("eager", gm, "eager runs the graph's own order"))
    if dynamic:
        # [Note: dynamic shapes] in capture/step_graph.py: in dynamo's own tracing context, on
        # fakes of its fake mode, so what lowering assumes about a size is a guard.
        context = contextlib.nullcontext(list(example_inputs))
    else:
        context = _static_tracing_context(example_inputs)
    with context as fakes, torch._functorch.config.patch(cse=False):
        if backend == "aot_eager":
            from torch._dynamo.backends.debugging import aot_eager

            return Lowered(aot_eager(gm, fakes), order_as_graph(
                "aot_eager", gm, "aot_eager runs the graph op by op, in its own order"))
        if backend == "inductor":
            return _inductor(gm, fakes, pin_schedule, resident)
    raise ValueError(f"unknown backend {backend!r}")


def _inductor(gm: GraphModule, fakes, pin_schedule: bool, resident: Collection[str]) -> Lowered:
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    planned = planned_schedule(gm, inductor_keeps_as_kernel)
    sources: list[str] = []

    def keeping_source(*args, **kwargs):
        compiled = compile_fx_inner(*args, **kwargs)
        sources.append(getattr(compiled, "source_code", "") or "")
        return compiled

    tag_released_gathers(gm, resident)
    ours = [StoreReleasedReaders()]  # before the pin wraps matmuls in control_deps
    if pin_schedule:
        tag_schedule(gm)
        ours.append(PinSchedule())
    # the user's passes, then ours, as one pass: [Note: Inductor's post-grad pre-pass]
    patches = {"post_grad_custom_pre_pass": one_post_grad_pass(config.post_grad_custom_pre_pass,
                                                               ours)}
    # AOTAutograd's own cache, on a hit, skips inner_compile (no source to read); with it
    # off, Inductor's FX graph cache still hits and its compiled graph carries the source.
    with config.patch(patches), torch._functorch.config.patch(enable_autograd_cache=False):
        run = compile_fx(gm, fakes, inner_compile=keeping_source)
    program = sources[0] if len(sources) == 1 else ""  # both readers return None for ""
    lowered = lowered_schedule(program, tensor_parallel_groups(gm))
    note = "" if lowered is not None else (
        f"Inductor produced {len(sources)} programs, not one: the order is not checked"
        if len(sources) != 1 else "Inductor's C++ wrapper is not read: the order is not checked")
    return Lowered(run, OrderCheck("Inductor", planned, lowered, note), lowered_memory(program),
                   program)


def _regional(gm: GraphModule, backend: str) -> Lowered:
    """A copy of ``gm`` whose runs of compute call their compiled bodies."""
    copy = torch.fx.Graph()
    copy.output(copy.graph_copy(gm.graph, {}))
    # lazy: [Note: graph modules that generate their code when it is used] in backend.py
    outer, report = compile_regions(_make_graph_module(gm, copy),
                                    functools.partial(_compile_body, backend))
    return Lowered(outer, order_as_graph(
        f"{backend} by regions", gm,
        f"the step's own graph runs as Python and issues and waits for every collective in its "
        f"order; its {report.calls} runs of compute call {len(report.regions)} compiled bodies, "
        f"which hold no collective"), regions=report)


def _compile_body(backend: str, body: GraphModule, values: Sequence[torch.Tensor]):
    """One region's body compiled with ``backend``, on static fakes shaped like ``values``
    ("eager": the body as traced)."""
    if backend == "eager":
        return body
    with _static_tracing_context(values) as fakes, torch._functorch.config.patch(cse=False):
        if backend == "aot_eager":
            from torch._dynamo.backends.debugging import aot_eager

            return aot_eager(body, fakes)
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(body, fakes)


@contextlib.contextmanager
def _static_tracing_context(example_inputs: Sequence):
    """Outside dynamo's tracing context (the shards are not dynamo's inputs, and its shape
    environment would make their sizes symbols without a source), inside one of our own
    with a shape environment; yields the inputs as its static fakes.

    [Note: the FX graph cache]
    Inductor's FX graph cache stores each compiled graph with the guards of the shape
    environment it was compiled under, and bypasses itself when the tracing context has
    none: every compilation of the same rewritten step then paid Inductor's whole lowering
    again. So lowering runs in a tracing context of our own, with a ``ShapeEnv``, on static
    fakes of the inputs (sizes are constants: no symbol without a source). The second
    compilation of the same step is a cache hit, with the user's passes in the pipeline too
    (tests/test_fx_graph_cache.py)."""
    with outside_dynamo_tracing():
        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
        fakes = static_fakes(example_inputs, fake_mode)  # from real tensors or other fakes
        with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
            yield fakes
