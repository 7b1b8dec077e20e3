"""Graph breaks: which failures of dynamo's trace are a break in the user's step, and where.

A graph break is dynamo meeting code it cannot put in one graph: a Python branch on a
tensor's value (``if loss > 100:``), a call it cannot trace. zero_fx then runs the step
eagerly on its sharded state (runtime/eager_fallback.py) or, with
``on_graph_break="error"``, raises; either way it says where the break is, in the user's
file and line, and why, from what dynamo's exception carries (its ``real_stack``, the
frames of the user's code it was tracing, and its ``gb_type``, the kind of break). Any
other failure (our own ``CaptureError`` on the step's shape, a ``ValueError``, a failure
of the compiler after the trace) is not a break and is raised as it is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from .step_graph import CaptureError
from ..errors import GraphBreakWarning  # noqa: F401  (its old import path)

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class GraphBreak:
    """Where and why dynamo could not trace the step as one graph."""

    kind: str
    """The kind of break, as dynamo names it ("Data-dependent branching")."""
    reason: str
    """The kind with dynamo's explanation, when it gives one."""
    where: str
    """``file:line`` of the deepest frame of the user's code dynamo was tracing ("" if it
    named none)."""
    code: str
    """That line's source ("" if unknown)."""
    stack: tuple[str, ...] = ()
    """The user's frames, outermost first, each ``file:line in function``."""

    def __str__(self) -> str:
        at = f" at {self.where}" + (f": {self.code}" if self.code else "") if self.where else ""
        return f"{self.kind}{at}"


def graph_break_of(err: BaseException) -> Optional[GraphBreak]:
    """The graph break ``err`` reports, or None when it is not one."""
    if not isinstance(err, (torch._dynamo.exc.Unsupported, GuardOnDataDependentSymNode)):
        return None
    frames = [f for f in (getattr(err, "real_stack", None) or ())
              if not os.path.abspath(f.filename).startswith(_PACKAGE + os.sep)]
    stack = tuple(f"{f.filename}:{f.lineno} in {f.name}" for f in frames)
    last = frames[-1] if frames else None
    kind, reason = _reason(err)
    return GraphBreak(kind=kind, reason=reason,
                      where=f"{last.filename}:{last.lineno}" if last else "",
                      code=(last.line or "").strip() if last else "",
                      stack=stack)


def _reason(err: BaseException) -> tuple[str, str]:
    message = str(err).strip()
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    kind = getattr(err, "gb_type", "") or (lines[0] if lines else type(err).__name__)
    explanation = next((line.removeprefix("Explanation:").strip() for line in lines
                        if line.startswith("Explanation:")), "")
    return kind, f"{kind}: {explanation}" if explanation else kind


def break_error(error: CaptureError, graph_break: GraphBreak) -> CaptureError:
    """``error`` (what ``capture_failed`` says) with the break's place in the user's code and
    the way to train anyway: ``on_graph_break="error"`` asked for one graph or an error."""
    where = f"\nThe step breaks at {graph_break.where}" + (
        f": {graph_break.code}" if graph_break.code else "") if graph_break.where else ""
    return CaptureError(f"{error}{where}\n(on_graph_break=\"error\" asks for one graph; "
                        "on_graph_break=\"eager\", the default, would run this step eagerly on "
                        "the sharded state instead: docs/training-features.md, \"Graph breaks\")")
