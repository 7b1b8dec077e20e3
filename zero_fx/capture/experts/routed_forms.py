"""The fixed-shape forwards a mixture-of-experts block may be given (steps 1 to 5 of
[Note: routed experts with fixed shapes] in routed_experts.py): route, sort the (token,
expert) pairs by expert, run the experts as one grouped computation, and scatter the rows
back, weighted. ``candidate_forms`` lists the candidates for a block; routed_experts.py installs the
first that reproduces it."""

from __future__ import annotations

import copy
import dataclasses
import sys
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .expert_exchange import dispatch_and_combine
from .grouped_experts import GroupedExperts
from .grouped_mm import sort_by_group
from .moe_blocks import LocalExperts, MoeShape, RoutedExperts, routed_count


@dataclasses.dataclass(frozen=True)
class _Form:
    """One fixed-shape forward a block may have: its routing, its shared expert."""

    routing: str
    forward: Callable  # (block, hidden_states) -> output
    shared: Optional[str]


class RoutedForward:
    """The fixed-shape forward installed on a block (``block.forward``)."""

    def __init__(self, block: nn.Module, form: _Form, grouped: "GroupedExperts",
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

    def on(self, block: nn.Module) -> "RoutedForward":
        """The same forward, installed on ``block`` (a probe copy of its block)."""
        new = copy.copy(self)
        new._block = block
        return new


def candidate_forms(block: nn.Module, router: nn.Module, shape: MoeShape) -> list[_Form]:
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

    def route(block, routed: RoutedForward, logits):
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

    def route(block, routed: RoutedForward, logits):
        return sparsemixer(logits, jitter_eps=getattr(block, "router_jitter_noise", 0.0),
                           training=block.training)

    return _linear_router_forward(route, shared, True, jitter="input_jitter_noise")


def _linear_router_forward(route: Callable, shared: Optional[str], with_logits: bool, *,
                           jitter: str) -> Callable:
    """A block with a Linear router: its input scaled by uniform noise of the block's
    ``jitter`` attribute while training, the router's logits, ``route(block, routed,
    logits) -> (weights, chosen)``, the experts mixed (weights cast to the input's dtype) and
    the shared expert added."""

    def forward(block, routed: RoutedForward, hidden_states):
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

    def forward(block, routed: RoutedForward, hidden_states):
        shape = hidden_states.shape
        chosen, weights = getattr(block, routed.router)(hidden_states)
        hidden = hidden_states.reshape(-1, shape[-1])
        out, extra = _mix_experts(block, routed, hidden, chosen, weights, weights.dtype,
                                  _shared_output(block, shared, hidden_states))
        return _plus(out.to(hidden_states.dtype).reshape(shape), extra)

    return forward


def _mix_experts(block, routed: RoutedForward, hidden: torch.Tensor, chosen: torch.Tensor,
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
