"""The "Plan" section of ``explain``: ranks, shards and padding, buckets, and what each
option changed (hybrid sharding, tensor parallelism, mixed precision, quantized
communication, offload, accumulation, mixture-of-experts blocks), then one line per
parameter."""

from __future__ import annotations

from typing import Sequence

from ..capture.experts.moe_blocks import RoutedExperts
from ..base.formatting import format_bytes, short_dtype
from ..plan.layout import BLOCKS


def _moe_lines(plan, moe_blocks: Sequence[RoutedExperts]) -> list[str]:
    """One line per distinct shape of mixture-of-experts block ([Note: routed experts with
    fixed shapes]); then, under expert parallelism, which experts this rank runs."""
    shapes: dict[tuple, list[str]] = {}
    for b in moe_blocks:
        shapes.setdefault((b.num_experts, b.top_k, b.routing, b.expert_parameters,
                           b.shared_expert), []).append(b.name)
    lines = []
    for (experts, top_k, routing, numel, shared), names in shapes.items():
        inside = [l.name for l in plan.params if l.name.startswith(f"{names[0]}.")]
        held = ("whole on every rank" if not plan.params_sharded
                else "resident (gathered once per step)"
                if inside and all(n in plan.resident for n in inside)
                else "gathered with their block's bucket" if plan.bucket_bytes == BLOCKS
                else "gathered in the buckets of their block's parameters")
        which = names[0] if len(names) == 1 else (
            f"{names[0]}, {names[1]}" if len(names) == 2 else f"{names[0]} … {names[-1]}")
        lines.append(
            f"  mixture of experts: {len(names)} block{'s' if len(names) > 1 else ''} ({which}): "
            f"{experts} experts, top-{top_k}, routed by {routing}"
            + (f", shared expert {shared!r}" if shared else "")
            + f"; {numel:,} expert parameters each, {held}; each token's rows run through its "
              f"top-{top_k} experts only, in fixed shapes")
    parallel = plan.expert_parallel
    if parallel is not None and moe_blocks:
        local = moe_blocks[0].num_experts // parallel.degree
        first = parallel.rank * local
        lines.append(
            f"  expert parallelism {parallel.degree}: this rank runs experts {first}-"
            f"{first + local - 1} of each block, and sends each token's rows to the rank of its "
            f"experts and back (all_to_all over its {parallel.degree} ranks, group "
            f"{parallel.group_name!r}); its experts' weights are sharded over the "
            f"{parallel.data_size} rank(s) that hold the same experts (group "
            f"{parallel.data_group_name!r}); every other parameter over all {plan.world_size}"
            + ("" if parallel.capacity_factor is None else
               f"; each expert takes at most {parallel.capacity_factor:g}x an even spread's "
               f"rows (expert_capacity_factor), the rest dropped"))
    return lines


def _tensor_parallel_lines(plan) -> list[str]:
    """What tensor parallelism changed ([Note: ZeRO over tensor parallelism])."""
    parallel = plan.tensor_parallel
    if parallel is None:
        return []
    split = len(parallel.specs) - len(parallel.replicated & parallel.specs.keys())
    return [f"  tensor parallel: the model's layers split over {parallel.degree} ranks (group "
            f"{parallel.group_name!r}, this rank {parallel.rank}); shapes above are this rank's "
            f"pieces: {split} parameters split, {len(parallel.replicated)} whole on every tp "
            f"rank; DTensor's tp collectives stay in the step where its placements put them"]


def _quantization_lines(plan) -> list[str]:
    """What ``quantize_collectives`` moves quantized ([Note: quantized blocks on the wire])."""
    forward, backward = getattr(plan, "quantize_weights", (None, None))
    gradients = getattr(plan, "quantize_gradients", None)
    if not (forward or backward or gradients):
        return []
    parts = []
    if forward or backward:
        parts.append("gathers " + (forward if forward == backward else
                                   f"{forward or 'unquantized'} in the forward, "
                                   f"{backward or 'unquantized'} in the backward"))
    if gradients:
        parts.append(f"reductions {gradients} by all-to-all, summed in fp32"
                     + (" (across replicas too, where it moves fewer bytes)"
                        if plan.replicas > 1 else ""))
    return [f"  quantized communication: {'; '.join(parts)}; blocks of {plan.quantize_block} "
            f"elements with an fp32 scale each; masters and shards in full precision "
            f"([Note: quantized blocks on the wire])"]


