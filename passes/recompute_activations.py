"""recompute_activations: the backward recomputes forward values instead of keeping them.

[Note: recompute as a graph pass]
Our backward is recorded inline by the autograd engine, so no partitioner runs:
without this pass the step keeps exactly what eager keeps for the backward. The
pass decides, for every forward value the backward reads (an *activation*),
whether it is **kept** (alive from the forward to its last backward reader) or
**recomputed**: copied, with the chain of values it is computed from, into the
backward right before its first backward reader, so the forward original dies
at its last forward reader. A copy reads kept values, the step's inputs and the
parameters; in stage 3 a recomputed matmul reads its weight through the
backward's own gather (``gather_params`` runs later and sees a backward reader),
so recompute costs compute, never a gather, and keeps no full weight.

What is kept (``plan.recompute``):

- ``"blocks"``: only the input of each repeated block (as ``checkpoint_wrapper``
  per block). The graph has no modules, so blocks come from the parameters:
  a node's *unit* is the block (``plan.unit_of``) of the last unit among its
  inputs, the units ordered by first use. A unit's value is **fresh** when it is
  computed from that unit's parameters without passing through a value that
  leaves the unit (is read by another unit). Kept: what leaves a unit fresh (the
  block's output, the embedding), and everything of the units that are not
  repeated blocks (the embedding, the head, the loss); recomputed: the rest of
  each block, including the work a block does on its input before its first
  parameter (RMSNorm's ``pow``/``mean`` of the residual stream).
- a policy ``fn(node) -> "save" | "recompute"``: asked for every forward op.
- ``ActivationBudget``: the blocks' inputs are kept, and of the values
  ``"blocks"`` would recompute, those with the most recompute seconds per byte
  are kept too, as many as fit the budget (PyTorch's greedy knapsack, the one its
  partitioner uses for ``activation_memory_budget``).

Never recomputed, whatever is asked: ops that change a tensor in place or draw
random numbers (dropout's ``bernoulli_``): a copy reads the forward's result, so a
recomputed dropout applies the same mask. Views follow their base: recomputing
a value while a view of it is kept would keep both.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
from torch.fx import GraphModule, Node

from .common.backward_copies import copy_into_backward
from .common.predicates import (Phase, is_impure, is_param_input, is_view, param_name, phase_of,
                                tensor_bytes, vals)

RECOMPUTE_META = "zero_recompute"
"""GraphModule meta key: the ``RecomputeSummary`` of ``recompute_activations``."""
RECOMPUTED_META = "zero_recomputed"
"""Node meta key on a copy: the name of the forward node it recomputes."""

RecomputePolicy = Callable[[Node], str]
"""``policy(node) -> "save" | "recompute"`` for a forward op of the captured step."""


@dataclass(frozen=True)
class ActivationBudget:
    """``recompute="auto"``: keep at most ``budget`` of the activations, chosen by
    ``seconds(node)`` (the time to recompute a node) per byte."""

    budget: Union[float, int]
    """A fraction (0-1) of the bytes kept for the backward without recompute, or bytes (>1)."""
    seconds: Callable[[Node], float]


@dataclass(frozen=True)
class RecomputeSummary:
    """What ``recompute_activations`` did, for ``explain()`` and the planner."""

    mode: str
    recomputed_ops: int
    """Ops copied into the backward (views and getitems not counted)."""
    kept_bytes_before: int
    """Bytes of forward values the backward reads, without recompute."""
    kept_bytes: int
    """The same after this pass."""
    recompute_seconds: Optional[float] = None
    """The cost model's time for the copies (``"auto"`` only)."""

    @property
    def dropped_bytes(self) -> int:
        return self.kept_bytes_before - self.kept_bytes


