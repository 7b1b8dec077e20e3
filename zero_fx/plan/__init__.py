"""Where every element of every parameter lives (``layout``), and the planner that answers
"will it fit" before any memory is spent (``python -m zero_fx.plan``; ``planner``)."""

from .build import PlanOptions, PlanRanks, make_plan, plan_for_module
from .layout import ParamLayout, ShardPlan

__all__ = ["ParamLayout", "PlanOptions", "PlanRanks", "ShardPlan", "make_plan", "plan_for_module"]
