"""accumulate_embedding_grads: a tied embedding's rows are added into the head's gradient.

[Note: the tied embedding's two gradients]
When the output head shares its weight with the token embedding (GPT-2,
nanoGPT), autograd computes that weight's gradient in two pieces: the head's
``mm`` at the start of the backward and ``embedding_dense_backward`` at its very
end, and adds them. Recorded as functional ops, the end of the backward holds
three full tables at once: the head's gradient (alive through the whole
backward), the embedding's (a table of zeros with the token rows summed in) and
their sum. For GPT-2's 50304 x 768 that is 3 x 147 MiB: in GPT-2 125M at stage
3 over 2 ranks, the graph's timeline over the last 15 % of the step peaks at
609 MiB without this pass and 467 MiB with it. Eager autograd holds two tables,
since it adds into ``.grad`` in place. This pass writes the rows straight into the head's gradient,
``index_put(head_grad, [ids], rows, accumulate=True)``: one table fewer, and
Inductor may write the result into the head's buffer. The sum is the same up to
the order of the additions.

Only plain embeddings are rewritten: no ``padding_idx`` (its row's gradient is
dropped) and no ``scale_grad_by_freq`` (the rows are scaled by counts), and only
where the ``add`` is the sole reader of both addends.

[Note: the head's gradient is made where the rows are added]
The head's gradient is still a table alive from the head's backward to the
embedding's, through the whole backward. It is one matmul of two values,
``logits_grad^T @ hidden``. When those two are smaller than the table (fewer
tokens than the model is wide: B*T*V + B*T*d < V*d), the matmul moves to the
end, right before the rows are added: the backward then keeps the smaller
inputs alive instead of the table. GPT-2 125M at 1 x 512 tokens per rank keeps
98 MiB of logits' gradient instead of a 147 MiB table. With more tokens per
rank than the width the inputs are larger, and the matmul stays where it is.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from .common.predicates import (Phase, is_anchor_compute, is_view, phase_of, readers_through_views,
                                tensor_bytes, viewed)
from .common.splice import splice

aten = torch.ops.aten


def accumulate_embedding_grads(gm: GraphModule, plan=None) -> GraphModule:
    """``add(grad, embedding_dense_backward(rows, ids, n, -1, False))`` becomes
    ``index_put(grad, [ids], rows, accumulate=True)``.

    Requires: phases annotated. Ensures: no backward ``add`` reads both a gradient and an
    ``embedding_dense_backward`` of a plain embedding that nothing else reads.
    """
    rewritten = False
    for node in list(gm.graph.nodes):
        match = _tied_gradient_sum(node)
        if match is None:
            continue
        grad, dense = match
        rows, ids = dense.args[0], dense.args[1]
        # See [Note: the head's gradient is made where the rows are added]
        _make_late_if_smaller(gm, grad, node)
        (summed,) = splice(gm.graph, _add_rows_into, [grad, ids, rows], before=node,
                           phase=Phase.BACKWARD)
        node.replace_all_uses_with(summed)
        gm.graph.erase_node(node)
        gm.graph.erase_node(dense)
        rewritten = True
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return gm


def _tied_gradient_sum(node: Node):
    """``(grad, dense)`` if ``node`` adds a plain embedding's dense gradient to another one."""
    if node.op != "call_function" or node.target != aten.add.Tensor \
            or phase_of(node) is not Phase.BACKWARD or len(node.args) != 2 or node.kwargs:
        return None
    for dense, grad in (node.args, node.args[::-1]):
        if not (isinstance(dense, Node) and dense.target == aten.embedding_dense_backward.default
                and isinstance(grad, Node)):
            continue
        padding_idx, scale_grad_by_freq = dense.args[3], dense.args[4]
        dense_val, grad_val = dense.meta["val"], grad.meta["val"]
        if padding_idx == -1 and not scale_grad_by_freq and len(dense.users) == 1 \
                and len(grad.users) == 1 and grad_val.shape == dense_val.shape \
                and grad_val.dtype == dense_val.dtype:
            return grad, dense
    return None


def _add_rows_into(grad: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return grad.index_put([ids], rows.to(grad.dtype), accumulate=True)


def _make_late_if_smaller(gm: GraphModule, grad: Node, reader: Node) -> None:
    """Move the matmul computing ``grad`` (and the views between) right before ``reader``
    when what it reads, kept alive until there, takes fewer bytes than ``grad``."""
    chain = [grad]
    while is_view(chain[-1]) and len(chain[-1].all_input_nodes) == 1:
        chain.append(chain[-1].all_input_nodes[0])
    matmul = chain[-1]
    if not is_anchor_compute(matmul) or any(len(n.users) != 1 for n in chain):
        return
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    extended = {viewed(i) for i in matmul.all_input_nodes}
    extended = {b for b in extended
                if all(order[u] < order[reader] for u in readers_through_views(b) if u not in chain)}
    if sum(tensor_bytes(b.meta.get("val")) for b in extended) >= tensor_bytes(grad.meta["val"]):
        return
    for node in reversed(chain):
        reader.prepend(node)
