"""gather_params: parameters enter the graph as shards and are all-gathered where used."""

from __future__ import annotations


from torch.fx import GraphModule, Node

from .common.collective_code import gather_code, owner_rows_gather_code
from .common.predicates import (CARRIES_META, GATHERED_META, KEPT_THROUGH_LOSS_META, SECONDARY_META,
                                Phase, is_anchor_compute, is_param_input, is_view, param_name,
                                phase_of, readers_through_views)
from .common.secondary_code import from_secondary_code, keeping_code
from .common.splice import splice


def gather_params(gm: GraphModule, plan) -> GraphModule:
    """Turn each parameter placeholder into its shard and gather it before use.

    Stage 3 only: in stages 0-2 every rank holds whole parameters, which
    enter the graph as they are (see [Note: stages 1 and 2 keep whole
    parameters] in zero_fx/runtime/sharded_state.py).

    Requires: phases annotated; parameter placeholders tagged with their plan
    name; ``recompute_param_views`` has run.
    Ensures: every parameter placeholder's value is its 1-D shard
    (``shard_numel`` elements of ``layout.dtype``; with mixed precision cast to
    ``plan.compute_dtype`` before it is gathered); one gather right before the first forward use
    and one right before the first backward use, so nothing full crosses from
    forward to backward. A parameter the backward does not read (a bias, an
    embedding table) is not gathered for it. World size 1 inserts no
    collective, only the slice and view, unless the plan keeps its collectives
    (``plan.keeps_collectives_at_one``). A resident parameter
    (``plan.resident``) is gathered once, before its first use, and that full
    tensor serves forward and backward. So does the forward gather of a parameter
    whose last forward reader and first backward reader have no matmul, attention
    or convolution between them (the language-model head: [Note: a weight kept
    through the loss]); their names go to ``gm.meta["zero_kept_through_loss"]``.
    With ``plan.secondary`` a parameter gathered in both phases is gathered in the
    forward across nodes, then within the node, and the first result, its secondary
    shard (``meta["zero_secondary"]``), is the backward gather's input instead of the
    shard, gathered within the node only ([Note: the secondary partition] in
    zero_fx/plan/secondary.py).
    An owner group whose shards hold its owners' rows (``plan.owner_row_groups``) is gathered
    as one bucket per phase (per step when resident), right before the first use of any
    member, each member copied out of its owner's row ([Note: owners' rows as the shards] in
    zero_fx/runtime/update/whole_tensor_updates.py); ``bucket_collectives`` leaves it so.
    Does nothing when the graph has no parameter placeholders.

    [Note: a weight kept through the loss]
    The last weight the forward reads (the head's, tied to the token embedding
    or not) is the first the backward reads: between the two reads lie only
    the loss and its gradient, pointwise work and reductions. Releasing the
    gathered weight after the forward and gathering it again for the backward
    buys no memory where it counts: the gather is issued at once (nothing to
    hide it behind but the loss) and Inductor moves the loss's kernels after
    it, so the full weight is alive through the loss either way; it costs one
    more all-gather of the largest parameter, exposed at the start of the
    backward. On gloo it also costs a second full copy while it runs (gloo
    gathers into a flat buffer of its own, then copies out), and on GPT-2 125M
    that moment (gathered embedding 147 MiB, gloo's copy 147 MiB, logits 98 MiB)
    was the step's measured peak. So such a weight is gathered once: before its
    first forward reader, released after its first backward reader. FSDP2 users
    get the same by not resharding the last layers after the forward
    (torchtitan does it by default). The graph's own timeline, which keeps the
    loss's order, now counts the weight through the loss as well.
    """
    params = [n for n in gm.graph.nodes if is_param_input(n)]
    if not params or not plan.params_sharded:
        return gm
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    anchors = [order[n] for n in gm.graph.nodes if is_anchor_compute(n)]
    kept = set()
    row_groups: dict[tuple, list[Node]] = {}
    for placeholder in params:
        layout = plan.layout(param_name(placeholder))
        full_val = placeholder.meta["val"]
        placeholder.meta["val"] = full_val.new_empty(layout.shard_numel, dtype=plan.input_dtype(layout))
        if plan.stored_as_rows(layout.name):
            row_groups.setdefault(plan.owner_row_group(layout.name), []).append(placeholder)
            continue
        users_by_phase = _users_by_phase(placeholder)
        if layout.name in plan.resident:
            users_by_phase = {Phase.FORWARD: list(placeholder.users)}
        elif _only_the_loss_between(users_by_phase, order, anchors):
            # see [Note: a weight kept through the loss]
            kept.add(layout.name)
            users_by_phase = {Phase.FORWARD: list(placeholder.users)}
        codes = dict.fromkeys(users_by_phase, gather_code(plan, [layout.name]))
        if plan.secondary is not None and set(users_by_phase) == {Phase.FORWARD, Phase.BACKWARD}:
            # see [Note: the secondary partition] in zero_fx/plan/secondary.py
            codes = {Phase.FORWARD: keeping_code(plan, [layout.name], [True]),
                     Phase.BACKWARD: from_secondary_code(plan, [layout.name])}
        source = placeholder
        for phase in sorted(users_by_phase, key=lambda p: p is not Phase.FORWARD):
            users = users_by_phase[phase]
            first = min(users, key=order.__getitem__)
            code = codes[phase]
            full, *kept_shard = splice(gm.graph, code, [source], before=first,
                                       phase=phase_of(first),
                                       meta={CARRIES_META: (layout.name,)})
            full.meta[GATHERED_META] = (layout.name, phase)
            if kept_shard:
                kept_shard[0].meta[SECONDARY_META] = layout.name
                source = kept_shard[0]
            for user in users:
                user.replace_input_with(placeholder, full)
    for group, placeholders in row_groups.items():
        _gather_owner_rows(gm, plan, group, placeholders, order)
    gm.meta[KEPT_THROUGH_LOSS_META] = frozenset(kept)
    gm.graph.lint()
    gm.recompile()
    return gm


