"""From the captured graph to the program that runs: the dynamo backend that runs capture,
our passes and lowering for each compilation (``backend``), the lowering itself
(``lower``: pinning the collective schedule through Inductor, realizing readers), and the
checks on the generated program's order and memory (``lowered_schedule``,
``lowered_memory``)."""
