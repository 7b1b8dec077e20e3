"""Mixture-of-experts blocks, rewritten to fixed shapes before capture.

[Note: routed experts with fixed shapes]
HuggingFace's MoE blocks (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3) loop over the experts
that received tokens (``for expert_idx in expert_hit``) or skip empty ones (``if
token_indices.numel() > 0``): a loop count that depends on the data, which one graph, the
same on every rank, cannot hold. Before the first capture zero_fx finds such blocks by
structure and gives each a forward of the same mathematics in fixed shapes:

1. route: the block's own router gives each token its top-k experts and weights;
2. sort the T*k (token, expert) pairs by expert (a stable argsort: static size), and
   count each expert's pairs into int32 offsets (a scatter-add: static size);
3. gather the pairs' token rows;
4. run the experts as one grouped computation: the expert's own forward, traced once, with
   each ``nn.Linear`` replaced by a grouped linear over the experts' stacked weights
   (``grouped_mm.py``) and everything else (activations, products) applied row-wise;
5. scale each row by its routing weight and scatter-add it back to its token.

A block is recognised by what it holds, not its class: a list of at least two experts of
the same structure, a router of the same width (an ``nn.Linear`` with one output per
expert, or a module holding an (experts, hidden) weight that returns ``(indices,
weights)``), and ``top_k`` or ``num_experts_per_tok`` on the block or its router. Which
routing the block computes (softmax then top-k, renormalised or not; the router
module's own), and its shared experts, are then confirmed by running the block's own
forward and the fixed-shape one on the same random input (RNG state and buffers kept): the
first form that agrees is installed. A block that looks like a mixture of experts but that
no form reproduces is left as it is, never given a routing it does not compute: if it
already routes in fixed shapes it captures unchanged; if its loop is data-dependent,
capture fails and ``CaptureError`` names the block and says why it was not rewritten
(``ExpertsRewrite.unrecognised``).

The block's forward is replaced on the instance (``block.forward``); its parameters,
names and state dict are untouched, so sharding, checkpoints and ``full_state_dict()``
see the model the user built.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import sys
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .expert_exchange import dispatch_and_combine
from .fused_experts import route_fused_experts_with_fixed_shapes
from .grouped_gemm_modules import route_grouped_gemms_with_fixed_shapes
from .grouped_mm import grouped_linear, sort_by_group
from .rewrite_check import output_and_grads, probe_copy, same_output, worst_different_gradient
from .step_graph import CaptureError

log = logging.getLogger("zero_fx")

TOP_K_NAMES = ("top_k", "num_experts_per_tok")
SHAPE_THAT_CAPTURES = (
    "zero_fx captures a mixture-of-experts block that holds its experts as an nn.ModuleList "
    "of modules of one structure (nn.Linear layers and row-wise operations), a router with "
    "one output per expert (an nn.Linear whose logits are softmaxed and top-k selected in the "
    "block's forward, renormalised or not, the block returning its output alone or with the "
    "router logits; or a router module returning (indices, weights)), "
    "`top_k` or `num_experts_per_tok` on the block or its router, and optionally a shared "
    "expert (`shared_expert` with a sigmoid `shared_expert_gate`, or `shared_experts`) added "
    "to the output. Other blocks: write the expert loop in fixed shapes yourself (sort the "
    "(token, expert) pairs by expert and run each expert on a fixed-size slice, or run every "
    "expert on every token weighted by its routing weight).")


@dataclasses.dataclass(frozen=True)
class RoutedExperts:
    """One mixture-of-experts block zero_fx rewrote (``step.moe_blocks``, ``explain()``)."""

    name: str
    """The block's module name."""
    experts: str
    """The module name of its list of routed experts (their parameters start with it)."""
    num_experts: int
    top_k: int
    routing: str
    """How the block routes, in words (for example "softmax, top-2, renormalised")."""
    expert_parameters: int
    """Elements of all routed experts' parameters."""
    shared_expert: Optional[str]
    """The shared expert's module name, if the block has one."""
    identity_experts: int = 0
    """``nn.Identity`` experts after the ``num_experts`` routed ones (LongCat-Flash's
    "zero-computation experts"): a row routed to one passes through as it is."""
    stacked: bool = False
    """The experts are one module holding them as 3-D parameters (``name`` and ``experts``
    are that module's), called by its block with the routing ([Note: fused experts that
    loop] in fused_experts.py); listed only for expert parallelism, which splits their rows."""


