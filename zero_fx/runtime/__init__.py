"""What lives between calls and runs around the compiled graph. By role:

- the sharded state: ``sharded_state`` (each rank's parameter shards, their gradients and
  the optimizer on them), ``whole_parameters`` (gathering them whole, or copying them out),
  ``optimizer`` (the user's optimizer rebound to shards; which rule steps each parameter),
  ``refuse_conversion`` (no ``model.to`` on it);
- the first call: ``sharding`` (find the model and optimizer, plan, shard), ``offload`` and
  ``offload_choice`` (what lives in host memory, and ``offload="auto"``'s choice);
- each call: ``step_runner`` (what dynamo calls: shards in, gradient shards out),
  ``eager_fallback`` (a step that breaks the graph, run eagerly on the shards);
- ``update/``: the optimizer's update, in the graph bucket by bucket or after it (its
  ``__init__`` indexes it: where the optimizer steps per bucket is ``update/graph_update.py``);
- ``distributed/``: the process groups, and when ranks or collectives go wrong.

The modules of the two rooms keep their old paths (``zero_fx.runtime.failures`` is
``zero_fx.runtime.distributed.failures``), but ``update``, now the room's name."""
