"""Experts held as stacked 3-D parameters and looped over in Python: the same in fixed shapes.

[Note: fused experts that loop]
transformers 5 holds a block's experts as two 3-D parameters, ``gate_up_proj`` (E, 2I, H)
and ``down_proj`` (E, H, I), in a module called as ``experts(hidden_states, top_k_index,
top_k_weights)``. Most families decorate that module with transformers'
``use_experts_implementation``, which runs it as one grouped matmul in fixed shapes, and it
captures as it is. A few write their own loop over the experts the tokens chose
(LongCat-Flash: ``for expert_idx_tensor in expert_hit: ... int(expert_idx_tensor.item())``),
a count and sizes the data decides, which one graph cannot hold.

zero_fx gives such a module (3-D ``gate_up_proj`` and ``down_proj``, not decorated) the
fixed-shape forward of [Note: routed experts with fixed shapes] (routed_experts.py): the T*k
(token, expert) pairs sorted by expert, each row through its expert as two grouped matmuls
(``F.linear`` by each expert's slice, the gate and up halves, ``act_fn(gate) * up``), scaled
by its weight and added back to its token. Experts past ``down_proj``'s count (LongCat's
"zero-computation experts", ``nn.Identity``) pass their row through. Before it is
installed the module's own forward and this one run on one random input and routing, and
it is kept only if both the output and every gradient agree ([Note: a rewrite proves
itself]); otherwise the module is left as it is, and the capture error says why.

Expert parallelism needs the same forward on the modules transformers' interface runs
(decorated, ``has_gate`` set): theirs runs every expert on the rank, ours sends each row to
the rank holding its expert ([Note: exchanging rows in fixed shapes] in expert_exchange.py).
So with ``expert_parallel`` above 1, a decorated module of the first layout (concatenated,
not transposed, no bias, no norm after the experts: its own flags say so) is given it too,
checked the same way, and each rank keeps its rows of the two parameters ([Note: experts held
as 3-D parameters, split by rows] in zero_fx/plan/expert_parallel.py). Without expert
parallelism a decorated module runs as transformers made it.

GPT-OSS under transformers 4 holds its experts the other way round, ``gate_up_proj`` (E, H,
2I) and ``down_proj`` (E, I, H), with biases, gate and up interleaved, its own clamped GLU
(``alpha``, ``limit``), called with a dense (tokens, E) matrix of routing weights; on the
CPU and in training it loops over the experts hit. Its form is the same grouped
computation in that layout, checked the same way.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional

import torch
import torch.nn as nn

from .grouped_mm import grouped_linear, sort_by_group
from .rewrite_check import probe_copy, what_differs

log = logging.getLogger("zero_fx")

Tensor = torch.Tensor


class FixedShapeFusedExperts:
    """The fixed-shape forward of one looping fused-experts module (the note)."""

    def __init__(self, module: nn.Module, form: "_Form"):
        self._module, self.form = module, form
        self.parallel = None
        """With expert parallelism, this rank's experts and the group it exchanges rows with
        (``moe_blocks.LocalExperts``); the module then holds only those experts' rows."""

    def __call__(self, *args, **kwargs) -> Tensor:
        if self.parallel is not None:
            return self.form.forward_parallel(self._module, self.parallel, *args, **kwargs)
        return self.form.forward(self._module, *args, **kwargs)

    def __deepcopy__(self, memo):
        copied = type(self)(memo.get(id(self._module), self._module), self.form)
        copied.parallel = self.parallel
        return copied


def concatenated_forward(module: nn.Module, hidden: Tensor, top_k_index: Tensor,
                         top_k_weights: Tensor) -> Tensor:
    """transformers 5's layout (the note): identity experts past ``down_proj``'s count."""
    gate_up, down = module.gate_up_proj, module.down_proj
    routed = down.shape[0]
    order, expert_of_row, token_of_row, counts = sort_by_group(
        top_k_index.reshape(-1), top_k_index.shape[1], gate_up.shape[0])
    offs = counts[:routed].cumsum(0).to(torch.int32)  # identity experts' rows come last
    rows = hidden[token_of_row]
    group_of_row = expert_of_row.clamp(max=routed - 1)
    out = _concatenated_experts(module, gate_up[:routed], rows, offs, group_of_row)
    out = torch.where((expert_of_row < routed).unsqueeze(-1), out, rows)
    return _weighted_sum(hidden, out, top_k_weights, order, token_of_row)


def concatenated_forward_parallel(module: nn.Module, held, hidden: Tensor, top_k_index: Tensor,
                                  top_k_weights: Tensor) -> Tensor:
    """``concatenated_forward`` under expert parallelism: the module holds its rank's rows of
    the experts (``held``: ``moe_blocks.LocalExperts``), each (token, expert) row is run
    on the rank of its expert and comes back ([Note: exchanging rows in fixed shapes])."""
    from .expert_exchange import dispatch_and_combine

    top_k = top_k_index.shape[1]
    order, expert_of_row, token_of_row, counts = sort_by_group(
        top_k_index.reshape(-1), top_k, module.gate_up_proj.shape[0] * held.degree)
    out = dispatch_and_combine(
        hidden[token_of_row], counts, expert_of_row,
        lambda rows, offs, group_of_row: _concatenated_experts(
            module, module.gate_up_proj, rows, offs, group_of_row),
        degree=held.degree, top_k=top_k, group_name=held.group_name,
        capacity_factor=held.capacity_factor)
    return _weighted_sum(hidden, out, top_k_weights, order, token_of_row)


