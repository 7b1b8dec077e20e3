"""The step's optimizer calls, as dynamo traces them: checked before anything compiles.

[Note: checking the step's calls before compiling]
Inside the step, ``opt.step()`` and ``opt.zero_grad()`` only record that they ran
(runtime/deferred_optimizer.py); dynamo replays that record after the compiled graph
has run, which is after the whole first compilation. So each recorder also notes the
call at trace time with ``comptime`` (its function runs while dynamo traces, not at
run time), and the backend checks the notes first, before capture, our passes, or
Inductor/aot_eager start. A trace that dynamo restarts starts the notes over
(``trace_started``). The functions ``comptime`` runs may not close over anything, so
the notes live in this module: dynamo traces one frame at a time.
"""

from __future__ import annotations

from torch._dynamo.comptime import comptime

from .step_graph import CaptureError

_traced: list[str] = []
"""The optimizer calls of the trace under way, in order."""


def _start(ctx) -> None:
    _traced.clear()


def _step(ctx) -> None:
    _traced.append("step")


def _zero_grad(ctx) -> None:
    _traced.append("zero_grad")


def _scheduler(ctx) -> None:
    _traced.append("scheduler")


def _reads_gradients(ctx) -> None:
    _traced.append("reads gradients")


def traced_calls() -> list[str]:
    """The notes of the latest trace: "step", "zero_grad", "scheduler" (a scheduler's
    ``step()``) and "reads gradients" (a clip, or a GradScaler's ``unscale_``/``step``), in
    order."""
    return list(_traced)


def trace_started() -> None:
    """Call first in the traced step: the notes start over."""
    comptime(_start)


def traced_step() -> None:
    """Call from the recorder of ``opt.step()``."""
    comptime(_step)


def traced_zero_grad() -> None:
    """Call from the recorder of ``opt.zero_grad()``."""
    comptime(_zero_grad)


def traced_scheduler() -> None:
    """Call from the recorder of a scheduler's ``step()``."""
    comptime(_scheduler)


def traced_gradient_reader() -> None:
    """Call from the recorders of the companions that read the gradients (clips, a
    GradScaler's ``unscale_`` and ``step``): the update must follow them."""
    comptime(_reads_gradients)


def check_step_calls(calls=None) -> None:
    """Raise ``CaptureError`` unless the step calls ``opt.step()`` once and ``opt.zero_grad()``.

    ``calls``: the recorded calls; default the notes of the trace under way (nothing is
    compiled yet, and the error says so)."""
    before_compiling = calls is None
    calls = _traced if before_compiling else calls
    done = " Nothing was compiled." if before_compiling else ""
    steps = calls.count("step")
    if steps != 1:
        raise CaptureError(
            f"the step calls opt.step() {steps} times; zero_fx needs exactly one call per step "
            + ("(the optimizer's update runs after the compiled graph, on the shards): add "
               "opt.step() after loss.backward()" if steps == 0 else
               "(the optimizer's update runs once, after the compiled graph, on the shards): "
               "keep one (to step every K calls, use zero_compile(accumulation_steps=K))")
            + "." + done)
    if "zero_grad" not in calls:
        raise CaptureError(
            "the step never calls opt.zero_grad(); call it after opt.step() (to accumulate "
            "gradients over several calls, use zero_compile(accumulation_steps=K))." + done)
