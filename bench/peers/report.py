"""The peers' rows as one summary per peer, a Markdown table with ratios against FSDP2
eager, the targets' ratios, and the check that every peer trained the same thing.

The columns (``COLUMNS`` says the same in the table's header): the step time (the slowest
rank's, median over the timed steps, with min and max); tokens/s per rank (one GPU each):
batch × sequence ÷ median step time; MFU (bench/helpers/mfu.py: GPT models on a GPU of
known peak only); the allocator's peak and held bytes per rank; the host's enqueue time of
a step with the device held busy (bench/helpers/host_enqueue.py) and its ratio to the step
time; the first step and the compile time; the bytes sent (gloo); the final loss.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional

from ..helpers import mfu

MIB = 2 ** 20
FP32 = 4


def pool_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One peer's rows of several rounds (``--rounds``) as the rows of one run, rank by rank:
    the first round's, with every round's timed steps one after another (each round has as
    many, so a step's times stay side by side over the ranks), the highest peak and held
    bytes, and each round's own step times and losses kept (``round_step_s``,
    ``round_losses``) for the report to show and compare."""
    pooled = []
    for rows in zip(*rounds):
        row = dict(rows[0])
        row["step_s"] = [t for r in rows for t in r["step_s"]]
        row["median_step_s"] = statistics.median(row["step_s"])
        row["peak_bytes"] = max(r["peak_bytes"] for r in rows)
        row["held_bytes"] = max(r["held_bytes"] for r in rows)
        row["round_step_s"] = [r["step_s"] for r in rows]
        row["round_losses"] = [r["losses"] for r in rows]
        pooled.append(row)
    return pooled


def round_disagreements(summaries: list[dict], rtol: float) -> list[str]:
    """Peers whose later rounds' losses differ from their first round's by more than
    ``rtol`` at any step: the same training run again must give the same losses."""
    bad = []
    for s in summaries:
        first, *later = s.get("round_losses", [[]])
        for number, losses in enumerate(later, 2):
            worst = _worst_relative_difference(losses, first)
            if not worst <= rtol:  # a NaN disagrees
                bad.append(f"{s['peer']}: round {number}'s losses differ from round 1's by "
                           f"{worst:.2e} (> {rtol:.0e})")
    return bad


def round_lines(summaries: list[dict]) -> str:
    """Each peer's median step in each round (``--rounds``), one line each."""
    lines = [f"- {s['peer']}: " + ", ".join(f"{ms:.1f}" for ms in s["round_median_step_ms"])
             for s in summaries if len(s.get("round_median_step_ms", [])) > 1]
    return "\n".join(["Median step ms in each round (the rounds ran the peers in alternating "
                      "order; the table pools every round's timed steps):", *lines]
                     ) if lines else ""


def summarize(name: str, ranks: list[dict]) -> dict:
    """One peer over all ranks: per step the slowest rank's time, then median/min/max and
    the tokens/s and MFU of that median; the highest peak over ranks; the slowest rank's
    host enqueue time (the least of its measures); rank 0's losses (means over ranks)."""
    slowest = _slowest_rank([r["step_s"] for r in ranks])
    median = statistics.median(slowest)
    tokens_per_s = ranks[0]["tokens_per_step"] / median
    enqueue_s = max(min(r["enqueue_s"]) for r in ranks)
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
        "tokens_per_s": tokens_per_s,
        "flops_per_token": row0["flops_per_token"],
        "peak_flops": row0["peak_flops"],
        "mfu": mfu.mfu(row0["flops_per_token"], tokens_per_s, row0["peak_flops"]),
        "enqueue_ms": 1e3 * enqueue_s,
        "enqueue_blocked": any(r["enqueue_blocked"] for r in ranks),
        "enqueue_synchronous": row0["enqueue_synchronous"],
        "enqueue_vs_step": enqueue_s / median,
        "first_step_s": first,
        "compile_s": row0.get("compile_s", first_step_extra),
        "first_step_extra_s": first_step_extra,
        "peak_mib": max(r["peak_bytes"] for r in ranks) / MIB,
        "held_mib": max(r["held_bytes"] for r in ranks) / MIB,
        "sent_mib_per_step": (None if row0["sent_bytes_per_step"] is None else
                              max(r["sent_bytes_per_step"] for r in ranks) / MIB),
        "final_loss": row0["losses"][-1],
        "losses": row0["losses"],
        "loss_steps_compared": min(r["loss_steps_compared"] for r in ranks),
        "loss_steps_why": row0["loss_steps_why"],
        "whole_batch": row0["whole_batch"],
    }
    if "ring_bytes_per_step" in row0:
        summary["ring_mib_per_step"] = row0["ring_bytes_per_step"] / MIB
    if row0.get("profile"):
        summary["profile"] = row0["profile"]
    if "round_step_s" in row0:
        summary["round_median_step_ms"] = [
            1e3 * statistics.median(_slowest_rank(steps))
            for steps in zip(*(r["round_step_s"] for r in ranks))]
        summary["round_losses"] = row0["round_losses"]
    return summary


