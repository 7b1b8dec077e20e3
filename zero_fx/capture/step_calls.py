"""The step's optimizer calls, as dynamo traces them: checked before anything compiles.

[Note: checking the step's calls before compiling]
Inside the step, ``opt.step()`` and ``opt.zero_grad()`` only record that they ran
(runtime/update/deferred_optimizer.py); dynamo replays that record after the compiled graph
has run, which is after the whole first compilation. So each recorder also notes the
call at trace time with ``comptime`` (its function runs while dynamo traces, not at
run time), and the backend checks the notes first, before capture, our passes, or
Inductor/aot_eager start. A trace that dynamo restarts starts the notes over
(``trace_started``). The functions ``comptime`` runs may not close over anything, so
the notes live in this module: dynamo traces one frame at a time.

[Note: hyperparameters written inside the step]
A step may set its optimizer's hyperparameters itself, as nanoGPT's loop sets the learning
rate (``for g in opt.param_groups: g["lr"] = lr``). Dynamo does not write such a dict while
it runs the graph: it replays the write after the compiled graph has returned. So the
update in the graph, which steps during the graph, would read the groups as the call found
them, and the update after the graph reads them as the call leaves them. Eager's
``opt.step()`` reads them as they are at that line. The notes say which the step does, from
dynamo's own record of what it will replay (``side_effects.is_modified`` of each group's
dict, read through ``comptime``):

- "writes param groups": a group was written before ``opt.step()``. The update runs after
  the graph, where the groups hold what the step wrote (graph_update.py,
  ``why_not_for_capture``);
- "writes param groups after step": the groups were first written after ``opt.step()`` (a
  schedule by hand at the end of the step). The update in the graph reads them before the
  write, as eager does; the update after the graph steps with the groups as the call found
  them (``OptimizerUpdate.apply``) and then leaves them as the step wrote them.

A group written both before and after ``opt.step()`` is seen as the first case: the update
reads what the step left, which is right unless the second write changes a value the step
used. Whatever the step writes, nothing of it is a constant of the graph: the groups are
plain dicts to dynamo ([Note: the optimizer as dynamo reads it] in zero_fx/base/compat.py), read
by torch.optim's own ``step`` when it runs.
"""

from __future__ import annotations

import contextlib

from torch._dynamo.comptime import comptime

from .step_graph import CaptureError

_traced: list[str] = []
"""The optimizer calls of the trace under way, in order."""

WRITES_GROUPS = "writes param groups"
"""The note of a param group written before ``opt.step()`` ([Note: hyperparameters written
inside the step])."""
WRITES_GROUPS_AFTER_STEP = "writes param groups after step"
"""The note of param groups first written after ``opt.step()``."""
ZERO_GRAD_KEEPS_ZEROS = "zero_grad keeps zeros"
"""Noted (and recorded) after "zero_grad" for ``opt.zero_grad(set_to_none=False)`` ([Note:
zero_grad(set_to_none=False)] in runtime/update/update.py)."""

_groups: list[dict] = []
"""The param groups of the optimizer whose step is being called (``watching``)."""


def _groups_written(ctx) -> bool:
    """Whether dynamo will write back any of ``_groups`` after the graph."""
    tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
    side_effects = tx.output.side_effects
    for group in _groups:
        variable = side_effects.id_to_variable.get(id(group))
        if variable is not None and side_effects.is_modified(variable):
            return True
    return False


def _start(ctx) -> None:
    _traced.clear()


def _step(ctx) -> None:
    if _groups_written(ctx):
        _traced.append(WRITES_GROUPS)
    _traced.append("step")


def _end(ctx) -> None:
    if WRITES_GROUPS not in _traced and _groups_written(ctx):
        _traced.append(WRITES_GROUPS_AFTER_STEP)


def _zero_grad(ctx) -> None:
    _traced.append("zero_grad")


def _scheduler(ctx) -> None:
    _traced.append("scheduler")


def _zero_grad_keeping(ctx) -> None:
    _traced.append("zero_grad")
    _traced.append(ZERO_GRAD_KEEPS_ZEROS)


def _reads_gradients(ctx) -> None:
    _traced.append("reads gradients")


def traced_calls() -> list[str]:
    """The notes of the latest trace: "step", "zero_grad", "scheduler" (a scheduler's
    ``step()``), "zero_grad keeps zeros" (after "zero_grad", for ``set_to_none=False``),
    "reads gradients" (a clip, or a GradScaler's ``unscale_``/``step``), "writes
    param groups" (before "step") and "writes param groups after step" ([Note:
    hyperparameters written inside the step]), in order."""
    return list(_traced)


def trace_started() -> None:
    """Call first in the traced step: the notes start over."""
    comptime(_start)


def trace_ended() -> None:
    """Call last in the traced step, after the user's function returned."""
    comptime(_end)


@contextlib.contextmanager
def watching(groups: list[dict]):
    """While the step runs (and dynamo may trace it): the optimizer's ``param_groups``,
    whose writes the notes report ([Note: hyperparameters written inside the step])."""
    _groups[:] = groups
    try:
        yield
    finally:
        _groups.clear()


def traced_step() -> None:
    """Call from the recorder of ``opt.step()``."""
    comptime(_step)


def traced_zero_grad(keeps_zeros: bool = False) -> None:
    """Call from the recorder of ``opt.zero_grad()``; ``keeps_zeros``: it was given
    ``set_to_none=False`` (a constant of the trace)."""
    if keeps_zeros:
        comptime(_zero_grad_keeping)
    else:
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
