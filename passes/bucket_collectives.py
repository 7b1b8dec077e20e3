"""bucket_collectives: fuse per-parameter collectives into one launch per bucket."""

from __future__ import annotations

import functools
from typing import Optional

from torch.fx import GraphModule, Node

from .common.collective_code import gather_code
from .common.predicates import (CARRIES_META, GATHERED_META, SECONDARY_META, Phase, carried_params,
                                gathered_param, grad_slots, kept_through_loss, phase_of,
                                secondary_of)
from .reduce_grads import reduction
from .common.secondary_code import from_secondary_code, keeping_code
from .common.splice import splice


def bucket_collectives(gm: GraphModule, plan) -> GraphModule:
    """Replace runs of per-parameter gathers (per phase) and of gradient reductions by
    one collective per bucket (``plan.buckets``: one repeated block each, or at most
    ``plan.bucket_bytes``).

    Requires: ``gather_params`` and ``reduce_grads`` have run; each inserted
    chain carries exactly its own parameter (``meta["zero_carries"]``).
    Ensures: the same values reach the same users; a bucket is consecutive
    parameters in the order the graph used (gathers) or produced (gradients)
    them; a bucket's all-gather is where its first member's was, its
    reduction where its last member's was (so a bucket is reduced once it is
    complete). Only the members after the first of a gather bucket, and only
    the members before the last of a reduction bucket, move. The order is read
    off the graph and the plan only: the same on every rank.
    Resident parameters are bucketed with each other only, and so are those
    kept through the loss.
    Does nothing when ``bucket_bytes`` is 0 or the world is one rank (unless it keeps its
    collectives: [Note: collectives kept at a world of one] in zero_fx/runtime/distributed/process_group.py).

    [Note: resident parameters share buckets only with each other]
    A resident parameter (``plan.resident``: a norm weight, a bias) is gathered
    once and its full value serves the forward and the backward. Its value is a
    slice of the bucket's gathered buffer; Inductor does not copy such a slice
    out, it reads it from the buffer wherever it is used, so a resident in a
    bucket of released parameters would keep the whole buffer alive until its
    last backward use. On GPT-2 125M that held 370 MiB per rank more than
    aot_eager did (bench/README.md). Kept apart, the residents' buckets are
    small and the others are freed after their last forward use. The same holds
    for a weight kept through the loss ([Note: a weight kept through the loss] in
    gather_params.py): in a bucket with the last block's weights it would keep
    them alive into the backward.
    """
    if plan.bucket_bytes == 0 or not plan.issues_collectives:
        return gm
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    # an owner group stored as rows is gathered whole already ([Note: owners' rows as the
    # shards] in zero_fx/runtime/update/whole_tensor_updates.py)
    gathered = [n for n in gm.graph.nodes if gathered_param(n) is not None
                and not plan.stored_as_rows(gathered_param(n)[0])]
    replaced: dict[Node, Node] = {}
    kept = kept_through_loss(gm)
    for phase in Phase:
        results = [n for n in gathered if gathered_param(n)[1] is phase]
        # see [Note: resident parameters share buckets only with each other]
        resident = [n for n in results if carried_params(n)[0] in plan.resident]
        through_loss = [n for n in results if carried_params(n)[0] in kept]
        released = [n for n in results
                    if carried_params(n)[0] not in plan.resident | kept]
        # [Note: the secondary partition]: the backward's gathers from secondary shards
        # share buckets with each other only
        from_secondary = [n for n in released if _reads_secondary(n)]
        released = [n for n in released if n not in from_secondary]
        for group, is_resident in ((resident, True), (through_loss, False), (released, False)):
            replaced |= _fuse(gm, plan, group, order, _gather_code(plan, _keeps_secondary(group)),
                              insert_at_first=True, resident=is_resident)
        replaced |= _fuse(gm, plan, from_secondary, order,
                          functools.partial(from_secondary_code, plan), insert_at_first=True)
    if plan.reduces_in_graph:
        output = gm.graph.output_node()
        # a gradient reduced to its owner after the graph leaves it whole, unreduced; one
        # reduced to its owner in the graph is bucketed by its owner group already
        slots = {i: output.args[0][i] for i, name in grad_slots(gm).items()
                 if output.args[0][i] is not None and not plan.reduced_by_owner(name)
                 and not plan.reduced_to_owner_in_graph(name)}
        reduced = sorted(slots.values(), key=lambda r: order[_chain_inputs(r)[0]])
        replaced |= _fuse(gm, plan, reduced, order, functools.partial(reduction, plan),
                          insert_at_first=False)
    _erase_dead_chains(gm, replaced)
    gm.graph.lint()
    gm.recompile()
    return gm


