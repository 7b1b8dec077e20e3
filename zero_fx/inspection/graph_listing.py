"""A rewritten graph as rows a person reads: one per node, parameters by name, zero_fx's
own nodes marked. The text dump and the HTML view both render these rows."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch
from torch.fx import GraphModule, Node

from ..analysis.memory_timeline import is_view, tensor_bytes
from ..base.formatting import format_bytes, short_dtype
from ..passes.common.predicates import (
    UPDATES_META,
    carried_params,
    gathered_param,
    grad_slots,
    is_all_gather,
    is_all_reduce,
    is_all_to_all,
    is_param_input,
    is_reduce_scatter,
    is_update,
    is_wait,
    param_name,
    phase_of,
    runs_across_replicas,
)
from ..passes.recompute_activations import RECOMPUTED_META

COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")

ARGS_WIDTH = 110
NAME_WIDTH = 40
PHASE_SHORT = {"forward": "fwd", "backward": "bwd"}


@dataclass(frozen=True)
class NodeRow:
    """One node of the graph, ready to print."""

    index: int
    phase: str
    """"forward" or "backward"."""
    name: str
    op: str
    """The op without namespaces (``mm``, ``all_gather_into_tensor``), "input" or "output"."""
    args: str
    value: str
    """dtype and shape of what the node yields (``f32[64, 32]``)."""
    kind: str
    """What the view colours it as: a collective kind, "wait", "param" (a parameter input),
    "gathered" (a full parameter ready for use), "comm" (other code zero_fx inserted
    to move parameters or gradients), "input", "output", or "compute"."""
    note: str
    """What zero_fx knows of the node, in words ("" if nothing)."""
    inputs: tuple[str, ...]
    """Names of the nodes it reads."""


def graph_rows(gm: GraphModule, plan=None, *, rank_neutral: bool = False) -> list[NodeRow]:
    """The rows of ``gm``, in graph order; ``plan`` (a ShardPlan) adds shard sizes.

    ``rank_neutral``: rows that are equal on every rank running the same graph, for
    comparing ranks ([Note: checking that ranks agree]): arguments are not shortened, a
    device reads as its type (``cuda``), since rank r's graph reads its own ``cuda:r``
    wherever the step writes ``device=x.device``, and a process group by its role (with a
    mesh, each shard group has a name of its own: [Note: hybrid sharding])."""
    grads = {}
    output = gm.graph.output_node()
    for index, name in grad_slots(gm).items():
        out = output.args[0][index]
        if isinstance(out, Node):
            grads[out] = name
    neutral = _group_roles(plan) if rank_neutral else None
    return [_row(i, node, plan, grads, neutral) for i, node in enumerate(gm.graph.nodes)]


def _group_roles(plan) -> dict:
    """Rank-neutral names: each process group the plan's collectives use, by its role."""
    roles = {}
    if plan is not None:
        roles[plan.group_name] = "<shard group>"
        if plan.replicate_group_name:
            roles[plan.replicate_group_name] = "<replicate group>"
        secondary = getattr(plan, "secondary", None)
        if secondary is not None:
            roles[secondary.node_group_name] = "<node group>"
            roles[secondary.across_group_name] = "<across-nodes group>"
        parallel = getattr(plan, "expert_parallel", None)
        if parallel is not None:
            roles[parallel.group_name] = "<expert-parallel group>"
            roles[parallel.data_group_name] = "<expert-data-parallel group>"
        tensor_parallel = getattr(plan, "tensor_parallel", None)
        if tensor_parallel is not None:
            roles[tensor_parallel.group_name] = "<tp group>"
    return roles


def _row(index: int, node: Node, plan, grads: dict[Node, str], neutral: Optional[dict]) -> NodeRow:
    kind, note = _kind_and_note(node, plan)
    if node in grads:
        note = "; ".join(filter(None, [note, f"gradient of {grads[node]}"]))
    return NodeRow(
        index=index,
        phase=phase_of(node).value,
        name=node.name,
        op=_op(node),
        args=_args(node, neutral),
        value=_value(node.meta.get("val")),
        kind=kind,
        note=note,
        inputs=tuple(n.name for n in node.all_input_nodes),
    )


