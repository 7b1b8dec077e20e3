"""``.item()`` in a captured step: a value the graph returns, not a host read inside it.

[Note: .item() as a graph output]
With ``capture_scalar_outputs`` dynamo traces ``loss.item()`` as a ``call_method item`` node
whose value is a symbolic number, and returns what uses it (``return loss.item()``, a
print's argument, ``loss.item() * 2``) through ``torch.scalar_tensor(value,
dtype=float64)`` outputs, which it turns back into Python numbers after the graph. The
aten trace of the step cannot read a number out of a fake tensor, so before it, each such
``item`` becomes the 0-dim tensor itself, cast to float64 (int64 for integers, bool for
bools), and each ``scalar_tensor`` of it a cast. Arithmetic on it stays the same
``operator`` calls, now on tensors, in the same precision as Python's floats. An ``item``
with any other reader (a size, a branch's condition, a library call on the number) is
left alone, and the trace fails as before with the error that names it.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from .errors import CaptureError

_ARITHMETIC = frozenset({operator.add, operator.sub, operator.mul, operator.truediv,
                         operator.floordiv, operator.mod, operator.pow, operator.neg,
                         operator.pos, operator.abs})


def item_as_tensor(value: torch.Tensor) -> torch.Tensor:
    """``value.item()``, kept on the device: a 0-dim tensor of Python's precision."""
    value = value.detach()
    if value.dtype == torch.bool:
        return value.clone()
    return value.to(torch.float64 if value.is_floating_point() else torch.int64)


def scalar_as_tensor(value, dtype=None, **kwargs) -> torch.Tensor:
    """``torch.scalar_tensor(value, dtype=...)`` of a value ``item_as_tensor`` made."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if dtype is not None else value
    return torch.scalar_tensor(value, dtype=dtype, **kwargs)


def items_as_tensors(gm: GraphModule) -> int:
    """Rewrite the ``item`` nodes whose values only feed arithmetic and the graph's outputs
    ([Note: .item() as a graph output]); the number rewritten."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if not _is_item(node):
            continue
        readers = _scalar_readers(node)
        if readers is None:
            continue
        _check_written(node)
        node.op, node.target = "call_function", item_as_tensor
        for reader in readers:
            if reader.target is torch.scalar_tensor:
                reader.target = scalar_as_tensor
        rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten


def _check_written(item: Node) -> None:
    """``.item()`` of a tensor the graph never writes is a value that arrives after it: the
    norm ``clip_grad_norm_`` returns inside a step (runtime/update/companions.py)."""
    source = item.args[0]
    if isinstance(source, Node) and source.target in (torch.empty, torch.empty_like):
        raise CaptureError(
            "the step reads .item() of the norm clip_grad_norm_ returned; zero_fx computes that "
            "norm after the graph, from the reduced gradients, so inside the step it has no "
            "value yet. Log or return the tensor itself (`logger.info('%.3f', norm)`, "
            "`return {'grad_norm': norm}`): it holds the norm when the step returns, and a "
            "logged line is formatted then.")


def _is_item(node: Node) -> bool:
    return ((node.op == "call_method" and node.target == "item")
            or (node.op == "call_function"
                and node.target is torch.ops.aten._local_scalar_dense.default))


def _scalar_readers(item: Node):
    """The nodes reading ``item``'s number, through arithmetic, if every one is arithmetic,
    a ``scalar_tensor`` or the output; else None."""
    readers, frontier = [], [item]
    while frontier:
        for user in frontier.pop().users:
            if user.op == "output" or user in readers:
                continue
            if user.op == "call_function" and user.target is torch.scalar_tensor:
                readers.append(user)
            elif user.op == "call_function" and user.target in _ARITHMETIC:
                readers.append(user)
                frontier.append(user)
            else:
                return None
    return readers
