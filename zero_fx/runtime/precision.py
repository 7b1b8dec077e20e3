"""Mixed precision: the policy, the loss scaler of fp16 training, and the casts at the model's edge.

[Note: mixed precision]
With ``MixedPrecision(param_dtype=torch.bfloat16)`` the optimizer keeps fp32:
it steps on fp32 master shards (in stage 0, fp32 master copies of the whole
parameters), with fp32 optimizer state. The model's own parameters hold
``param_dtype``: in stages 0-2 whole bf16 copies that the runtime refreshes
from the masters after every optimizer step (stages 1-2 all-gather the
updated shards cast to bf16, half the bytes of fp32); in stage 3 their
storage is freed as always and the graph casts each fp32 shard to bf16 before
its all-gather, so every gather moves bf16. Dynamo traces the model in
``param_dtype``, so forward and backward compute in it and produce gradients
in it; ``reduce_dtype`` is what they are reduced in (None: ``param_dtype``,
as FSDP2 does), and gradients are accumulated into the masters' fp32
``.grad``.

fp16 has too few exponent bits for small gradients, so it also scales the
loss: the backward is seeded with the loss scale instead of 1 (the
``scale_loss`` pass), the reduced gradients are divided by it, and a step
whose gradients hold an inf or NaN is skipped and the scale halved
(``LossScaler``, GradScaler's rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch.utils._pytree import tree_map_only

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class MixedPrecision:
    """How a compiled step computes, communicates and scales (``zero_compile(mixed_precision=...)``).

    Like FSDP2's ``MixedPrecisionPolicy``; see [Note: mixed precision].
    """

    param_dtype: torch.dtype = torch.bfloat16
    """Forward and backward compute, and all-gathers move, this dtype."""
    reduce_dtype: Optional[torch.dtype] = None
    """Gradients are reduced in this dtype; None: ``param_dtype``. ``torch.float32``
    reduces more precisely, at twice the reduce traffic of bf16."""
    output_dtype: Optional[torch.dtype] = None
    """Cast the model's floating-point outputs to this dtype (e.g. float32 logits for
    the loss); None: leave them in ``param_dtype``."""
    cast_forward_inputs: bool = True
    """Cast the model's floating-point inputs to ``param_dtype``."""
    loss_scale: Union[str, float, None] = "auto"
    """"dynamic": GradScaler's dynamic loss scaling; a number: a static scale; None:
    no scaling; "auto": dynamic for float16, none otherwise."""
    initial_scale: float = 2.0 ** 16
    growth_interval: int = 2000
    """Dynamic scaling doubles the scale after this many steps without an overflow."""

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and dtype not in FLOAT_DTYPES:
                raise ValueError(f"MixedPrecision.{name} must be a floating dtype "
                                 f"({', '.join(map(str, FLOAT_DTYPES))}), got {dtype!r}")
        scale = self.loss_scale
        if not (scale is None or scale in ("auto", "dynamic")
                or (isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0)):
            raise ValueError(f'MixedPrecision.loss_scale must be "auto", "dynamic", a positive '
                             f"number or None, got {scale!r}")
        if self.initial_scale <= 0 or self.growth_interval < 1:
            raise ValueError("MixedPrecision.initial_scale must be > 0 and growth_interval >= 1")

    @property
    def scales_loss(self) -> bool:
        if self.loss_scale == "auto":
            return self.param_dtype == torch.float16
        return self.loss_scale is not None

    @property
    def dynamic_scaling(self) -> bool:
        return self.scales_loss and self.loss_scale in ("auto", "dynamic")

    def plan_options(self) -> dict:
        """What the shard plan records of this policy."""
        return {"compute_dtype": self.param_dtype,
                "reduce_dtype": self.reduce_dtype or self.param_dtype,
                "loss_scaled": self.scales_loss}


class _DeviceCount:
    """An int counter kept in a device tensor (``_<name>``), so that counting reads nothing on
    the host; reading it does, and waits for the device."""

    def __set_name__(self, owner, name: str):
        self.tensor = f"_{name}"

    def __get__(self, obj, owner=None):
        return self if obj is None else int(getattr(obj, self.tensor).item())

    def __set__(self, obj, value: int) -> None:
        getattr(obj, self.tensor).fill_(value)


class LossScaler:
    """The loss scale of fp16 training and GradScaler's rule for it: halve it on a step
    whose gradients overflowed (that step is skipped), double it after
    ``growth_interval`` clean steps; a static scale never changes.

    The scale and the counters live on the device and ``update`` reads nothing on the
    host (``torch._amp_update_scale_``, as GradScaler does)."""

    skipped_steps = _DeviceCount()
    """Optimizer steps skipped because the gradients overflowed."""
    clean_steps = _DeviceCount()
    """Clean steps since the scale last changed (GradScaler's growth tracker)."""

    def __init__(self, policy: MixedPrecision, device: torch.device):
        initial = policy.initial_scale if policy.dynamic_scaling else float(policy.loss_scale)
        self.scale = torch.tensor(initial, dtype=torch.float32, device=device)
        """Read by the graph on every call (the ``loss_scale`` input); updated in place."""
        self.dynamic = policy.dynamic_scaling
        self.growth_interval = policy.growth_interval
        self._skipped_steps = torch.zeros((), dtype=torch.int64, device=device)
        self._clean_steps = torch.zeros((), dtype=torch.int32, device=device)

    def update(self, found_inf: torch.Tensor) -> None:
        """Count the optimizer step and move the scale; ``found_inf`` is a float32 scalar on
        the device, 1.0 if the step's gradients overflowed (the step is skipped), else 0.0."""
        self._skipped_steps.add_(found_inf.to(self._skipped_steps.dtype))
        if self.dynamic:
            torch._amp_update_scale_(self.scale, self._clean_steps, found_inf, 2.0, 0.5,
                                     self.growth_interval)


def cast_at_model_edge(model: torch.nn.Module, policy: MixedPrecision) -> None:
    """Cast the model's floating inputs to ``param_dtype`` and its floating outputs to
    ``output_dtype``, as the policy asks (hooks on the root module, which dynamo traces)."""
    def cast(dtype):
        return lambda t: t.to(dtype) if t.is_floating_point() else t

    if policy.cast_forward_inputs:
        model.register_forward_pre_hook(
            lambda module, args, kwargs: tree_map_only(torch.Tensor, cast(policy.param_dtype),
                                                       (args, kwargs)),
            with_kwargs=True)
    if policy.output_dtype is not None:
        model.register_forward_hook(
            lambda module, args, output: tree_map_only(torch.Tensor, cast(policy.output_dtype),
                                                       output))
