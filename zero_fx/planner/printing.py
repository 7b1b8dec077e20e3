"""The report as ``python -m zero_fx.plan`` prints it: markdown tables, one per question."""

from __future__ import annotations

import math
import statistics
from typing import Optional

from ..plan.layout import BLOCKS
from .features.expert_parallel import buffer_rows
from .features.offload import largest_model, offload_fits
from .features.quantization import format_quantization
from .report import GB, OPTIMIZER_BYTES, PlanReport
from .features.whole_updates import format_whole_updates


def format_report(report: PlanReport, *, device_memory_gb: Optional[float] = None,
                  all_buckets: bool = False) -> str:
    n = report.world_size
    dtype = str(report.dtype).removeprefix("torch.")
    precision = (f"{dtype} compute, fp32 masters" if report.dtype.itemsize < 4 else f"{dtype}")
    tp, dp = report.tensor_parallel, n // report.tensor_parallel
    lines = [
        f"zero_fx plan: {report.model} on {n} ranks, {precision}, {report.optimizer}",
        f"{report.psi / 1e9:.3f}B parameters (Ψ) in {report.tensors} tensors; padding to {dp} "
        f"ranks adds {report.padding:,} elements. Planned in {report.seconds:.1f} s. "
        "GB = 10^9 bytes.",
        *_format_experts(report),
        *([] if tp == 1 else [
            f"Tensor parallelism {tp} x ZeRO over {dp} ranks: a rank holds 1/{tp} of every "
            f"block's matrices and of the vocabulary-parallel embedding and head, the norms "
            f"whole: Ψ_T = {report.psi_per_rank / 1e9:.3f}B elements, sharded over the {dp} "
            "data-parallel ranks. The tables below are per rank, of that piece."]),
        "",
        "Model states per rank at the peak of a step (parameters, gradients, masters, optimizer):",
        "",
        "| stage | parameters | gradients | fp32 masters | optimizer | total | ZeRO paper (2+2+12)Ψ |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in report.stages:
        mark = " ←" if s.stage == report.stage else ""
        paper = "" if math.isnan(s.paper_bytes) else _three_digits(s.paper_bytes / GB)
        lines.append(f"| {s.stage}{mark} | " + " | ".join(
            f"{s.states[k] / GB:.2f}" for k in ("parameters", "gradients", "masters", "optimizer"))
            + f" | **{s.state_bytes / GB:.2f}** | {paper} |")
    if report.dtype.itemsize < 4:
        lines += ["", "The paper counts 2-byte gradients; zero_fx keeps the gradient the optimizer "
                  "reads in fp32: 2Ψ/N more in stage 2, 2Ψ more in stage 0, the same in stages 1 "
                  "and 3."]
    exchanges = ("all_to_all",) if any("all_to_all" in s.traffic for s in report.stages) else ()
    lines += ["", f"Traffic per step per rank ({dtype} collectives; stage 3's all-gather counts "
              "the backward's re-gather, an upper bound):", "",
              "| stage | all-reduce | reduce-scatter | all-gather | "
              + ("all-to-all | " if exchanges else "") + "sent over a ring | in Ψ"
              + ("_T |" if tp > 1 else " |"),
              "|---|---|---|---|---|---|" + ("---|" if exchanges else "")]
    for s in report.stages:
        cells = [f"{s.traffic[k] / GB:.2f}" if k in s.traffic else "—"
                 for k in ("all_reduce", "reduce_scatter", "all_gather", *exchanges)]
        in_psi = sum(s.traffic.values()) / (report.psi_per_rank * report.dtype.itemsize)
        lines.append(f"| {s.stage} | " + " | ".join(cells) + f" | {s.wire_bytes / GB:.2f} | "
                     f"{in_psi:.2f} |")
    cut = ("one per repeated block" if report.bucket_cap == BLOCKS
           else f"cap {report.bucket_cap / 2**20:.0f} MiB")
    lines += ["", f"Buckets in stage {report.stage} ({cut}"
              + (f"; {report.resident} small parameters stay resident" if report.stage == 3 else "")
              + "):"]
    for kind, buckets in report.buckets.items():
        sizes = [b.bytes for b in buckets]
        if not sizes:  # every parameter resident
            lines.append(f"- {kind}: none")
            continue
        lines.append(f"- {kind}: {len(buckets)} buckets, {min(sizes) / 2**20:.1f} / "
                     f"{statistics.median(sizes) / 2**20:.1f} / {max(sizes) / 2**20:.1f} MiB "
                     "(smallest / median / largest)")
        shown = buckets if all_buckets else buckets[:3]
        for b in shown:
            lines.append(f"    {b.bytes / 2**20:8.1f} MiB  {b.names[0]}"
                         + (f" … {b.names[-1]} ({len(b.names)})" if len(b.names) > 1 else ""))
        if len(shown) < len(buckets):
            lines.append(f"    … {len(buckets) - len(shown)} more (--buckets lists them all)")
    if report.whole_updates is not None:
        lines += ["", *format_whole_updates(report.whole_updates, report.psi, report.tensors,
                                            report.hardware, report.world_size)]
    if report.levels:
        lines += ["", *_format_levels(report)]
    lines.append("")
    if report.working_set is None:
        lines.append("Working set: give --seq (and --batch) to trace activations on fake tensors.")
    else:
        peak = report.peak_bytes
        lines += [f"Step working set (activations, gathered parameters, gradients before they are "
                  f"reduced), stage {report.stage}"
                  + (f", tensor parallelism {tp} (the traced step priced again)" if tp > 1 else "")
                  + f": {report.working_set / GB:.2f} GB",
                  f"    ({report.working_set_how})",
                  f"Estimated peak per rank, stage {report.stage}"
                  + (", without offload" if report.offload_rows else "")
                  + f": {peak / GB:.2f} GB"]
        if device_memory_gb is not None:
            verdict = "fits" if peak <= device_memory_gb * GB else "does NOT fit"
            lines.append(f"    {verdict} in {device_memory_gb:g} GB per device")
    if report.expert_parallel:
        lines += ["", *_format_expert_parallel(report, device_memory_gb)]
    if report.tensor_parallel_rows:
        lines += ["", *_format_tensor_parallel(report, device_memory_gb)]
    if report.offload_rows:
        lines += ["", *_format_offload(report)]
    if report.quantized:
        lines += ["", *format_quantization(report.quantized, report.hardware, report.world_size)]
    if device_memory_gb is not None and report.working_set is None:
        fitting = [s.stage for s in report.stages if s.state_bytes <= device_memory_gb * GB]
        lines.append(f"Model states fit in {device_memory_gb:g} GB in stages: "
                     f"{', '.join(map(str, fitting)) or 'none'} (activations not counted)")
    return "\n".join(lines)


def _format_experts(report: PlanReport) -> list[str]:
    e = report.experts
    if e is None:
        return []
    shapes = "; ".join(f"{n} experts, top-{k}" + (" + a shared expert" if shared else "")
                       for n, k, shared in e.shapes)
    return [f"Mixture of experts: {e.blocks} blocks of {shapes}. {e.expert_parameters / 1e9:.3f}B "
            f"expert parameters, all sharded and stored; {e.active_parameters / 1e9:.3f}B "
            "parameters active per token (activations count each token's top-k experts)."]


def _format_expert_parallel(report: PlanReport, device_memory_gb: Optional[float]) -> list[str]:
    e = report.experts
    counts = "/".join(str(n) for n in sorted({n for _, n, _, _ in e.routed}))
    tokens = report.working_set_how.split(" tokens")[0].removeprefix("batch ")
    lines = [f"Expert parallelism, stage {report.stage} (a block's {counts} experts split over P "
             f"ranks; per rank per step; times on {report.hardware}; [Note: planning expert "
             "parallelism] in zero_fx/planner/features/expert_parallel.py):", "",
             "| P | experts gathered per block | expert rows per block | working set | "
             "estimated peak per rank | all-gather + reduce-scatter | all-to-all | sent per rank "
             "| step (compute, collectives, exchanges) |",
             "|---|---|---|---|---|---|---|---|---|"]
    _, n, k, _ = e.routed[-1]
    t = report.tokens_per_rank
    for row in report.expert_parallel:
        p = row.degree
        rows = f"{buffer_rows(t, p, n, k, report.expert_capacity_factor) / t:g}T"
        fits = ("" if device_memory_gb is None else
                " (fits)" if row.peak_bytes <= device_memory_gb * GB else " (does NOT fit)")
        lines.append(
            f"| {p} | {n // p} | {rows} | {row.working_set / GB:.2f} GB | "
            f"{row.peak_bytes / GB:.2f} GB{fits} | "
            f"{(row.traffic['all_gather'] + row.traffic['reduce_scatter']) / GB:.2f} GB | "
            f"{row.traffic['all_to_all'] / GB:.2f} GB | {row.wire_bytes / GB:.2f} GB | "
            f"{1e3 * row.step_seconds:.0f} ms ({1e3 * row.compute_seconds:.0f}, "
            f"{1e3 * row.collective_seconds:.0f}, {1e3 * row.exchange_seconds:.1f}) |")
    buffer = ("the worst case, P·T·min(k, E/P) rows" if report.expert_capacity_factor is None
              else f"the experts' capacity at expert_capacity_factor "
                   f"{report.expert_capacity_factor:g}, about {report.expert_capacity_factor:g}"
                   f"·T·k rows (rows past it dropped)")
    lines.append(f"T = {tokens} tokens per rank. Model states are the same for every P. The "
                 f"buffer of received rows is {buffer}; all-to-all "
                 "counts the token side, 4 exchanges of T·k rows per block, of which a rank "
                 "sends (P-1)/P. The step is max(compute, collectives) + exchanges.")
    return lines


def _format_tensor_parallel(report: PlanReport, device_memory_gb: Optional[float]) -> list[str]:
    """The seeds' question: does the largest block fit one device, with data parallelism
    alone and with tensor parallelism ([Note: planning tensor parallelism])."""
    tp, n = report.tensor_parallel, report.world_size
    sp = "on" if report.sequence_parallel else "off (--sequence-parallel)"

    def gb(x: Optional[float]) -> str:
        return "—" if x is None else f"{x / GB:.2f} GB"

    def fits(x: Optional[float]) -> str:
        if x is None or device_memory_gb is None:
            return ""
        return " (fits)" if x <= device_memory_gb * GB else " (does NOT fit)"

    lines = [f"Tensor parallelism against data parallelism alone, stage {report.stage}, {n} "
             f"ranks (tp {tp}: Megatron's column and row split of each block over {tp} "
             f"consecutive ranks, ZeRO over the {n // tp} at stride {tp}; sequence parallelism "
             f"{sp}; per rank; times on {report.hardware}; [Note: planning tensor "
             "parallelism] in zero_fx/planner/features/tensor_parallel.py):", "",
             "| tp | parameters per rank | model states | largest block: parameters + "
             "gradients + activations | largest matrix | working set | estimated peak | "
             "TP collectives | ZeRO collectives | step (compute, ZeRO, TP) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in report.tensor_parallel_rows:
        name = f"{row.degree}" + (" (data parallel only)" if row.degree == 1 else "")
        kept = "—" if row.block_activations is None else f"{row.block_activations / GB:.2f}"
        block = (f"{row.block_params / GB:.2f} + {row.block_params / GB:.2f} + {kept} = "
                 f"{row.block_bytes / GB:.2f} GB{fits(row.block_bytes)}")
        tp_cell = ("—" if not report.tokens_per_rank else
                   f"{row.tp_bytes / GB:.2f} GB, {1e3 * row.tp_seconds:.0f} ms")
        step = ("—" if row.step_seconds is None else
                f"{1e3 * row.step_seconds:.0f} ms ({1e3 * row.compute_seconds:.0f}, "
                f"{1e3 * row.zero_seconds:.0f}, {1e3 * row.tp_seconds:.0f})")
        lines.append(
            f"| {name} | {row.params_per_rank / 1e9:.2f}B | {row.state_bytes / GB:.2f} GB | "
            f"{block} | {row.largest_matrix / GB:.2f} GB | {gb(row.working_set)} | "
            f"{gb(row.peak_bytes)}{fits(row.peak_bytes)} | {tp_cell} | "
            f"{row.zero_bytes / GB:.2f} GB, {1e3 * row.zero_seconds:.0f} ms | {step} |")
    tokens = report.working_set_how.split(" tokens")[0].removeprefix("batch ")
    lines.append(
        f"The largest block is {report.largest_block}: its parameters gathered and its "
        "gradients before they are reduced (the compute dtype), and the activations it keeps "
        "for the backward"
        + (f" at {tokens} tokens per rank" if report.tokens_per_rank else " (give --seq)")
        + ". TP collectives: 4 all-reduces of b·s·h a block (2 forward, 2 backward), 2 for "
        "the embedding and head, none hidden; ZeRO's carry a rank's piece over the "
        "data-parallel ranks. The step is max(compute/T, ZeRO) + TP.")
    return lines


def _format_offload(report: PlanReport) -> list[str]:
    """Every offload mode the stage allows, device and host side by side, and the largest
    model each fits ([Note: planning offload])."""
    n, stage, device = report.world_size, report.stage, report.device_memory
    dtype = str(report.dtype).removeprefix("torch.")
    ranks = f"{n} rank" + ("s" if n > 1 else "")
    budget = (f"device {device / GB:g} GB" if device is not None else "device memory not given")
    lines = [f"Offload, stage {stage}, {ranks} (per rank per step; {budget}, host "
             f"{report.host_memory / GB:g} GB; copies and the host's optimizer step on "
             f"{report.hardware}; [Note: planning offload] in zero_fx/planner/features/offload.py):", "",
             "| offload | device: model states | working set | device: estimated peak | "
             "host: model states | to host + to device | copies | host optimizer step | "
             "step |", "|---|---|---|---|---|---|---|---|---|"]

    def verdict(fits: bool) -> str:
        return " (fits)" if fits else " (does NOT fit)"

    for row in report.offload_rows:
        mark = " ←" if row.mode == report.offload else ""
        on_device = row.device_bytes if row.peak_bytes is None else row.peak_bytes
        device_fits = "" if device is None else verdict(on_device <= device)
        states = f"{row.device_bytes / GB:.2f} GB" + (device_fits if row.peak_bytes is None
                                                       else "")
        working = "—" if row.working_set is None else f"{row.working_set / GB:.2f} GB"
        peak = "—" if row.peak_bytes is None else f"{row.peak_bytes / GB:.2f} GB{device_fits}"
        host = f"{row.host_bytes / GB:.2f} GB{verdict(row.host_bytes <= report.host_memory)}"
        to_host, to_device = row.copy_seconds
        off = row.mode == "none"
        step = ("—" if row.step_seconds is None else
                f"{1e3 * row.step_seconds:.0f} ms" + (
                    "" if off else f" (compute {1e3 * row.compute_seconds:.0f}, host step "
                                   f"{1e3 * row.host_step_seconds:.0f})"))
        lines.append(
            f"| {row.mode}{mark} | {states} | {working} | {peak} | {host} | "
            + ("— | — | —" if off else
               f"{row.to_host / GB:.2f} + {row.to_device / GB:.2f} GB | {1e3 * to_host:.0f} + "
               f"{1e3 * to_device:.0f} ms | {1e3 * row.host_step_seconds:.0f} ms")
            + f" | {step} |")
    lines.append(
        f"Offloaded, the device keeps the {dtype} parameters ("
        + ("its shard" if stage == 3 else "whole") + ", none with 'parameters') and two "
        "buckets of reduced gradients on their way to the host; the host keeps the fp32 "
        "masters, the optimizer state and the fp32 gradients the reduced buckets are added "
        "into. Gradients go to the host in the compute dtype during the backward; updated "
        "parameters come back after the host's step ('parameters': each gather's shard comes "
        "over ahead of it instead). The step is max(compute, collectives, copies that "
        "overlap) + the host's step + the copy back.")
    if report.offload_auto:
        chosen = next(r for r in report.offload_rows if r.mode == report.offload)
        lines.append(f"--offload auto: '{report.offload}', the least offload that fits."
                     if offload_fits(report, chosen) else
                     f"--offload auto: no mode fits; '{report.offload}' is the most offload.")
    if device is not None:
        largest = []
        for row in report.offload_rows:
            psi, bound = largest_model(stage, n, row.mode,
                                       optimizer_bytes=OPTIMIZER_BYTES[report.optimizer],
                                       param_bytes=report.dtype.itemsize,
                                       device_memory=device, host_memory=report.host_memory)
            largest.append(f"{row.mode} {psi / 1e9:.2f}B ({bound})")
        lines.append(f"Largest model these budgets hold at {ranks}, stage {stage}, {dtype}, "
                     f"{report.optimizer}, model states only (before activations and the "
                     f"gathered working set): " + ", ".join(largest) + ".")
    return lines


def _format_levels(report: PlanReport) -> list[str]:
    per_node = report.world_size // report.nodes
    lines = [f"Flat or hybrid over {report.nodes} nodes of {per_node} ranks, stage {report.stage} "
             "(bytes each rank sends per step; a ring over ranks on several nodes runs at the "
             "network's speed, so all of its bytes count as crossing):", "",
             "| sharding | model states per rank | estimated peak per rank | sent within a node "
             "| sent across nodes |", "|---|---|---|---|---|"]
    for row in report.levels:
        peak = "—" if row.peak_bytes is None else f"{row.peak_bytes / GB:.2f} GB"
        lines.append(f"| {row.name} | {row.state_bytes / GB:.2f} GB | {peak} | "
                     f"{row.within_node / GB:.2f} GB | {row.across_nodes / GB:.2f} GB |")
    if report.stage == 0:
        lines.append("Stage 0 shards nothing: a mesh changes nothing (one all-reduce over every rank).")
    elif len(report.levels) > 1:
        flat, one_per_node = report.levels[:2]
        lines.append(f"One replica per node sends {flat.across_nodes / one_per_node.across_nodes:.1f}x "
                     f"fewer bytes across nodes than flat, for "
                     f"{(one_per_node.state_bytes - flat.state_bytes) / GB:.2f} GB more states "
                     "per rank.")
    return lines


def _three_digits(x: float) -> str:
    """120, 31.4, 16.6, 1.88: three significant digits, as the ZeRO paper prints them."""
    decimals = max(0, 2 - math.floor(math.log10(abs(x)))) if x else 0
    return f"{x:.{decimals}f}"
