"""schedule_collectives: issue all-gathers ahead of their use, wait for reductions late.

[Note: the collective schedule]
After ``bucket_collectives`` every collective is issued right before its wait
(functional collectives: ``wait_tensor(all_gather(...))``), so the compute
stream stalls for each. This pass moves issue points and waits, never the
compute, and never across the forward/backward boundary:

- all-gathers: in each phase, gather ``i`` is issued where gather
  ``i - prefetch`` is waited for, so it runs while the compute that uses gather
  ``i - prefetch`` (and those after it) runs. Its wait stays right before its
  first use (``prefetch``, ``prefetch_buckets`` of zero_compile). With
  ``memory_budget_bytes`` (``max_gathered_bytes``), the prefetch distance shrinks (to 0 if
  need be) wherever the gathered buckets alive at the new issue point plus this
  one would exceed the budget;
- with ``offload="parameters"``, a gather's copy of its shards from the host is issued
  one bucket earlier still, with the previous gather of its phase, so it has landed by
  the time its gather is issued ([Note: shards brought from the host]);
- reductions (reduce-scatter, all-reduce): issued where ``bucket_collectives``
  put them, as soon as their last gradient exists; reduction ``i`` is waited for
  right before reduction ``i + k`` is issued (``k``: ``reduce_overlap_buckets``), or at
  the end of the step.
  With hybrid sharding a bucket's all-reduce across replicas reads its
  reduce-scatter's shard: it is issued where that is waited for and waited
  ``k`` reductions later again.
  A reduction's input (a bucket of full gradients) stays alive until its wait,
  so the distance is bounded.

Collectives are issued in an order read off the graph: the same on every
rank. The gloo and NCCL backends run one process group's collectives in issue
order, so a prefetched gather may queue behind a reduction; that is the price
of one communication stream, and the cost model (zero_fx/analysis/cost_model.py) shows it.
"""

from __future__ import annotations

from torch.fx import GraphModule, Node

from .common.host_copies import is_device_copy
from .common.predicates import (
    Phase,
    carried_params,
    gathered_param,
    is_all_gather,
    is_collective,
    is_wait,
    phase_of,
    tensor_bytes,
)


def schedule_collectives(gm: GraphModule, plan) -> GraphModule:
    """Move collective issue points earlier and reduction waits later ([Note: the collective schedule]).

    Requires: every collective's only user is its wait; inserted code carries
    ``meta["zero_carries"]``. Ensures: the same nodes compute the same values
    (only positions change); no collective is issued before the inputs it
    reads nor waited after its first user.
    Does nothing when ``prefetch`` and the reductions' overlap are 0 or the world is one rank
    (unless it keeps its collectives: [Note: collectives kept at a world of one] in
    zero_fx/runtime/distributed/process_group.py).
    """
    overlap = reduce_overlap(plan)
    if (plan.prefetch == 0 and overlap == 0) or not plan.issues_collectives:
        return gm
    if plan.prefetch:
        for phase in Phase:
            _prefetch_gathers(gm, plan, phase)
    if overlap:
        _sink_reduction_waits(gm, overlap)
    gm.graph.lint()
    gm.recompile()
    return gm


def _prefetch_gathers(gm: GraphModule, plan, phase: Phase) -> None:
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    gathers = [n for n in gm.graph.nodes if is_all_gather(n) and phase_of(n) is phase
               and not _feeds_a_gather(n, order)]
    copies_ahead = _copies_one_bucket_ahead(gathers, order)
    waits = [_wait_of(g) for g in gathers]
    issued_at = {g: order[g] for g in gathers}
    last_use = {g: _last_use(g, order) for g in gathers}
    nbytes = {g: _gathered_bytes(g, order) for g in gathers}
    for i, gather in enumerate(gathers):
        for distance in range(min(plan.prefetch, i), 0, -1):
            anchor = waits[i - distance]
            alive = sum(nbytes[g] for g in gathers[:i]
                        if issued_at[g] <= order[anchor] < last_use[g])
            if plan.memory_budget_bytes is None or alive + nbytes[gather] <= plan.memory_budget_bytes:
                for node in _issue_group(gather, order):
                    anchor.prepend(node)
                issued_at[gather] = order[anchor] - 0.5
                break
    for copy, anchor in copies_ahead:
        anchor.prepend(copy)


def _feeds_a_gather(gather: Node, order) -> bool:
    """A gather whose result another gather of its bucket gathers again (the secondary
    partition's gather across nodes, [Note: the secondary partition] in
    zero_fx/plan/secondary.py): it moves with that one, in its issue group."""
    return any(is_all_gather(n) and n is not gather for n in _tail(_wait_of(gather), order))


