"""Plan a step without running it: the rewritten graph of a model built on fake tensors.

A fake tensor has a shape, a dtype and a device but no memory, so an 8B-parameter
model at any world size is planned on a laptop. Nothing here needs a process
group: the passes only write the group's name into the graph.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule

from ..capture.experts.routed_experts import route_experts_with_fixed_shapes
from ..config import ZeroConfig
from ..passes import build_pipeline, run_pipeline
from ..passes.common.predicates import mark_step_graph
from ..passes.common.splice import trace_to_aten
from ..plan.build import PlanRanks, plan_for_module
from ..plan.layout import ShardPlan
from ..plan.secondary import planned as planned_secondary
from .on_device import moved_to_device

LossFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def language_model_loss(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor):
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def causal_lm_loss(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor):
    """The planner's loss: ``language_model_loss`` of a model that may be HuggingFace's (its
    output's ``logits``), in fp32."""
    out = model(tokens)
    logits = getattr(out, "logits", out)  # HuggingFace returns an output object
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def rewritten_step_on_fake(build_model: Callable[[], torch.nn.Module], *, batch: int, seq: int,
                           vocab_size: int, world_size: int, stage: int = 3,
                           loss_fn: LossFn = language_model_loss, dtype=None, replicas: int = 1,
                           device: str = "cpu", **options) -> tuple[GraphModule, ShardPlan]:
    """The graph ``@zero_compile(stage=stage, **options)`` would run on each of
    ``world_size`` ranks for a language model, and its plan; no memory is allocated.
    ``replicas``: hybrid sharding, ``replicas`` copies of shard groups of ``world_size``
    ranks ([Note: hybrid sharding] in runtime/distributed/process_group.py; not in stage 0).

    ``batch`` is per rank. ``dtype`` is the default dtype while the model is
    built (bf16 planning of a model written for fp32). ``device``: where the step's
    tensors live in the result ("cuda": as on a GPU, [Note: a CUDA graph planned on a
    CPU-only build] in zero_fx/planner/on_device.py; the step is traced on the CPU either way).
    """
    config = ZeroConfig(stage=stage, backend="eager", **options)
    with FakeTensorMode(), _default_dtype(dtype):
        model = build_model()
        _route_experts(model)
        named = dict(model.named_parameters())
        world_size, replicas, secondary = planned_secondary(config.secondary_partition,
                                                            world_size, replicas)
        hybrid = replicas > 1 and stage != 0
        plan = plan_for_module(model, PlanRanks(world_size, group_name="planned",
                                                replicas=replicas if hybrid else 1,
                                                replicate_group_name="planned-replicas" if hybrid
                                                else "", secondary=secondary),
                               config.plan_options())
        tokens = torch.randint(0, vocab_size, (batch, seq))
        targets = torch.randint(0, vocab_size, (batch, seq))

        def step(params: dict, tokens, targets):
            loss = loss_fn(_bound(model, params), tokens, targets)
            grads = torch.autograd.grad(loss, list(params.values()))
            return (loss.detach(), *grads)

        gm = trace_to_aten(step)(named, tokens, targets)
    mark_step_graph(gm, [*named, None, None], {i + 1: name for i, name in enumerate(named)})
    gm = run_pipeline(gm, build_pipeline(plan, disable=config.debug.disable_passes, extra=config.passes))
    if device != "cpu":
        moved_to_device(gm, device, shards_on_host=plan.offloads_parameters)
    return gm, plan


def _route_experts(model: torch.nn.Module) -> None:
    """Mixture-of-experts blocks get the fixed-shape forward ``zero_compile`` gives them before
    capture ([Note: routed experts with fixed shapes]); their own forward loops over the
    experts that received tokens, which no graph holds. Capture confirms the form on a
    random input; on fake tensors there are no values to compare (and a real copy of a
    DeepSeek-V3 block is 45 GB), so the first form of the block's router is taken: the
    routing variants differ in arithmetic, not in shapes or memory."""
    route_experts_with_fixed_shapes(model, confirm=False)


@contextlib.contextmanager
def _default_dtype(dtype):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype or saved)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def _bound(model: torch.nn.Module, params: dict):
    def call(*args):
        return torch.func.functional_call(model, params, args, tie_weights=True)
    return call
