"""Mixtures of experts, rewritten to fixed shapes before capture ([Note: routed experts with
fixed shapes] in routed_experts.py). By role:

- the rewrite: ``routed_experts`` (finds each block, installs the fixed-shape forward that
  reproduces it), ``moe_blocks`` (which modules are MoE blocks, from their structure alone),
  ``routed_forms`` (the fixed-shape forwards a block may be given), ``rewrite_check`` (each
  rewrite against the module's own forward, outputs and gradients);
- other layouts of experts: ``fused_experts`` (experts as stacked 3-D parameters looped over
  in Python), ``grouped_gemm_modules`` (a grouped-GEMM module that loops over its experts);
- the computation: ``grouped_experts`` (every expert's forward at once), ``grouped_mm`` (the
  grouped matrix multiply), ``expert_exchange`` (expert parallelism's all-to-alls of
  tokens)."""
