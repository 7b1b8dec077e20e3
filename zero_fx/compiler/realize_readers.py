"""Store what is computed from a released gathered parameter, so Inductor frees the gather
where our graph does.

[Note: a released gather's readers are stored]
Stage 3 gathers a parameter, uses it, and releases it: in our graph the gathered
buffer dies with its last reader. Inductor may decide otherwise. It does not
store a cheap pointwise result (an indirect load such as ``embedding(weight,
ids)``, an add): it recomputes it inside each kernel that reads it, and every
one of those kernels then reads the gathered buffer, which lives until the
last of them. Found with ``lowered_memory`` ([Note: reading buffer lifetimes
from generated code]) on GPT-2 125M at stage 3: the largest buffer alive at
the program's peak, deep in the backward, was the forward's gathered token
embedding (147 MiB), read by the layer norm backward of block 0 because that
kernel recomputed the block's input, ``wte[ids] + wpe[pos]``, instead of
reading it; the program peaked 1.24x above the graph.

The fix marks the first reader of every released gather that is not a view
(through the wait, the bucket's split and the parameter's views) with
``meta["inductor_realize_to_strides"]``, which makes Inductor store that node's
result (``GraphLowering.run_node`` realizes it), so later kernels read the
stored activation, as eager does, and not the weight. A matmul reader is stored
anyway (an extern kernel). Residents (``plan.resident``) are gathered once for
the whole step, so their readers (norms, biases: pointwise ops Inductor should
keep fusing) are left alone. The marks ride on ``meta["custom"]``, which
AOTAutograd copies onto every node it retraces, into a post-grad pre-pass (with
a ``uuid()``, so the FX graph cache still works).

To find the next such lifetime: compare ``step.compilations[-1].memory`` with
the graph's timeline (``explain()`` prints both), take the largest buffer alive
at the program's peak, and search the generated code (``TORCH_LOGS=output_code``)
for its last reader.
"""

from __future__ import annotations

import operator
from typing import Collection, Iterator

from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx import Graph, GraphModule, Node

from ..analysis.memory_timeline import is_view
from ..passes.common.predicates import carried_params, is_all_gather, is_anchor_compute, is_wait

RELEASED_KEY = "zero_fx_released_gather"
"""Key in ``node.meta["custom"]``: an all-gather of parameters that are released after use."""
REALIZE_META = "inductor_realize_to_strides"


def tag_released_gathers(gm: GraphModule, resident: Collection[str]) -> None:
    """Mark (in ``meta["custom"]``) each all-gather of ``gm`` whose parameters are not
    resident."""
    for node in gm.graph.nodes:
        params = carried_params(node)
        if is_all_gather(node) and params and not set(params) & set(resident):
            node.meta["custom"] = {**(node.meta.get("custom") or {}), RELEASED_KEY: True}


class StoreReleasedReaders(CustomGraphPass):
    """Inductor post-grad pre-pass: store the first reader of each released gather
    ([Note: a released gather's readers are stored])."""

    def __call__(self, graph: Graph) -> None:
        for node in graph.nodes:
            if (node.meta.get("custom") or {}).get(RELEASED_KEY):
                for reader in first_readers(node):
                    reader.meta[REALIZE_META] = True

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


def first_readers(gathered: Node) -> Iterator[Node]:
    """The nodes that compute from ``gathered``'s value: past its wait and every view of it
    (the bucket's split, the parameter's reshapes); matmuls and attention left out (Inductor
    stores their results anyway)."""
    seen, stack = set(), list(gathered.users)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if is_wait(node) or is_view(node) or node.target is operator.getitem:
            stack.extend(node.users)
        elif node.op == "call_function" and not is_anchor_compute(node):
            yield node