@dataclasses.dataclass(frozen=True)
class ExpertsRewrite:
    """What ``route_experts_with_fixed_shapes`` did to a model."""

    blocks: list[RoutedExperts]
    """The blocks given a fixed-shape forward, in module order."""
    unrecognised: list[str]
    """One sentence per block that looks like a mixture of experts but was left as it is,
    naming it and saying why (the capture error quotes them if the step does not capture)."""


@dataclasses.dataclass(frozen=True)
class _Form:
    """One fixed-shape forward a block may have: its routing, its shared expert."""

    routing: str
    forward: Callable  # (block, hidden_states) -> output
    shared: Optional[str]


@dataclasses.dataclass(frozen=True)
class MoeShape:
    """What a block shaped like a mixture of experts holds (``moe_shape``)."""

    experts: str
    """The child ``nn.ModuleList`` of experts."""
    router: str
    num_experts: int
    top_k: Optional[int]
    shared_expert: Optional[str]


def moe_shape(block: nn.Module) -> Optional[MoeShape]:
    """The parts of ``block`` if it is shaped like a mixture of experts (the note), else None.
    Reads only structure: works on the meta device and on fake tensors."""
    parts = _moe_parts(block)
    if parts is None:
        return None
    experts, router = (getattr(block, name) for name in parts)
    return MoeShape(parts[0], parts[1], routed_count(experts), _top_k(block, router),
                    _shared_expert(block))


def routed_expert_modules(model: nn.Module) -> tuple[str, ...]:
    """The names of ``model``'s routed experts' modules (a block's expert list, or its
    experts held as 3-D parameters), as the rewrite recognises them; structure only."""
    from .fused_experts import holds_stacked_experts

    names = []
    for path, module in model.named_modules():
        moe = moe_shape(module)
        if moe is not None:
            names.append(f"{path}.{moe.experts}" if path else moe.experts)
        elif holds_stacked_experts(module) and path:
            names.append(path)
    return tuple(names)


def route_experts_with_fixed_shapes(model: nn.Module, *, confirm: bool = True,
                                    expert_parallel: bool = False) -> ExpertsRewrite:
    """Give every mixture-of-experts block of ``model`` a fixed-shape forward (see the note);
    what was rewritten and what was left as it is. ``confirm=False`` takes each block's
    first form without running it (the planner, on fake tensors: the forms differ in
    arithmetic, not in shapes or memory). ``expert_parallel``: the step splits experts, so
    experts held as 3-D parameters are rewritten too and listed ([Note: fused experts that
    loop] in fused_experts.py)."""
    found, unrecognised = [], []
    for name, block in model.named_modules():
        if isinstance(block.__dict__.get("forward"), _RoutedForward):
            found.append(block.forward.info)
            continue
        shape = moe_shape(block)
        if shape is None:
            continue
        try:
            found.append(_install(name, block, shape, confirm))
        except _NotRewritten as why:
            unrecognised.append(str(why))
    # experts held as 3-D parameters and looped over: [Note: fused experts that loop]
    fused, left = route_fused_experts_with_fixed_shapes(model, confirm=confirm,
                                                         decorated=expert_parallel)
    unrecognised += left
    found += _stacked_experts(model, fused, expert_parallel)
    # a grouped GEMM called with row counts (Aria): [Note: grouped GEMM modules that loop]
    unrecognised += route_grouped_gemms_with_fixed_shapes(model, confirm=confirm)[1]
    if found:
        log.info("zero_fx: %d mixture-of-experts block(s) routed with fixed shapes (%s, %d "
                 "experts, top-%d)", len(found), found[0].routing, found[0].num_experts,
                 found[0].top_k)
    for why in unrecognised:
        log.info("zero_fx: %s; it is left as it is", why)
    return ExpertsRewrite(found, unrecognised)