def _gather_code(plan, keeping: frozenset = frozenset()):
    """Code for a bucket of ``gather_params``' gathers; where a member of ``keeping`` is in
    the bucket, the forward's gather that keeps the secondary shards of those members."""
    def code(names):
        if any(n in keeping for n in names):
            return keeping_code(plan, names, [n in keeping for n in names])
        return gather_code(plan, names)  # a bucket is one group's
    return code


def _kept_secondary(result: Node) -> Optional[Node]:
    """The secondary shard the forward gather of ``result`` keeps, if it keeps one."""
    return next((n for n in _chain(result) if secondary_of(n) is not None), None)


def _keeps_secondary(results: list[Node]) -> frozenset:
    return frozenset(carried_params(r)[0] for r in results if _kept_secondary(r) is not None)


def _reads_secondary(result: Node) -> bool:
    return any(secondary_of(n) is not None for n in _chain_inputs(result))


def _fuse(gm, plan, results: list[Node], order, code_for, *, insert_at_first: bool,
          resident: bool = False) -> dict:
    """Splice one bucketed chain per bucket of ``results`` (per-parameter chain results,
    in order); return {old result: new result}. Old chains are left for ``_erase_dead_chains``."""
    by_name = {carried_params(r)[0]: r for r in results}
    replaced: dict[Node, Node] = {}
    for bucket in plan.buckets(list(by_name), resident=resident):
        if len(bucket) == 1:
            continue
        olds = [by_name[name] for name in bucket]
        starts = [min(_chain(old), key=order.__getitem__) for old in olds]
        before = starts[0] if insert_at_first else starts[-1]
        inputs = [_chain_inputs(old)[0] for old in olds]
        news = splice(gm.graph, code_for(bucket), inputs, before=before,
                      phase=phase_of(before), meta={CARRIES_META: tuple(bucket)})
        old_secondaries = [s for s in map(_kept_secondary, olds) if s is not None]
        for old, new in zip(olds + old_secondaries, news):
            for key in (GATHERED_META, SECONDARY_META):
                if key in old.meta:
                    new.meta[key] = old.meta[key]
            old.replace_all_uses_with(new)
            replaced[old] = new
    return replaced


def _chain(result: Node) -> list[Node]:
    """The inserted nodes that compute ``result``: its ancestors carrying the same parameters."""
    carries, phase = carried_params(result), phase_of(result)
    chain, stack = [], [result]
    while stack:
        node = stack.pop()
        if node in chain or carried_params(node) != carries or phase_of(node) is not phase:
            continue  # a backward gather's chain ends at the secondary shard it reads
        chain.append(node)
        stack.extend(node.all_input_nodes)
    return chain


def _chain_inputs(result: Node) -> list[Node]:
    """What the chain of ``result`` reads from the rest of the graph (the shard, the gradient)."""
    chain = _chain(result)
    return list(dict.fromkeys(i for n in chain for i in n.all_input_nodes if i not in chain))


def _erase_dead_chains(gm: GraphModule, replaced: dict) -> None:
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    erased = set()  # a kept secondary shard is in its full parameter's chain too
    for old in replaced:
        if old in erased:
            continue
        for node in sorted(_chain(old), key=order.__getitem__, reverse=True):
            if not node.users:
                gm.graph.erase_node(node)
                erased.add(node)
