"""zero_fx: compiler-based ZeRO for PyTorch."""

from .api import CompiledStep, zero_compile
from .capture import CaptureError
from .config import ZeroConfig
from .cost_model import PRESETS, Estimate, Hardware, estimate
from .offline import rewritten_step_on_fake
from .plan import ParamLayout, ShardPlan, make_plan, plan_for_module

__all__ = [
    "CaptureError",
    "CompiledStep",
    "Estimate",
    "Hardware",
    "PRESETS",
    "ParamLayout",
    "ShardPlan",
    "ZeroConfig",
    "estimate",
    "make_plan",
    "plan_for_module",
    "rewritten_step_on_fake",
    "zero_compile",
]
