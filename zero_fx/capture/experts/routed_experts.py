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
import dataclasses
import logging
from typing import Callable, Optional

import torch
from torch import nn

from .fused_experts import route_fused_experts_with_fixed_shapes
from .grouped_experts import GroupedExperts, NotGroupable
from .grouped_gemm_modules import route_grouped_gemms_with_fixed_shapes
from .moe_blocks import LocalExperts, MoeShape, RoutedExperts, moe_shape
from .rewrite_check import output_and_grads, probe_copy, same_output, worst_different_gradient
from .routed_forms import candidate_forms, RoutedForward
from ..step_graph import CaptureError

log = logging.getLogger("zero_fx")

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
class ExpertsRewrite:
    """What ``route_experts_with_fixed_shapes`` did to a model."""

    blocks: list[RoutedExperts]
    """The blocks given a fixed-shape forward, in module order."""
    unrecognised: list[str]
    """One sentence per block that looks like a mixture of experts but was left as it is,
    naming it and saying why (the capture error quotes them if the step does not capture)."""


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
        if isinstance(block.__dict__.get("forward"), RoutedForward):
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


def hold_local_experts(model: nn.Module, blocks: list[RoutedExperts], degree: int, rank: int,
                       group_name: str, capacity_factor: Optional[float] = None) -> None:
    """Expert parallelism: every rewritten block of ``model`` runs only the experts of slice
    ``rank`` of ``degree`` and sends the other rows to their ranks ([Note: expert
    parallelism] in zero_fx/plan/expert_parallel.py); ``degree`` 1 is a group of one rank,
    whose rows go through the exchanges all the same (a world of one that keeps its
    collectives). ``degree`` divides every block's number of experts."""
    for info in blocks:
        held = LocalExperts(degree, rank * info.num_experts // degree, group_name,
                            capacity_factor)
        if info.stacked:  # its parameters keep this place's rows once sharded
            model.get_submodule(info.experts).forward.parallel = held
        else:
            model.get_submodule(info.experts.rpartition(".")[0]).forward.parallel = held


def unrecognised_experts_error(rewrite: ExpertsRewrite, error: CaptureError) -> CaptureError:
    """The step did not capture (``error``) and the model has blocks the rewrite left alone:
    name them, and say what shape of block the rewrite takes."""
    return CaptureError(f"{error}\nIn this model, " + "; ".join(rewrite.unrecognised)
                        + f".\n{SHAPE_THAT_CAPTURES}")


class _NotRewritten(Exception):
    """A block that looks like a mixture of experts, left as it is (the message says why)."""


def _unrecognised(name: str, block: nn.Module, why: str) -> _NotRewritten:
    return _NotRewritten(f"module {name!r} ({type(block).__name__}) looks like a "
                         f"mixture-of-experts block, but {why}")


# -- installing a form ----------------------------------------------------------------------

def _install(path: str, block: nn.Module, shape: MoeShape, confirm: bool) -> RoutedExperts:
    name = path or type(block).__name__
    experts_name, router_name, top_k = shape.experts, shape.router, shape.top_k
    experts, router = getattr(block, experts_name), getattr(block, router_name)
    if top_k is None:
        raise _unrecognised(name, block, "neither it nor its router has `top_k` or "
                                         "`num_experts_per_tok`")
    try:
        grouped = GroupedExperts(experts[0])
    except NotGroupable as err:
        raise _unrecognised(name, block, f"its experts cannot be run as one grouped "
                                         f"computation ({err})") from None
    original = type(block).forward
    for form in candidate_forms(block, router, shape):
        routed = RoutedForward(block, form, grouped, experts_name, router_name, top_k,
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


# -- the check that a form reproduces the block ---------------------------------------------

def _reproduces(name: str, block: nn.Module, original: Callable, routed: RoutedForward,
                expert: nn.Module) -> bool:
    """Whether ``routed`` computes what the block's own forward does, on a random input: its
    outputs, and the gradients of the input and of every parameter under one random
    cotangent ([Note: a rewrite proves itself]). A form whose outputs agree but whose
    gradients do not raises ``CaptureError``: zero_fx would train the block wrong."""
    probe = probe_copy(block)
    routed_probe = routed.on(probe)
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
            f"config. [Note: a rewrite proves itself] in zero_fx/capture/experts/routed_experts.py")
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
