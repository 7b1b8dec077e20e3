"""Each feature the planner plans and prices beside the stages, one module each:

- ``offload``: what ``--offload`` moves to the host, and the host's step;
- ``quantization``: ZeRO++'s quantized collectives, each configuration priced;
- ``tensor_parallel``: the tensor-parallel split of each block and its collectives;
- ``expert_parallel``: the routed experts split over ranks, their exchanges;
- ``whole_updates``: whole-tensor updates (Muon): owners, their work and exchanges.

Their old paths (``zero_fx.planner.offload``, ...) are these modules
(``zero_fx/planner/__init__.py`` registers them)."""
