"""What lives between calls and runs around the compiled graph: the sharded parameters and
optimizer (``sharded_state``, ``whole_parameters``, ``optimizer``), the first call that shards them
(``sharding``), each call's graph inputs and gradient shards (``step_runner``), the
deferred optimizer update with accumulation, clipping and loss scaling (``update``,
``precision``), and the process group: joining torchrun's (``init_distributed``), its
world, the ranks' agreement check and collective failures (``process_group``,
``rank_agreement``, ``failures``, ``gloo_all_gather``)."""
