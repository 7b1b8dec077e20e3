"""Insert tensor code into a graph: trace it with make_fx, copy its nodes in.

Passes write what they insert as ordinary tensor code (``gather_bucket``,
``reduce_scatter_bucket``); ``splice`` traces it on the fake values of the nodes it
will read, so every inserted node carries a correct ``meta["val"]``.

[Note: one trace per distinct splice]
A deep model splices the same code hundreds of times: every block's gather bucket is
``gather_bucket`` with the same bound arguments on shards of the same shapes. A trace
costs tens of milliseconds (make_fx sets up a tracer and generates a module), and at 48
blocks those traces were most of the passes' time. The same function with the same
bound arguments on inputs of the same layouts traces to the same graph, so a trace is
kept and copied again; the copies' values are computed afresh on their own inputs (one
fake op each), so no two nodes share a fake tensor. Functions with a closure are traced
every time: what they captured is not in the key.

The traces are kept for the process, not for one compilation: a step compiled again (a
new batch shape, a second step function, the planner tracing a model at three depths)
splices mostly what the first compilation did. A kept trace holds no fake tensor (its
nodes' values are dropped when it is kept), so it keeps no fake mode alive, and its key
holds what else decides a trace that a process may change between compilations: the
default dtype, grad mode, and which function each global name the code calls is bound
to, through the functions it calls that are not torch's (a test that patches
``collective_code._average`` out gets a trace without the divide, not the kept one).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import types
from typing import Any, Callable, Hashable, Mapping, Optional, Sequence

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import Graph, GraphModule, Node, map_arg
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


def trace_to_aten(fn: Callable, tracing_mode: str = "real",
                  decompositions: Optional[Mapping] = None) -> Callable[..., GraphModule]:
    """``make_fx(fn)`` without its torch-function metadata mode, which records on each node
    the torch function that made it (``meta["torch_fn"]``, read by nothing of ours nor by
    our lowering) and costs about a third of a trace: capturing a 48-block GPT-2 step took
    7.0-7.8 s with it, 4.9-5.6 s without."""
    return make_fx(fn, decomposition_table=decompositions, tracing_mode=tracing_mode,
                   _disable_torch_fn_metadata_mode=True)


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
            traced, traced_now = _trace(fn, vals, fake_mode)
            env: dict[Node, Node] = {}
            placeholders = iter(inputs)
            results: list[Node] = []
            with graph.inserting_before(before):
                for node in traced.nodes:
                    if node.op == "placeholder":
                        env[node] = next(placeholders)
                    elif node.op == "output":
                        results = [env[r] for r in torch.utils._pytree.tree_leaves(node.args[0])]
                    else:
                        new = graph.node_copy(node, lambda n: env[n])
                        if not traced_now:  # [Note: one trace per distinct splice]
                            new.meta["val"] = _fake_value(new)
                        new.meta[PHASE_META] = phase
                        new.meta.update(meta)
                        env[node] = new
    return results


KEPT_TRACES = 4096
"""How many distinct splices the process keeps the trace of (the least recently used
go first). A compilation of a GPT-2-sized step splices a few hundred distinct ones."""

_kept: "collections.OrderedDict[Hashable, Graph]" = collections.OrderedDict()
"""The trace of each distinct splice, without values ([Note: one trace per distinct
splice])."""


def _trace(fn: Callable, vals: Sequence, fake_mode) -> tuple[Graph, bool]:
    """``fn`` traced on ``vals`` (a kept trace where there is one) and whether it was
    traced now (then its nodes carry their values)."""
    key = _trace_key(fn, vals) if fake_mode is not None else None
    if key in _kept:
        _kept.move_to_end(key)
        return _kept[key], False
    sub = trace_to_aten(fn, "real" if fake_mode is not None else "fake")(*vals)
    if key is not None:
        _kept[key] = _without_values(sub.graph)
        if len(_kept) > KEPT_TRACES:
            _kept.popitem(last=False)
    return sub.graph, True


def _without_values(graph: Graph) -> Graph:
    """A copy of ``graph`` whose nodes' metadata holds no tensor (a fake tensor would keep
    its fake mode, and every tensor of that mode, alive)."""
    copy = Graph()
    copy.output(copy.graph_copy(graph, {}))
    for node in copy.nodes:
        node.meta = {k: v for k, v in node.meta.items()
                     if not any(isinstance(leaf, torch.Tensor)
                                for leaf in torch.utils._pytree.tree_leaves(v))}
    return copy


def _trace_key(fn: Callable, vals: Sequence) -> Optional[Hashable]:
    """What decides ``fn``'s trace on ``vals``: its code, its bound arguments, the inputs'
    layouts; None where that is not all (a closure, a symbolic size)."""
    func, bound = (fn.func, (fn.args, sorted(fn.keywords.items()))) if isinstance(
        fn, functools.partial) else (fn, ())
    code = getattr(func, "__code__", None)
    if (code is None or getattr(func, "__closure__", None)
            or any(isinstance(b, torch.Tensor) for b in torch.utils._pytree.tree_leaves(bound))):
        return None
    layouts = [static_layout(v) if isinstance(v, torch.Tensor) else None for v in vals]
    if None in layouts:
        return None
    return (code, repr(bound), tuple(layouts), torch.get_default_dtype(),
            torch.is_grad_enabled(), _called_functions(func))


def static_layout(value: torch.Tensor) -> Optional[tuple]:
    """What of a tensor decides a trace on it: sizes, strides, offset, dtype, device,
    requires_grad, the conjugate and negative bits; None if a size is symbolic."""
    sizes = (tuple(value.shape), value.stride(), value.storage_offset())
    if not all(type(n) is int for n in torch.utils._pytree.tree_leaves(sizes)):
        return None
    return sizes, value.dtype, value.device, value.requires_grad, value.is_conj(), value.is_neg()


def _called_functions(func) -> tuple:
    """The functions ``func`` calls by global name, and those they call, as (name, id)
    pairs: a global rebound since a trace was kept (a patched helper) changes the key.
    torch's own functions are taken as they are, not followed."""
    found, stack, seen = [], [func], set()
    while stack:
        function = stack.pop()
        if id(function) in seen:
            continue
        seen.add(id(function))
        scope = getattr(function, "__globals__", {})
        for name in _global_names(function.__code__):
            value = scope.get(name)
            if isinstance(value, types.FunctionType):
                found.append((name, id(value)))
                if not (value.__module__ or "").startswith("torch"):
                    stack.append(value)
    return tuple(found)


def _global_names(code: types.CodeType) -> list[str]:
    """The names ``code`` looks up, its comprehensions' and inner functions' too."""
    names = list(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names += _global_names(constant)
    return names


def _fake_value(node: Node):
    """``node``'s value, computed from its inputs' values (under their fake mode)."""
    args, kwargs = map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    return node.target(*args, **kwargs)
