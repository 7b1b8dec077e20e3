"""Node predicates shared by every pass. Passes are specialised by these, never copied."""

from __future__ import annotations

import enum
import operator
from typing import Mapping, Optional, Sequence

import torch
from torch.fx import Node
from torch.utils._sympy.numbers import int_oo

_c10d = torch.ops._c10d_functional

PARAM_META = "zero_param"
"""Placeholder meta key: the parameter's name in the shard plan."""
PHASE_META = "zero_phase"
"""Node meta key: the node's ``Phase`` (set by ``annotate_phases``, kept by every pass)."""
GATHERED_META = "zero_gathered"
"""Node meta key on the node that yields a gathered full parameter: ``(name, Phase)``."""
SECONDARY_META = "zero_secondary"
"""Node meta key on the node that yields a parameter's secondary shard: its name ([Note: the
secondary partition] in zero_fx/plan/secondary.py)."""
CARRIES_META = "zero_carries"
"""Node meta key on inserted communication code: the names of the parameters
whose elements it moves (one bucket), in order."""
LOSS_SCALE_META = "zero_loss_scale"
"""Placeholder meta key: this input is the loss scale (``scale_loss``), not a step argument."""
GRAD_SLOTS_META = "zero_grad_slots"
"""GraphModule meta key: ``{output index: parameter name}`` for the gradient outputs."""
TP_COLLECTIVE_META = "zero_tp_collective"
"""Node meta key: a collective (or its wait) that tensor parallelism (DTensor) put in the
step, on the "tp" group the value names ([Note: capturing a tensor-parallel step] in
zero_fx/capture/tensor_parallel.py). ZeRO's predicates below do not match it: it is data,
moved by no pass, like compute."""
CAPTURED_AT_META = "zero_captured_at"
"""Node meta key: the node's position in the captured graph, before any pass (copies of a
node keep it): what ``check_invariants`` holds every in-place write's readers to ([Note:
in-place writes keep their readers' sides])."""
UPDATES_META = "zero_updates"
"""Node meta key on an optimizer update in the graph (``update_in_graph``): the names of
the parameters whose shards it steps (one bucket), in order."""
KEPT_THROUGH_LOSS_META = "zero_kept_through_loss"
"""GraphModule meta key: the stage-3 parameters whose forward gather also serves the
backward (``gather_params``, [Note: a weight kept through the loss])."""


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


def is_param_input(node: Node) -> bool:
    return node.op == "placeholder" and PARAM_META in node.meta


def param_name(node: Node) -> str:
    return node.meta[PARAM_META]


def phase_of(node: Node) -> Phase:
    return node.meta.get(PHASE_META, Phase.FORWARD)


def _target_is(node: Node, *ops) -> bool:
    return node.op == "call_function" and node.target in ops and TP_COLLECTIVE_META not in node.meta


def is_tensor_parallel_collective(node: Node) -> bool:
    """A collective (not its wait) that tensor parallelism put in the step."""
    return TP_COLLECTIVE_META in node.meta and node.target != _c10d.wait_tensor.default


def collective_group(args) -> str:
    """A functional collective's group name: the last string among its arguments."""
    names = [a for a in args if isinstance(a, str)]
    return names[-1] if names else ""


def tensor_parallel_groups(gm: torch.fx.GraphModule) -> frozenset:
    """The groups tensor parallelism's collectives in ``gm`` run on."""
    return frozenset(node.meta[TP_COLLECTIVE_META] for node in gm.graph.nodes
                     if TP_COLLECTIVE_META in node.meta)


def is_all_gather(node: Node) -> bool:
    return _target_is(node, _c10d.all_gather_into_tensor.default)


def is_reduce_scatter(node: Node) -> bool:
    return _target_is(node, _c10d.reduce_scatter_tensor.default)


def is_all_reduce(node: Node) -> bool:
    return _target_is(node, _c10d.all_reduce.default)