def _slowest_rank(step_s: list[list[float]]) -> list[float]:
    """Per step, the slowest rank's time (``step_s``: each rank's step times)."""
    return [max(times) for times in zip(*step_s)]


def profile_lines(summaries: list[dict]) -> str:
    """Where each profiled peer's step went (``--profile``), one line each."""
    lines = []
    for s in summaries:
        p = s.get("profile")
        if not p:
            continue
        line = f"- {s['peer']}: one step {p['wall_ms']:.1f} ms, {p['aten_ops']} aten ops"
        if p["gpu_busy_ms"] is not None:
            top = ", ".join(f"{k['name'][:40]} {k['ms']:.1f} ms" for k in p["top_kernels"][:3])
            line += (f", {p['launches']} launches, {p['kernels']} kernels; GPU busy "
                     f"{p['gpu_busy_ms']:.1f} ms, idle {p['gpu_idle_ms']:.1f} ms "
                     f"({100 * p['gpu_idle_fraction']:.0f} %); most time: {top}")
        lines.append(line)
    return "\n".join(["Profile of one step (torch.profiler; idle: wall time no kernel "
                      "covered):", *lines]) if lines else ""


def loss_disagreements(summaries: list[dict], reference: str, rtol: float,
                       steps: Optional[int] = None) -> list[str]:
    """Peers whose losses at any of the first ``steps`` steps (None: every step) differ
    from the reference's by more than ``rtol``."""
    ref = next(s for s in summaries if s["peer"] == reference)["losses"][:steps]
    bad = []
    for s in summaries:
        worst = _worst_relative_difference(s["losses"], ref)
        s["loss_rel_diff"] = worst
        if not worst <= rtol:  # a NaN disagrees
            bad.append(f"{s['peer']}: losses differ from {reference}'s by {worst:.2e} (> {rtol:.0e})")
    return bad


def _worst_relative_difference(losses: list[float], reference: list[float]) -> float:
    """The largest ``|loss - ref| / |ref|`` over the steps both have; NaN if any is NaN."""
    diffs = [abs(a - b) / abs(b) for a, b in zip(losses, reference)]
    return math.nan if any(map(math.isnan, diffs)) else max(diffs, default=0.0)


def _ratio(value, ref):
    return "" if value is None or not ref else f" ({value / ref:.2f}×)"


def _enqueue(s: dict) -> str:
    if s["enqueue_blocked"]:
        return f"blocked ({s['enqueue_ms']:.1f})"
    if s["enqueue_synchronous"]:
        return f"{s['enqueue_ms']:.1f} (CPU: synchronous)"
    return f"{s['enqueue_ms']:.1f} ({s['enqueue_vs_step']:.2f} of the step)"


