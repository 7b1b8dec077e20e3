"""The optimizer's companions inside the captured step: learning-rate schedulers,
``GradScaler`` and ``clip_grad_norm_`` / ``clip_grad_value_`` record their calls while the
step runs, and the calls run after the graph, in the step's order, around the update.

[Note: the optimizer's companions]
A step written for plain PyTorch calls more than ``opt.step()``::

    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    scheduler.step()

All of these read or change the gradients or the optimizer, which exist only as shards,
after the graph (runtime/update/update.py). So during the call (``recording``) zero_fx swaps them,
as it swaps ``opt.step`` (deferred_optimizer.py), for recorders that append an event to
the call's list of optimizer calls, and runs the events after the graph in that order:

- Swapped at class level, so a scheduler or scaler found anywhere (an argument, a global,
  a closure, an attribute) is seen: ``LRScheduler.step`` and every subclass's own ``step``
  (``ReduceLROnPlateau``, ``SequentialLR``, ...), and ``GradScaler.scale / unscale_ / step
  / update`` (``torch.cuda.amp`` / ``torch.cpu.amp.GradScaler`` inherit them). The
  functions are swapped by name: ``torch.nn.utils.clip_grad_norm_`` and
  ``torch.nn.utils.clip_grad.clip_grad_norm_`` (and ``_value_``), and a global of the step's
  module bound to them (``from torch.nn.utils import clip_grad_norm_``). Called through a
  name zero_fx does not see, the real function reads the unreduced gradients and the
  capture refuses, naming the fix.
- ``scaler.scale(loss)`` is the one call that stays in the graph: ``loss * scaler._scale``,
  the scaler's own scale tensor as a graph input (created at trace time if the scaler has
  none yet), so the backward is scaled as in eager and a new scale needs no recompilation.
- After the graph, at the end of an accumulation window (the gradient shards reduced and
  averaged), the events run in order: ``unscale_`` divides the shards by the scale and
  finds inf/NaN on every rank (one max all-reduce, so all ranks agree); ``clip_grad_norm_``
  computes the global norm of all the model's gradients from the shards (``grad_norm``),
  scales them as ``clip_grad_norm_`` does and writes the norm into the tensor the step
  returned; ``clip_grad_value_`` clamps the shards; ``scaler.step(opt)`` unscales if not
  done and skips the update when an inf/NaN was found; ``opt.step()`` is the update;
  ``scaler.update()`` moves the scaler's ``_scale`` and ``_growth_tracker`` with its own
  factors and interval (``torch._amp_update_scale_``), so ``get_scale()`` and
  ``state_dict()`` tell the truth; ``scheduler.step()`` is the scheduler's own step, after
  the update if the step calls it after ``opt.step()`` (no "before optimizer.step()"
  warning: the update calls the optimizer's ``step`` as the scheduler wrapped it). A
  tensor given to it (``ReduceLROnPlateau``'s metric) is averaged over the data-parallel
  ranks first: each rank's loss is its slice's, and ranks deciding apart would step the
  shards of one model with different learning rates. With ``offload_step="overlap"`` the
  scheduler waits for the update's host thread (which reads the learning rate), so the
  update no longer overlaps the next call.
- With ``accumulation_steps=K`` the companions act with the optimizer, on every K-th call
  (so a scheduler steps once per optimizer step, as in the eager loop that accumulates);
  on the other calls they do nothing, and a clip's returned norm is NaN.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
from torch._dynamo.comptime import comptime

from ...capture.step_calls import traced_gradient_reader, traced_scheduler, traced_step
from ...capture.step_graph import CaptureError
from .optimizer_set import members

_c10d = torch.ops._c10d_functional

SCALE = "scaler.scale"
UNSCALE = "scaler.unscale_"
SCALER_STEP = "scaler.step"
SCALER_UPDATE = "scaler.update"
SCHEDULER_STEP = "scheduler.step"
CLIP_NORM = "clip_grad_norm_"
CLIP_VALUE = "clip_grad_value_"

_clip = torch.nn.utils.clip_grad
CLIP_FUNCTIONS = {CLIP_NORM: _clip.clip_grad_norm_, CLIP_VALUE: _clip.clip_grad_value_}
"""The real functions (``torch.nn.utils`` re-exports these same objects)."""


def _scheduler_classes() -> list[type]:
    """``LRScheduler`` and each subclass that defines its own ``step`` (imported so far)."""
    base = torch.optim.lr_scheduler.LRScheduler
    found, todo = [], [base]
    while todo:
        cls = todo.pop()
        if "step" in cls.__dict__:
            found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def _detached(values):
    return type(values)(v.detach() if isinstance(v, torch.Tensor) else v for v in values)


def _init_scale(ctx) -> None:
    """At trace time: the scaler's lazy ``_scale`` and ``_growth_tracker``, made as its first
    ``scale()`` would, on the loss's device, so the graph reads them as inputs."""
    scaler = ctx.get_local("scaler")._i_will_not_complain_if_bc_breaks_VariableTracker().value
    if scaler._scale is None:
        scaler._lazy_init_scale_growth_tracker(ctx.get_local("outputs").as_fake().device)


