"""Pricing ZeRO++ before a run: ``python -m zero_fx.plan --quantize``, its quantized collectives
and, on hardware of several nodes, its secondary partition.

[Note: when quantizing pays]
Quantizing trades bytes on the wire for work on the device. Each gather quantizes the
rank's shard and dequantizes the gathered bucket; each reduction quantizes the bucket and
dequantizes and sums what arrives ([Note: quantized blocks on the wire] and [Note:
reductions as all-to-alls] in passes/common/quantized_code.py). That work is ops of the step's
graph, so the cost model prices it like any other: the bytes each op moves at the preset's
memory bandwidth, plus a launch.

For each configuration of ``CONFIGURATIONS`` the stage allows, the planner traces the step
on fake tensors with the configuration's options, at ``STEADY_FROM`` + 1 blocks and at one
block more, and extrapolates to the model's depth: the bytes a rank sends per step and the
cost model's communication, compute and step seconds ([Note: the cost model] in
zero_fx/analysis/cost_model.py). A configuration pays where its step is shorter than the
step without quantization: where the communication it saves was exposed, and more of it
than the quantizing adds.

Checked against one H200 (bench/README.md, "On one GPU"): on GPT-2 125M's shape, a rank of
8, the model charges int8 both ways 9.1 ms a step and int4 gradients 10.6; measured, 7.3
and 16.4 ms, on a step bound by launching kernels. The communication saved is the model's
alone: nothing here has run across GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ...analysis.cost_model import estimate
from ...analysis.hardware import hardware as preset
from ...analysis.traffic import traffic_report
from ..models import ModelSource
from ..offline import causal_lm_loss, rewritten_step_on_fake
from ..question import Workload

CONFIGURATIONS = {
    "none": {},
    "qwZ int8": {"quantize_weights": "int8"},
    "qgZ int8": {"quantize_gradients": "int8"},
    "qwZ + qgZ int8": {"quantize_weights": "int8", "quantize_gradients": "int8"},
    "qwZ int8 + qgZ int4": {"quantize_weights": "int8", "quantize_gradients": "int4"},
}
"""What ``--quantize`` compares: ``zero_compile``'s options for each (docs/quantization.md)."""

SECONDARY_CONFIGURATIONS = {
    "hpZ": {},
    "qwZ + qgZ int8 + hpZ": {"quantize_weights": "int8", "quantize_gradients": "int8"},
}
"""Where the hardware has several nodes: the secondary partition (``secondary_partition``,
ranks per node from the preset), alone and with int8 both ways ([Note: the secondary
partition] in zero_fx/plan/secondary.py). It saves no bytes in all (the forward moves what
it did); it moves the backward's gathers onto the node's links, and costs each rank ``Ψ/n``
parameters kept from the forward to the backward (the peak column)."""


@dataclass(frozen=True)
class QuantizedRow:
    """One configuration's step, per rank, extrapolated to the model's depth."""

    name: str
    options: dict
    sent_bytes: float
    """Bytes a rank sends per step (``traffic().wire_bytes()``)."""
    communication_seconds: float
    compute_seconds: float
    """The compute stream's time, quantizing and dequantizing included."""
    step_seconds: float
    peak_bytes: float = 0.0
    """The cost model's peak memory of the step, a hpZ row's secondary shards included."""


def check_quantizable(stage: int, world_size: int) -> None:
    """A ValueError saying what to change where a step has nothing to quantize."""
    if world_size < 2:
        raise ValueError("one rank sends nothing, so there is nothing to quantize: plan "
                         "--quantize with --world 2 or more")
    if stage == 0:
        raise ValueError("quantized reductions start at stage 1 (stage 0 all-reduces whole "
                         "gradients, which qgZ does not replace) and quantized gathers at "
                         "stage 3: plan --quantize with --stage 1, 2 or 3")


