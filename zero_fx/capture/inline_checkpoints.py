"""The model's own activation checkpointing, handed to zero_fx's recompute pass.

[Note: torch.utils.checkpoint in a captured step]
Dynamo records ``torch.utils.checkpoint.checkpoint(fn, ...)`` (and HF's
``gradient_checkpointing_enable()``, which calls it per layer) as a
``tag_activation_checkpoint`` region. ``make_fx`` would run that region through
the checkpoint machinery on fake tensors, which refuses random ops (dropout's
in-place ``bernoulli_`` is "a tensor cached during selective activation
checkpoint [that] has been mutated"), and would recompute dropout with fresh
random numbers anyway. zero_fx instead inlines each region into the step and
recomputes with its own pass (``recompute_activations``), which keeps what random
ops drew: a step whose model checkpoints is compiled with ``recompute="blocks"``
unless the user chose a recompute mode. Checkpointing per block, as HF and
torchtitan do, is what ``"blocks"`` does; a region that is not a whole block (a
checkpointed MLP) is recomputed as part of its block, and a selective policy
(``context_fn``) is replaced by ``"blocks"`` too (logged).
"""

from __future__ import annotations

import logging
import operator

import torch
from torch.fx import GraphModule

log = logging.getLogger("zero_fx")


def inline_checkpoints(gm: GraphModule) -> int:
    """Replace every ``tag_activation_checkpoint`` region of dynamo's graph ``gm`` by its
    body's nodes; returns how many regions there were (nested ones included)."""
    hop = torch.ops.higher_order.tag_activation_checkpoint
    regions = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=hop)):
        body_attr = node.args[0]
        body = getattr(gm, body_attr.target)
        regions += 1 + inline_checkpoints(body)
        if node.kwargs.get("context_fn") is not None:
            log.info("zero_fx: a selective checkpoint policy (context_fn) is replaced by "
                     "recompute='blocks' ([Note: torch.utils.checkpoint in a captured step])")
        env = dict(zip(body.graph.find_nodes(op="placeholder"), node.args[1:]))
        for attr in body.graph.find_nodes(op="get_attr"):
            name = f"{body_attr.target}_{attr.target.replace('.', '_')}"
            setattr(gm, name, getattr(body, attr.target))
            attr.target = name
        with gm.graph.inserting_before(node):
            outputs = gm.graph.graph_copy(body.graph, env)
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise RuntimeError(f"zero_fx cannot inline a checkpoint region read by {user}")
            user.replace_all_uses_with(outputs[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        if not body_attr.users:
            gm.graph.erase_node(body_attr)
            delattr(gm, body_attr.target)
    if regions:
        gm.graph.lint()
        gm.recompile()
    return regions