def _stacked_experts(model: nn.Module, names: list[str], expert_parallel: bool
                     ) -> list[RoutedExperts]:
    """The fused-experts modules ``names`` (rewritten) that expert parallelism can split, as
    blocks: when it is asked for, or already split (an evaluation step of a training step's
    model)."""
    found = []
    for name in names:
        module = model.get_submodule(name)
        installed = module.forward
        if installed.form.forward_parallel is None or not (
                expert_parallel or installed.parallel is not None):
            continue
        places = installed.parallel.degree if installed.parallel is not None else 1  # rows cut
        top_k = getattr(getattr(module, "config", None), "num_experts_per_tok", None)
        found.append(RoutedExperts(
            name=name, experts=name, num_experts=module.down_proj.shape[0] * places,
            top_k=top_k if isinstance(top_k, int) else 0,
            routing="its block's own (indices and weights passed to the experts)",
            expert_parameters=sum(p.numel() for p in module.parameters()) * places,
            shared_expert=None,
            identity_experts=module.gate_up_proj.shape[0] - module.down_proj.shape[0],
            stacked=True))
    return found


@dataclasses.dataclass(frozen=True)
class LocalExperts:
    """Expert parallelism for one block: this rank runs experts ``first`` to ``first + E /
    degree`` and exchanges tokens with the ``degree`` ranks of ``group_name``."""

    degree: int
    first: int
    group_name: str
    capacity_factor: Optional[float] = None
    """Rows each expert takes, as a multiple of an even spread's ([Note: expert capacity]
    in expert_exchange.py); None: every row."""


def hold_local_experts(model: nn.Module, blocks: list[RoutedExperts], degree: int, rank: int,
                       group_name: str, capacity_factor: Optional[float] = None) -> None:
    """Expert parallelism: every rewritten block of ``model`` runs only the experts of slice
    ``rank`` of ``degree`` and sends the other rows to their ranks ([Note: expert
    parallelism] in zero_fx/plan/expert_parallel.py); ``degree`` 1 undoes it. ``degree``
    divides every block's number of experts."""
    for info in blocks:
        held = (None if degree == 1 else
                LocalExperts(degree, rank * info.num_experts // degree, group_name,
                             capacity_factor))
        if info.stacked:  # its parameters keep this place's rows once sharded
            model.get_submodule(info.experts).forward.parallel = held
        else:
            model.get_submodule(info.experts.rpartition(".")[0]).forward.parallel = held


def unrecognised_experts_error(rewrite: ExpertsRewrite, error: CaptureError) -> CaptureError:
    """The step did not capture (``error``) and the model has blocks the rewrite left alone:
    name them, and say what shape of block the rewrite takes."""
    return CaptureError(f"{error}\nIn this model, " + "; ".join(rewrite.unrecognised)
                        + f".\n{SHAPE_THAT_CAPTURES}")


# -- recognition ----------------------------------------------------------------------------

def _moe_parts(block: nn.Module) -> Optional[tuple[str, str]]:
    """(experts child, router child) of a block shaped like a mixture of experts, else None."""
    for experts_name, experts in block.named_children():
        if not (isinstance(experts, nn.ModuleList) and (routed := routed_count(experts)) >= 2
                and _same_structure(experts[:routed])):
            continue
        for router_name, router in block.named_children():
            if router is not experts and _routes_over(router, len(experts)):
                return experts_name, router_name
    return None


def routed_count(experts: nn.ModuleList) -> int:
    """The experts before the trailing ``nn.Identity`` ones (all of them, usually)."""
    count = len(experts)
    while count and isinstance(experts[count - 1], nn.Identity):
        count -= 1
    return count


