"""Training runs for the training-feature tests (precision, accumulation, clipping, schedules,
frozen parameters): zero_fx on N ranks, and plain PyTorch on one process doing the same."""

from __future__ import annotations

import collections
import functools
import re

import torch
import torch.nn as nn

from support import models
from support.ranks import run_ranks, with_mesh
from zero_fx import zero_compile

STEPS = 5


class LoRALinear(nn.Module):
    """A frozen base weight plus a trainable low-rank update, as in LoRA fine-tuning."""

    def __init__(self, features: int, rank: int = 2):
        super().__init__()
        self.base = nn.Linear(features, features)
        self.base.requires_grad_(False)
        self.down = nn.Linear(features, rank, bias=False)
        self.up = nn.Linear(rank, features, bias=False)
        nn.init.normal_(self.up.weight, std=0.1)  # (LoRA starts it at zero; here it should move)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


class FrozenBaseMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(LoRALinear(models.FEATURES), nn.GELU(), LoRALinear(models.FEATURES),
                                 nn.Linear(models.FEATURES, 7))
        self.net[3].requires_grad_(False)  # a frozen head too: no gradient at all reaches it

    def forward(self, x):
        return self.net(x)


def build(model_name: str) -> nn.Module:
    if model_name == "frozen_mlp":
        torch.manual_seed(0)
        return FrozenBaseMLP()
    return models.build(model_name)


def _data_name(model_name: str) -> str:
    return "mlp" if model_name == "frozen_mlp" else model_name


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    trainable = [p for p in model.parameters() if p.requires_grad]
    if kind == "sgd":
        return torch.optim.SGD(trainable, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1)


def schedule(opt: torch.optim.Optimizer, scheduled: bool):
    """A learning rate that halves every 2 steps, and a weight decay changed by hand."""
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if scheduled else None


def _after_step(opt, scheduler, step: int) -> None:
    if scheduler is not None:
        scheduler.step()
        for group in opt.param_groups:
            group["weight_decay"] = 0.1 / (step + 2)


def zero_fx_rank(rank: int, world_size: int, model_name: str, stage: int, optimizer: str,
                 options: tuple, micro_batches: int, scheduled: bool, steps: int):
    """``steps`` optimizer steps of @zero_compile(**dict(options)) on this rank's slice of
    each global batch, cut into ``micro_batches`` calls per step."""
    model = build(model_name)
    opt = make_optimizer(model, optimizer)
    scheduler = schedule(opt, scheduled)
    loss_of = models.training_step(_data_name(model_name))
    train_step = zero_compile(loss_of, stage=stage, accumulation_steps=micro_batches,
                              **with_mesh({"backend": models.BACKEND, **dict(options)}))
    losses, norms = [], []
    for step in range(steps):
        x, y = models.global_batch(_data_name(model_name), step)
        per_rank = x.shape[0] // world_size
        local = slice(rank * per_rank, (rank + 1) * per_rank)
        with train_step.counting_collectives() as counted:  # the last step's count is kept
            micro = [train_step(model, opt, xm, ym).item()
                     for xm, ym in zip(x[local].chunk(micro_batches), y[local].chunk(micro_batches))]
        losses.append(sum(micro) / len(micro))
        norm = train_step.last_grad_norm
        norms.append(None if norm is None else norm.item())
        _after_step(opt, scheduler, step)
    return {
        "losses": losses,
        "norms": norms,
        "params": train_step.full_parameters(),
        "compilations": len(train_step.compilations),
        "optimizer_steps": train_step.optimizer_steps,
        "traffic": train_step.traffic(),
        "counted": dict(counted.numel),
        "model_dtypes": {name: p.dtype for name, p in model.named_parameters()},
        "shard_dtypes": {name: s.dtype for name, s in train_step.state.shards.items()},
        "device_shard_dtypes": {name: s.dtype for name, s in train_step.state.device_shards.items()},
        "optimizer_state_dtypes": {v.dtype for st in opt.state.values() for v in st.values()
                                   if isinstance(v, torch.Tensor) and v.ndim > 0},
        "storage_bytes": {name: p.untyped_storage().nbytes() for name, p in model.named_parameters()},
        "our_ops": _our_ops(train_step),
    }


def _our_ops(train_step) -> dict:
    """Calls of zero_fx's own ops (the copies between host and device) by name: in the latest
    rewritten graph, and in the program Inductor lowered it to (empty for other backends)."""
    graph = collections.Counter(str(node.target.name()).split("::")[1].split(".")[0]
                                for node in train_step.graphs[-1].graph.nodes
                                if isinstance(node.target, torch._ops.OpOverload)
                                and node.target.namespace == "zero_fx")
    program = collections.Counter(re.findall(r"= torch\.ops\.zero_fx\.(\w+)\.default\(",
                                             train_step.compilations[-1].program))
    return {"graph": dict(graph), "program": dict(program)}


@functools.lru_cache(maxsize=None)
def zero_fx_run(world_size: int, model_name: str, stage: int, optimizer: str = "sgd",
                options: tuple = (), micro_batches: int = 1, scheduled: bool = False,
                steps: int = STEPS):
    return run_ranks(world_size, zero_fx_rank, model_name, stage, optimizer, options,
                     micro_batches, scheduled, steps, shared=True)


@functools.lru_cache(maxsize=None)
def reference_run(model_name: str, optimizer: str = "sgd", max_grad_norm=None,
                  scheduled: bool = False, steps: int = STEPS):
    """Plain PyTorch on one process and the whole global batch, clipping with
    ``clip_grad_norm_``."""
    model = build(model_name)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = make_optimizer(model, optimizer)
    scheduler = schedule(opt, scheduled)
    losses, norms = [], []
    for step in range(steps):
        x, y = models.global_batch(_data_name(model_name), step)
        loss = models.loss_fn(_data_name(model_name), model, x, y)
        loss.backward()
        if max_grad_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        _after_step(opt, scheduler, step)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "norms": norms, "initial": initial}