def _kind_and_note(node: Node, plan) -> tuple[str, str]:
    if is_param_input(node):
        return "param", _param_note(node, plan)
    if node.op == "placeholder":
        return "input", "input of the step"
    if node.op == "output":
        return "output", ""
    for kind, test in zip(COLLECTIVE_KINDS, (is_all_gather, is_reduce_scatter, is_all_reduce,
                                             is_all_to_all)):
        if test(node):
            buffer = (node.args[0].meta["val"] if kind in ("reduce_scatter", "all_to_all")
                      else node.meta["val"])
            nbytes = tensor_bytes(buffer)
            return kind, (f"{kind.upper().replace('_', '-')} {format_bytes(nbytes)} of "
                          f"{_members(carried_params(node))}"
                          + (" across replicas" if runs_across_replicas(node, plan) else ""))
    if is_wait(node):
        return "wait", f"wait for {node.args[0].name}"
    if is_update(node):
        return "update", (f"zero_fx: steps the optimizer on {_members(node.meta[UPDATES_META])} "
                          "and frees their gradients")
    gathered = gathered_param(node)
    if gathered:
        return "gathered", f"full {gathered[0]} for the {gathered[1].value}"
    if carried_params(node):
        quiet = node.target is operator.getitem or is_view(node)
        return "comm", "" if quiet else f"zero_fx: moves {_members(carried_params(node))}"
    if node.meta.get(RECOMPUTED_META):
        return "recomputed", f"recomputes {node.meta[RECOMPUTED_META]} of the forward"
    return "compute", ""


def _param_note(node: Node, plan) -> str:
    name = param_name(node)
    val = node.meta.get("val")
    layout = plan.layout(name) if plan is not None else None
    if layout is not None and isinstance(val, torch.Tensor) and val.numel() == layout.shard_numel \
            and layout.shard_numel != layout.numel:
        return f"shard of {name}: {layout.shard_numel:,} of {layout.numel:,} elements"
    return f"parameter {name}"


def _members(names: tuple[str, ...]) -> str:
    if len(names) <= 3:
        return "[" + ", ".join(names) + "]"
    return f"[{names[0]}, {names[1]}, … {names[-1]}] ({len(names)} parameters)"


def _op(node: Node) -> str:
    if node.op == "placeholder":
        return "input"
    if node.op == "output":
        return "output"
    if node.op != "call_function":
        return node.op
    name = getattr(node.target, "__name__", str(node.target))
    if hasattr(node.target, "_schema"):  # an OpOverload: aten.mm.default -> mm
        overload = node.target._overloadname
        name = node.target._schema.name.split("::")[-1]
        return name if overload == "default" else f"{name}.{overload}"
    return name


def _args(node: Node, neutral: Optional[dict] = None) -> str:
    """``neutral``: rank-neutral arguments, process groups named by their role (a dict of
    group name to role; see ``graph_rows``)."""
    if node.op in ("placeholder",):
        return ""
    parts = ([_arg(a, neutral) for a in node.args]
             + [f"{k}={_arg(v, neutral)}" for k, v in node.kwargs.items()])
    text = ", ".join(parts)
    if neutral is not None or len(text) <= ARGS_WIDTH:
        return text
    return text[:ARGS_WIDTH - 1] + "…"


def _arg(value, neutral: Optional[dict] = None) -> str:
    if isinstance(value, Node):
        return value.name
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_arg(v, neutral) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, torch.dtype):
        return short_dtype(value)
    if isinstance(value, torch.device) and neutral is not None:
        return value.type
    if isinstance(value, str):
        return repr(value if neutral is None else neutral.get(value, value))
    return str(value)


def _value(val) -> str:
    if isinstance(val, torch.Tensor):
        return f"{short_dtype(val.dtype)}[{', '.join(str(s) for s in val.shape)}]"
    if isinstance(val, (list, tuple)):
        shown = [s for s in (_value(v) for v in val) if s]
        return "(" + ", ".join(shown) + ")" if len(shown) <= 3 else f"({len(shown)} tensors)"
    return "" if val is None else type(val).__name__


def format_rows(rows: list[NodeRow], title: Optional[str] = None) -> str:
    """The rows as a text listing: ``index phase name: value = op(args)  # note``."""
    lines = [f"# {title}"] if title else []
    lines.append("# index phase   name: value = op(args)    # what zero_fx knows of it")
    for r in rows:
        head = f"{r.name}: {r.value}" if r.value else r.name
        call = r.op if r.op == "input" else f"{r.op}({r.args})"
        note = f"    # {r.note}" if r.note else ""
        lines.append(f"{r.index:>6} {PHASE_SHORT[r.phase]:<5} {head:<{NAME_WIDTH}} = {call}{note}")
    return "\n".join(lines) + "\n"