def recompute_activations(gm: GraphModule, plan) -> GraphModule:
    """Recompute forward values in the backward instead of keeping them ([Note: recompute
    as a graph pass]).

    Requires: phases annotated; runs before ``recompute_param_views`` and ``gather_params``.
    Ensures: every BACKWARD reader of a forward value the policy recomputes reads a copy
    (phase BACKWARD, ``meta["zero_recomputed"]``) placed before its first backward reader;
    impure ops are never copied; ``gm.meta["zero_recompute"]`` holds a ``RecomputeSummary``.
    Does nothing when ``plan.recompute`` is None or the graph has no backward.
    """
    policy = plan.recompute
    if policy is None or not any(phase_of(n) is Phase.BACKWARD for n in gm.graph.nodes):
        return gm
    before = kept_for_backward(gm)
    units = _Units(gm, plan)
    if policy == "blocks":
        mode, keep = "blocks", units.keeps_block_inputs()
    elif isinstance(policy, ActivationBudget):
        mode, keep = _within_budget(units, policy, before)
    elif callable(policy):
        mode, keep = f"policy {getattr(policy, '__name__', repr(policy))}", _asking(policy, units)
    else:
        raise ValueError(f"recompute must be None, 'blocks', 'auto' or a policy "
                         f"fn(node) -> 'save' | 'recompute'; got {policy!r}")
    keep |= {storage_root(n) for n in gm.graph.output_node().all_input_nodes}  # alive anyway
    copies = _recompute(gm, units, keep)
    seconds = (sum(policy.seconds(c) for c in copies) if isinstance(policy, ActivationBudget)
               else None)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    gm.meta[RECOMPUTE_META] = RecomputeSummary(
        mode=mode, recomputed_ops=sum(1 for c in copies if not _aliases(c)),
        kept_bytes_before=before, kept_bytes=kept_for_backward(gm), recompute_seconds=seconds)
    return gm


def kept_for_backward(gm: GraphModule) -> int:
    """Bytes of the forward values (each storage once) that are computed before the backward
    starts and read by it: what a step keeps alive from its forward into its backward,
    besides its inputs."""
    before_backward: set[Node] = set()
    roots: set[Node] = set()
    started = False
    for node in gm.graph.nodes:
        if phase_of(node) is Phase.BACKWARD:
            started = True
            roots.update(r for r in map(storage_root, node.all_input_nodes) if r in before_backward)
        elif node.op == "call_function" and not started:
            before_backward.add(node)
    return sum(_bytes(r) for r in roots)


def storage_root(node: Node) -> Node:
    """The node whose memory ``node`` is: itself, or the base of a view chain."""
    while _aliases(node) and isinstance(node.args[0], Node):
        node = node.args[0]
    return node


def _aliases(node: Node) -> bool:
    """``node``'s result is its first input's memory: a view (or an item of a view op's
    results, like ``split``'s), ``_unsafe_view``, or an op that writes its input in place
    (dropout's ``bernoulli_``)."""
    if node.target is operator.getitem:
        return isinstance(node.args[0], Node) and _aliases(node.args[0])
    schema = getattr(node.target, "_schema", None)
    writes_first = bool(schema and schema.returns and schema.returns[0].alias_info is not None)
    return writes_first or is_view(node) or node.target is torch.ops.aten._unsafe_view.default


def _bytes(node: Node) -> int:
    return sum(map(tensor_bytes, vals([node])))