def is_all_to_all(node: Node) -> bool:
    """A quantized reduction's all-to-all ([Note: reductions as all-to-alls] in
    passes/common/quantized_code.py); expert parallelism's exchanges are ops of their own
    (``is_token_exchange``), tensor parallelism's are tagged."""
    return _target_is(node, _c10d.all_to_all_single.default)


def is_collective(node: Node) -> bool:
    return (is_all_gather(node) or is_reduce_scatter(node) or is_all_reduce(node)
            or is_all_to_all(node))


def is_token_exchange(node: Node) -> bool:
    """An all-to-all of expert parallelism ([Note: exchanging rows in fixed shapes] in
    zero_fx/capture/experts/expert_exchange.py): it issues its collective and waits for it itself,
    or (the dispatch) is waited for by its own ``exchange_rows_wait``, where the capture
    put it; the passes that move collectives leave both where they are."""
    return node.op == "call_function" and is_token_exchange_op(node.target)


TOKEN_EXCHANGES = ("exchange_counts", "exchange_rows", "exchange_rows_issue")
"""Expert parallelism's ops that move data (``exchange_rows_wait`` waits and gathers)."""


def is_token_exchange_op(op) -> bool:
    """``op`` (an OpOverload, or any callable) is one of expert parallelism's all-to-alls."""
    return zero_fx_op_name(op) in TOKEN_EXCHANGES


def token_exchange_wait(node: Node) -> Optional[Node]:
    """The ``exchange_rows_wait`` of a dispatch issued by ``exchange_rows_issue``, else None."""
    return next((u for u in node.users if zero_fx_op_name(u.target) == "exchange_rows_wait"), None)


def zero_fx_op_name(op) -> str:
    """The name of ``op`` if it is one of zero_fx's custom ops (``zero_fx::exchange_rows``),
    else ""."""
    return getattr(op, "_opname", "") if getattr(op, "namespace", None) == "zero_fx" else ""


def token_exchange_numel(rows_in, rows_out) -> int:
    """What an all-to-all of expert parallelism counts as moved ([Note: exchanging rows in
    fixed shapes]): its token side, the smaller of what it sends and what it receives (the
    T * k routed rows, the same on every rank at every step, where the other side is the
    worst case's buffer); the counts' exchange, its whole tensor."""
    return min(rows_in.numel(), rows_out.numel())


def is_wait(node: Node, tensor_parallel: bool = False) -> bool:
    """A wait of one of ZeRO's collectives; ``tensor_parallel``: of tensor parallelism's."""
    if tensor_parallel:
        return node.target == _c10d.wait_tensor.default and TP_COLLECTIVE_META in node.meta
    return _target_is(node, _c10d.wait_tensor.default)


ANCHOR_OPS = ("mm", "bmm", "addmm", "baddbmm", "convolution", "convolution_backward")
"""Ops (besides attention) that Inductor runs as kernels of their own (see ``is_anchor_compute``)."""


def is_anchor_compute(node: Node) -> bool:
    """A matmul, attention or convolution: compute that Inductor never fuses into another
    kernel nor inlines into its reader, so it has one well-defined place in the generated
    program ([Note: pinning the schedule through Inductor] in zero_fx/compiler/pin_schedule.py)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    name = node.target._schema.name.split("::")[-1]
    return name in ANCHOR_OPS or "scaled_dot_product" in name


def is_update(node: Node) -> bool:
    """An optimizer update in the graph (``update_in_graph``): it changes the bucket's
    masters and optimizer state in place, and runs in the outer graph."""
    return node.op == "call_function" and UPDATES_META in node.meta


def is_view(node: Node) -> bool:
    """The op's results alias its input (so they cost no memory of their own)."""
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and all(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns))


