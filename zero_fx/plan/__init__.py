"""Where every element of every parameter lives (``layout``): the plan the passes and the
runtime read. The offline planner that answers "will it fit" (``python -m zero_fx.plan``)
is zero_fx.planner, which reads this package; nothing here imports it."""

from .layout import ParamLayout, ShardPlan, make_plan, plan_for_module

__all__ = ["ParamLayout", "ShardPlan", "make_plan", "plan_for_module"]
