"""The collective schedule as planned (our graph) and as it runs (Inductor's generated program).

A schedule is the program order of three kinds of event: a collective issued,
a collective waited for, and an *anchor* computed (a matmul, attention or
convolution: ``passes.common.predicates.is_anchor_compute``; the compute whose place
in generated code is well defined). Collectives are numbered in issue order.
Two schedules are the same when these sequences are: every issue and every
wait has the same anchors before and after it. ``OrderCheck`` holds that
comparison for one compilation; ``explain()`` prints it.

Reading generated code: the Python wrapper Inductor writes (``def call(args)``)
calls collectives and extern kernels by name, one statement a line::

    buf16 = torch.ops._c10d_functional.all_gather_into_tensor.default(buf15, 2, '0')
    torch.ops._c10d_functional.wait_tensor.default(buf16)
    extern_kernels.mm(buf23, buf24, out=buf25)

Its C++ wrapper (``cpp_wrapper=True``) is not read: the check then says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Collection, NamedTuple, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule, Node
from torch.utils._pytree import tree_leaves, tree_map_only

from ..passes.common.predicates import (
    ANCHOR_OPS,
    is_all_gather,
    is_all_to_all,
    is_anchor_compute,
    is_collective,
    is_reduce_scatter,
    is_wait,
)

ISSUE, WAIT, COMPUTE = "issue", "wait", "compute"


class Event(NamedTuple):
    kind: str
    """``ISSUE``, ``WAIT`` or ``COMPUTE``."""
    collective: int = -1
    """Issue number of the collective an issue or wait is about; -1 for compute."""
    op: str = ""
    """all_gather / reduce_scatter / all_reduce for an issue; empty otherwise."""


@dataclass(frozen=True)
class Schedule:
    events: tuple[Event, ...]

    @property
    def collectives(self) -> int:
        return sum(e.kind == ISSUE for e in self.events)

    @property
    def anchors(self) -> int:
        return sum(e.kind == COMPUTE for e in self.events)

    def tokens(self) -> list[str]:
        """The events in words, runs of compute counted: ``["issue all_gather 0", "2 anchors",
        "wait 0", ...]``."""
        tokens, run = [], 0
        for e in self.events:
            if e.kind == COMPUTE:
                run += 1
                continue
            if run:
                tokens.append(f"{run} anchor{'s' * (run > 1)}")
                run = 0
            tokens.append(f"issue {e.op} {e.collective}" if e.kind == ISSUE
                          else f"wait {e.collective}")
        if run:
            tokens.append(f"{run} anchor{'s' * (run > 1)}")
        return tokens

    def anchors_between(self) -> list[int]:
        """For each collective (issue order): the anchors between its issue and its wait."""
        counts, open_ = [0] * self.collectives, set()
        for e in self.events:
            if e.kind == ISSUE:
                open_.add(e.collective)
            elif e.kind == WAIT:
                open_.discard(e.collective)
            else:
                for c in open_:
                    counts[c] += 1
        return counts


def planned_schedule(gm: GraphModule, is_anchor: Callable[[Node], bool] = is_anchor_compute
                      ) -> Schedule:
    """The schedule of our rewritten graph, in node order; ``is_anchor`` says which compute
    counts (for Inductor: ``inductor_keeps_as_kernel``)."""
    events, number = [], {}
    for node in gm.graph.nodes:
        if is_collective(node):
            number[node] = len(number)
            events.append(Event(ISSUE, number[node], _kind(node)))
        elif is_wait(node) and node.args[0] in number:
            events.append(Event(WAIT, number[node.args[0]]))
        elif is_anchor(node):
            events.append(Event(COMPUTE))
    return Schedule(tuple(events))


def inductor_keeps_as_kernel(node: Node) -> bool:
    """An anchor that Inductor runs as a kernel of its own: not one its decompositions turn
    into pointwise code for these shapes (on CPU, a matmul whose inner dimension is 1, as
    a rotary embedding's ``inv_freq @ positions``), which then fuses where Inductor likes
    and is no anchor in the generated program. Asked of Inductor's own decomposition
    table, on the node's fake values."""
    if not is_anchor_compute(node):
        return False
    from torch._inductor.decomposition import select_decomp_table

    decomposition = select_decomp_table().get(node.target)
    if decomposition is None:
        return True
    values = tree_map_only(Node, lambda n: n.meta.get("val"), (node.args, node.kwargs))
    tensors = [v for v in tree_leaves(values) if isinstance(v, torch.Tensor)]
    if not all(isinstance(s, int) for t in tensors for s in (*t.shape, *t.stride())):
        return True  # dynamic shapes: assume a kernel
    with FakeTensorMode():  # fresh fakes: the graph's values may come from several modes
        args, kwargs = tree_map_only(torch.Tensor, lambda t: torch.empty_strided(
            t.shape, t.stride(), dtype=t.dtype, device=t.device), values)
        return decomposition(*args, **kwargs) is NotImplemented


def _kind(node) -> str:
    return "all_gather" if is_all_gather(node) else (
        "reduce_scatter" if is_reduce_scatter(node) else
        "all_to_all" if is_all_to_all(node) else "all_reduce")


_C10D = r"torch\.ops\._c10d_functional\."
_ISSUE_RE = re.compile(_C10D + r"(all_gather_into_tensor|reduce_scatter_tensor|all_reduce|all_to_all_single)(_out|_)?"
                       r"\.default\((?P<args>.*)\)\s*$")
_WAIT_RE = re.compile(_C10D + r"wait_tensor\.default\((?P<buf>\w+)\)")
_ASSIGN_RE = re.compile(r"^(?P<lhs>\w+) = (?P<rhs>.*)$")
_ALIAS_RE = re.compile(r"^(?P<lhs>\w+) = (?:reinterpret_tensor\()?(?P<rhs>buf\w+)\b.*# reuse")
_ANCHOR_RE = re.compile(r"\bextern_kernels\.(?:%s)\(|torch\.ops\.aten\.(?:%s|\w*scaled_dot_product\w*)"
                        r"\.default\(" % ("|".join(ANCHOR_OPS), "|".join(ANCHOR_OPS)))
_ISSUE_KIND = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
               "all_reduce": "all_reduce", "all_to_all_single": "all_to_all"}