def storage_base(node: Node) -> Node:
    """The node whose storage ``node`` reads: followed back through views, the getitems of a
    view that returns several (``split``, ``unbind``), ``_unsafe_view`` (which aliases its
    input though its schema does not say so) and an in-place op's result (``div_`` returns
    the tensor it changed)."""
    while True:
        if node.op == "call_function" and node.target is operator.getitem:
            parent = node.args[0] if node.args and isinstance(node.args[0], Node) else None
            if parent is None or not (is_view(parent) and parent.all_input_nodes):
                return node
            node = parent.all_input_nodes[0]
        elif node.op == "call_function" and node.all_input_nodes and (
                is_view(node) or node.target == torch.ops.aten._unsafe_view.default):
            node = node.all_input_nodes[0]
        elif _returns_what_it_writes(node):
            node = written_in_place(node)[0]
        else:
            return node


def _returns_what_it_writes(node: Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(node.op == "call_function" and schema is not None and len(schema.returns) == 1
                and schema.returns[0].alias_info is not None
                and schema.returns[0].alias_info.is_write and written_in_place(node))


def written_in_place(node: Node) -> list[Node]:
    """The inputs an op changes in place (``div_``'s first, ``index_add_``'s ``self``,
    ``copy_``'s destination); empty for ops that change none."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.is_mutable:
        return []
    written = []
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = node.args[position] if position < len(node.args) else node.kwargs.get(argument.name)
        written += [v for v in (value if isinstance(value, (list, tuple)) else (value,))
                    if isinstance(v, Node)]
    return written


def reads_the_same(a, b) -> bool:
    """Whether tensors ``a`` and ``b`` read the same elements the same way ([Note: views
    that read differently])."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.shape == b.shape and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset()
            and a.is_conj() == b.is_conj() and a.is_neg() == b.is_neg())


# [Note: views that read differently]
# A view is more than its sizes, strides and offset: ``_conj(c)`` of a complex tensor and
# ``_neg_view`` set a bit that every reader applies (the conjugate, the negation), with the
# base's exact layout. The backward of a complex product takes the conjugate of the other
# factor (``g * _conj(c)``), and a view dropped as "the same tensor as its base" because the
# layouts matched lost it: every model with complex RoPE (Llama's reference code,
# torchtitan's) trained with q and k projections 4% to 73% off their update, at every stage
# and at world size 1. So whatever compares two tensors as the same, or keys a compiled body
# or a kept trace on a tensor's layout, counts the two bits (``reads_the_same``).


def viewed(node: Node) -> Node:
    """What ``node`` is a view of, following views back (itself if it is no view)."""
    while is_view(node) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def readers_through_views(node: Node) -> list[Node]:
    """The nodes that read ``node``'s value as data: its users, and through its views theirs."""
    readers, stack = [], list(node.users)
    while stack:
        user = stack.pop()
        if is_view(user):
            stack.extend(user.users)
        else:
            readers.append(user)
    return readers


def vals(nodes) -> list:
    """The ``meta["val"]`` of each node, multi-output values flattened."""
    out = []
    for n in nodes:
        val = n.meta.get("val")
        out.extend(val if isinstance(val, (list, tuple)) else [val])
    return out


def tensor_bytes(val) -> int:
    """Bytes of a (fake) tensor; a symbolic size counts at the value it was traced with."""
    return hint(val.numel()) * val.element_size() if isinstance(val, torch.Tensor) else 0


def hint(size) -> int:
    """An int, or a symbolic size's value when it was traced ([Note: dynamic shapes] in
    zero_fx/capture/step_graph.py). A size the data decides (an unbacked symbol: the rows
    routed to one expert by ``nonzero``) has no traced value: it counts at its upper bound
    where the trace knows one (as many rows as there are), else at its lower bound."""
    if isinstance(size, int):
        return size
    if size.node.hint is not None:
        return int(size.node.hint)
    bound = size.node.shape_env.bound_sympy(size.node.expr)
    if bound.upper.is_number and bound.upper != int_oo:
        return int(bound.upper)
    return max(int(bound.lower), 0) if bound.lower.is_number and bound.lower != -int_oo else 0


