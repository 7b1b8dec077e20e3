"""What lives between calls and runs around the compiled graph. By role:

- the sharded state: ``sharded_state`` (each rank's parameter shards, their gradients and
  the optimizer on them), ``whole_parameters`` (gathering them whole, or copying them out),
  ``optimizer`` (the user's optimizer rebound to shards; which rule steps each parameter),
  ``optimizer_set`` (several optimizers as one), ``whole_tensor_updates`` (Muon and other
  whole-tensor updates on owner ranks), ``refuse_conversion`` (no ``model.to`` on it);
- the first call: ``sharding`` (find the model and optimizer, plan, shard), ``offload`` and
  ``offload_choice`` (what lives in host memory, and ``offload="auto"``'s choice);
- each call: ``step_runner`` (what dynamo calls: shards in, gradient shards out),
  ``eager_fallback`` (a step that breaks the graph, run eagerly on the shards);
- the optimizer's update: in the graph, bucket by bucket, ``graph_update`` (what the pass
  ``update_in_graph`` calls); after the graph, ``deferred_optimizer`` (``opt.step()`` and
  ``zero_grad()`` recorded, run afterwards) and ``update`` (accumulate, unscale, clip, step),
  with ``companions`` (schedulers, GradScaler, clipping as the step called them),
  ``precision`` (the fp16 loss scaler, the casts at the model's edge) and
  ``streamed_update`` (``offload_update="device"``);
- the process groups: ``init_distributed`` (joining torchrun's), ``process_group`` (the
  world, a mesh), ``cpu_group`` (CPU tensors and objects beside training's),
  ``expert_groups``, ``secondary_groups``, ``gloo_all_gather``;
- when ranks or collectives go wrong: ``rank_agreement`` (ranks that disagree fail fast),
  ``failures`` (a failed collective said in words)."""
