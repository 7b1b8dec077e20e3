"""ZeRO stages side by side: measured per-rank peak, the table's formula, traffic in Ψ, step time.

    torchrun --nproc_per_node 4 -m bench.experiments.stages          # 4 gloo ranks on CPU
    python -m bench.experiments.stages                               # one process, world size 1

Trains a deep bias-free MLP (model states dominate a small batch) with AdamW
under ``@zero_compile(stage=s, backend="aot_eager")`` for each stage. Per stage
and rank: the peak live tensor bytes during a step (``LiveTensorBytes``, see
[Note: measuring peak memory on CPU] in zero_fx/analysis/live_memory.py), the formula
of zero_fx/planner/table.py, the traffic report's totals as multiples of Ψ, the
collectives counted as they ran, and the median step time. Writes
``bench/out/stages-w<N>.json`` and prints a Markdown table. aot_eager because
the memory probe cannot see Inductor's buffers; step times are for comparing
stages on this run, not a speed claim.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from zero_fx import zero_compile
from zero_fx.analysis.live_memory import LiveTensorBytes
from zero_fx.planner.table import FP32, model_state_bytes

from ..helpers.rss import MALLOC_ENV, peak_rss, reset_peak_rss, rss_supported
from ..helpers.runs import join_group, leave_group, machine, rows_of_every_rank, write_json

ADAM_STATE_BYTES = 2 * FP32  # exp_avg and exp_avg_sq


def deep_mlp(width: int, depth: int, seed: int = 0) -> nn.Module:
    """Many equal square layers, no biases: model states dominate a small batch's activations."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width, bias=False), nn.Tanh())
                           for _ in range(depth)])