def _same_structure(modules) -> bool:
    shapes = [[(n, p.shape) for n, p in m.named_parameters()] for m in modules]
    return bool(shapes[0]) and all(s == shapes[0] for s in shapes)


def _routes_over(router: nn.Module, num_experts: int) -> bool:
    """An nn.Linear of one output per expert, a module with such a ``weight``, or a module
    whose scoring layer is one (LongCat-Flash's ``router.classifier``)."""
    if isinstance(router, nn.Linear):
        return router.out_features == num_experts
    weight = getattr(router, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.dim() == 2 and weight.shape[0] == num_experts
    return any(isinstance(c, nn.Linear) and c.out_features == num_experts
               for c in router.children())


def _top_k(block: nn.Module, router: nn.Module) -> Optional[int]:
    for owner in (block, router):
        for attr in TOP_K_NAMES:
            value = getattr(owner, attr, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


class _NotRewritten(Exception):
    """A block that looks like a mixture of experts, left as it is (the message says why)."""


def _unrecognised(name: str, block: nn.Module, why: str) -> _NotRewritten:
    return _NotRewritten(f"module {name!r} ({type(block).__name__}) looks like a "
                         f"mixture-of-experts block, but {why}")


# -- installing a form ----------------------------------------------------------------------

class _RoutedForward:
    """The fixed-shape forward installed on a block (``block.forward``)."""

    def __init__(self, block: nn.Module, form: _Form, grouped: "_GroupedExperts",
                 experts: str, router: str, top_k: int, info: RoutedExperts):
        self._block = block
        self.form, self.grouped, self.experts, self.router, self.top_k = (
            form, grouped, experts, router, top_k)
        self.info = info
        self.parallel: Optional[LocalExperts] = None
        """With expert parallelism, the experts this rank holds and the group it exchanges
        tokens with (``hold_local_experts``)."""

    def __call__(self, hidden_states, *args, **kwargs):
        if args or kwargs:
            raise TypeError(f"{self.info.name}: the fixed-shape forward takes the hidden states only")
        return self.form.forward(self._block, self, hidden_states)

    def __deepcopy__(self, memo):
        new = copy.copy(self)
        new._block = copy.deepcopy(self._block, memo)
        return new


def _install(path: str, block: nn.Module, shape: MoeShape, confirm: bool) -> RoutedExperts:
    name = path or type(block).__name__
    experts_name, router_name, top_k = shape.experts, shape.router, shape.top_k
    experts, router = getattr(block, experts_name), getattr(block, router_name)
    if top_k is None:
        raise _unrecognised(name, block, "neither it nor its router has `top_k` or "
                                         "`num_experts_per_tok`")
    try:
        grouped = _GroupedExperts(experts[0])
    except _NotGroupable as err:
        raise _unrecognised(name, block, f"its experts cannot be run as one grouped "
                                         f"computation ({err})") from None
    original = type(block).forward
    for form in _forms(block, router, shape):
        routed = _RoutedForward(block, form, grouped, experts_name, router_name, top_k,
                                info=None)
        if not confirm or _reproduces(name, block, original, routed, experts[0]):
            info = RoutedExperts(
                name=name, experts=f"{path}.{experts_name}" if path else experts_name,
                num_experts=shape.num_experts, top_k=top_k, routing=form.routing,
                expert_parameters=sum(p.numel() for p in experts.parameters()),
                shared_expert=form.shared, identity_experts=len(experts) - shape.num_experts)
            routed.info = info
            block.forward = routed
            return info
    raise _unrecognised(name, block, "none of the fixed-shape forms zero_fx knows reproduces "
                                     "its output on a random input")


def _forms(block: nn.Module, router: nn.Module, shape: MoeShape) -> list[_Form]:
    shared = shape.shared_expert
    if isinstance(router, nn.Linear):
        normalise = getattr(block, "norm_topk_prob", None)
        choices = [normalise] if isinstance(normalise, bool) else [True, False]
        forms = [_Form(f"softmax, top-{shape.top_k}{', renormalised' if n else ''}",
                       _softmax_top_k_forward(n, shared, with_logits), shared)
                 for with_logits in (True, False) for n in choices]
        sparsemixer = getattr(sys.modules.get(type(block).__module__), "sparsemixer", None)
        if callable(sparsemixer):  # PhiMoE under transformers 4
            forms.insert(0, _Form("sparsemixer, top-2 (the model's own)",
                                  _sparsemixer_forward(sparsemixer, shared), shared))
        return forms
    return [_Form("the router module's (indices, weights)", _router_module_forward(shared), shared)]


def _shared_expert(block: nn.Module) -> Optional[str]:
    for name in ("shared_expert", "shared_experts"):
        if isinstance(getattr(block, name, None), nn.Module):
            return name
    return None


def _shared_output(block: nn.Module, shared: Optional[str], hidden: torch.Tensor
                   ) -> Optional[Callable[[], torch.Tensor]]:
    """The shared expert's output on ``hidden`` (gated where the block gates it), to be
    computed: ``_mix_experts`` runs it while the rows travel to their experts under expert
    parallelism ([Note: the dispatch issued, then waited for] in expert_exchange.py)."""
    if shared is None:
        return None

    def output() -> torch.Tensor:
        extra = getattr(block, shared)(hidden)
        gate = getattr(block, "shared_expert_gate", None)
        return torch.sigmoid(gate(hidden)) * extra if gate is not None else extra
    return output


def _plus(out: torch.Tensor, extra: Optional[torch.Tensor]) -> torch.Tensor:
    return out if extra is None else out + extra


def _softmax_top_k_forward(normalise: bool, shared: Optional[str], with_logits: bool) -> Callable:
    """Mixtral / Qwen-MoE / OLMoE: a Linear router, softmax in fp32, top-k, optionally
    renormalised; returns (hidden, router logits) as HuggingFace's blocks do, or the hidden
    states alone."""

    def route(block, routed: _RoutedForward, logits):
        weights = F.softmax(logits, dim=1, dtype=torch.float)
        weights, chosen = torch.topk(weights, routed.top_k, dim=-1)
        if normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    return _linear_router_forward(route, shared, with_logits, jitter="jitter_noise")


def _sparsemixer_forward(sparsemixer: Callable, shared: Optional[str]) -> Callable:
    """PhiMoE (transformers 4): a Linear router whose logits the model's own ``sparsemixer``
    turns into top-2 (weights, indices): Gumbel-sampled while training, its routing gradient
    a custom autograd function. Calling the model's function keeps both as they are (and its
    random draws in the order eager makes them); returns (hidden, router logits)."""

    def route(block, routed: _RoutedForward, logits):
        return sparsemixer(logits, jitter_eps=getattr(block, "router_jitter_noise", 0.0),
                           training=block.training)

    return _linear_router_forward(route, shared, True, jitter="input_jitter_noise")


def _linear_router_forward(route: Callable, shared: Optional[str], with_logits: bool, *,
                           jitter: str) -> Callable:
    """A block with a Linear router: its input scaled by uniform noise of the block's
    ``jitter`` attribute while training, the router's logits, ``route(block, routed,
    logits) -> (weights, chosen)``, the experts mixed (weights cast to the input's dtype) and
    the shared expert added."""

    def forward(block, routed: _RoutedForward, hidden_states):
        shape = hidden_states.shape
        noise = getattr(block, jitter, 0)
        if block.training and noise:
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - noise, 1.0 + noise)
        hidden = hidden_states.reshape(-1, shape[-1])
        logits = getattr(block, routed.router)(hidden)
        weights, chosen = route(block, routed, logits)
        out, extra = _mix_experts(block, routed, hidden, chosen, weights.to(hidden.dtype),
                                  hidden.dtype, _shared_output(block, shared, hidden))
        out = _plus(out, extra).reshape(shape)
        return (out, logits) if with_logits else out

    return forward


def _router_module_forward(shared: Optional[str]) -> Callable:
    """DeepSeek-V3: the router module returns (indices, weights) itself (its own code, so its
    buffers behave as in eager); mixed in the weights' dtype; shared experts on the input."""

    def forward(block, routed: _RoutedForward, hidden_states):
        shape = hidden_states.shape
        chosen, weights = getattr(block, routed.router)(hidden_states)
        hidden = hidden_states.reshape(-1, shape[-1])
        out, extra = _mix_experts(block, routed, hidden, chosen, weights, weights.dtype,
                                  _shared_output(block, shared, hidden_states))
        return _plus(out.to(hidden_states.dtype).reshape(shape), extra)

    return forward


def _mix_experts(block, routed: _RoutedForward, hidden: torch.Tensor, chosen: torch.Tensor,
                 weights: torch.Tensor, out_dtype: torch.dtype,
                 meanwhile: Optional[Callable[[], torch.Tensor]] = None
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """sum over each token's k experts of weight * expert(token), in fixed shapes (the note),
    and ``meanwhile()`` (the shared expert): after the routed experts, or under expert
    parallelism while the rows travel to theirs."""
    done_meanwhile = None
    every = getattr(block, routed.experts)
    experts = every[:routed_count(every)]  # identity experts' rows pass through, below
    tokens, k = chosen.shape
    order, expert_of_row, token_of_row, counts = sort_by_group(chosen.reshape(-1), k, len(every))
    counts = counts[:len(experts)]
    if routed.parallel is None:
        offs = counts.cumsum(0).to(torch.int32)  # identity experts' rows come last
        rows = routed.grouped(hidden[token_of_row], offs,
                              expert_of_row.clamp(max=len(experts) - 1), experts)
        if len(every) > len(experts):
            rows = torch.where((expert_of_row < len(experts)).unsqueeze(-1), rows,
                               hidden[token_of_row].to(rows.dtype))
    else:  # [Note: exchanging rows in fixed shapes]
        held = routed.parallel
        local = experts[held.first:held.first + len(experts) // held.degree]
        rows, done_meanwhile = dispatch_and_combine(
            hidden[token_of_row], counts, expert_of_row,
            lambda received, offs, group_of_row: routed.grouped(received, offs, group_of_row, local),
            degree=held.degree, top_k=k, group_name=held.group_name,
            capacity_factor=held.capacity_factor, meanwhile=meanwhile or (lambda: None))
        meanwhile = None
    rows = rows * weights.reshape(-1)[order].unsqueeze(-1)
    out = torch.zeros(tokens, hidden.shape[-1], dtype=out_dtype, device=hidden.device)
    out = out.index_add(0, token_of_row, rows.to(out_dtype))
    return out, (meanwhile() if meanwhile is not None else done_meanwhile)


# -- the experts as one grouped computation --------------------------------------------------

class _NotGroupable(Exception):
    pass


class _GroupedExperts:
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
            raise _NotGroupable(f"torch.fx.symbolic_trace failed: {err}") from None
        graph = torch.fx.Graph()
        rows, offs, group_of_row = (graph.placeholder(n) for n in ("rows", "offs", "group_of_row"))
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        self.linears: list[tuple[str, bool]] = []
        inputs = [n for n in traced.graph.nodes if n.op == "placeholder"]
        if len(inputs) != 1:
            raise _NotGroupable(f"its forward takes {len(inputs)} inputs, not one")
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
                    raise _NotGroupable(f"its submodule {node.target!r} holds state and is not "
                                        f"an nn.Linear")
                env[node] = graph.node_copy(node, lambda n: env[n])
            elif node.op == "get_attr":
                raise _NotGroupable(f"its forward reads the tensor {node.target!r} directly")
            else:
                env[node] = graph.node_copy(node, lambda n: env[n])
        if not self.linears:
            raise _NotGroupable("it has no nn.Linear")
        self.module = torch.fx.GraphModule(traced, graph)

    def __call__(self, rows, offs, group_of_row, experts: nn.ModuleList):
        stacked = []
        for name, has_bias in self.linears:
            linears = [e if isinstance(e, nn.Linear) else e.get_submodule(name) for e in experts]
            stacked.append(torch.stack([lin.weight for lin in linears]))
            if has_bias:
                stacked.append(torch.stack([lin.bias for lin in linears]))
        return self.module(rows, offs, group_of_row, *stacked)


# -- the check that a form reproduces the block ---------------------------------------------

def _reproduces(name: str, block: nn.Module, original: Callable, routed: _RoutedForward,
                expert: nn.Module) -> bool:
    """Whether ``routed`` computes what the block's own forward does, on a random input: its
    outputs, and the gradients of the input and of every parameter under one random
    cotangent ([Note: a rewrite proves itself]). A form whose outputs agree but whose
    gradients do not raises ``CaptureError``: zero_fx would train the block wrong."""
    probe = probe_copy(block)
    routed_probe = copy.copy(routed)
    routed_probe._block = probe
    hidden_size = _hidden_size(expert)
    device = next(probe.parameters()).device
    tokens = 4 * len(getattr(probe, routed.experts))
    named = [(n, p) for n, p in probe.named_parameters() if p.requires_grad]
    with torch.random.fork_rng(devices=_cuda_devices(device)), _eval(probe), \
            _buffers_kept(probe):
        torch.manual_seed(0)
        x = torch.randn(2, tokens, hidden_size, device=device)
        try:
            expected, expected_grads = output_and_grads(lambda h: original(probe, h), x, named)
            got, got_grads = output_and_grads(routed_probe, x, named)
        except Exception:  # noqa: BLE001 - a block that fails on hidden states is not this form
            return False
    if not same_output(expected, got):
        return False
    differs = worst_different_gradient(expected_grads, got_grads)
    if differs is not None:
        raise CaptureError(
            f"zero_fx's fixed-shape forward for the mixture-of-experts block {name!r} "
            f"({type(block).__name__}; {routed.form.routing}) computes the block's output but "
            f"not its gradients: on a random input the gradient of {differs}. zero_fx would "
            f"train this block wrong, so it stops here: please report it with the model's "
            f"config. [Note: a rewrite proves itself] in zero_fx/capture/routed_experts.py")
    return True


# [Note: a rewrite proves itself]
# Replacing a block of the user's model with a computation of our own (routed experts in
# fixed shapes) is right only if it computes what the block computes, forward and backward;
# the next model or the next transformers release can break that without a sound, and a
# wrong gradient on a router barely moves the loss (a router update 7% off showed in no
# loss). So before a form is installed, the block's own forward and the form run on the same
# random fp32 input, with gradients taken under one random cotangent for the input and
# every parameter (``torch.autograd.grad``: no ``.grad`` is touched). Outputs that differ
# mean "not this form" (the next is tried); outputs that agree with gradients that differ
# mean our rewrite is wrong for this block, and capture stops with a ``CaptureError``
# naming it. The check runs once per block, on the first call, in eager (docs/moe.md has
# its measured cost: 22 ms on the tests' Mixtral, 1.0 s on a 4-layer Mixtral of width 512,
# against 13 ms and 0.23 s forward alone) and holds two fp32 gradients of one block.


def _hidden_size(expert: nn.Module) -> int:
    first = next(m for m in expert.modules() if isinstance(m, nn.Linear))
    return first.in_features


def _cuda_devices(device: torch.device) -> list:
    return [device] if device.type == "cuda" else []


@contextlib.contextmanager
def _eval(block: nn.Module):
    modes = [(m, m.training) for m in block.modules()]
    block.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


@contextlib.contextmanager
def _buffers_kept(block: nn.Module):
    """The probe runs the user's block: buffers its forward updates are put back."""
    kept = [(b, b.clone()) for b in block.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in kept:
                b.copy_(value)