def _copies_one_bucket_ahead(gathers: list[Node], order) -> list[tuple[Node, Node]]:
    """Each gather's copy of shards from the host (offload="parameters") with the node it is
    to be issued before: the first node after the previous gather's own copy in that
    gather's code, so it is issued with the previous gather, one bucket ahead
    ([Note: shards brought from the host] in passes/common/host_copies.py)."""
    moves = []
    for previous, gather in zip(gathers, gathers[1:]):
        copies = [n for n in _issue_group(gather, order) if is_device_copy(n)]
        rest = [n for n in _issue_group(previous, order) if not is_device_copy(n)]
        moves += [(copy, rest[0]) for copy in copies]
    return moves


def reduce_overlap(plan) -> int:
    """How many reductions later each reduction is waited for: ``plan.reduce_overlap_buckets``,
    or ``plan.prefetch`` when that is None."""
    overlap = getattr(plan, "reduce_overlap_buckets", None)
    return plan.prefetch if overlap is None else overlap


def _sink_reduction_waits(gm: GraphModule, overlap: int) -> None:
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    reductions = [n for n in gm.graph.nodes
                  if is_collective(n) and not is_all_gather(n) and not _chained(n)]
    output = gm.graph.output_node()

    def anchor(k: int) -> Node:
        return (min(_issue_group(reductions[k], order), key=order.__getitem__)
                if k < len(reductions) else output)

    for i, reduction in enumerate(reductions):
        tail = _tail(_wait_of(reduction), order)
        segments = _segments(tail)
        outside_users = [u for n in tail for u in n.users if u not in tail]
        last = anchor(i + overlap * len(segments))
        if all(u is output or order[u] >= order[last] for u in outside_users):
            for j, segment in enumerate(segments, start=1):
                here = anchor(i + overlap * j)
                for node in segment:
                    here.prepend(node)


def _chained(collective: Node) -> bool:
    """A collective that reduces what another one of the same bucket returned: hybrid
    sharding's all-reduce across replicas of a reduce-scatter's shard (read directly, or
    through the code between them: a quantized shard's dequantization, sum and
    requantization)."""
    carries = carried_params(collective)
    seen, stack = set(), list(collective.all_input_nodes)
    while stack:
        node = stack.pop()
        if node in seen or carried_params(node) != carries:
            continue
        if is_wait(node):
            return True
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return False


def _segments(tail: list[Node]) -> list[list[Node]]:
    """``tail`` cut before each wait after its first: a chained reduction's issue goes with
    the wait it reads, its own wait ``k`` reductions later, so it overlaps too."""
    segments = [[]]
    for node in tail:
        if is_wait(node) and segments[-1]:
            segments.append([])
        segments[-1].append(node)
    return segments


def _wait_of(collective: Node) -> Node:
    (wait,) = collective.users
    return wait


def _issue_group(collective: Node, order) -> list[Node]:
    """The collective and the inserted code that prepares its buffer (its concatenation, a
    reduction's division), in order."""
    carries, phase = carried_params(collective), phase_of(collective)
    group, stack = set(), [collective]
    while stack:
        node = stack.pop()
        if node not in group and carried_params(node) == carries and phase_of(node) is phase:
            group.add(node)
            stack.extend(node.all_input_nodes)
    return sorted(group, key=order.__getitem__)


def _tail(wait: Node, order) -> list[Node]:
    """The wait and the inserted code after it (the copy-out or split, views), in order."""
    carries, phase = carried_params(wait), phase_of(wait)
    tail, stack = set(), [wait]
    while stack:
        node = stack.pop()
        if (node not in tail and carried_params(node) == carries and node.op != "output"
                and phase_of(node) is phase):  # a kept secondary's backward reader is not
            tail.add(node)
            stack.extend(node.users)
    return sorted(tail, key=order.__getitem__)


def _gathered_bytes(gather: Node, order) -> int:
    """Bytes of the buffer a gather fills once waited for: its output, or where it moves
    quantized bytes, the dequantized buffer its parameters are copied out of (the
    largest value of its tail)."""
    return max(tensor_bytes(n.meta.get("val")) for n in _tail(_wait_of(gather), order))


def _last_use(gather: Node, order) -> int:
    """Position of the last node reading a full parameter this gather yields."""
    results = [n for n in _tail(_wait_of(gather), order) if gathered_param(n) is not None]
    return max((order[u] for r in results for u in r.users), default=order[gather])
