"""reduce_grads: each full gradient becomes the mean over ranks (stage 0) or this rank's shard of it.

[Note: where gradients are reduced]
Stage 0 (DDP) all-reduces each gradient right after it exists; every rank keeps
the whole averaged gradient for its replicated optimizer. Stages 2 and 3
reduce-scatter each gradient right after it exists, so its full-size buffer dies
at once and only the 1/N shard is kept. Stage 1 keeps every full gradient until
the end of the backward and reduce-scatters them there: that is what separates
stage 1 from stage 2 in memory (ZeRO-1 shards optimizer states, not gradients),
and it still moves Ψ, not the 2Ψ of an all-reduce.
"""

from __future__ import annotations

import functools

from torch.fx import GraphModule

from .common.collective_code import all_reduce_bucket, reduce_scatter_bucket, reduce_to_owners_bucket
from .common.predicates import CARRIES_META, Phase, grad_slots
from .common.splice import splice


def reduce_grads(gm: GraphModule, plan) -> GraphModule:
    """Replace every gradient output with the mean gradient over ranks, or this rank's shard of it.

    Requires: ``gm.meta["zero_grad_slots"]`` names the parameter of each
    gradient output. Ensures: in stage 0 each such output is the whole mean
    gradient, parameter-shaped; in stages 1-3 it is a 1-D tensor of
    ``shard_numel`` elements holding this rank's slice of it. Where the
    collectives go: [Note: where gradients are reduced]. A ``None`` gradient
    (parameter unused by the loss) stays None. With ``plan.reduce_dtype`` the
    gradient is cast to it before the collective. Does nothing when the graph
    has no gradient outputs, or when the plan reduces outside the graph
    (stages 0-1 with gradient accumulation: [Note: gradient accumulation] in
    zero_fx/runtime/update/update.py). At stage 1 a whole-tensor update's gradient stays
    whole too: the runtime reduces it to its owner ([Note: reductions laid out by owner] in
    zero_fx/runtime/update/whole_tensor_updates.py); at stages 2-3 the graph does, and its
    output is the whole flat gradient on the owner (``_reduce_to_owners``).
    """
    slots = grad_slots(gm)
    if not slots or not plan.reduces_in_graph:
        return gm
    output = gm.graph.output_node()
    outs = list(output.args[0])
    _reduce_to_owners(gm, plan, slots, outs)
    for index, name in slots.items():
        grad = outs[index]
        # whole, to its owner: after the graph (stage 1), or reduced to it already (stages 2-3)
        if grad is None or plan.reduced_by_owner(name) or plan.reduced_to_owner_in_graph(name):
            continue
        (outs[index],) = splice(gm.graph, reduction(plan, [name]), [grad],
                             before=output if plan.reduces_after_backward else grad.next,
                             phase=Phase.BACKWARD, meta={CARRIES_META: (name,)})
    output.args = (type(output.args[0])(outs),)
    gm.graph.lint()
    gm.recompile()
    return gm


def _reduce_to_owners(gm: GraphModule, plan, slots: dict, outs: list) -> None:
    """Stages 2-3 with whole-tensor updates (``plan.reduces_to_owners_in_graph``): one
    reduction laid out by owner per group of their gradients ([Note: owner groups] in
    zero_fx/plan/owners.py), right after the group's last gradient; each gradient's output
    becomes its whole mean on its owner ([Note: reductions laid out by owner] in
    zero_fx/runtime/update/whole_tensor_updates.py)."""
    index_of = {name: index for index, name in slots.items()
                if outs[index] is not None and plan.reduced_to_owner_in_graph(name)}
    if not index_of:
        return
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for group in plan.owner_groups(list(index_of)):
        grads = [outs[index_of[name]] for name in group]
        last = max(grads, key=order.__getitem__)
        results = splice(gm.graph, owner_reduction(plan, group), grads, before=last.next,
                         phase=Phase.BACKWARD, meta={CARRIES_META: tuple(group)})
        for name, result in zip(group, results):
            outs[index_of[name]] = result


def owner_reduction(plan, names) -> functools.partial:
    """The code that reduces the gradients of ``names`` (one owner group, plan order) to their
    owners, laid out by owner ([Note: reductions laid out by owner])."""
    width, where = plan.rows_by_owner(names)
    return functools.partial(reduce_to_owners_bucket, owners=[where[n][0] for n in names],
                             starts=[where[n][1] for n in names], width=width,
                             world_size=plan.world_size, group_name=plan.group_name,
                             dtype=plan.reduce_dtype, averages=plan.collectives_average,
                             mean_over=plan.ranks_averaged)


def reduction(plan, names) -> functools.partial:
    """The code that reduces the gradients of ``names`` (one bucket) for ``plan``'s stage."""
    if plan.replicated:
        return functools.partial(all_reduce_bucket, world_size=plan.world_size,
                                 group_name=plan.group_name, dtype=plan.reduce_dtype,
                                 averages=plan.collectives_average,
                                 keep_at_one=plan.keeps_collectives_at_one)
    # a routed expert's bucket runs on its expert-data-parallel group, but its mean is over
    # every rank, which the collective's own average would not give ([Note: expert
    # parallelism] in zero_fx/plan/expert_parallel.py)
    size, group = plan.collective_group(names[0])
    return functools.partial(reduce_scatter_bucket,
                             paddings=[plan.layout(n).padding for n in names],
                             world_size=size, group_name=group,
                             dtype=plan.reduce_dtype, replicas=plan.replicas,
                             replicate_group_name=plan.replicate_group_name,
                             averages=plan.collectives_average and not plan.is_expert(names[0]),
                             mean_over=plan.ranks_averaged,
                             to_host=plan.offloads_optimizer,
                             keep_at_one=plan.keeps_collectives_at_one)