def format_plan(plan, moe_blocks: Sequence[RoutedExperts] = ()) -> str:
    lines = ["Plan"]
    dtypes = sorted({short_dtype(l.dtype) for l in plan.params})
    if plan.replicated:
        lines.append(f"  {plan.world_size} rank(s), group {plan.group_name!r}; stage 0 keeps every "
                     f"parameter whole on every rank (Ψ = {plan.total_numel:,}, {'/'.join(dtypes)})")
    else:
        lines.append(
            f"  {plan.world_size} rank(s), group {plan.group_name!r}; Ψ = {plan.total_numel:,} "
            f"parameters in {len(plan.params)} tensors ({'/'.join(dtypes)}); each rank holds "
            f"{plan.shard_numel:,} elements ({plan.padding_numel:,} of padding in all)")
        if plan.replicas > 1:
            lines.append(f"  hybrid sharding: {plan.replicas} replicas of these {plan.world_size} "
                         f"ranks (group {plan.replicate_group_name!r}); each reduced gradient shard "
                         f"is all-reduced across them, the only traffic between replicas")
        secondary = getattr(plan, "secondary", None)
        if secondary is not None:
            lines.append(
                f"  secondary partition: {secondary.nodes} nodes of {secondary.size} ranks; the "
                f"forward gathers across nodes (group {secondary.across_group_name!r}), keeping "
                f"1/{secondary.size} of each parameter, then within the node (group "
                f"{secondary.node_group_name!r}); the backward gathers within the node only")
    if plan.keeps_collectives_at_one:
        lines.append("  collectives kept at a world of one (keep_collectives_at_world_one): each "
                     "runs on the group of one as it would at N ranks, an identity ([Note: "
                     "collectives kept at a world of one])")
    lines += _tensor_parallel_lines(plan)
    lines.append("  buckets: one per repeated block (bucket_bytes='blocks')" if plan.bucket_bytes == BLOCKS
                 else f"  buckets of at most {format_bytes(plan.bucket_bytes)}"
                 if plan.bucket_bytes else "  one collective per parameter (bucket_bytes=0)")
    lines[-1] += (f", prefetch_buckets {plan.prefetch}, max_gathered_bytes "
                  f"{format_bytes(plan.memory_budget_bytes) if plan.memory_budget_bytes else 'none'}")
    if plan.compute_dtype is not None:
        lines.append(f"  mixed precision: compute and gather {short_dtype(plan.compute_dtype)}, reduce "
                     f"{short_dtype(plan.reduce_dtype or plan.compute_dtype)}, masters and optimizer "
                     f"state {'/'.join(dtypes)}" + (", loss scaled" if plan.loss_scaled else ""))
    lines += _quantization_lines(plan)
    if getattr(plan, "offloads_optimizer", False):
        lines.append("  offload: the fp32 masters and the optimizer's state in host memory, where "
                     "the optimizer steps; each gradient shard streams to the host in the graph "
                     "as soon as it is reduced (below), each updated parameter comes back after the "
                     "optimizer's step"
                     + (" into its host shard in the compute dtype, the graph's input, copied "
                        "to the device bucket by bucket before each all-gather, issued one bucket "
                        "ahead of it (with the previous gather, where the prefetch allows), so the "
                        "copy can run during the compute between the two (offload='parameters', "
                        "[Note: shards brought from the host])" if plan.offloads_parameters
                        else " into its device shard in the compute dtype, the graph's input"
                        if plan.params_sharded else ", gathered into the whole parameters")
                     + " ([Note: optimizer offload])")
        if plan.offload_step == "overlap":
            lines.append("  delayed update (offload_step='overlap'): each optimizer step runs on "
                         "the host while the next call's forward and backward run, on parameters "
                         "one step stale ([Note: the delayed update])")
    if plan.accumulation_steps > 1:
        where = ("summed whole and reduced once per optimizer step, outside the graph"
                 if not plan.reduces_in_graph else "reduced every call, shards summed")
        lines.append(f"  gradient accumulation: {plan.accumulation_steps} calls per optimizer "
                     f"step; gradients {where}")
    if plan.params_sharded:
        lines.append(f"  resident (gathered once per step): {len(plan.resident)} parameters, "
                     f"{sum(plan.layout(n).numel for n in plan.resident):,} elements")
    lines += _moe_lines(plan, moe_blocks)
    width = max((len(l.name) for l in plan.params), default=9)
    lines.append(f"  {'parameter':<{width}}  {'shape':<16} {'elements':>11} {'per rank':>10} "
                 f"{'padding':>8}")
    for l in plan.params:
        shape = "[" + ", ".join(map(str, l.shape)) + "]"
        per_rank = l.numel if plan.replicated else l.shard_numel
        flag = ("  resident" if l.name in plan.resident else "") + ("" if l.requires_grad else "  frozen")
        lines.append(f"  {l.name:<{width}}  {shape:<16} {l.numel:>11,} {per_rank:>10,} "
                     f"{0 if plan.replicated else l.padding:>8,}{flag}")
    return "\n".join(lines)