class Recorders:
    """The functions swapped in during a call; each appends its event to ``calls`` (the
    call's optimizer calls, in order). The same function objects on every call, so dynamo's
    guards on them hold."""

    def __init__(self, calls: list):
        def scheduler_step(scheduler, *args, **kwargs):
            traced_scheduler()
            calls.append((SCHEDULER_STEP, scheduler, _detached(args),
                          {k: v.detach() if isinstance(v, torch.Tensor) else v
                           for k, v in kwargs.items()}))

        def scale(scaler, outputs):
            if not scaler._enabled:
                return outputs
            if not isinstance(outputs, torch.Tensor):
                return type(outputs)(scale(scaler, o) for o in outputs)
            comptime(_init_scale)
            calls.append((SCALE, scaler))
            return outputs * scaler._scale.to(outputs.device)

        def unscale_(scaler, optimizer):
            if scaler._enabled:
                traced_gradient_reader()
                calls.append((UNSCALE, scaler, optimizer))

        def scaler_step(scaler, optimizer, *args, **kwargs):
            if scaler._enabled:
                traced_gradient_reader()
                calls.append((SCALER_STEP, scaler, optimizer))
            traced_step()
            calls.append("step")

        def scaler_update(scaler, new_scale=None):
            if scaler._enabled:
                if isinstance(new_scale, torch.Tensor):
                    new_scale = new_scale.detach()
                calls.append((SCALER_UPDATE, scaler, new_scale))

        def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                            foreach=None):
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            dtype = params[0].dtype if params else torch.float32
            device = params[0].device if params else None
            norm = torch.empty((), dtype=dtype, device=device)
            traced_gradient_reader()
            calls.append((CLIP_NORM, norm, max_norm, float(norm_type), error_if_nonfinite,
                          len(params)))
            return norm

        def clip_grad_value_(parameters, clip_value, foreach=None):
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            traced_gradient_reader()
            calls.append((CLIP_VALUE, None, clip_value, len(params)))

        self.scheduler_step = scheduler_step
        self.scaler = {"scale": scale, "unscale_": unscale_, "step": scaler_step,
                       "update": scaler_update}
        self.clip = {CLIP_NORM: clip_grad_norm_, CLIP_VALUE: clip_grad_value_}


@contextlib.contextmanager
def recording(recorders: Recorders, step_globals: Optional[dict] = None):
    """Inside, the companions' calls only append their events ([Note: the optimizer's
    companions]); ``step_globals``: the step's module globals, whose names bound to the
    clipping functions are swapped too."""
    swaps = [(cls, "step", recorders.scheduler_step) for cls in _scheduler_classes()]
    swaps += [(torch.amp.GradScaler, name, fn) for name, fn in recorders.scaler.items()]
    for name, fn in recorders.clip.items():
        swaps += [(torch.nn.utils, name, fn), (_clip, name, fn)]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in swaps]
    aliases = {}
    if step_globals is not None:
        real = {id(f): name for name, f in CLIP_FUNCTIONS.items()}
        aliases = {key: value for key, value in step_globals.items() if id(value) in real}
        for key, value in aliases.items():
            step_globals[key] = recorders.clip[real[id(value)]]
    try:
        for owner, name, fn in swaps:
            setattr(owner, name, fn)
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
        if step_globals is not None:
            step_globals.update(aliases)


