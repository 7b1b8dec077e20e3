"""quantize_collectives: gathers and reductions move block-quantized bytes (ZeRO++'s qwZ, qgZ)."""

from __future__ import annotations

import functools

from torch.fx import GraphModule, Node

from .common.predicates import (CARRIES_META, Phase, carried_params, collective_group,
                                is_all_gather, is_all_reduce, is_reduce_scatter, phase_of,
                                runs_across_replicas)
from .common.quantized_code import (bytes_per_element, quantized_all_gather, quantized_all_reduce,
                                    quantized_reduce_scatter)
from .common.splice import splice


def quantize_collectives(gm: GraphModule, plan) -> GraphModule:
    """Replace each stage-3 all-gather of a phase ``plan.quantize_weights`` names, and
    each gradient reduction when ``plan.quantize_gradients`` is set, by the same collective
    on block-quantized bytes ([Note: quantized blocks on the wire] in quantized_code.py).

    Requires: every collective is issued right before its wait (``bucket_collectives``
    has run, ``schedule_collectives`` has not); inserted code carries
    ``meta["zero_carries"]``.
    Ensures: the same users read values of the same shapes and dtypes (the dequantized
    ones); every rewritten collective moves ``uint8`` rows and has one user, its wait. A
    gather (qwZ) stays an all-gather; a reduce-scatter becomes an all-to-all whose rows
    are summed in fp32 on arrival, and hybrid sharding's all-reduce across replicas an
    all-to-all of the quantized shard where that moves fewer bytes than the ring
    all-reduce it replaces ([Note: reductions as all-to-alls]). The new code carries the
    collective's bucket and phase, so ``schedule_collectives`` moves it with the
    collective. Only ZeRO's collectives change: tensor parallelism's and expert
    parallelism's exchanges are left as they are. The masters and the shards the graph
    reads are untouched: only the copy on the wire is quantized.
    Does nothing when neither option is set or the world is one rank (unless it keeps its
    collectives: [Note: collectives kept at a world of one] in zero_fx/runtime/distributed/process_group.py).
    """
    forward_fmt, backward_fmt = plan.quantize_weights
    gradient_fmt = plan.quantize_gradients
    one_rank = plan.ranks_averaged == 1 and not plan.keeps_collectives_at_one
    if not (forward_fmt or backward_fmt or gradient_fmt) or one_rank:
        return gm
    block = plan.quantize_block
    for node in list(gm.graph.nodes):
        code = None
        if is_all_gather(node):
            fmt = forward_fmt if phase_of(node) is Phase.FORWARD else backward_fmt
            if fmt:
                code = functools.partial(quantized_all_gather, world_size=node.args[1],
                                         group_name=collective_group(node.args), fmt=fmt,
                                         block=block)
        elif gradient_fmt and is_reduce_scatter(node):
            code = functools.partial(quantized_reduce_scatter, op=node.args[1],
                                     world_size=node.args[2],
                                     group_name=collective_group(node.args), fmt=gradient_fmt,
                                     block=block)
        elif (gradient_fmt and is_all_reduce(node) and runs_across_replicas(node, plan)
              and replica_exchange_pays(plan.replicas, gradient_fmt, block,
                                        node.args[0].meta["val"].element_size())):
            code = functools.partial(quantized_all_reduce, op=node.args[1],
                                     group_size=plan.replicas,
                                     group_name=collective_group(node.args), fmt=gradient_fmt,
                                     block=block)
        if code is not None:
            _replace(gm, node, code)
    gm.graph.lint()
    gm.recompile()
    return gm


def replica_exchange_pays(replicas: int, fmt: str, block: int, itemsize: int) -> bool:
    """Whether sending the quantized shard to each other replica moves fewer bytes than a
    ring all-reduce of the shard as it is ([Note: reductions as all-to-alls])."""
    return replicas * bytes_per_element(fmt, block) < 2 * itemsize


def _replace(gm: GraphModule, collective: Node, code) -> None:
    """Splice ``code`` (the quantized collective, waited) where ``collective`` is issued;
    its result takes the place of the collective's wait."""
    (wait,) = collective.users
    (result,) = splice(gm.graph, code, [collective.args[0]], before=collective,
                       phase=phase_of(collective),
                       meta={CARRIES_META: carried_params(collective)})
    wait.replace_all_uses_with(result)
    gm.graph.erase_node(wait)
    gm.graph.erase_node(collective)
