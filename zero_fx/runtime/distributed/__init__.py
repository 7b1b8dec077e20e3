"""The process groups, and what to do when ranks or collectives go wrong. By role:

- the groups: ``init_distributed`` (joining torchrun's), ``process_group`` (the world, a
  mesh), ``cpu_group`` (CPU tensors and objects beside training's), ``expert_groups``
  (expert parallelism's), ``secondary_groups`` (the secondary partition's),
  ``gloo_all_gather`` (gloo's all-gather made safe);
- when they go wrong: ``rank_agreement`` (ranks that disagree fail fast), ``failures`` (a
  failed collective said in words)."""