def mlp_training(stage: int, backend: str, width: int, depth: int, **options):
    """``(model, optimizer, compiled step, batch)``: AdamW on ``deep_mlp``, a batch of 2 rows;
    ``options`` go to ``zero_compile``."""
    model = deep_mlp(width, depth)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    @zero_compile(stage=stage, backend=backend, **options)
    def train_step(model, opt, x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return model, opt, train_step, torch.randn(2, width)


LAYERS_PER_BUCKET = 2
"""The table's runs fuse two layers per collective: with the 25 MiB default the
whole 9 MiB model would be one bucket, and stage 2 would hold every full
gradient until that bucket is complete, like stage 1."""


def measure_stage(stage: int, world_size: int, *, width: int, depth: int, steps: int = 3,
                  **options) -> dict:
    """One stage on this rank: the first step compiles (and creates the optimizer
    state); the peak is measured on the second; the median time over the rest.
    ``options`` go to ``zero_compile`` (``optimizer_update="eager"``)."""
    bucket_bytes = LAYERS_PER_BUCKET * width * width * 4
    model, opt, train_step, x = mlp_training(stage, "aot_eager", width, depth,
                                             bucket_bytes=bucket_bytes, **options)
    train_step(model, opt, x)
    gc.collect()
    probe = LiveTensorBytes(list(train_step.state.held_tensors()) + [x])
    with train_step.observing(probe), train_step.counting_collectives() as counted:
        train_step(model, opt, x)
    times = []
    for _ in range(max(steps - 2, 1)):
        start = time.perf_counter()
        train_step(model, opt, x)
        times.append(time.perf_counter() - start)
    psi = sum(p.numel() for p in model.parameters())
    in_graph = not train_step.compilations[-1].update_reason
    formula = model_state_bytes(stage, psi, world_size, optimizer_bytes=ADAM_STATE_BYTES,
                                updates_in_graph=in_graph)
    working_set = working_set_bytes(stage, bucket_bytes, train_step.config.schedule.prefetch_buckets,
                                    updates_in_graph=in_graph,
                                    reduce_overlap=train_step.config.schedule.reduce_overlap_buckets)
    report = train_step.traffic()
    return {
        "stage": stage,
        "psi": psi,
        "peak_bytes": probe.peak,
        "formula_bytes": formula,
        "working_set_bytes": working_set,
        "traffic_psi": report.psi_by_kind(),
        "traffic_numel": report.numel_by_kind(),
        "counted_numel": dict(counted.numel),
        "wire_bytes": report.wire_bytes(),
        "step_ms": 1e3 * statistics.median(times),
        "compile_s": train_step.compile_seconds[0],
    }


def working_set_bytes(stage: int, bucket_bytes: int, prefetch: int, *,
                      updates_in_graph: bool = False, reduce_overlap: int = 1) -> int:
    """What the table's row leaves out: full tensors in flight. Stage 3: the gathered
    bucket in use and ``prefetch`` more, and the one bucket of full gradients being
    filled (a layer's gathered weight is released before its weight gradient exists:
    [Note: release the gathered weight before the weight gradient]); stage 2: the
    gradient bucket being filled and ``prefetch`` more waiting for their reduce-scatter.
    Stages 0 and 1 hold every full gradient anyway (in the row).

    With the update in the graph, stage 3's peak moves from the end of the backward (where
    every gradient shard was alive) into it, where the ``reduce_overlap`` buckets of full
    gradients still wait for their reduce-scatter beside the gathers and the bucket being
    filled: measured 11.3-12.4 MiB at 4 ranks on the 16 x 384^2 MLP against 11.25 (the
    graph's own timeline: 12.4, with the shard-sized copies in and out of each collective)."""
    in_flight = (prefetch + 1) * bucket_bytes
    if stage == 3:
        reducing = reduce_overlap * bucket_bytes if updates_in_graph else 0
        return in_flight + bucket_bytes + reducing
    return in_flight if stage == 2 else 0


def rss_growth_during_step(rank: int, world_size: int, stage: int, backend: str,
                           width: int, depth: int, options: tuple = ()) -> dict:
    """How far resident memory rises above its level before a step, during the third
    step (see [Note: peak RSS on Linux] in bench/helpers/rss.py); works under Inductor."""
    if not rss_supported():
        raise RuntimeError("resident-memory peaks need Linux and a process started with "
                           + " ".join(f"{k}={v}" for k, v in MALLOC_ENV.items()))
    model, opt, train_step, x = mlp_training(stage, backend, width, depth, **dict(options))
    for _ in range(2):
        train_step(model, opt, x)
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
    before = reset_peak_rss()
    train_step(model, opt, x)
    return {"growth_bytes": peak_rss() - before,
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def measure_stages(rank: int, world_size: int, stages, width: int, depth: int,
                   steps: int = 3) -> list[dict]:
    return [measure_stage(s, world_size, width=width, depth=depth, steps=steps) for s in stages]


def markdown(rows: list[dict]) -> str:
    lines = [
        f"| stage | peak per rank (measured) | table formula | measured / formula | "
        f"all-gather | reduce-scatter | all-reduce | counted = report | step (aot_eager) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    mib = 2 ** 20
    for r in rows:
        expected = r["formula_bytes"] + r["working_set_bytes"]
        formula = f"{r['formula_bytes'] / mib:.2f} MiB" + (
            f" + {r['working_set_bytes'] / mib:.2f} working set" if r["working_set_bytes"] else "")
        t = r["traffic_psi"]
        lines.append(
            f"| {r['stage']} | {r['peak_bytes'] / mib:.2f} MiB | {formula} | "
            f"{r['peak_bytes'] / expected:.3f} | {t['all_gather']:.3f} Ψ | "
            f"{t['reduce_scatter']:.3f} Ψ | {t['all_reduce']:.3f} Ψ | "
            f"{'yes' if r['counted_numel'] == r['traffic_numel'] else 'NO'} | {r['step_ms']:.1f} ms |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--steps", type=int, default=7, help="per stage: 1 compile, 1 measured, rest timed")
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    args = parser.parse_args()
    rank, world = join_group()
    rows = []
    for stage in args.stages:
        if rank == 0:
            print(f"stage {stage} ...", flush=True)
        rows += measure_stages(rank, world, [stage], args.width, args.depth, args.steps)
    everyone = rows_of_every_rank(rows)
    if rank == 0:
        result = {"machine": machine(), "world_size": world, "width": args.width,
                  "depth": args.depth, "ranks": everyone}
        path = write_json(f"stages-w{world}", result)
        print(f"\n{result['machine']}; {world} rank(s); deep MLP {args.depth} x {args.width}^2, "
              f"Ψ = {rows[0]['psi']:,}; rank 0:\n")
        print(markdown(rows))
        print(f"\nwritten to {path}")
    leave_group()

if __name__ == "__main__":
    main()
