"""zero_fx graph passes: each ``fn(gm: GraphModule, plan: ShardPlan) -> GraphModule``.

Passes never import the runtime (``zero_fx``); they read the plan and node
metadata only. See README.md in this folder for what every graph between
passes satisfies; ``common/`` holds what they share, not passes.

The passes, in the order ``pipeline`` runs them (``PASS_ORDER``):

- ``annotate_phases``: every node marked forward or backward;
- ``scale_loss``: fp16's loss scale on the backward's seed;
- ``recompute_activations``: the backward recomputes forward values;
- ``recompute_param_views``: the backward reads parameters through its own nodes;
- ``order_weight_grads``: a layer's input gradient before its weight gradient (stage 3);
- ``gather_params`` (stage 3): shards in, all-gathered where used;
- ``accumulate_embedding_grads``: a tied embedding's rows added into the head's gradient;
- ``reduce_grads``: each gradient averaged over the ranks, or this rank's shard of it;
- ``bucket_collectives``: one launch per bucket;
- ``quantize_collectives``: ZeRO++'s quantized gathers and reductions;
- ``schedule_collectives``: gathers issued early, reductions waited for late;
- ``update_in_graph``: each bucket's optimizer update right after its reduction lands;
- ``check_invariants``: the graph keeps README.md's promises, or compiling stops.
"""

from .accumulate_embedding_grads import accumulate_embedding_grads
from .annotate_phases import annotate_phases
from .bucket_collectives import bucket_collectives
from .check_invariants import InvariantError, check_invariants
from .gather_params import gather_params
from .order_weight_grads import order_weight_grads
from .pipeline import PASS_ORDER, NamedPass, Placed, after, before, build_pipeline, pass_names, run_pipeline
from .common.predicates import mark_step_graph
from .quantize_collectives import quantize_collectives
from .recompute_activations import recompute_activations
from .recompute_param_views import recompute_param_views
from .reduce_grads import reduce_grads
from .scale_loss import scale_loss
from .schedule_collectives import schedule_collectives

__all__ = [
    "PASS_ORDER",
    "InvariantError",
    "NamedPass",
    "Placed",
    "accumulate_embedding_grads",
    "after",
    "annotate_phases",
    "before",
    "bucket_collectives",
    "build_pipeline",
    "check_invariants",
    "gather_params",
    "order_weight_grads",
    "mark_step_graph",
    "recompute_activations",
    "recompute_param_views",
    "reduce_grads",
    "pass_names",
    "quantize_collectives",
    "run_pipeline",
    "scale_loss",
    "schedule_collectives",
]
