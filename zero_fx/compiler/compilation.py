"""``Compilation``: what one compilation of a step did (its time, why it ran, the lowered
program's order, memory and regions), which ``CompiledStep.compilations`` lists and the
inspection reads. Apart from the backend that makes it, so that inspection/ can name the type
without importing the compiler above it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .lowered_memory import LoweredMemory
from .lowered_schedule import OrderCheck
from .regions import RegionReport


@dataclass(frozen=True)
class Compilation:
    """One compilation of a step."""

    seconds: float
    """Wall time: capture, passes and lowering."""
    reason: str
    """Why it compiled: "first call", or the guard that failed (dynamo's words)."""
    order: Optional[OrderCheck] = None
    """Whether the lowered program runs the graph's collective schedule."""
    memory: Optional[LoweredMemory] = None
    """The buffers of the lowered program (Inductor's), read from its code."""
    program: str = ""
    """The lowered program's code (Inductor's Python wrapper); empty for other backends."""
    regions: Optional[RegionReport] = None
    """The compiled bodies and where they run, when compiled by regions."""
    update_reason: str = ""
    """Why this graph leaves the optimizer's update to after the graph; "" when the graph
    steps it, bucket by bucket ([Note: the update in the graph] in
    zero_fx/runtime/update/graph_update.py)."""
