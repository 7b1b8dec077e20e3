"""The step as one FX graph. By role:

- the capture: ``step_graph`` (dynamo's graph of the whole step, its backward recorded by
  the autograd engine), ``kept_captures`` (a graph compiled again is not traced again),
  ``step_calls`` (the optimizer calls the step makes, checked before compiling),
  ``accumulated_gradients`` (several ``backward()`` calls summed), ``scalar_outputs``
  (``.item()`` as a graph output), ``host_effects`` (prints and logs run after the graph),
  ``inline_checkpoints`` (the model's ``torch.utils.checkpoint`` regions),
  ``layout_decompositions`` (backward ops traced as the pointwise ops they are),
  ``dynamic_shapes`` (which sizes dynamo traces as symbols);
- tensor parallelism: ``tensor_parallel`` (a graph over DTensors' local pieces),
  ``dtensors`` (whether a value is a DTensor, and its piece);
- ``experts/``: mixtures of experts, rewritten to fixed shapes before capture (its own
  ``__init__`` indexes them);
- when a step does not capture: ``errors`` (``CaptureError``), ``graph_breaks`` (a break,
  and where), ``hints`` (what to do about the failures users meet most)."""
