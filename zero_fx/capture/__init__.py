"""The step as one FX graph: dynamo's graph of the whole step, with its backward recorded
by the autograd engine (``step_graph``), model-level ``torch.utils.checkpoint`` regions
inlined (``inline_checkpoints``), and what to tell a user whose step does not capture
(``hints``)."""
