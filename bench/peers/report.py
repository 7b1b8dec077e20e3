"""The peers' rows as one summary per peer, a Markdown table with ratios against FSDP2
eager, the targets' ratios, and the check that every peer trained the same thing."""

from __future__ import annotations

import statistics

MIB = 2 ** 20
FP32 = 4


def summarize(name: str, ranks: list[dict]) -> dict:
    """One peer over all ranks: per step the slowest rank's time, then median/min/max;
    the highest peak over ranks; rank 0's losses (they are means over ranks)."""
    slowest = [max(times) for times in zip(*(r["step_s"] for r in ranks))]
    median = statistics.median(slowest)
    first = max(r["first_step_s"] for r in ranks)
    # what the first step took beyond a median one, for every peer alike (dynamo's trace and
    # the first call's set-up included); compile_s is zero_fx's own measure for zero_fx
    first_step_extra = max(first - median, 0.0)
    row0 = ranks[0]
    summary = {
        "peer": name,
        "psi": row0["psi"],
        "median_step_ms": 1e3 * median,
        "min_step_ms": 1e3 * min(slowest),
        "max_step_ms": 1e3 * max(slowest),
        "first_step_s": first,
        "compile_s": row0.get("compile_s", first_step_extra),
        "first_step_extra_s": first_step_extra,
        "peak_mib": max(r["peak_bytes"] for r in ranks) / MIB,
        "held_mib": max(r["held_bytes"] for r in ranks) / MIB,
        "sent_mib_per_step": (None if row0["sent_bytes_per_step"] is None else
                              max(r["sent_bytes_per_step"] for r in ranks) / MIB),
        "final_loss": row0["losses"][-1],
        "losses": row0["losses"],
        "whole_batch": row0["whole_batch"],
    }
    if "ring_bytes_per_step" in row0:
        summary["ring_mib_per_step"] = row0["ring_bytes_per_step"] / MIB
    return summary


def loss_disagreements(summaries: list[dict], reference: str, rtol: float) -> list[str]:
    """Peers whose losses at any step differ from the reference's by more than ``rtol``."""
    ref = next(s for s in summaries if s["peer"] == reference)["losses"]
    bad = []
    for s in summaries:
        worst = max(abs(a - b) / abs(b) for a, b in zip(s["losses"], ref))
        s["loss_rel_diff"] = worst
        if worst > rtol:
            bad.append(f"{s['peer']}: losses differ from {reference}'s by {worst:.2e} (> {rtol:.0e})")
    return bad


def _ratio(value, ref):
    return "" if value is None or not ref else f" ({value / ref:.2f}×)"


def markdown(summaries: list[dict], reference: str, wire: bool, losses: bool = True) -> str:
    """The table; ``wire``: a column of bytes sent (gloo only); ``losses``: a column of
    final losses (not with the fake process group, whose collectives return nothing)."""
    ref = next((s for s in summaries if s["peer"] == reference), None)
    psi_bytes = summaries[0]["psi"] * FP32
    head = ["peer", "step ms: median (min–max)", "peak MiB / rank", "held MiB", "first step s",
            "compile s"]
    if wire:
        head.append("sent / rank / step")
    if losses:
        head.append("final loss")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        step = f"{s['median_step_ms']:.1f} ({s['min_step_ms']:.1f}–{s['max_step_ms']:.1f})"
        if s["whole_batch"]:
            step += " †"
        cells = [s["peer"] + (" (ref)" if s["peer"] == reference else ""),
                 step + ("" if s["whole_batch"] else _ratio(s["median_step_ms"],
                                                           ref and ref["median_step_ms"])),
                 f"{s['peak_mib']:.1f}" + _ratio(s["peak_mib"], ref and ref["peak_mib"]),
                 f"{s['held_mib']:.1f}",
                 f"{s['first_step_s']:.1f}",
                 f"{s['compile_s']:.1f}"]
        if wire:
            sent = s["sent_mib_per_step"]
            cells.append(f"{sent:.1f} MiB = {sent * MIB / psi_bytes:.2f} Ψ"
                         + _ratio(sent, ref and ref["sent_mib_per_step"]))
        if losses:
            cells.append(f"{s['final_loss']:.5f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


TARGETS = [
    ("zero_fx-3 step time vs FSDP2 eager", "zero_fx-3", "fsdp2", "median_step_ms", 0.75),
    ("zero_fx-3 step time vs DeepSpeed ZeRO-3", "zero_fx-3", "deepspeed-3", "median_step_ms", 0.75),
    ("zero_fx-3 peak memory vs FSDP2 eager", "zero_fx-3", "fsdp2", "peak_mib", 0.90),
    ("zero_fx-3-blocks peak memory vs FSDP2 with activation checkpointing", "zero_fx-3-blocks",
     "fsdp2-ac", "peak_mib", 0.90),
    ("zero_fx-3-blocks step time vs FSDP2 with activation checkpointing", "zero_fx-3-blocks",
     "fsdp2-ac", "median_step_ms", 1.0),
    ("zero_fx-0 step time vs DDP compiled", "zero_fx-0", "ddp-compiled", "median_step_ms", 1.0),
    ("zero_fx-3 compile time vs torch.compile of the step", "zero_fx-3", "torch.compile",
     "compile_s", 1.2),
]
"""(what, ours, theirs, measure, target ratio): the issue's targets, reported, never asserted."""


def targets(summaries: list[dict]) -> list[dict]:
    by_peer = {s["peer"]: s for s in summaries}
    rows = []
    for what, ours, theirs, key, target in TARGETS:
        if ours in by_peer and theirs in by_peer and by_peer[theirs][key]:
            ratio = by_peer[ours][key] / by_peer[theirs][key]
            rows.append({"what": what, "ratio": ratio, "target": target, "met": ratio <= target})
    return rows


def targets_markdown(rows: list[dict]) -> str:
    lines = ["| target | ratio | aim | met |", "|---|---|---|---|"]
    lines += [f"| {r['what']} | {r['ratio']:.2f} | ≤ {r['target']:.2f} | "
              f"{'yes' if r['met'] else 'no'} |" for r in rows]
    return "\n".join(lines)