def is_event(call) -> bool:
    return isinstance(call, tuple)


def check_companions(calls: list, update) -> None:
    """Refuse, before anything is updated, what zero_fx cannot do as eager would."""
    events = [c for c in calls if is_event(c)]
    if not events:
        return
    state = update.state
    if update.scaler is not None and any(e[0].startswith("scaler.") for e in events):
        raise CaptureError(
            "the step uses a torch GradScaler and zero_compile(mixed_precision=MixedPrecision("
            "param_dtype=torch.float16)) scales the loss too; use one: drop the GradScaler "
            "calls (zero_fx scales, unscales and skips overflowed steps itself), or keep the "
            "GradScaler and set MixedPrecision(loss_scale=None). Nothing was updated.")
    counts = _parameter_counts(state.model)
    after_step = False
    for call in calls:
        if call == "step":
            after_step = True
        if not is_event(call):
            continue
        kind = call[0]
        if kind in (UNSCALE, SCALER_STEP) and call[2] is not state.optimizer:
            raise CaptureError(
                f"{kind}(optimizer) is called with another optimizer than the one zero_fx shards; "
                "pass the step's optimizer. Nothing was updated." if call[2] not in members(
                    state.optimizer) else
                f"{kind}(optimizer) in a step of several optimizers is not supported yet; use "
                "zero_compile(mixed_precision=MixedPrecision(param_dtype=torch.float16)), which "
                "scales the loss itself, or one optimizer. Nothing was updated.")
        if kind in (CLIP_NORM, CLIP_VALUE, UNSCALE) and after_step:
            raise CaptureError(f"the step calls {kind}() after opt.step(); call it between "
                               "loss.backward() and opt.step(). Nothing was updated.")
        if kind in (CLIP_NORM, CLIP_VALUE) and call[-1] not in counts:
            raise CaptureError(
                f"{kind}() is given {call[-1]} tensors, not all of the model's parameters "
                f"({max(counts)}); zero_fx clips the gradient of the whole model, over all "
                f"ranks: pass model.parameters(). Nothing was updated.")
        if kind == CLIP_NORM and not (call[3] > 0):
            raise CaptureError(f"clip_grad_norm_(norm_type={call[3]}) is not supported inside a "
                               "zero_fx step: zero_fx combines the ranks' norms, which takes a "
                               "p-norm with p > 0 or inf (1.0, 2.0, inf, ...). Nothing was "
                               "updated.")


def _parameter_counts(model: torch.nn.Module) -> set[int]:
    """How many tensors "all of the model's parameters" may be: all, or the trainable ones."""
    params = list(model.parameters())
    return {len(params), sum(p.requires_grad for p in params)}


def run_window(calls: list, update) -> None:
    """At the end of an accumulation window (gradients reduced, averaged and ready): the
    step's optimizer calls and companions in order; ``opt.step()`` is ``update.apply()``,
    skipped when a GradScaler found inf or NaN."""
    found_inf: dict[int, torch.Tensor] = {}
    skip = False
    for call in calls:
        if call == "step":
            if skip:
                update.skip()
            else:
                update.apply()
            continue
        if not is_event(call):
            continue
        kind = call[0]
        if kind in (UNSCALE, SCALER_STEP):
            scaler = call[1]
            if id(scaler) not in found_inf:
                found_inf[id(scaler)] = _unscale(update, scaler)
            if kind == SCALER_STEP:
                skip = bool(found_inf[id(scaler)].item())  # GradScaler reads it too
        elif kind == SCALER_UPDATE:
            _update_scale(call[1], found_inf.get(id(call[1])), call[2])
        elif kind == CLIP_NORM:
            _clip_norm(update, *call[1:5])
        elif kind == CLIP_VALUE:
            grads = update.state.grads()
            if grads:
                torch._foreach_clamp_min_(grads, -call[2])
                torch._foreach_clamp_max_(grads, call[2])
        elif kind == SCHEDULER_STEP:
            update.settle()  # offload_step="overlap": the optimizer reads lr on its thread
            args = [_mean_over_ranks(update, a) if isinstance(a, torch.Tensor) else a
                    for a in call[2]]
            kwargs = {k: _mean_over_ranks(update, v) if isinstance(v, torch.Tensor) else v
                      for k, v in call[3].items()}
            call[1].step(*args, **kwargs)