class _Units:
    """The forward ops of the step, each with its unit (a block of the model or another
    module) and what ``"blocks"`` keeps ([Note: recompute as a graph pass])."""

    def __init__(self, gm: GraphModule, plan):
        self.forward = [n for n in gm.graph.nodes
                        if n.op == "call_function" and phase_of(n) is Phase.FORWARD]
        self.read_by_backward = {storage_root(a) for n in gm.graph.nodes
                                 if phase_of(n) is Phase.BACKWARD for a in n.all_input_nodes}
        self.param_only: set[Node] = set()
        self.unit: dict[Node, Optional[str]] = {}
        first_use: dict[str, int] = {}
        for node in gm.graph.find_nodes(op="placeholder"):
            self.unit[node] = plan.unit_of(param_name(node)) if is_param_input(node) else None
        for position, node in enumerate(self.forward):
            inputs = node.all_input_nodes
            if inputs and all(is_param_input(i) or i in self.param_only for i in inputs):
                self.param_only.add(node)
            units = [self.unit.get(i) for i in inputs if self.unit.get(i) is not None]
            for unit in units:
                first_use.setdefault(unit, position)
            self.unit[node] = max(units, key=first_use.__getitem__, default=None)
        self.leaves = {n for n in self.forward if self._leaves_unit(n)}
        self.fresh: set[Node] = set()
        for node in self.forward:
            if any(self._carries_unit(i, self.unit[node]) for i in node.all_input_nodes):
                self.fresh.add(node)

    def _leaves_unit(self, node: Node) -> bool:
        """A forward op (not a view) of another unit reads ``node`` or a view of it."""
        stack = [node]
        while stack:
            for user in stack.pop().users:
                if phase_of(user) is not Phase.FORWARD or user.op != "call_function":
                    continue
                if _aliases(user):
                    stack.append(user)
                elif self.unit.get(user) != self.unit[node]:
                    return True
        return False

    def _carries_unit(self, value: Node, unit: Optional[str]) -> bool:
        if is_param_input(value) or value in self.param_only:
            return self.unit.get(value) == unit
        return (self.unit.get(value) == unit and value in self.fresh
                and storage_root(value) not in self.leaves)

    def repeated(self, node: Node) -> bool:
        unit = self.unit.get(node)
        return unit is not None and unit.split(".")[-1].isdigit()

    def candidates(self) -> list[Node]:
        """Forward ops a policy may recompute: not impure, not views of parameters, not
        views (they follow their base)."""
        return [n for n in self.forward
                if n not in self.param_only and not _pinned(n) and not _aliases(n)]

    def keeps_block_inputs(self) -> set[Node]:
        """``"blocks"``: what is kept ([Note: recompute as a graph pass])."""
        if not any(self.repeated(n) for n in self.forward):
            raise ValueError(
                "recompute='blocks' found no repeated blocks in the step: no parameter name has "
                "an index (like 'layers.3.mlp.weight'). Use recompute='auto' or a policy "
                "fn(node) -> 'save' | 'recompute'")
        return {n for n in self.candidates()
                if self.unit[n] is None
                or (n in self.fresh and (not self.repeated(n) or n in self.leaves))}


def _pinned(node: Node) -> bool:
    """Impure, or a result of an impure op: never recomputed."""
    if node.target is operator.getitem and isinstance(node.args[0], Node):
        return is_impure(node.args[0])
    return is_impure(node)


def _asking(policy: RecomputePolicy, units: _Units) -> set[Node]:
    keep = set()
    for node in units.candidates():
        answer = policy(node)
        if answer not in ("save", "recompute"):
            raise ValueError(f"the recompute policy answered {answer!r} for {node.name} "
                             f"({node.target}); it must answer 'save' or 'recompute'")
        if answer == "save":
            keep.add(node)
    return keep


def _within_budget(units: _Units, budget: ActivationBudget, kept_before: int) -> tuple[str, set]:
    from torch._functorch._activation_checkpointing.knapsack import greedy_knapsack

    keep = units.keeps_block_inputs()
    allowed = budget.budget * kept_before if budget.budget <= 1 else budget.budget
    floor = sum(_bytes(n) for n in keep if n in units.read_by_backward)
    optional = [n for n in units.candidates() if n not in keep and n in units.read_by_backward
                and _bytes(n) > 0]
    if optional and allowed > floor:
        seconds = [budget.seconds(n) + (budget.seconds(n.args[0]) if n.target is operator.getitem
                                        else 0.0) for n in optional]
        _, chosen, _ = greedy_knapsack([float(_bytes(n)) for n in optional], seconds,
                                       float(allowed - floor))
        keep |= {optional[i] for i in chosen}
    label = f"{budget.budget:.0%}" if budget.budget <= 1 else f"{budget.budget} bytes"
    return f"auto (budget {label})", keep


def _recompute(gm: GraphModule, units: _Units, keep: set[Node]) -> list[Node]:
    """Copy what is not kept into the backward, before its first backward reader."""
    forward = set(units.forward)

    def recomputed(value: Node) -> bool:
        return (value in forward and value not in units.param_only and not _pinned(value)
                and storage_root(value) not in keep)

    copies = copy_into_backward(gm, recomputed, lambda original: {RECOMPUTED_META: original.name})
    return list(copies.values())
