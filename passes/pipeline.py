"""The pass pipeline: a flat, named list built once per plan."""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from typing import Callable, NamedTuple, Sequence

from torch.fx import GraphModule

from .annotate_phases import annotate_phases
from .bucket_collectives import bucket_collectives
from .check_invariants import check_invariants
from .gather_params import gather_params
from .recompute_param_views import recompute_param_views
from .reduce_grads import reduce_grads
from .schedule_collectives import schedule_collectives

log = logging.getLogger("zero_fx.passes")

GraphPass = Callable[[GraphModule], GraphModule]


class NamedPass(NamedTuple):
    name: str
    run: GraphPass


PASS_ORDER = (
    ("annotate_phases", annotate_phases),
    ("recompute_param_views", recompute_param_views),
    ("gather_params", gather_params),
    ("reduce_grads", reduce_grads),
    ("bucket_collectives", bucket_collectives),
    ("schedule_collectives", schedule_collectives),
    ("check_invariants", check_invariants),
)
"""Our passes, in the order they run. Each is ``fn(gm, plan) -> gm``."""


def build_pipeline(plan, *, disable: Sequence[str] = ()) -> list[NamedPass]:
    """The passes for ``plan``, each bound to it, minus those named in ``disable``."""
    known = {name for name, _ in PASS_ORDER}
    unknown = set(disable) - known
    if unknown:
        raise ValueError(f"cannot disable unknown passes {sorted(unknown)}; ours are {sorted(known)}")
    pipeline = [
        NamedPass(name, functools.partial(fn, plan=plan))
        for name, fn in PASS_ORDER
        if name not in disable
    ]
    log.info("zero_fx pipeline: %s", " -> ".join(p.name for p in pipeline))
    return pipeline


def run_pipeline(gm: GraphModule, pipeline: Sequence[NamedPass]) -> GraphModule:
    """Run each pass in order; at DEBUG, log its time and how op counts changed."""
    for named in pipeline:
        before = _op_counts(gm) if log.isEnabledFor(logging.DEBUG) else None
        start = time.perf_counter()
        gm = named.run(gm)
        if before is not None:
            after = _op_counts(gm)
            delta = {op: after[op] - before[op] for op in after | before if after[op] != before[op]}
            log.debug("%s: %.1f ms, op count changes %s", named.name,
                      1e3 * (time.perf_counter() - start), delta or "none")
    return gm


def _op_counts(gm: GraphModule) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
