"""Will it fit? Per-rank memory, traffic and buckets of a model at a world size, before any
memory is spent: the model is built on the meta device, only its shapes are read.
"""

from __future__ import annotations

import time
from typing import Optional

from ..config import DEFAULT_BUCKET_BYTES, DEFAULT_PERSISTENCE_THRESHOLD
from ..plan.build import PlanOptions, PlanRanks, plan_for_module
from ..plan.layout import ShardPlan
from .features.expert_parallel import (ExpertParallelOptions, check_degrees, expert_blocks,
                              expert_parallel_row)
from .models import ModelSource, on_meta
from .features.offload import OffloadOptions, check_offload, plan_offload
from .features.quantization import check_quantizable, price_quantization
from .question import Workload
from .report import PlanReport
from .stages import hybrid_levels, psi_per_rank, stage_buckets, stage_plan
from .features.tensor_parallel import (TensorParallelOptions, check_tensor_parallel, divisors,
                              largest_block, tensor_parallel_collectives, tensor_parallel_row,
                              tensor_parallel_shape, tensor_parallel_split)
from .features.whole_updates import MUON, plan_whole_updates
from .working_set import STEADY_FROM, traced_working_set


def plan_model(source: ModelSource, workload: Workload, *,
               expert_parallel: ExpertParallelOptions = ExpertParallelOptions(),
               tensor_parallel: TensorParallelOptions = TensorParallelOptions(),
               offload: OffloadOptions = OffloadOptions(), quantize: bool = False,
               nodes: int = 1, hardware: Optional[str] = None) -> PlanReport:
    """Plan ``source``'s model for ``workload`` on its ``world_size`` ranks; trace the
    working set when its ``seq`` is given, with its ``recompute`` (and budget) as
    ``zero_compile`` takes them. ``nodes`` > 1: also set flat and hybrid sharding side by
    side ([Note: what the planner counts] in zero_fx/planner/report.py).
    ``expert_parallel``: its ``degrees`` of expert parallelism to compare (stage 3, with
    ``seq``), their step times on ``hardware`` (a cost-model preset; default 8xH100 over
    NVLink up to 8 ranks, nodes of 8 over InfiniBand above; [Note: planning expert
    parallelism] in zero_fx/planner/features/expert_parallel.py), their buffers of received rows
    sized by its ``capacity_factor`` (None: the worst case; [Note: expert capacity] in
    zero_fx/capture/experts/expert_exchange.py).
    ``tensor_parallel``: its ``degree`` T > 1: each rank holds its Megatron piece of the
    model, ZeRO-sharded over ``world_size / T`` ranks, and the report sets it beside data
    parallelism alone (its ``sequence_parallel``: the norms' activations split too; [Note:
    planning tensor parallelism] in zero_fx/planner/features/tensor_parallel.py).
    ``offload``: its ``mode``, ``"optimizer"``, ``"parameters"`` or ``"auto"``, sets every
    mode the stage allows side by side, device and host bytes, copies and the host's
    optimizer step, with its ``host_memory`` bytes a rank (default: the preset's) and
    ``device_memory`` bytes a device (``"auto"`` picks the least offload that fits it;
    [Note: planning offload] in zero_fx/planner/features/offload.py).
    ``quantize``: ZeRO++'s quantized collectives, each configuration the stage allows,
    priced on ``hardware`` ([Note: when quantizing pays] in zero_fx/planner/features/quantization.py)."""
    world_size, stage, dtype, seq = (workload.world_size, workload.stage, workload.dtype,
                                     workload.seq)
    device_memory = offload.device_memory
    sequence_parallel = tensor_parallel.sequence_parallel
    check_offload(offload.mode, stage=stage, device_memory=device_memory,
                  others=tensor_parallel.degree > 1 or bool(expert_parallel.degrees))
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    tp = tensor_parallel.degree
    if tp < 1 or world_size % tp:
        raise ValueError(f"tensor parallelism of {tp} ranks must divide the {world_size} ranks "
                         f"(--tp must divide --world): use one of {divisors(world_size)}")
    if tp > 1 and expert_parallel.degrees:
        raise ValueError("plan tensor parallelism (--tp) and expert parallelism "
                         "(--expert-parallel) one at a time")
    if tp > 1 and nodes > 1:
        raise ValueError("--tp with --nodes is not planned: leave out --nodes (the "
                         "tensor-parallel group is T ranks of a node; --hardware 4x8xh100-ib "
                         "prices ZeRO's data-parallel group across nodes)")
    if sequence_parallel and tp == 1:
        raise ValueError("sequence parallelism splits what tensor parallelism leaves whole: "
                         "give --tp > 1 too")
    if nodes < 1 or world_size % nodes:
        raise ValueError(f"{world_size} ranks do not split evenly over {nodes} nodes")
    degrees = tuple(dict.fromkeys(expert_parallel.degrees))
    if degrees and stage != 3:
        raise ValueError(f"planning expert parallelism needs stage 3: the planner estimates it "
                         f"there only (training runs it at stages 1 and 2 too), got stage {stage}")
    if degrees and seq is None:
        raise ValueError("expert parallelism is planned from the step's working set: give seq "
                         "(--seq) too")
    if workload.optimizer == MUON and (tp > 1 or degrees or offload.mode != "none"):
        raise ValueError("--optimizer muon steps each matrix whole on one owner rank, which "
                         "training does not combine with tensor parallelism, expert parallelism "
                         "or offload yet: plan it without --tp, --expert-parallel and --offload")
    if quantize:
        check_quantizable(stage, world_size)
    if quantize and seq is None:
        raise ValueError("quantized collectives are priced on the traced step: give seq "
                         "(--seq) too")
    if quantize and (degrees or tp > 1 or offload.mode != "none" or nodes > 1):
        raise ValueError("plan --quantize without --tp, --expert-parallel, --offload and "
                         "--nodes (one question at a time)")
    start = time.perf_counter()
    model = on_meta(lambda: source.build(None))
    item = dtype.itemsize
    mixed = item < 4

    def plan_over(ranks: int) -> ShardPlan:
        return plan_for_module(model, PlanRanks(ranks), PlanOptions(
            stage=stage, resident_max_numel=DEFAULT_PERSISTENCE_THRESHOLD,
            bucket_bytes=DEFAULT_BUCKET_BYTES[stage], compute_dtype=dtype if mixed else None,
            reduce_dtype=dtype if mixed else None))

    experts = expert_blocks(model)
    shape, split = None, frozenset()
    if tp > 1:
        shape = tensor_parallel_shape(model)
        check_tensor_parallel(tp, world_size, shape, experts)
        split = tensor_parallel_split(model, shape.vocab)
    plan = plan_over(world_size // tp)
    stages = [stage_plan(s, plan, item, mixed, workload.optimizer, tp, split) for s in range(4)]
    report = PlanReport(
        model=source.description, world_size=world_size, stage=stage, dtype=dtype,
        optimizer=workload.optimizer, psi=plan.total_numel, tensors=len(plan.params),
        padding=plan.padding_numel, stages=stages,
        buckets=stage_buckets(plan, item, tp, split), bucket_cap=plan.bucket_bytes,
        resident=len(plan.resident), experts=experts, tensor_parallel=tp,
        sequence_parallel=sequence_parallel, psi_per_rank=psi_per_rank(plan, tp, split))
    if workload.optimizer == MUON:
        report.whole_updates = plan_whole_updates(plan)
    offloading = offload.mode != "none"
    if degrees or tp > 1 or offloading or quantize or report.whole_updates is not None:
        report.hardware = hardware or ("8xh100-nvlink" if world_size <= 8 else "4x8xh100-ib")
    if degrees:
        check_degrees(degrees, world_size, report.experts)
        report.expert_capacity_factor = expert_parallel.capacity_factor
    traced = per_block = None
    if seq is not None:
        report.tokens_per_rank = workload.sequences * seq
        traced, report.working_set_how, per_block = traced_working_set(
            source, workload, hardware=report.hardware,
            experts=report.experts if degrees else None, expert_parallel=expert_parallel,
            tensor_parallel=(tp, split, sequence_parallel) if tp > 1 else None,
            offload=offloading)
        report.working_set = traced["tp" if tp > 1 else 1]
        if degrees:
            report.expert_parallel = [
                expert_parallel_row(report, plan, p, traced, workload.sequences * seq)
                for p in degrees]
    if tp > 1:
        flat = plan_over(world_size)
        count = tensor_parallel_collectives(flat, workload.recompute)
        report.tensor_parallel_rows = [
            tensor_parallel_row(report, on, degree, chosen, shape, count, traced, per_block)
            for on, degree, chosen in ((flat, 1, frozenset()), (plan, tp, split))]
        report.largest_block = largest_block(plan, tp, split)[0]
    if offloading:
        plan_offload(report, offload.mode, traced, offload.host_memory, device_memory)
    if quantize:
        report.quantized = price_quantization(source, workload, hardware=report.hardware,
                                              steady_from=STEADY_FROM)
    if nodes > 1:
        report.nodes = nodes
        report.levels = hybrid_levels(report, plan_over, nodes, item, mixed)
    report.seconds = time.perf_counter() - start
    return report
