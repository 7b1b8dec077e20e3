"""From the captured graph to the program that runs. By role:

- ``backend``: the dynamo backend; each compilation runs capture, our passes and lowering,
  and ``progress`` logs its phases; ``compilation``: what one compilation did (its time,
  its reason, the checks below), which the step lists and the inspection reads;
  ``reuse``: the compilations kept for later steps of the same structure; ``saved_steps``:
  the rewritten graphs written for later processes, ``graph_files`` writing and reading them;
- ``lower``: compiles the rewritten graph with the chosen backend; ``regions``,
  ``compute_runs`` and ``packed_results``: regional compilation (each distinct run of
  compute compiled once, the collectives between them); ``pin_schedule``: the whole step as
  one Inductor program in our collective order; ``realize_readers``: Inductor frees a
  released gather where our graph does;
- checks on the generated program: ``lowered_schedule`` (its collective order against the
  graph's) and ``lowered_memory`` (when each of its buffers lives)."""
