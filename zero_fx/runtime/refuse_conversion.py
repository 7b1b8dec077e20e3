"""The guard on a sharded model's modules against conversions (``model.to``, ``.half()``)."""

from __future__ import annotations

import torch


class RefuseConversion:
    """Each module's ``_apply`` once zero_fx has sharded the model: ``model.to(dtype or
    device)``, ``.half()``, ``.cuda()`` would change the parameters under the plan and the
    shards (the fp32 masters, made on the first call); in stage 3, whose parameters have no
    storage, the copy reads freed memory (a SIGSEGV); ``to_empty()`` would give them new,
    uninitialized storage. What returns each tensor itself (``.to("cpu")`` on CPU,
    ``.float()`` of fp32, ``share_memory()``) goes through."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, fn, recurse: bool = True):
        kinds = {(p.dtype, p.device) for p in self.module.parameters()}
        for dtype, device in kinds:
            probe = torch.empty(0, dtype=dtype, device=device)
            converted = fn(probe)
            if converted is not probe:
                change = (f"turn the model's {dtype} parameters on {device} into "
                          f"{converted.dtype} on {converted.device}"
                          if (converted.dtype, converted.device) != (dtype, device)
                          else "replace the model's parameters with new tensors (to_empty?)")
                raise ValueError(
                    f"this would {change}, after its @zero_compile step sharded them (the plan "
                    "and the fp32 master shards are made on the first call): move and cast the "
                    "model before the first call; for 16-bit compute, zero_compile(mixed_precision="
                    "MixedPrecision(param_dtype=torch.bfloat16)) keeps fp32 masters")
        return type(self.module)._apply(self.module, fn, recurse)
