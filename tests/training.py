"""Training runs shared by the parity and memory tests: zero_fx on N ranks, and the reference."""

from __future__ import annotations

import functools
import gc
import os

import torch

import models
from ranks import run_ranks
from zero_fx import zero_compile

STEPS = 5


def zero_fx_rank(rank: int, world_size: int, model_name: str, backend: str, broken: str = ""):
    """Train STEPS steps with @zero_compile(stage=3) on this rank's slice of each global batch."""
    if broken == "skip_divide":  # a deliberately broken reduce pass, to prove the parity test bites
        import zero_fx.passes.reduce_grads as reduce_grads

        reduce_grads._average = lambda summed, world_size: summed
    model = models.build(model_name)
    opt = models.make_optimizer(model)

    @zero_compile(stage=3, backend=backend)
    def train_step(model, opt, x, y):
        loss = models.loss_fn(model_name, model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    losses = []
    for step in range(STEPS):
        x, y = models.global_batch(model_name, step)
        per_rank = x.shape[0] // world_size
        local = slice(rank * per_rank, (rank + 1) * per_rank)
        losses.append(train_step(model, opt, x[local], y[local]).item())
    return {
        "losses": losses,
        "params": train_step.full_parameters(),
        "memory": _held_memory(model, train_step),
        "compile_seconds": train_step.compile_seconds,
    }


def _held_memory(model, train_step) -> dict:
    """What this rank holds after a step, measured on the tensors themselves."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not isinstance(obj, torch._subclasses.FakeTensor):
            if obj.device.type == "meta":
                continue
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    state = train_step.state
    return {
        "full_param_storage_bytes": sum(p.untyped_storage().nbytes() for p in model.parameters()),
        "shard_bytes": sum(s.untyped_storage().nbytes() for s in state.shards.values()),
        "optimizer_state_bytes": sum(
            v.untyped_storage().nbytes()
            for st in state.optimizer.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        ),
        "all_live_tensor_bytes": sum(storages.values()),
    }


@functools.lru_cache(maxsize=None)
def zero_fx_run(world_size: int, model_name: str, backend: str, broken: str = ""):
    return run_ranks(world_size, zero_fx_rank, model_name, backend, broken)


@functools.lru_cache(maxsize=None)
def reference_run(model_name: str):
    """Plain single-process PyTorch on the whole global batch."""
    model = models.build(model_name)
    opt = models.make_optimizer(model)
    losses = []
    for step in range(STEPS):
        x, y = models.global_batch(model_name, step)
        loss = models.loss_fn(model_name, model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def parity_errors(results: list, reference: dict) -> dict:
    """Worst relative error of the per-step mean loss and of each final parameter."""
    mean_losses = torch.tensor([r["losses"] for r in results]).mean(0)
    errors = {"loss": relative_error(mean_losses, torch.tensor(reference["losses"]))}
    for name, expected in reference["params"].items():
        for rank, r in enumerate(results):
            errors[f"{name}@rank{rank}"] = relative_error(r["params"][name], expected)
    return errors
