"""order_weight_grads: a layer's input gradient before its weight gradient, in stage 3.

[Note: release the gathered weight before the weight gradient]
Autograd records a linear layer's backward as two matmuls that read the same
incoming gradient ``g``: the weight gradient (``mm(t(g), x)``, which reads no
parameter) and the input gradient (``mm(g, weight)``). It records the weight
gradient first. In stage 3 the input gradient is the backward's only reader of
the gathered weight, so the full weight stays alive while the weight gradient,
a tensor of the same size, is computed:

    g alive -> weight gradient (new, weight-sized) -> gather weight -> input gradient

Run the input gradient first and the gathered weight is released before the
weight gradient exists; the peak there drops by one weight. For GPT-2 125M's
tied head (50304 x 768, fp32, stage 3 over 2 ranks) that is 147 MiB at the
step's peak: the head's backward, where the logits' gradient, the gathered
table and the head's weight gradient were alive together. Inside a repeated
block a bucket holds the whole block, so the order within it changes little.

The swap is not free: the input gradient, an activation-sized tensor, now
exists while the weight gradient is computed. So a pair is swapped only when
the weight is larger than the input gradient (a head over few tokens, GPT-2's
block weights at 512 tokens per rank), not when the batch's tokens outnumber
the weight's rows. The head is swapped whatever its size: read first by the
backward, its forward gather is kept through the loss, no second gather.
Measured on gpt-small with recompute="blocks" (1024 tokens per rank, width
320, an MLP's 1280-wide input gradient 5 MiB against its 1.6 MiB weight):
swapping every pair peaked at 157.7 MiB per rank, none at 153.0.

The input gradient moves, with the nodes it needs that come after the weight
gradient (the parameter's view, ``t(weight)``), to right before the weight
gradient; nothing it moves depends on the weight gradient, so the graph stays
topologically ordered and every value is the same. ``gather_params`` then
places the backward gather before its new first use.
"""

from __future__ import annotations

from torch.fx import GraphModule, Node

from .common.predicates import (Phase, is_anchor_compute, is_param_input, phase_of,
                                readers_through_views, tensor_bytes, viewed)


def order_weight_grads(gm: GraphModule, plan) -> GraphModule:
    """Move each backward matmul that reads a parameter ahead of an earlier sibling matmul
    that reads the same tensor (directly or through views) and no parameter.

    Requires: phases annotated; parameters not yet gathered. Ensures: for every backward
    tensor read by two matmuls, one reading a parameter (directly or through views) and
    one reading none, the one reading the parameter runs first when the parameter is
    larger than what it computes. Does nothing unless
    ``plan.params_sharded``, stage 3 (below it parameters are whole for the entire step).
    """
    if not plan.params_sharded:
        return gm
    readers: dict[Node, list[Node]] = {}
    """Each tensor read by backward matmuls (views followed to what they view): its readers."""
    for node in gm.graph.nodes:
        if is_anchor_compute(node) and phase_of(node) == Phase.BACKWARD:
            for source in {viewed(arg) for arg in node.all_input_nodes}:
                readers.setdefault(source, []).append(node)
    moved = 0
    forward_matmuls = [n for n in gm.graph.nodes
                       if is_anchor_compute(n) and phase_of(n) == Phase.FORWARD]
    last_forward_matmul = forward_matmuls[-1] if forward_matmuls else None
    for siblings in readers.values():
        for weight_grad, input_grad in zip(siblings, siblings[1:]):
            if (not _params_read(weight_grad) and _params_read(input_grad)
                    and _worth_swapping(input_grad, last_forward_matmul)
                    and _move_before(input_grad, weight_grad)):
                moved += 1
    if moved:
        gm.graph.lint()
        gm.recompile()
    return gm


def _worth_swapping(input_grad: Node, last_forward_matmul) -> bool:
    """The parameter ``input_grad`` reads takes more bytes than the gradient it makes, or
    the forward's last matmul (the head) reads it: with its input gradient first the
    backward starts by reading it, and its forward gather is kept through the loss
    ([Note: a weight kept through the loss] in gather_params.py)."""
    weights = _params_read(input_grad)
    return (max(tensor_bytes(w.meta.get("val")) for w in weights)
            > tensor_bytes(input_grad.meta.get("val"))
            or any(last_forward_matmul in readers_through_views(w) for w in weights))


def _params_read(node: Node) -> list[Node]:
    """The parameter placeholders ``node`` reads, directly or through views of them."""
    return [source for source in map(viewed, node.all_input_nodes) if is_param_input(source)]


def _move_before(node: Node, anchor: Node) -> bool:
    """Put ``node``, and the inputs it needs that come after ``anchor``, right before
    ``anchor``; False (nothing moved) if any of them depends on ``anchor``."""
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    to_move, pending = set(), [node]
    while pending:
        current = pending.pop()
        if current is anchor:
            return False
        if current in to_move or order[current] < order[anchor]:
            continue
        to_move.add(current)
        pending.extend(current.all_input_nodes)
    for moving in sorted(to_move, key=order.__getitem__):
        anchor.prepend(moving)
    return True
