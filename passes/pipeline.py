"""The pass pipeline: a flat, named list built once per plan."""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from typing import Callable, NamedTuple, Optional, Sequence

from torch.fx import GraphModule

from .accumulate_embedding_grads import accumulate_embedding_grads
from .annotate_phases import annotate_phases
from .bucket_collectives import bucket_collectives
from .check_invariants import InvariantError, check_invariants
from .gather_params import gather_params
from .order_weight_grads import order_weight_grads
from .quantize_collectives import quantize_collectives
from .recompute_activations import recompute_activations
from .recompute_param_views import recompute_param_views
from .reduce_grads import reduce_grads
from .scale_loss import scale_loss
from .schedule_collectives import schedule_collectives
from .update_in_graph import update_in_graph

log = logging.getLogger("zero_fx.passes")

GraphPass = Callable[[GraphModule], GraphModule]


class NamedPass(NamedTuple):
    name: str
    run: GraphPass
    ours: bool = True


class Placed(NamedTuple):
    """A user's pass and where it runs among ours: ``before`` or ``after`` one of ours, by name."""

    run: Callable[[GraphModule], Optional[GraphModule]]
    before: Optional[str] = None
    after: Optional[str] = None

    @property
    def name(self) -> str:
        return getattr(self.run, "__name__", type(self.run).__name__)


def before(name: str, graph_pass: Callable[[GraphModule], Optional[GraphModule]]) -> Placed:
    """Run ``graph_pass(gm)`` right before our pass ``name`` (see ``PASS_ORDER``)."""
    return Placed(graph_pass, before=name)


def after(name: str, graph_pass: Callable[[GraphModule], Optional[GraphModule]]) -> Placed:
    """Run ``graph_pass(gm)`` right after our pass ``name`` (see ``PASS_ORDER``)."""
    return Placed(graph_pass, after=name)


PASS_ORDER = (
    ("annotate_phases", annotate_phases),
    ("scale_loss", scale_loss),
    ("recompute_activations", recompute_activations),
    ("recompute_param_views", recompute_param_views),
    ("order_weight_grads", order_weight_grads),
    ("gather_params", gather_params),
    ("accumulate_embedding_grads", accumulate_embedding_grads),
    ("reduce_grads", reduce_grads),
    ("bucket_collectives", bucket_collectives),
    ("quantize_collectives", quantize_collectives),
    ("schedule_collectives", schedule_collectives),
    ("update_in_graph", update_in_graph),
    ("check_invariants", check_invariants),
)
"""Our passes, in the order they run. Each is ``fn(gm, plan) -> gm``."""


def build_pipeline(plan, *, disable: Sequence[str] = (), extra: Sequence = ()) -> list[NamedPass]:
    """The passes for ``plan``, each bound to it, minus those named in ``disable``,
    with the user's passes ``extra`` placed among them.

    An entry of ``extra`` is ``before(name, fn)``, ``after(name, fn)``, or a bare
    ``fn``, which runs after all our rewrites, right before ``check_invariants``
    (at the end if that is disabled), so the invariants are checked on its output.
    User passes that land in the same gap between ours run in the order given.
    A user's pass takes the GraphModule and returns it (or None when it edits in place).
    """
    pipeline = [
        NamedPass(name, functools.partial(fn, plan=plan)) if ours
        else NamedPass(name, _returning_graph(fn, name), ours=False)
        for name, fn, ours in _arrange(disable, extra)
    ]
    log.info("zero_fx pipeline: %s", " -> ".join(
        p.name if p.ours else f"{p.name} (user)" for p in pipeline))
    return pipeline


def pass_names(*, disable: Sequence[str] = (), extra: Sequence = ()) -> list[str]:
    """The names of the passes that run, in order; raises on a bad ``disable`` or ``extra``."""
    return [name for name, _, _ in _arrange(disable, extra)]


def _arrange(disable: Sequence[str], extra: Sequence) -> list[tuple[str, Callable, bool]]:
    known = [name for name, _ in PASS_ORDER]
    unknown = set(disable) - set(known)
    if unknown:
        raise ValueError(f"cannot disable unknown passes {sorted(unknown)}; ours are {known}")
    arranged = [(name, fn, True) for name, fn in PASS_ORDER if name not in disable]
    for entry in extra:
        placed = entry if isinstance(entry, Placed) else Placed(entry)
        arranged.insert(_position(arranged, placed, known, disable), (placed.name, placed.run, False))
    return arranged


