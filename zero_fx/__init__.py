"""zero_fx: compiler-based ZeRO for PyTorch."""

from .api import CompiledStep, zero_compile
from .capture import CaptureError
from .config import ZeroConfig
from .plan import ParamLayout, ShardPlan, make_plan, plan_for_module

__all__ = [
    "CaptureError",
    "CompiledStep",
    "ParamLayout",
    "ShardPlan",
    "ZeroConfig",
    "make_plan",
    "plan_for_module",
    "zero_compile",
]
