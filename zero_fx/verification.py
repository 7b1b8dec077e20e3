"""``zero_fx.verify``: train a copy of the user's model one step under zero_fx and one step
under eager data parallelism, and compare what each parameter's update came to.

[Note: checking a step against eager]
A wrong gradient can leave every loss right: a router's update 7% off moved the loss by
1e-7, and a parameter compared with its own norm agreed to 1e-4. What shows it is the
update: ``‖p − p_eager‖ / ‖p_eager − p_0‖``, the error relative to how far the step moved
the parameter. ``verify`` measures it on the user's own model, which is the one model the
test suite has not seen:

- two copies of the model and optimizer are taken before the step's first call (the step
  itself is left untouched: it has not sharded anything yet);
- one copy trains ``steps`` calls under a new step with the same options;
- the other runs the undecorated step function eagerly on the same batch, its optimizer's
  ``step()`` first averaging each gradient over the ranks (SUM, then divided by the world
  size), which is what data parallelism computes (DDP's semantics), then clipping by the
  global norm and accumulating over ``accumulation_steps`` calls as zero_fx's options say;
- both start from the same RNG state; ``nn.Dropout`` modules are set to p = 0 in both
  copies (compiled and eager code draw different random numbers), and said so.

Options that are lossy by design are off in the zero_fx copy, and said so: mixed precision
(with its loss scaling), quantized collectives, an expert capacity that drops rows, an
update one step stale. What is verified is the rewrite's arithmetic, exactly: everything
else agrees to the rounding of fp32 (errors around 1e-6 on the suite's models; the default
tolerance is 1e-3).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from .compiled_step import CompiledStep
from .base.formatting import ranks_phrase
from .plan.tensor_parallel import is_dtensor
from .runtime.sharding import find_model_and_optimizer

TOLERANCE = 1e-3
"""The update error above which ``verify`` reports a parameter as wrong."""

LOSSY_OPTIONS = {
    "mixed_precision": None,
    "quantize_weights": None,
    "quantize_gradients": None,
    "expert_capacity_factor": None,
}
"""Options that change the numbers by design, and their values in the verified copy."""

SHOWN = 5
"""Parameters listed by name in the report (the worst first)."""


@dataclass(frozen=True)
class Verification:
    """What ``verify`` measured: print it for a report, or read ``ok`` and ``worst``."""

    update_errors: dict[str, float]
    """Each trained parameter's ``‖p − p_eager‖ / ‖p_eager − p_0‖``. A parameter that eager
    left where it was has its distance from where it started instead (0 when both agree)."""
    losses: tuple[Optional[float], Optional[float]]
    """The step's returned loss under zero_fx and under eager, on this rank (None if the
    step returns no scalar tensor), at the last call."""
    tolerance: float
    stage: int
    world_size: int
    steps: int
    backend: str
    options_off: tuple[str, ...] = ()
    """The lossy options the step sets that the check turned off (``LOSSY_OPTIONS``)."""
    dropouts_off: tuple[str, ...] = ()
    """The ``nn.Dropout`` modules set to p = 0 in both copies."""

    @property
    def worst(self) -> tuple[str, float]:
        """The parameter whose update is furthest off, and its error."""
        name = max(self.update_errors, key=self.update_errors.get)
        return name, self.update_errors[name]

    @property
    def ok(self) -> bool:
        return self.worst[1] <= self.tolerance

    def __str__(self) -> str:
        zero, eager = self.losses
        lines = [f"zero_fx.verify: stage {self.stage} on {ranks_phrase(self.world_size)}, "
                 f"{self.steps} call(s), backend {self.backend}, against eager PyTorch with "
                 f"gradients averaged over the ranks"]
        if zero is not None and eager is not None:
            lines.append(f"  loss on this rank: {zero:.6g} (zero_fx), {eager:.6g} (eager), "
                         f"{abs(zero - eager) / max(abs(eager), 1e-12):.1e} relative")
        ranked = sorted(self.update_errors.items(), key=lambda item: -item[1])
        width = max(len(name) for name, _ in ranked[:SHOWN])
        lines.append("  update error of each parameter, |p - p_eager| / |p_eager - p_0|, worst "
                     "first:")
        lines += [f"    {name:<{width}}  {error:.1e}" for name, error in ranked[:SHOWN]]
        if len(ranked) > SHOWN:
            lines.append(f"    ... {len(ranked) - SHOWN} more, each at most {ranked[SHOWN][1]:.1e}")
        for what, names in (("turned off (lossy by design)", self.options_off),
                            ("dropout set to p = 0 in both copies", self.dropouts_off)):
            if names:
                lines.append(f"  {what}: {', '.join(names)}")
        name, error = self.worst
        verdict = "passed" if self.ok else "FAILED"
        relation = "at most" if self.ok else "above"
        lines.append(f"  {verdict}: the worst, {error:.1e} ({name}), is {relation} the "
                     f"tolerance {self.tolerance:.0e}")
        return "\n".join(lines)


def verify(step: CompiledStep, *args: Any, steps: int = 1, tolerance: float = TOLERANCE,
           between: Optional[Callable[[int, torch.nn.Module, torch.optim.Optimizer], None]] = None,
           **kwargs: Any) -> Verification:
    """Check a step against eager PyTorch on your own model: ``print(zero_fx.verify(
    train_step, model, opt, x, y))``, before the step's first call, on every rank.

    A copy of the model and optimizer trains ``steps`` calls of ``step``'s function under
    zero_fx, with ``step``'s options; another copy runs the same function eagerly with each
    gradient averaged over the ranks before ``opt.step()``; both on the batch you pass
    (this rank's). The result lists each parameter's update error, ``‖p − p_eager‖ /
    ‖p_eager − p_0‖``, worst first, and ``ok`` says whether the worst is within
    ``tolerance``. ``step``, the model and the optimizer are not changed.

    ``between(call, model, optimizer)``, if given, runs before each call on each copy: your
    loop's own changes between steps (a learning rate set by hand, layers frozen or
    unfrozen, ``model.eval()``), so the check covers the pattern you train with.

    It holds two more copies of the model and optimizer while it runs: use it on models
    small enough to copy, or on a small config of yours ([Note: checking a step against
    eager])."""
    if not isinstance(step, CompiledStep):
        raise TypeError(f"verify takes a step decorated with @zero_compile, got "
                        f"{type(step).__name__}")
    if step.model is not None or step.optimizer is not None:
        raise ValueError("verify needs the model and optimizer as arguments of the step (it runs "
                         "the step on copies of them); this step was given model= or optimizer=")
    if step.state is not None:
        raise RuntimeError("verify copies the model and optimizer as they are before the step's "
                           "first call, and this step has already run (stage 3 holds no values "
                           "in the model's parameters): call verify first")
    accumulation = step.config.accumulation_steps
    if steps < 1 or steps % accumulation:
        raise ValueError(f"steps must be a positive multiple of accumulation_steps "
                         f"({accumulation}), or no optimizer step would be compared; got {steps}")
    model, optimizer = find_model_and_optimizer(args, kwargs, None, None)
    _check_copyable(model)
    config, options_off = _exact(step.config)
    (zero_model, zero_opt, zero_args, zero_kwargs), dropouts_off = _copy(model, optimizer, args,
                                                                         kwargs)
    (eager_model, eager_opt, eager_args, eager_kwargs), _ = _copy(model, optimizer, args, kwargs)
    # every parameter: one frozen now may be unfrozen by ``between``
    initial = {n: p.detach().clone() for n, p in eager_model.named_parameters()
               if p.requires_grad or between is not None}

    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    devices = [p.device for p in model.parameters() if p.device.type == "cuda"][:1]
    with torch.random.fork_rng(devices=devices):
        zero_step = CompiledStep(step.function, config, model=None, optimizer=None)
        for call in range(steps):
            if between is not None:
                between(call, zero_model, zero_opt)
            zero_out = zero_step(*zero_args, **zero_kwargs)
        trained = zero_step.full_parameters()
    with torch.random.fork_rng(devices=devices):
        averaged = _DataParallelOptimizer(eager_opt, eager_model, world_size, config)
        for call in range(steps):
            if between is not None:
                between(call, eager_model, eager_opt)
                averaged.params = [p for p in eager_model.parameters() if p.requires_grad]
            eager_out = averaged.call(step.function, eager_args, eager_kwargs)
    errors = {name: _update_error(trained[name], p.detach(), initial[name])
              for name, p in eager_model.named_parameters() if name in initial}
    return Verification(errors, (_scalar(zero_out), _scalar(eager_out)), tolerance, config.stage,
                        world_size, steps, str(getattr(config.backend, "__name__", config.backend)),
                        options_off, dropouts_off)


def _check_copyable(model: torch.nn.Module) -> None:
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("verify compares values, and the model is on the meta device: build a "
                         "small config of it with values (or load them) and verify that")
    if any(is_dtensor(p) for p in model.parameters()):
        raise NotImplementedError("verify does not check tensor-parallel models (DTensor "
                                  "parameters) yet: verify the model without parallelize_module")


def _exact(config):
    """``config`` with the lossy options off, and the names of those it had on."""
    on = tuple(name for name, off in LOSSY_OPTIONS.items() if getattr(config, name) != off)
    changes = {name: LOSSY_OPTIONS[name] for name in on}
    if config.offload.step != "sync":
        on += ("offload_step",)
        changes["offload_step"] = "sync"
    return config.replaced(**changes), on


def _copy(model, optimizer, args, kwargs):
    """Copies of the model and optimizer (the optimizer over the copied parameters) and the
    arguments with them in place of the originals; the dropouts set to 0."""
    memo: dict = {}
    model_copy = copy.deepcopy(model, memo)
    opt_copy = copy.deepcopy(optimizer, memo)
    swap = {id(model): model_copy, id(optimizer): opt_copy}

    def swapped(value):
        return swap.get(id(value), value)

    dropouts = []
    for name, module in model_copy.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            module.p = 0.0
            dropouts.append(name)
    return (model_copy, opt_copy, tuple(map(swapped, args)),
            {k: swapped(v) for k, v in kwargs.items()}), tuple(dropouts)


class _DataParallelOptimizer:
    """Runs the step function eagerly with ``opt.step()`` and ``opt.zero_grad()`` taking
    effect as zero_fx's options say: every ``accumulation_steps``-th call, on the gradient
    summed over those calls, divided by their number, averaged over the ranks and clipped
    to ``max_grad_norm``."""

    def __init__(self, optimizer, model, world_size: int, config):
        self.optimizer, self.world_size, self.config = optimizer, world_size, config
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.calls = 0

    def call(self, fn, args, kwargs):
        self.calls += 1
        last = self.calls % self.config.accumulation_steps == 0
        opt = self.optimizer
        own = {name: vars(opt)[name] for name in ("step", "zero_grad") if name in vars(opt)}
        step = opt.step
        opt.step = functools.partial(self._step, step) if last else _nothing
        if not last:
            opt.zero_grad = _nothing
        try:
            return fn(*args, **kwargs)
        finally:
            for name in ("step", "zero_grad"):  # as they were: the class's, or the instance's
                if name in own:
                    setattr(opt, name, own[name])
                else:
                    vars(opt).pop(name, None)

    def _step(self, step, *args, **kwargs):
        grads = [p.grad for p in self.params if p.grad is not None]
        for grad in grads:
            grad.div_(self.config.accumulation_steps)
            if self.world_size > 1:
                dist.all_reduce(grad, dist.ReduceOp.SUM)  # not AVG: gloo's sums (pytorch#162338)
                grad.div_(self.world_size)
        if self.config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm)
        return step(*args, **kwargs)


def _nothing(*args, **kwargs):
    return None


def _update_error(trained: torch.Tensor, expected: torch.Tensor, initial: torch.Tensor) -> float:
    trained, expected, initial = (t.detach().float().cpu() for t in (trained, expected, initial))
    moved = (expected - initial).norm()
    if moved == 0:
        return (trained - initial).norm().item()
    return ((trained - expected).norm() / moved).item()


def _scalar(out) -> Optional[float]:
    leaves = [v for v in tree_leaves(out) if isinstance(v, torch.Tensor) and v.numel() == 1]
    return leaves[0].item() if leaves else None
