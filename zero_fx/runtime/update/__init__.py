"""The optimizer's update: the optimizer steps, where and when. By role:

- in the graph, bucket by bucket: ``graph_update`` (what the pass ``update_in_graph`` calls);
- after the graph: ``deferred_optimizer`` (``opt.step()`` and ``zero_grad()`` recorded in the
  step, run afterwards) and ``update`` (accumulate, unscale, clip, step), with
  ``companions`` (schedulers, GradScaler, clipping as the step called them), ``precision``
  (the fp16 loss scaler, the casts at the model's edge) and ``streamed_update``
  (``offload_update="device"``);
- the optimizers themselves: ``optimizer_set`` (several optimizers as one),
  ``whole_tensor_updates`` (Muon and other whole-tensor updates on owner ranks),
  ``batched_muon`` (Muon's Newton-Schulz iterations batched by shape wherever it steps).

No module is imported here: the sharded state (``runtime/sharded_state.py``) imports
``whole_tensor_updates`` and ``update`` imports the sharded state."""