def configurations(stage: int, names: Optional[Sequence[str]] = None, *,
                   ranks_per_node: int = 0, world_size: int = 0) -> dict:
    """The configurations stage ``stage`` (1-3) allows (of ``names``, by default all): qwZ
    quantizes stage 3's gathers, qgZ the reductions of stages 1-3; hpZ (stage 3) where
    ``world_size`` ranks fill several nodes of ``ranks_per_node``."""
    offered = dict(CONFIGURATIONS)
    if stage == 3 and 0 < ranks_per_node < world_size and world_size % ranks_per_node == 0:
        offered |= {name: {**options, "secondary_partition": ranks_per_node}
                    for name, options in SECONDARY_CONFIGURATIONS.items()}
    unknown = set(names or ()) - set(offered)
    if unknown:
        raise ValueError(f"unknown configurations {sorted(unknown)}; choose from "
                         f"{list(offered)}")
    return {name: options for name, options in offered.items()
            if (stage == 3 or "quantize_weights" not in options)
            and (names is None or name in names or name == "none")}


def price_quantization(source: ModelSource, workload: Workload, *, hardware: str,
                       steady_from: int, names: Optional[Sequence[str]] = None
                       ) -> list[QuantizedRow]:
    """Each configuration ``workload``'s stage allows (of ``names``), priced on ``hardware``
    ([Note: when quantizing pays]); the first row is the step without quantization. Each
    step is traced with ``workload``'s recompute, as ``zero_compile`` would run it.
    ``steady_from``: blocks traced before the one whose cost is extrapolated to the model's
    depth."""
    check_quantizable(workload.stage, workload.world_size)
    offered = configurations(workload.stage, names,
                             ranks_per_node=preset(hardware).ranks_per_node,
                             world_size=workload.world_size)
    return [_priced(source, name, options, workload, hardware=hardware,
                    steady_from=steady_from)
            for name, options in offered.items()]


def _priced(source: ModelSource, name: str, options: dict, workload: Workload, *,
            hardware: str, steady_from: int) -> QuantizedRow:
    def figures(layers: Optional[int]) -> tuple[float, ...]:
        gm, plan = rewritten_step_on_fake(
            lambda: source.build(layers), batch=workload.sequences, seq=workload.seq,
            vocab_size=source.vocab_size, world_size=workload.world_size,
            stage=workload.stage, dtype=workload.dtype, loss_fn=causal_lm_loss, **options,
            **workload.recompute_options())
        guess = estimate(gm, plan, hardware)
        return (traffic_report(gm, plan).wire_bytes(), guess.communication_seconds,
                guess.compute_seconds, guess.step_seconds, guess.peak_bytes)

    first = steady_from + 1
    if source.layers is None or source.layers <= first + 1:
        values = figures(None)
    else:  # what one more block adds, times the blocks beyond the first traced depth
        base, more = figures(first), figures(first + 1)
        values = tuple(b + (source.layers - first) * (m - b) for b, m in zip(base, more))
    return QuantizedRow(name, options, *values)


def format_quantization(rows: list[QuantizedRow], hardware: str, world_size: int) -> list[str]:
    """The table ``python -m zero_fx.plan --quantize`` prints, and what pays."""
    base = rows[0]
    lines = [f"Quantized collectives on {hardware}, {world_size} ranks, per rank per step "
             f"([Note: when quantizing pays] in zero_fx/planner/features/quantization.py):",
             "| configuration | sent | communication | compute (quantizing included) | step "
             "| peak memory | |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        change = row.step_seconds - base.step_seconds
        verdict = ("" if row is base else
                   f"pays: {-1e3 * change:.2f} ms faster" if change < 0 else
                   f"does not pay: {1e3 * change:.2f} ms slower")
        lines.append(f"| {row.name} | {row.sent_bytes / 2**20:.1f} MiB "
                     f"({row.sent_bytes / base.sent_bytes:.2f}×) | "
                     f"{1e3 * row.communication_seconds:.2f} ms | {1e3 * row.compute_seconds:.2f} ms | "
                     f"{1e3 * row.step_seconds:.2f} ms | {row.peak_bytes / 2**20:,.0f} MiB | "
                     f"{verdict} |")
    best = min(rows, key=lambda row: row.step_seconds)
    lines.append(f"Fastest: {best.name}" + ("" if best is base else
                 f" ({', '.join(f'{k}={v!r}' for k, v in best.options.items())})"))
    return lines