def _concatenated_experts(module: nn.Module, gate_up: Tensor, rows: Tensor, offs: Tensor,
                          group_of_row: Tensor) -> Tensor:
    """Each row through its expert (``gate_up``'s and ``down_proj``'s): ``act_fn(gate) * up``,
    then down, as two grouped matmuls."""
    gate, up = grouped_linear(rows, gate_up, None, offs, group_of_row).chunk(2, dim=-1)
    return grouped_linear(module.act_fn(gate) * up, module.down_proj, None, offs, group_of_row)


def _weighted_sum(hidden: Tensor, out: Tensor, top_k_weights: Tensor, order: Tensor,
                  token_of_row: Tensor) -> Tensor:
    """Each expert row's output (sorted by expert: ``order``) scaled by its routing weight and
    added to its token."""
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    return torch.zeros_like(hidden).index_add(0, token_of_row, out.to(hidden.dtype))


def gpt_oss_forward(module: nn.Module, hidden_states: Tensor, router_indices: Tensor,
                    routing_weights: Tensor) -> Tensor:
    """GPT-OSS's layout (the note); an index equal to the expert count is a masked pair."""
    experts = module.gate_up_proj.shape[0]
    hidden = hidden_states.reshape(-1, module.gate_up_proj.shape[1])
    order, expert_of_row, token_of_row, counts = sort_by_group(  # index `experts`: masked
        router_indices.reshape(-1), router_indices.shape[1], experts + 1)
    offs = counts[:experts].cumsum(0).to(torch.int32)
    group_of_row = expert_of_row.clamp(max=experts - 1)
    gate_up = grouped_linear(hidden[token_of_row], module.gate_up_proj.transpose(1, 2),
                             module.gate_up_proj_bias, offs, group_of_row)
    gate = gate_up[..., ::2].clamp(max=module.limit)
    up = gate_up[..., 1::2].clamp(min=-module.limit, max=module.limit)
    glu = gate * torch.sigmoid(gate * module.alpha)
    out = grouped_linear((up + 1) * glu, module.down_proj.transpose(1, 2), module.down_proj_bias,
                         offs, group_of_row)
    weight = torch.where(expert_of_row < experts, routing_weights[token_of_row, group_of_row], 0)
    out = out * weight.unsqueeze(-1)
    return torch.zeros_like(hidden).index_add(0, token_of_row, out.to(hidden.dtype)).view(
        hidden_states.shape[0], -1, hidden.shape[-1])


def _concatenated_shape(module: nn.Module) -> bool:
    gate_up, down = module.gate_up_proj, module.down_proj
    return (callable(getattr(module, "act_fn", None)) and gate_up.shape[0] >= down.shape[0]
            and gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[2] == down.shape[1])


def _gpt_oss_shape(module: nn.Module) -> bool:
    gate_up, down = module.gate_up_proj, module.down_proj
    biases = [getattr(module, n, None) for n in ("gate_up_proj_bias", "down_proj_bias")]
    return (all(isinstance(b, nn.Parameter) and b.dim() == 2 for b in biases)
            and all(isinstance(getattr(module, n, None), float) for n in ("alpha", "limit"))
            and gate_up.shape[0] == down.shape[0] and gate_up.shape[2] == 2 * down.shape[1]
            and gate_up.shape[1] == down.shape[2])


def _concatenated_probe(module: nn.Module, hidden: Tensor, index: Tensor, weights: Tensor):
    return hidden, index, weights


def _gpt_oss_probe(module: nn.Module, hidden: Tensor, index: Tensor, weights: Tensor):
    dense = torch.zeros(hidden.shape[0], module.gate_up_proj.shape[0], dtype=weights.dtype,
                        device=weights.device).scatter(1, index, weights)
    return hidden.view(2, -1, hidden.shape[-1]), index, dense


@dataclasses.dataclass(frozen=True)
class _Form:
    name: str
    matches: Callable[[nn.Module], bool]
    forward: Callable[..., Tensor]
    probe: Callable[..., tuple]
    """(module, hidden (T, H), top-k index (T, k), top-k weights (T, k)) -> the forward's
    arguments, for the check before installing."""
    hidden_dim: int
    """The dimension of ``gate_up_proj`` that is the hidden size."""
    forward_parallel: Optional[Callable[..., Tensor]] = None
    """(module, ``LocalExperts``, the forward's arguments) -> its output under expert
    parallelism; None: a form expert parallelism does not split."""


FORMS = (
    _Form("concatenated [gate; up], identity experts last", _concatenated_shape,
          concatenated_forward, _concatenated_probe, hidden_dim=2,
          forward_parallel=concatenated_forward_parallel),
    _Form("GPT-OSS: transposed, interleaved, biased", _gpt_oss_shape, gpt_oss_forward,
          _gpt_oss_probe, hidden_dim=1),
)


