"""Where every element of every parameter lives: the plan the passes and the runtime read.
Pure data. By role:

- ``layout``: the shard plan (``ShardPlan``, ``ParamLayout``), what each stage shards and
  the buckets; ``build``: making it (``make_plan``, ``plan_for_module``);
- what options add to it: ``owners`` (the rank that steps each whole-tensor update),
  ``tensor_parallel``, ``expert_parallel``, ``secondary`` (ZeRO++'s partition in the node);
- ``__main__``: ``python -m zero_fx.plan``, which runs zero_fx.planner's command line.

The offline planner that answers "will it fit" is zero_fx.planner, which reads this
package; nothing here imports it."""

from .build import PlanOptions, PlanRanks, make_plan, plan_for_module
from .layout import ParamLayout, ShardPlan

__all__ = ["ParamLayout", "PlanOptions", "PlanRanks", "ShardPlan", "make_plan", "plan_for_module"]