def markdown(summaries: list[dict], reference: str, wire: bool, losses: bool = True) -> str:
    """The table; ``wire``: a column of bytes sent (gloo only); ``losses``: a column of
    final losses, with the largest relative difference from the reference's over the steps
    compared (when they are)."""
    ref = next((s for s in summaries if s["peer"] == reference), None)
    psi_bytes = summaries[0]["psi"] * FP32
    head = ["peer", "step ms: median (min–max)", "tokens/s per rank (GPU)", "MFU",
            "peak MiB / rank", "held MiB", "host enqueue ms", "first step s", "compile s"]
    if wire:
        head.append("sent / rank / step")
    if losses:
        head.append("final loss (worst Δ)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        step = f"{s['median_step_ms']:.1f} ({s['min_step_ms']:.1f}–{s['max_step_ms']:.1f})"
        if s["whole_batch"]:
            step += " †"
        cells = [s["peer"] + (" (ref)" if s["peer"] == reference else ""),
                 step + ("" if s["whole_batch"] else _ratio(s["median_step_ms"],
                                                           ref and ref["median_step_ms"])),
                 f"{s['tokens_per_s']:,.0f}" + ("" if s["whole_batch"] else _ratio(
                     s["tokens_per_s"], ref and ref["tokens_per_s"])),
                 "—" if s["mfu"] is None else f"{100 * s['mfu']:.1f} %",
                 f"{s['peak_mib']:.1f}" + _ratio(s["peak_mib"], ref and ref["peak_mib"]),
                 f"{s['held_mib']:.1f}",
                 _enqueue(s),
                 f"{s['first_step_s']:.1f}",
                 f"{s['compile_s']:.1f}"]
        if wire:
            sent = s["sent_mib_per_step"]
            cells.append(f"{sent:.1f} MiB = {sent * MIB / psi_bytes:.2f} Ψ"
                         + _ratio(sent, ref and ref["sent_mib_per_step"]))
        if losses:
            diff = s.get("loss_rel_diff")
            cells.append(f"{s['final_loss']:.5f}" + ("" if diff is None else f" ({diff:.1e})"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


COLUMNS = (
    "tokens/s per rank (GPU): batch × sequence ÷ median step time; "
    f"{mfu.FORMULA}, only for the GPT models on a GPU of known peak (— otherwise); "
    "host enqueue: host time to launch one step while the device is held busy (a CUDA "
    "sleep kernel ahead of it), the least of 2 steps, and its share of the median step "
    "time; 'blocked' when the step returned only after the hold ended (it waited for the "
    "device, or launched more kernels than CUDA's queue holds), so the time is no enqueue "
    "time. On a CPU the step runs on the host, "
    "synchronously: there it is the step's own time.")
"""The table's columns in words, printed with it (the ones whose names do not say it)."""


@dataclass(frozen=True)
class Target:
    """One of an issue's aims: ``ours``'s ``measure`` over ``theirs``'s ``their_measure``
    (the same measure unless given), met when at most ``aim`` (lower is better) or, with
    ``higher``, at least ``aim``."""

    what: str
    ours: str
    theirs: str
    measure: str
    aim: float
    higher: bool = False
    their_measure: Optional[str] = None


TARGETS = [
    Target("zero_fx-3 step time vs FSDP2 eager", "zero_fx-3", "fsdp2", "median_step_ms", 0.75),
    Target("zero_fx-3 step time vs DeepSpeed ZeRO-3", "zero_fx-3", "deepspeed-3",
           "median_step_ms", 0.75),
    Target("zero_fx-3 peak memory vs FSDP2 eager", "zero_fx-3", "fsdp2", "peak_mib", 0.90),
    Target("zero_fx-3-blocks peak memory vs FSDP2 with activation checkpointing",
           "zero_fx-3-blocks", "fsdp2-ac", "peak_mib", 0.90),
    Target("zero_fx-3-blocks step time vs FSDP2 with activation checkpointing",
           "zero_fx-3-blocks", "fsdp2-ac", "median_step_ms", 1.0),
    Target("zero_fx-0 step time vs DDP compiled", "zero_fx-0", "ddp-compiled", "median_step_ms",
           1.0),
    Target("zero_fx-3 compile time vs torch.compile of the step", "zero_fx-3", "torch.compile",
           "compile_s", 1.2),
    # issue 68, one GPU (a fake group of 8)
    Target("zero_fx-3 tokens/s vs FSDP2 compiled (issue 68)", "zero_fx-3", "fsdp2-compiled",
           "tokens_per_s", 1.0, higher=True),
    Target("zero_fx-3 tokens/s vs FSDP2 eager (issue 68)", "zero_fx-3", "fsdp2",
           "tokens_per_s", 1.2, higher=True),
    Target("zero_fx-3 peak memory vs FSDP2 eager (issue 68)", "zero_fx-3", "fsdp2", "peak_mib",
           0.85),
    Target("zero_fx-3 host enqueue vs its step time (issue 68)", "zero_fx-3", "zero_fx-3",
           "enqueue_ms", 0.5, their_measure="median_step_ms"),
]
"""The issues' targets, reported, never asserted."""


def targets(summaries: list[dict]) -> list[dict]:
    """Each target whose two peers ran: its ratio and whether it is met (None when ours's
    measure is no measure: a host enqueue time that blocked, or a CPU's)."""
    by_peer = {s["peer"]: s for s in summaries}
    rows = []
    for t in TARGETS:
        if t.ours not in by_peer or t.theirs not in by_peer:
            continue
        ours, theirs = by_peer[t.ours], by_peer[t.theirs]
        if not theirs[t.their_measure or t.measure]:
            continue
        ratio = ours[t.measure] / theirs[t.their_measure or t.measure]
        measured = not (t.measure == "enqueue_ms"
                        and (ours["enqueue_blocked"] or ours["enqueue_synchronous"]))
        met = (ratio >= t.aim if t.higher else ratio <= t.aim) if measured else None
        rows.append({"what": t.what, "ratio": ratio, "target": t.aim,
                     "better": "higher" if t.higher else "lower", "met": met})
    return rows


def targets_markdown(rows: list[dict]) -> str:
    lines = ["| target | ratio | aim | met |", "|---|---|---|---|"]
    lines += [f"| {r['what']} | {r['ratio']:.2f} | {'≥' if r['better'] == 'higher' else '≤'} "
              f"{r['target']:.2f} | {_met(r['met'])} |" for r in rows]
    return "\n".join(lines)


def _met(met: Optional[bool]) -> str:
    return "not measured" if met is None else "yes" if met else "no"
