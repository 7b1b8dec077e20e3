"""The sections of ``explain`` after the plan that read one part of the report each: the
copies to and from the host, memory over the step, recompute, and the compilations; and the
small formatters the report shares."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from ..analysis.memory_timeline import MemoryTimeline
from ..base.formatting import format_bytes, format_seconds
from ..passes.recompute_activations import RecomputeSummary
from .step_facts import DeviceCopy, HostCopy

if TYPE_CHECKING:  # a type for annotations only: the compiler sits above inspection/
    from ..compiler.compilation import Compilation

LIVE_AT_PEAK_SHOWN = 8
SPARKLINE_WIDTH = 64
_BARS = " ▁▂▃▄▅▆▇█"


def host_copies_section(copies: Sequence[HostCopy]) -> str:
    if not copies:
        return ""
    lines = [f"Copies to the host: {len(copies)} gradient shard(s), {format_bytes(sum(c.bytes for c in copies))} "
             f"a step, each issued in the graph right after its reduction's wait, on a side stream "
             f"([Note: gradients streamed to the host])",
             f"  {'#':>3}  {'bytes':>10} {'waited':>6} {'copied':>6}  {'compute after':>13}  bucket"]
    for i, c in enumerate(copies):
        lines.append(f"  {i:>3}  {format_bytes(c.bytes):>10} {position_text(c.after_wait):>6} "
                     f"{c.at:>6}  {c.compute_after:>13}  {bucket_text(c.bucket)}")
    lines.append("  compute after: matmuls, attention and convolutions the graph runs after the "
                 "copy is issued, which it overlaps; the host reads the shards after the graph")
    return "\n".join(lines)


def device_copies_section(copies: Sequence[DeviceCopy]) -> str:
    if not copies:
        return ""
    lines = [f"Copies from the host: {len(copies)} bucket(s) of shards, "
             f"{format_bytes(sum(c.bytes for c in copies))} a step, each issued one bucket ahead "
             f"of its all-gather on a side stream, waited for where the gather is issued "
             f"([Note: shards brought from the host])",
             f"  {'#':>3}  {'bytes':>10} {'copied':>6} {'waited':>6}  {'compute between':>15}  bucket"]
    for i, c in enumerate(copies):
        lines.append(f"  {i:>3}  {format_bytes(c.bytes):>10} {c.at:>6} {c.waited:>6}  "
                     f"{c.compute_between:>15}  {bucket_text(c.bucket)}")
    lines.append("  compute between: matmuls, attention and convolutions the graph runs between "
                 "the copy's issue and its wait, which it can overlap (the graph's order; not "
                 "measured on a GPU)")
    return "\n".join(lines)


def memory_section(m: MemoryTimeline, compilations: Sequence[Compilation] = (),
                    recompute: Optional[RecomputeSummary] = None) -> str:
    peak = m.peak_index
    lines = ["Memory per rank over the step (estimated, [Note: the memory timeline])",
             f"  persistent {format_bytes(m.persistent_bytes)} (graph inputs and optimizer "
             f"state); peak {format_bytes(m.peak_bytes)} at node {peak} ({m.node_names[peak]}, "
             f"{m.phases[peak]})",
             f"  {sparkline(m.total)}  0 … {len(m.total) - 1}"]
    live = m.live_at(peak)
    lines.append(f"  alive at the peak, besides the persistent bytes: {len(live)} tensors, "
                 f"{format_bytes(sum(t.bytes for t in live))}; the largest:")
    for t in live[:LIVE_AT_PEAK_SHOWN]:
        lines.append(f"    {format_bytes(t.bytes):>10}  {t.node} ({t.what}, {t.phase}; "
                     f"nodes {t.index}–{t.last_use})")
    if recompute is not None:
        lines.append(f"  {describe_recompute(recompute)}")
    lowered = compilations[-1].memory if compilations else None
    if lowered is not None:
        graph_peak = m.peak_bytes - m.persistent_bytes
        lines.append(f"  as lowered: Inductor's program peaks at {format_bytes(lowered.peak_bytes)} "
                     f"besides the persistent bytes ({lowered.peak_bytes / max(graph_peak, 1):.2f}x "
                     f"the graph's {format_bytes(graph_peak)}; read from its code, [Note: reading "
                     f"buffer lifetimes from generated code])")
    return "\n".join(lines)


def describe_recompute(summary: RecomputeSummary) -> str:
    """One line on what ``recompute_activations`` did (explain() and the graph dumps)."""
    cost = (f", about {format_seconds(summary.recompute_seconds)} more compute per step "
            f"(cost model)" if summary.recompute_seconds is not None else "")
    return (f"recompute ({summary.mode}): {summary.recomputed_ops} ops recomputed in the "
            f"backward; the backward keeps {format_bytes(summary.kept_bytes)} of the forward's "
            f"values instead of {format_bytes(summary.kept_bytes_before)} (saves "
            f"{format_bytes(summary.dropped_bytes)}){cost}")


def compilations_section(compilations: Sequence[Compilation]) -> str:
    if not compilations:
        return ""
    lines = [f"Compilations: {len(compilations)}"]
    for i, c in enumerate(compilations):
        lines.append(f"  {i}: {c.seconds:.1f} s, {c.reason}")
        if c.regions is not None:
            lines.extend(f"     {line}" for line in str(c.regions).splitlines())
    return "\n".join(lines)


def sparkline(values: Sequence[int], width: int = SPARKLINE_WIDTH) -> str:
    """``values`` squeezed into ``width`` block characters (each the max of its span)."""
    if not values:
        return ""
    top = max(values) or 1
    n = len(values)
    columns = [max(values[i * n // width:max((i + 1) * n // width, i * n // width + 1)])
               for i in range(min(width, n))]
    return "".join(_BARS[round(v / top * (len(_BARS) - 1))] for v in columns)


def position_text(index: Optional[int]) -> str:
    return "-" if index is None else str(index)


def bucket_text(names: tuple[str, ...]) -> str:
    if len(names) <= 2:
        return ", ".join(names)
    return f"{names[0]} … {names[-1]} ({len(names)})"