def lowered_schedule(source: str, skip_groups: Collection[str] = ()) -> Optional[Schedule]:
    """The schedule of Inductor's generated Python wrapper ``source``; None if it has none
    (a C++ wrapper). Collectives on ``skip_groups`` (tensor parallelism's: data, not ZeRO's
    schedule; [Note: capturing a tensor-parallel step]) are not events."""
    if "def call(" not in source:
        return None
    events, number = [], {}  # buffer name -> issue number (aliases included)
    issued = 0
    for line in source[source.index("def call("):].splitlines():
        statement = line.strip()
        if statement.startswith(("#", "assert")):
            continue
        issue = _ISSUE_RE.search(statement)
        if issue and any(f"'{group}'" in issue.group("args") for group in skip_groups):
            continue
        if issue:
            buffer = _issued_buffer(statement, issue)
            number[buffer], issued = issued, issued + 1  # an in-place collective renumbers its buffer
            events.append(Event(ISSUE, number[buffer], _ISSUE_KIND[issue.group(1)]))
            continue
        wait = _WAIT_RE.search(statement)
        if wait and wait.group("buf") in number:
            events.append(Event(WAIT, number[wait.group("buf")]))
            continue
        alias = _ALIAS_RE.match(statement)
        if alias and alias.group("rhs") in number:
            number[alias.group("lhs")] = number[alias.group("rhs")]
        if _ANCHOR_RE.search(statement):
            events.append(Event(COMPUTE))
    return Schedule(tuple(events))


def _issued_buffer(statement: str, issue: re.Match) -> str:
    """The buffer a collective call writes: ``out=``, its left-hand side, or (in place) its
    first argument."""
    out = re.search(r"\bout=(\w+)", issue.group("args"))
    if out:
        return out.group(1)
    assigned = _ASSIGN_RE.match(statement)
    if assigned:
        return assigned.group("lhs")
    return re.match(r"\s*(?:reinterpret_tensor\()?(\w+)", issue.group("args")).group(1)


@dataclass(frozen=True)
class OrderCheck:
    """Whether the program that runs keeps the schedule of the rewritten graph."""

    backend: str
    planned: Schedule
    lowered: Optional[Schedule]
    """Read from the generated code (Inductor); None when the backend runs the graph's own
    order or the code could not be read (see ``note``)."""
    note: str = ""

    @property
    def difference(self) -> Optional[str]:
        """The first place where the generated program differs from the plan, in words;
        None when they agree (or there is no generated program to compare)."""
        if self.lowered is None:
            return None
        return first_difference(self.planned, self.lowered)

    def __str__(self) -> str:
        if self.lowered is None:
            return self.note
        difference = self.difference
        if difference is None:
            return (f"{self.backend}'s generated program runs the graph's schedule: the same "
                    f"{self.planned.collectives} collectives issued and waited for between the "
                    f"same {self.planned.anchors} matmul/attention kernels (read from its code)")
        return f"{self.backend}'s generated program does NOT run the graph's schedule: {difference}"


def first_difference(planned: Schedule, lowered: Schedule, context: int = 3) -> Optional[str]:
    mine, theirs = planned.tokens(), lowered.tokens()
    if mine == theirs:
        return None
    at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
    start = max(0, at - context)
    return (f"at event {at}, the graph has [{', '.join(mine[start:at + context])}] where the "
            f"program has [{', '.join(theirs[start:at + context])}]")


def order_as_graph(backend: str, gm: GraphModule, why: str) -> OrderCheck:
    """A check for a backend that runs the graph's own order (``why`` says why)."""
    return OrderCheck(backend, planned_schedule(gm), None, why)
