"""Where every element of every parameter lives (``layout``): the plan the passes and the
runtime read. The offline planner that answers "will it fit" (``python -m zero_fx.plan``)
is zero_fx.planner, which reads this package; nothing here imports it."""

from .build import PlanOptions, PlanRanks, make_plan, plan_for_module
from .layout import ParamLayout, ShardPlan

__all__ = ["ParamLayout", "PlanOptions", "PlanRanks", "ShardPlan", "make_plan", "plan_for_module"]
