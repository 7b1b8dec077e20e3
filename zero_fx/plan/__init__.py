"""Where every element of every parameter lives (``layout``), and the planner that answers
"will it fit" before any memory is spent (``python -m zero_fx.plan``; ``planner``)."""

from .layout import ParamLayout, ShardPlan, make_plan, plan_for_module

__all__ = ["ParamLayout", "ShardPlan", "make_plan", "plan_for_module"]
