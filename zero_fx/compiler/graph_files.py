"""A rewritten step's graph as bytes and back: what a saved step holds ([Note: saved steps]
in saved_steps.py).

[Note: a graph as bytes]
torch has no stable file for an FX graph that keeps what lowering and the step's runner read:
``torch.save`` of a GraphModule writes its generated code, not its nodes' metadata, and
the FX graph cache's pickler refuses functional collectives and calls of Python functions
(our ``update_bucket``). So each node is written as a record (op, name, target, arguments
with nodes as indices, metadata) with the standard pickler, and three kinds of value by
their description:
- a fake tensor (a node's ``val``) by its dtype, shape, strides, offset, device and
  ``requires_grad``, made again in one fresh fake mode on loading (values are only read for
  their layout: the lowering traces the graph again on the real inputs);
- an aten or functional-collective op by its qualified name (``torch.ops.ns.op.overload``);
- a subgraph (``get_attr`` of a GraphModule) as a graph of its own; a tensor constant as
  its values.
Module-level functions (``operator.getitem``, our ``update_bucket``) are written by name,
as pickle does. Anything else fails the save (``NotSavable``): a lambda or a closure as a
target, a symbolic size, an object of the user's. Node names are written and given back
as they were, and so are the names the graph ever gave (a node a pass adds later is named
as in the graph saved).
"""

from __future__ import annotations

import contextvars
import io
import operator
import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_aggregate
from torch.fx._lazy_graph_module import _make_graph_module


class NotSavable(Exception):
    """Why a graph cannot be written (the step is compiled as before, and not saved)."""


@dataclass(frozen=True)
class _NodeIndex:
    index: int


_LOADING_FAKES: contextvars.ContextVar = contextvars.ContextVar("zero_fx_loading_fakes")


def graph_bytes(gm: GraphModule) -> bytes:
    """``gm`` as bytes ([Note: a graph as bytes]); raises ``NotSavable``."""
    buffer = io.BytesIO()
    try:
        _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(_record(gm))
    except (pickle.PicklingError, TypeError, AttributeError) as why:
        raise NotSavable(str(why)) from why
    return buffer.getvalue()


def graph_from_bytes(data: bytes) -> GraphModule:
    """The GraphModule ``graph_bytes`` wrote, its fake values of one new fake mode."""
    token = _LOADING_FAKES.set(FakeTensorMode())
    try:
        return _graph_module(pickle.loads(data))
    finally:
        _LOADING_FAKES.reset(token)


def _record(gm: GraphModule) -> dict:
    index = {node: i for i, node in enumerate(gm.graph.nodes)}
    nodes = [(node.op, node.name, node.target,
              torch.fx.node.map_arg((node.args, node.kwargs), lambda n: _NodeIndex(index[n])),
              dict(node.meta), node.type)
             for node in gm.graph.nodes]
    attributes = {}
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            value = operator.attrgetter(node.target)(gm)
            if isinstance(value, GraphModule):
                attributes[node.target] = ("graph", _record(value))
            elif isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
                attributes[node.target] = ("tensor", value.detach().cpu(), str(value.device))
            else:
                raise NotSavable(f"{node.op} {node.target} holds a {type(value).__name__}")
    namespace = gm.graph._graph_namespace
    return {"nodes": nodes, "attributes": attributes, "meta": dict(gm.meta),
            "class_name": type(gm).__name__, "codegen": gm.graph._codegen,
            "used_names": sorted(namespace._used_names), "base_count": dict(namespace._base_count)}


def _graph_module(record: dict) -> GraphModule:
    graph = Graph()
    graph._codegen = record["codegen"]
    nodes: list[Node] = []
    for op, name, target, (args, kwargs), meta, type_ in record["nodes"]:
        args, kwargs = map_aggregate(
            (args, kwargs), lambda v: nodes[v.index] if isinstance(v, _NodeIndex) else v)
        node = graph.create_node(op, target, args, kwargs, name=name, type_expr=type_)
        if node.name != name:
            raise ValueError(f"node {name} came back as {node.name}")
        node.meta = meta
        nodes.append(node)
    graph._graph_namespace._used_names = set(record["used_names"])
    graph._graph_namespace._base_count = dict(record["base_count"])
    # a root of qualified names: GraphModule makes the submodules and buffers they name
    root = {target: _graph_module(value[0]) if kind == "graph" else value[0].to(value[1])
            for target, (kind, *value) in record["attributes"].items()}
    gm = _make_graph_module(root, graph, class_name=record["class_name"])
    gm.meta.update(record["meta"])
    return gm


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, FakeTensor):
            return _fake, (obj.dtype, tuple(obj.shape), tuple(obj.stride()),
                           obj.storage_offset(), str(obj.device), obj.requires_grad)
        if isinstance(obj, torch._ops.OpOverload):
            return _overload, (obj.namespace, obj._opname, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            return _packet, (obj._qualified_op_name.split("::")[0], obj.__name__)
        if isinstance(obj, torch._ops.HigherOrderOperator):
            return _higher_order, (obj.name(),)
        if isinstance(obj, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise NotSavable("symbolic sizes")
        if isinstance(obj, Node):
            raise NotSavable(f"a node ({obj.name}) held outside the node's arguments")
        return NotImplemented


def _fake(dtype, shape, stride, offset, device, requires_grad):
    """A fake of the loading fake mode with this layout: made on the meta device and given
    its device (as fake tensors are made from meta ones), without a dispatch through the
    fake mode for each value."""
    extent = offset + sum((size - 1) * step for size, step in zip(shape, stride)) + 1
    meta = torch.empty(extent if 0 not in shape else offset, dtype=dtype, device="meta")
    meta = meta.as_strided(shape, stride, offset).detach().requires_grad_(requires_grad)
    mode = _LOADING_FAKES.get()
    return mode.fake_tensor_converter.from_meta_and_device(mode, meta, torch.device(device))


def _overload(namespace: str, name: str, overload: str):
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _packet(namespace: str, name: str):
    return getattr(getattr(torch.ops, namespace), name)


def _higher_order(name: str):
    return getattr(torch.ops.higher_order, name)