def _position(arranged: list, placed: Placed, known: Sequence[str], disabled: Sequence[str]) -> int:
    if not callable(placed.run):
        raise TypeError(f"a user pass must be a function gm -> gm, got {placed.run!r}; "
                        f"place one with zero_fx.before(name, fn) or zero_fx.after(name, fn)")
    anchor = placed.before or placed.after
    ours = [name if is_ours else None for name, _, is_ours in arranged]
    if anchor is None:
        return ours.index("check_invariants") if "check_invariants" in ours else len(arranged)
    if anchor not in known:
        raise ValueError(f"cannot place {placed.name} next to unknown pass {anchor!r}; "
                         f"ours are {list(known)}")
    if anchor in disabled:
        raise ValueError(f"cannot place {placed.name} next to {anchor!r}: it is disabled")
    at = ours.index(anchor)
    if placed.after:  # behind the user passes already in this gap: they run in list order
        at += 1
        while at < len(arranged) and ours[at] is None:
            at += 1
    return at


def _returning_graph(user_pass: Callable, name: str) -> GraphPass:
    def run(gm: GraphModule) -> GraphModule:
        result = user_pass(gm)
        if result is None:
            return gm
        if not isinstance(result, GraphModule):
            raise TypeError(f"user pass {name} returned {type(result).__name__}; "
                            f"return the GraphModule, or None after editing it in place")
        return result
    return run


PassObserver = Callable[[str, GraphModule], None]
"""Called as ``observe("captured", gm)`` before the first pass and ``observe(name, gm)``
after each (graph dumps)."""


def run_pipeline(gm: GraphModule, pipeline: Sequence[NamedPass],
                 observe: Optional[PassObserver] = None) -> GraphModule:
    """Run each pass in order; at INFO on ``zero_fx.passes``, log its time and how op
    counts changed.

    When the pipeline ends in ``check_invariants``, the invariants are also checked after
    every pass before it, so an ``InvariantError`` names the pass that broke them
    (``err.pass_name``): the user's pass, or one of ours (a zero_fx bug)."""
    logging_ops = log.isEnabledFor(logging.INFO)
    check = next((p for p in pipeline if p.ours and p.name == "check_invariants"), None)
    if observe:
        observe("captured", gm)
    for named in pipeline:
        before = _op_counts(gm) if logging_ops else None
        start = time.perf_counter()
        gm = named.run(gm)
        if check is not None and named is not check:
            _check_after(check, named, gm)
        if before is not None:
            after = _op_counts(gm)
            delta = {op: after[op] - before[op] for op in after | before if after[op] != before[op]}
            log.info("zero_fx pass %s: %.1f ms, %d nodes, op count changes %s", named.name,
                     1e3 * (time.perf_counter() - start), len(gm.graph.nodes),
                     _format_delta(delta))
        if observe:
            observe(named.name, gm)
    return gm


def _check_after(check: NamedPass, named: NamedPass, gm: GraphModule) -> None:
    """``check_invariants`` on the output of ``named``; an ``InvariantError`` names it."""
    try:
        check.run(gm)
    except InvariantError as err:
        if named.ours:
            blame = (f"zero_fx's pass {named.name} broke an invariant: {err}. This is a zero_fx "
                     f"bug: please report it with the graph dump "
                     f"(zero_compile(debug=DebugOptions(dump_dir=...)))")
        else:
            blame = (f"your pass {named.name} broke an invariant: {err}. Fix {named.name}, or "
                     f"place it elsewhere with zero_fx.before/after; passes/README.md lists "
                     f"what every graph between passes must satisfy")
        raise InvariantError(blame, pass_name=named.name) from err


def _op_counts(gm: GraphModule) -> Counter:
    return Counter(_short(n.target) for n in gm.graph.nodes if n.op == "call_function")


def _short(target) -> str:
    name = str(target)
    for prefix in ("aten.", "_c10d_functional."):
        name = name.removeprefix(prefix)
    return name.removesuffix(".default")


def _format_delta(delta: dict) -> str:
    if not delta:
        return "none"
    return ", ".join(f"{op} {n:+d}" for op, n in sorted(delta.items(), key=lambda kv: -abs(kv[1])))