def _mean_over_ranks(update, value: torch.Tensor) -> torch.Tensor:
    """A tensor given to ``scheduler.step`` (``ReduceLROnPlateau``'s metric, the loss):
    its mean over the data-parallel ranks, the global batch's for a mean loss, so every
    rank's scheduler decides alike (a rank's own would set different learning rates on
    the shards of one model)."""
    plan = update.state.plan
    # a world of one may keep its collectives ([Note: collectives kept at a world of one])
    for group, size, issued in ((plan.group_name, plan.world_size, plan.issues_collectives),
                                (plan.replicate_group_name, plan.replicas, plan.replicas > 1)):
        if issued:
            value = _c10d.wait_tensor(_c10d.all_reduce(value.float(), "sum", group)) / size
    return value


def outside_window(calls: list) -> None:
    """A call inside an accumulation window: the companions wait for its end; a clip's
    returned norm is NaN (there is no window's gradient yet)."""
    for call in calls:
        if is_event(call) and call[0] == CLIP_NORM:
            call[1].fill_(math.nan)


def _unscale(update, scaler) -> torch.Tensor:
    """Divide the gradient shards by the scaler's scale as ``GradScaler.unscale_`` does;
    1.0 if any rank's shards hold an inf or NaN, else 0.0 (the same on every rank)."""
    scale = scaler._scale
    inv_scale = scale.double().reciprocal().float()
    found = torch.zeros((), dtype=torch.float32, device=scale.device)
    by_device: dict = {}
    for grad in update.state.grads():
        by_device.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, _), grads in by_device.items():
        here = torch.zeros((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, here, inv_scale.to(device))
        found = torch.maximum(found, here.to(found.device))
    return update.across_ranks(found, "max")


def _update_scale(scaler, found_inf: Optional[torch.Tensor], new_scale) -> None:
    """``GradScaler.update`` on the scaler's own tensors and settings."""
    if new_scale is not None:
        if isinstance(new_scale, torch.Tensor):
            scaler._scale.copy_(new_scale)
        else:
            scaler._scale.fill_(new_scale)
        return
    if found_inf is None:
        raise RuntimeError("scaler.update() without scaler.step(opt) or scaler.unscale_(opt) "
                           "before it in the step: no inf checks were recorded (as GradScaler "
                           "says)")
    torch._amp_update_scale_(scaler._scale, scaler._growth_tracker,
                             found_inf.to(scaler._scale.device), scaler._growth_factor,
                             scaler._backoff_factor, scaler._growth_interval)


def _clip_norm(update, out: torch.Tensor, max_norm, norm_type: float,
               error_if_nonfinite: bool) -> None:
    """``clip_grad_norm_`` on the shards: the global norm over all ranks ([Note: clipping and
    overflow] in update.py), written into the tensor the step returned."""
    grads = update.state.grads()
    norm = update.grad_norm(grads, norm_type)
    if error_if_nonfinite and not bool(norm.isfinite()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
            "by the non-finite norm anyway, set `error_if_nonfinite=False`")
    coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    if grads:
        torch._foreach_mul_(grads, coefficient.to(grads[0].device))
    update.last_grad_norm = norm
    out.copy_(norm)
