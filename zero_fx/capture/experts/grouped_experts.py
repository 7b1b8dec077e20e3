"""An expert's forward run for every expert at once: the grouped computation of step 4 of
[Note: routed experts with fixed shapes] (routed_experts.py)."""

from __future__ import annotations

import torch
from torch import nn

from .grouped_mm import grouped_linear


class NotGroupable(Exception):
    pass


class GroupedExperts:
    """An expert's forward traced once (``torch.fx.symbolic_trace``), each ``nn.Linear``
    replaced by ``grouped_linear`` over every expert's stacked weights. Other submodules
    must hold no state (activations); other operations must act on each row alone, which
    the installing check confirms numerically."""

    def __init__(self, expert: nn.Module):
        if isinstance(expert, nn.Linear):  # the expert is one linear layer
            expert = nn.Sequential(expert)
        try:
            traced = torch.fx.symbolic_trace(expert)
        except Exception as err:  # noqa: BLE001 - any tracing failure means "not this shape"
            raise NotGroupable(f"torch.fx.symbolic_trace failed: {err}") from None
        graph = torch.fx.Graph()
        rows, offs, group_of_row = (graph.placeholder(n) for n in ("rows", "offs", "group_of_row"))
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        self.linears: list[tuple[str, bool]] = []
        inputs = [n for n in traced.graph.nodes if n.op == "placeholder"]
        if len(inputs) != 1:
            raise NotGroupable(f"its forward takes {len(inputs)} inputs, not one")
        weights = []
        for node in traced.graph.nodes:
            if node.op == "placeholder":
                env[node] = rows
            elif node.op == "call_module" and isinstance(traced.get_submodule(node.target), nn.Linear):
                has_bias = traced.get_submodule(node.target).bias is not None
                self.linears.append((node.target, has_bias))
                weight = graph.placeholder(f"w_{len(weights)}")
                bias = graph.placeholder(f"b_{len(weights)}") if has_bias else None
                weights.append(weight)
                env[node] = graph.call_function(
                    grouped_linear, (env[node.args[0]], weight, bias, offs, group_of_row))
            elif node.op == "call_module":
                sub = traced.get_submodule(node.target)
                if any(True for _ in sub.parameters()) or any(True for _ in sub.buffers()):
                    raise NotGroupable(f"its submodule {node.target!r} holds state and is not "
                                        f"an nn.Linear")
                env[node] = graph.node_copy(node, lambda n: env[n])
            elif node.op == "get_attr":
                raise NotGroupable(f"its forward reads the tensor {node.target!r} directly")
            else:
                env[node] = graph.node_copy(node, lambda n: env[n])
        if not self.linears:
            raise NotGroupable("it has no nn.Linear")
        self.module = torch.fx.GraphModule(traced, graph)

    def __call__(self, rows, offs, group_of_row, experts: nn.ModuleList):
        stacked = []
        for name, has_bias in self.linears:
            linears = [e if isinstance(e, nn.Linear) else e.get_submodule(name) for e in experts]
            stacked.append(torch.stack([lin.weight for lin in linears]))
            if has_bias:
                stacked.append(torch.stack([lin.bias for lin in linears]))
        return self.module(rows, offs, group_of_row, *stacked)
