"""The test suite's helpers, apart from the tests (``from support.ranks import run_ranks``).
By role:

- running ranks: ``ranks`` (``run_ranks``, the shared runs, the fork server), ``warm_ranks``
  (what the fork server imports and compiles once), ``cores`` (one multi-rank job on the
  machine's cores at a time), ``torchrun`` (a torchrun command line);
- what the tests train: ``models`` (the tiny models and their steps), ``training``
  (training loops, eager references and parity errors), ``feature_runs`` (the runs the
  feature files share), ``step_idioms`` (training steps as people write them),
  ``stacked_experts`` (transformers 5's 3-D experts), ``tensor_parallel_models``
  (the tensor-parallel runs);
- ``gpu_figures``: the figures the CUDA tests record for bench/gpu_check.sh.
"""
