"""Insert tensor code into a graph: trace it with make_fx, copy its nodes in.

Passes write what they insert as ordinary tensor code (``gather_bucket``,
``reduce_scatter_bucket``); ``splice`` traces it on the fake values of the nodes it
will read, so every inserted node carries a correct ``meta["val"]``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping, Sequence

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import Graph, Node
from torch.fx.experimental.proxy_tensor import make_fx

from .predicates import PHASE_META, Phase


@contextlib.contextmanager
def outside_dynamo_tracing():
    """Leave the tracing context and fake mode of a surrounding dynamo backend call.

    Inside them, shape computations on our own (static) fake tensors would be
    recorded as dynamo guards on symbols that have no source.
    """
    with torch._guards.tracing(None), unset_fake_temporarily():
        yield


def splice(
    graph: Graph,
    fn: Callable[..., torch.Tensor],
    inputs: Sequence[Node],
    *,
    before: Node,
    phase: Phase,
    meta: Mapping[str, Any] = {},
) -> list[Node]:
    """Insert ``fn(*inputs)`` before ``before``; return the nodes of its results
    (``fn`` returns a tensor or a list of tensors).

    Every inserted node is tagged with ``phase`` and the entries of ``meta``.
    """
    vals = [n.meta["val"] for n in inputs]
    # Trace in the graph's own fake mode, not in whatever tracing context
    # (dynamo's, when we run inside a backend) happens to surround the pass.
    with outside_dynamo_tracing():
        fake_mode = detect_fake_mode(vals)
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            sub = make_fx(fn, tracing_mode="real" if fake_mode is not None else "fake")(*vals)
    env: dict[Node, Node] = {}
    placeholders = iter(inputs)
    results: list[Node] = []
    with graph.inserting_before(before):
        for node in sub.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(placeholders)
            elif node.op == "output":
                results = [env[r] for r in torch.utils._pytree.tree_leaves(node.args[0])]
            else:
                new = graph.node_copy(node, lambda n: env[n])
                new.meta[PHASE_META] = phase
                new.meta.update(meta)
                env[node] = new
    return results