def is_impure(node: Node) -> bool:
    """An op that changes a tensor in place or draws random numbers: running it twice is not
    running it once (``bernoulli_`` of dropout, ``native_dropout``, ``rand_like``; attention
    only with ``dropout_p`` > 0)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target._schema.is_mutable:
        return True
    if torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    for position, argument in enumerate(target._schema.arguments):
        if argument.name == "dropout_p":
            given = (node.args[position] if position < len(node.args)
                     else node.kwargs.get("dropout_p", argument.default_value))
            return given != 0
    return True


def is_gradient_seed(node: Node) -> bool:
    """The ``ones_like(loss)`` that autograd starts the backward from."""
    return _target_is(node, torch.ops.aten.ones_like.default)


def gradient_seeds(gm: torch.fx.GraphModule) -> set:
    """The ``ones_like`` of a scalar that some gradient output depends on.

    ``loss.backward()`` seeds autograd with ``ones_like(loss)``, a scalar. A
    forward ``ones_like`` of a scalar that also feeds a gradient would be
    mistaken for a seed; none of the models we test has one.
    """
    outs = gm.graph.output_node().args[0]
    grads = [outs[i] for i in grad_slots(gm) if outs[i] is not None]
    ancestors, stack = set(), list(grads)
    while stack:
        node = stack.pop()
        if node in ancestors:
            continue
        ancestors.add(node)
        stack.extend(node.all_input_nodes)
    return {node for node in ancestors
            if is_gradient_seed(node) and getattr(node.meta.get("val"), "ndim", None) == 0}


def gathered_param(node: Node) -> Optional[tuple[str, Phase]]:
    """``(name, phase)`` if ``node`` yields a gathered full parameter, else None."""
    return node.meta.get(GATHERED_META)


def secondary_of(node: Node) -> Optional[str]:
    """The parameter whose secondary shard ``node`` yields, else None."""
    return node.meta.get(SECONDARY_META)


def carried_params(node: Node) -> tuple[str, ...]:
    """The parameters whose elements a collective moves (its bucket); () if untagged."""
    return node.meta.get(CARRIES_META, ())


def runs_across_replicas(collective: Node, plan) -> bool:
    """A collective on the plan's replicate group (hybrid sharding: the all-reduce of a
    reduced gradient shard); the group's name is a functional collective's last argument."""
    return (plan is not None and plan.replicas > 1
            and collective.args[-1] == plan.replicate_group_name)


def grad_slots(gm: torch.fx.GraphModule) -> dict[int, str]:
    return gm.meta.get(GRAD_SLOTS_META, {})


def kept_through_loss(gm: torch.fx.GraphModule) -> frozenset:
    """The parameters gathered once for the forward's end and the backward's start."""
    return gm.meta.get(KEPT_THROUGH_LOSS_META, frozenset())


def mark_step_graph(gm: torch.fx.GraphModule, param_names: Sequence[Optional[str]],
                    grad_outputs: Mapping[int, str]) -> torch.fx.GraphModule:
    """Tag a training-step graph that did not come from ``zero_compile`` so our passes run on it.

    ``gm`` must be one functional aten graph of forward and backward (e.g.
    ``make_fx`` of a function calling ``torch.autograd.grad``; see
    passes/README.md, "Our passes on your own graph"). ``param_names[i]`` is the
    plan name of placeholder ``i`` if it is a parameter, else None;
    ``grad_outputs`` maps output positions to the parameter whose gradient they are.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(param_names) != len(placeholders):
        raise ValueError(f"param_names has {len(param_names)} entries for {len(placeholders)} "
                         f"placeholders; give None for inputs that are not parameters")
    outputs = gm.graph.output_node().args[0]
    bad = [i for i in grad_outputs if not 0 <= i < len(outputs)]
    if bad:
        raise ValueError(f"grad_outputs names outputs {bad}, but the graph has {len(outputs)}")
    for node, name in zip(placeholders, param_names):
        if name is not None:
            node.meta[PARAM_META] = name
    gm.meta[GRAD_SLOTS_META] = dict(grad_outputs)
    return gm
