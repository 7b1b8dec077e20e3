"""Mixed precision: the loss scaler of fp16 training and the casts at the model's edge (the
policy, ``MixedPrecision``, is one of the user's options in config/policies.py).

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

import torch
from torch.utils._pytree import tree_map_only

from ...config import MixedPrecision


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
