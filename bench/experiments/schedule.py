"""Stage 3 unscheduled vs scheduled vs scheduled + bucketed, next to stage 0, on one run.

    torchrun --nproc_per_node 2 -m bench.experiments.schedule            # Inductor, the example's GPT

Per variant, on the same model and per-rank batch: median step time over the
timed steps after warm-up, collective launches per step (counted as they run),
whether the lowered program runs the graph's order (``pin_schedule``; one variant
lets Inductor re-sort, for comparison),
and the cost model's prediction: with the ``cpu-gloo`` preset, and with a
``Hardware`` calibrated on this machine a moment before (matmul FLOP/s, copy
bandwidth, gloo all-gather speed and overlap). Writes bench/out/schedule-w<N>.json.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from examples.gpt import GPT, GPTConfig
from zero_fx import PRESETS, DebugOptions, Hardware, estimate, rewritten_step_on_fake, zero_compile
from zero_fx.estimate import load_model_builder, vocab_size_of
from zero_fx.planner.offline import language_model_loss

from ..helpers.calibrate import calibrate, fit_op_overhead
from ..helpers.runs import (join_group, leave_group, machine, median_step_seconds, rows_of_every_rank,
                   write_json)

VARIANTS = {
    "stage 0 (DDP)": dict(stage=0),
    "stage 3 unscheduled": dict(stage=3, bucket_bytes=0, prefetch_buckets=0, reduce_overlap_buckets=0,
                                resident_max_numel=0),
    "stage 3 scheduled": dict(stage=3, bucket_bytes=0, prefetch_buckets=1, reduce_overlap_buckets=1,
                              resident_max_numel=0),
    "stage 3 scheduled, Inductor's own order": dict(stage=3, bucket_bytes=0, prefetch_buckets=1,
                                                     reduce_overlap_buckets=1, resident_max_numel=0,
                                                     debug=DebugOptions(pin_schedule=False)),
    "stage 3 scheduled + bucketed": dict(stage=3),
}
"""zero_compile options of each row; the last is the default configuration."""


def measure_variant(options: dict, cfg: GPTConfig, batch: int, steps: int, backend: str,
                    calibrated: Hardware) -> dict:
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    @zero_compile(backend=backend, **options)
    def train_step(model, opt, x, y):
        loss = language_model_loss(model, x, y)  # the loss the planner traces
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    g = torch.Generator().manual_seed(1 + (dist.get_rank() if dist.is_initialized() else 0))
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    y = torch.roll(x, -1, dims=1)
    for _ in range(2):  # compile, then let the optimizer state exist
        train_step(model, opt, x, y)
    with train_step.counting_collectives() as counted:
        train_step(model, opt, x, y)
    step_seconds = median_step_seconds(lambda: train_step(model, opt, x, y), steps)
    preset, fitted = train_step.estimate("cpu-gloo"), train_step.estimate(calibrated)
    order = train_step.compilations[0].order
    return {
        "runs_plan": order.difference is None,
        "step_ms": 1e3 * step_seconds,
        "launches": sum(counted.launches.values()),
        "launches_per_block_per_phase": _per_block_per_phase(train_step, cfg.n_layer),
        "compile_s": train_step.compile_seconds[0],
        "predicted_ms_preset": 1e3 * preset.step_seconds,
        "predicted_ms_calibrated": 1e3 * fitted.step_seconds,
        "exposed_fraction_calibrated": fitted.exposed_fraction,
    }


def _per_block_per_phase(train_step, n_layer: int) -> float:
    """In-graph launches of the busiest phase, per transformer block."""
    report = train_step.traffic()
    phases = [sum(1 for c in report.collectives if c.phase == p) for p in ("forward", "backward")]
    return max(phases) / n_layer


def planned_exposure(model: str, world_size: int, batch: int, seq: int) -> dict:
    """The cost model on the 8xH100 preset for a model planned on fake tensors (bf16,
    stage 3, default buckets and prefetch): no memory, no GPU."""
    build = load_model_builder(model)
    gm, plan = rewritten_step_on_fake(build, batch=batch, seq=seq, vocab_size=vocab_size_of(build),
                                      world_size=world_size, dtype=torch.bfloat16)
    result = estimate(gm, plan, "8xh100-nvlink")
    return {"model": model, "params": plan.total_numel, "world_size": world_size,
            "batch_per_rank": batch, "seq": seq, "step_ms": 1e3 * result.step_seconds,
            "exposed_fraction": result.exposed_fraction,
            "launches": result.collectives, "peak_gib": result.peak_bytes / 2**30}


def markdown(rows: dict) -> str:
    lines = ["| variant | step (median) | vs stage 0 | launches / step | per block per phase | "
             "predicted, cpu-gloo preset | predicted, calibrated | error (calibrated) | "
             "exposed comm. (predicted) | compile | runs the planned order |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = rows["stage 0 (DDP)"]["step_ms"]
    for name, r in rows.items():
        error = r["predicted_ms_calibrated"] / r["step_ms"] - 1
        lines.append(
            f"| {name} | {r['step_ms']:.1f} ms | {r['step_ms'] / base:.2f}x | {r['launches']} | "
            f"{r['launches_per_block_per_phase']:.2f} | {r['predicted_ms_preset']:.1f} ms | "
            f"{r['predicted_ms_calibrated']:.1f} ms | {100 * error:+.0f}% | "
            f"{100 * r['exposed_fraction_calibrated']:.0f}% | {r['compile_s']:.1f} s | "
            f"{'yes' if r['runs_plan'] else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="inductor", choices=("inductor", "aot_eager"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    args = parser.parse_args()
    rank, world = join_group()
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=512, block_size=args.seq, n_layer=args.layers, n_head=4,
                    n_embd=args.width, bias=True)
    calibrated, _ = fit_op_overhead(calibrate(world))
    rows = {}
    for name, options in VARIANTS.items():
        if rank == 0:
            print(f"{name} ...", flush=True)
        rows[name] = measure_variant(options, cfg, args.batch, args.steps, args.backend, calibrated)
    everyone = rows_of_every_rank(rows)
    if rank == 0:
        result = {"machine": machine(), "world_size": world, "backend": args.backend,
                  "model": vars(cfg), "batch_per_rank": args.batch, "ranks": everyone,
                  "calibrated": vars(calibrated), "preset": vars(PRESETS["cpu-gloo"])}
        path = write_json(f"schedule-w{world}", result)
        print(f"\n{result['machine']}; {world} ranks, gloo, {args.backend}; GPT {args.layers} x "
              f"{args.width}, seq {args.seq}, batch {args.batch} per rank; rank 0:\n")
        print(markdown(rows))
        print(f"\ncalibrated: {calibrated}")
        planned = [planned_exposure(m, 8, 1, s) for m, s in (("gpt-1b", 2048), ("llama3-8b", 4096))]
        for p in planned:
            print(f"planned on fake tensors, 8xh100-nvlink preset, stage 3, bf16: {p['model']} "
                  f"({p['params'] / 1e9:.2f}B), batch {p['batch_per_rank']} x {p['seq']} per rank: "
                  f"step {p['step_ms']:.0f} ms, exposed communication "
                  f"{100 * p['exposed_fraction']:.1f}%, {p['launches']} launches, "
                  f"peak {p['peak_gib']:.1f} GiB")
        result["planned"] = planned
        write_json(f"schedule-w{world}", result)
        print(f"written to {path}")
    leave_group()


if __name__ == "__main__":
    main()