def _gather_owner_rows(gm: GraphModule, plan, group: tuple, placeholders: list[Node],
                       order: dict) -> None:
    """One of ``plan.owner_row_groups``: one gather of the whole group per phase, right before
    the first use of any member in it, which every member's users in that phase read
    ([Note: owners' rows as the shards] in zero_fx/runtime/update/whole_tensor_updates.py)."""
    by_name = {param_name(p): p for p in placeholders}
    missing = [name for name in group if name not in by_name]
    if missing:
        raise AssertionError(f"the graph has no input for {missing[0]!r}, whose shard holds part "
                             f"of its owner group's rows: the group cannot be gathered")
    members = [by_name[name] for name in group]
    users: dict[Phase, list[tuple[int, Node]]] = {}
    for index, placeholder in enumerate(members):
        by_phase = _users_by_phase(placeholder)
        if group[0] in plan.resident:  # one gather for the step: the plan's residents are all
            by_phase = {Phase.FORWARD: list(placeholder.users)}  # or none of a group
        for phase, readers in by_phase.items():
            users.setdefault(phase, []).extend((index, reader) for reader in readers)
    for phase in sorted(users, key=lambda p: p is not Phase.FORWARD):
        first = min((reader for _, reader in users[phase]), key=order.__getitem__)
        fulls = splice(gm.graph, owner_rows_gather_code(plan, group), members, before=first,
                       phase=phase_of(first), meta={CARRIES_META: group})
        for name, full in zip(group, fulls):
            full.meta[GATHERED_META] = (name, phase)
        for index, reader in users[phase]:
            reader.replace_input_with(members[index], fulls[index])


def _only_the_loss_between(users_by_phase: dict, order: dict, anchors: list[int]) -> bool:
    """Both phases read the parameter, and no anchor op (matmul, attention, convolution)
    lies between the last forward and the first backward read (through views)."""
    if set(users_by_phase) != {Phase.FORWARD, Phase.BACKWARD}:
        return False
    last_forward = max(order[r] for u in users_by_phase[Phase.FORWARD] for r in _reads(u))
    first_backward = min(order[r] for u in users_by_phase[Phase.BACKWARD] for r in _reads(u))
    return not any(last_forward < a < first_backward for a in anchors)


def _reads(user: Node) -> list[Node]:
    """The nodes that read ``user``'s value as data: ``user`` itself, or through its views."""
    return (is_view(user) and readers_through_views(user)) or [user]


def _users_by_phase(placeholder: Node) -> dict[Phase, list[Node]]:
    by_phase: dict[Phase, list[Node]] = {}
    for user in placeholder.users:
        by_phase.setdefault(phase_of(user), []).append(user)
    return by_phase