def holds_stacked_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds its experts as 3-D ``gate_up_proj`` and ``down_proj``
    parameters (the note; the planner counts such experts too)."""
    weights = [getattr(module, n, None) for n in ("gate_up_proj", "down_proj")]
    return all(isinstance(w, nn.Parameter) and w.dim() == 3 for w in weights)


def looping_fused_experts(module: nn.Module) -> Optional[_Form]:
    """The form of a module of the note's shapes, not dispatched by transformers' experts
    interface (which sets ``has_gate``); else None."""
    if not holds_stacked_experts(module) or hasattr(module, "has_gate"):
        return None
    return next((form for form in FORMS if form.matches(module)), None)


DECORATED_FLAGS = {"has_gate": True, "has_bias": False, "is_transposed": False,
                   "is_concatenated": True, "has_post_expert_norm": False}
"""The flags of transformers' ``use_experts_implementation`` for the layout the first form
computes (the note)."""


def decorated_fused_experts(module: nn.Module) -> Optional[_Form]:
    """The form of a module transformers' experts interface dispatches (the note), where its
    flags and shapes are the first form's and it has no identity experts; else None."""
    if not (holds_stacked_experts(module) and hasattr(module, "has_gate")):
        return None
    if any(getattr(module, flag, value) != value for flag, value in DECORATED_FLAGS.items()):
        return None
    form = FORMS[0]
    same_count = module.gate_up_proj.shape[0] == module.down_proj.shape[0]
    return form if form.matches(module) and same_count else None


def splittable_fused_experts(module: nn.Module) -> Optional[_Form]:
    """The form expert parallelism would give a module holding its experts as 3-D
    parameters, looping or decorated (the note), or None: another layout, or identity
    experts. Structure only: the planner asks it of fakes."""
    form = looping_fused_experts(module) or decorated_fused_experts(module)
    if form is None or form.forward_parallel is None:
        return None
    return form if module.gate_up_proj.shape[0] == module.down_proj.shape[0] else None


def route_fused_experts_with_fixed_shapes(model: nn.Module, *, confirm: bool = True,
                                          decorated: bool = False
                                          ) -> tuple[list[str], list[str]]:
    """Install the note's forward on every looping fused-experts module of ``model`` that it
    reproduces, and with ``decorated`` (expert parallelism) on every decorated one of the
    first layout; (names rewritten, reasons for those left as they are)."""
    def form_of(module: nn.Module) -> Optional[_Form]:
        return looping_fused_experts(module) or (
            decorated_fused_experts(module) if decorated else None)

    rewritten, left = install_where_reproduced(
        model, FORMS, form_of, _differs if confirm else None,
        "holds its experts as 3-D gate_up_proj and down_proj, but zero_fx's fixed-shape "
        "forward for them")
    if rewritten:
        log.info("zero_fx: %d fused-experts module(s) routed with fixed shapes ([Note: fused "
                 "experts that loop])", len(rewritten))
    return rewritten, left


def install_where_reproduced(model: nn.Module, forms, form_of: Callable, differs: Optional[Callable],
                             what: str) -> tuple[list[str], list[str]]:
    """Give each module of ``model`` that ``form_of(module)`` finds a form for (one of
    ``forms``) that form's forward, where ``differs(module, form)`` (if given) finds nothing
    different ([Note: a rewrite proves itself]); (names rewritten, the others' reasons:
    ``what`` the module is, then what differs)."""
    rewritten, left = [], []
    for name, module in model.named_modules():
        installed = module.__dict__.get("forward")
        if isinstance(installed, FixedShapeFusedExperts) and installed.form in forms:
            rewritten.append(name)
            continue
        form = form_of(module)
        if form is None:
            continue
        why = None if differs is None else differs(module, form)
        if why is None:
            module.forward = FixedShapeFusedExperts(module, form)
            rewritten.append(name)
        else:
            left.append(f"module {name!r} ({type(module).__name__}) {what} {why}")
    return rewritten, left


def _differs(module: nn.Module, form: _Form) -> Optional[str]:
    """None if ``form`` computes what ``module``'s own forward does, forward and backward,
    on a random input and routing ([Note: a rewrite proves itself]); else what differs."""
    original = type(module).forward
    module = probe_copy(module)  # a meta model's: a copy with random values
    total = module.gate_up_proj.shape[0]
    device = module.gate_up_proj.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        tokens, top_k = 4 * total, min(2, total)
        hidden = torch.randn(tokens, module.gate_up_proj.shape[form.hidden_dim], device=device,
                             dtype=module.gate_up_proj.dtype)
        index = torch.rand(tokens, total, device=device).argsort(-1)[:, :top_k]
        weights = torch.rand(tokens, top_k, device=device,
                             dtype=hidden.dtype).requires_grad_()
        named = [("the routing weights", weights),
                 *((n, p) for n, p in module.named_parameters() if p.requires_grad)]
        return what_differs(
            lambda x: original(module, *form.probe(module, x, index, weights)),
            lambda x: form.forward(module, *form.probe(module, x, index, weights)), hidden, named)
