"""The step's working set: the rewritten step traced on fake tensors at a few blocks and
extrapolated to the model's depth ([Note: what the planner counts] in
zero_fx/planner/report.py), with what each question prices again on the same trace."""

from __future__ import annotations

from typing import Optional

from ..analysis.cost_model import replay
from ..analysis.memory_timeline import memory_timeline
from .features.expert_parallel import ExpertParallelOptions, peaks_by_degree
from .models import ModelSource
from .offline import causal_lm_loss, rewritten_step_on_fake
from .features.offload import device_optimizer_seconds, streamed_peak
from .question import Workload
from .report import GB, ExpertBlocks
from .features.tensor_parallel import tensor_parallel_prices

STEADY_FROM = 3
"""Blocks traced before each further block adds the same memory ([Note: what the planner
counts] in zero_fx/planner/report.py)."""


def traced_working_set(source: ModelSource, workload: Workload, *, hardware: str = "",
                       experts: Optional[ExpertBlocks] = None,
                       expert_parallel: ExpertParallelOptions = ExpertParallelOptions(),
                       tensor_parallel: Optional[tuple[int, frozenset, bool]] = None,
                       offload: bool = False) -> tuple[dict, str, Optional[dict]]:
    """The working set of ``workload`` (its batch, sequence length and recompute)
    extrapolated to the model's depth, ``{1: bytes}``; with ``experts``, also each degree of
    ``expert_parallel`` and the cost model's ``"compute"`` seconds on ``hardware`` ([Note:
    planning expert parallelism] in zero_fx/planner/features/expert_parallel.py); with
    ``tensor_parallel`` (degree, split parameters, sequence parallelism), ``"tp"``: the
    working set priced again for it, and ``"compute"`` ([Note: planning tensor parallelism]
    in zero_fx/planner/features/tensor_parallel.py); with ``offload``, ``"streamed"``: the working
    set with the reduced gradients streamed to the host, ``"compute"`` and
    ``"device_optimizer"``, the part of it the device's optimizer step takes ([Note:
    planning offload] in zero_fx/planner/features/offload.py). Then how it was had, and what one
    more block adds to each (None where the model was traced whole)."""
    batch, seq, recompute = workload.sequences, workload.seq, workload.recompute_options()

    def traced_peak(layers: Optional[int], dense_layers: Optional[int] = None) -> dict:
        build = ((lambda: source.build(layers)) if dense_layers is None
                 else (lambda: source.build(layers, dense_layers)))
        gm, plan = rewritten_step_on_fake(
            build, batch=batch, seq=seq, vocab_size=source.vocab_size,
            world_size=workload.world_size, stage=workload.stage, dtype=workload.dtype,
            loss_fn=causal_lm_loss, **recompute)
        if experts is None and tensor_parallel is None and not offload:
            return {1: float(max(memory_timeline(gm).transient))}
        if offload:
            out = {1: float(max(memory_timeline(gm).transient)), "streamed": streamed_peak(gm),
                   "device_optimizer": device_optimizer_seconds(plan, hardware)}
        elif experts is not None:
            out: dict = peaks_by_degree(gm, plan, experts, batch * seq,
                                        sorted({1, *expert_parallel.degrees}),
                                        expert_parallel.capacity_factor)
        else:
            degree, split, sequence_parallel = tensor_parallel
            out = {1: float(max(memory_timeline(gm).transient)),
                   **tensor_parallel_prices(gm, plan, split, degree, sequence_parallel)}
        out["compute"] = replay(gm, plan, hardware).estimate.compute_seconds
        return out

    def grow(base: dict, *more: tuple[int, dict]) -> dict:  # base + n x (traced - base), by key
        return {key: base[key] + sum(n * (t[key] - base[key]) for n, t in more) for key in base}

    if source.vocab_size is None:
        raise SystemExit("the model has no nn.Embedding to read a vocabulary size from")
    if source.max_positions is not None and seq > source.max_positions:
        raise SystemExit(f"--seq {seq} is longer than the model's {source.max_positions} positions")
    chosen = recompute["recompute"] or ("auto" if len(recompute) > 1 else None)
    # tensor parallelism asks what one block adds: a model of STEADY_FROM + 1 blocks is
    # traced with STEADY_FROM and with all of them, which is tracing it whole
    if source.layers is None or source.layers <= STEADY_FROM + (tensor_parallel is None):
        return traced_peak(None), (f"batch {batch} x {seq} tokens per rank, recompute "
                                   f"{chosen or 'none'}; traced whole"), None
    dense = source.dense_layers
    first = STEADY_FROM  # [Note: what the planner counts]
    if 0 < dense < source.layers and source.layers - dense > STEADY_FROM:
        # dense blocks, then blocks with experts: each kind grows at its own rate
        moe = source.layers - dense
        base = traced_peak(1 + first, 1)
        more_moe = traced_peak(2 + first, 1)
        more_dense = traced_peak(2 + first, 2) if dense > 1 else base
        total = grow(base, (moe - first, more_moe), (dense - 1, more_dense))
        per_moe, per_dense = more_moe[1] - base[1], more_dense[1] - base[1]
        how = (f"batch {batch} x {seq} tokens per rank, recompute {chosen or 'none'}; traced "
               f"with 1 dense and {first} expert blocks, then one more of each, of {dense} dense "
               f"and {moe} expert blocks on fake tensors: {base[1] / GB:.2f} GB + {moe - first} x "
               f"{per_moe / GB:.3f} GB + {dense - 1} x {per_dense / GB:.3f} GB")
        return total, how, None
    base, grown = traced_peak(first), traced_peak(first + 1)
    total = grow(base, (source.layers - first, grown))
    how = (f"batch {batch} x {seq} tokens per rank, recompute {chosen or 'none'}; "
           f"traced with {first} and {first + 1} of {source.layers} blocks on fake tensors: "
           f"{base[1] / GB:.2f} GB + {source.layers - first} x {(grown[1] - base[1]) / GB:.3f} GB")
    return total, how, {key: grown[key] - base[key] for key in base}
