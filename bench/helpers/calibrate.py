"""Measure this machine for the cost model and write its ``cpu-gloo`` preset.

    python -m bench.helpers.calibrate                  # 2 gloo ranks, one core each (~15 s)
    python -m bench.helpers.calibrate --world 4 --out /tmp/mine.json

Each rank runs on one thread, as the tests and benchmarks do: a 512² fp32 matmul
(FLOP/s), a 32 MiB copy (memory bandwidth), all-gathers of 64 bytes and of 16 MiB
over gloo (latency per ring step and bandwidth); the best of 15 runs of each. Then
how much of a 16 MiB all-gather hides behind matmuls issued while it runs (the
median of 7 trials; 0 on the 2-core box, where gloo's threads have no idle core).
Then the op overhead is fitted on a real step of a tiny GPT (``fit_op_overhead``). The
result is written as JSON with where and when it was measured; the default path is
the preset the cost model loads (``zero_fx/analysis/presets/cpu-gloo.json``,
committed), so rerun this and commit the file when the CI machine changes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from datetime import date

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zero_fx import Hardware
from zero_fx.analysis.hardware import PRESET_DIR

from .runs import free_port, join_spawned_group, machine, median_step_seconds

DEFAULT_OUT = os.path.join(PRESET_DIR, "cpu-gloo.json")


def calibrate(world_size: int) -> Hardware:
    """This machine's matmul speed, copy bandwidth, gloo all-gather speed and how much of an
    all-gather runs beside a matmul, measured now (every rank of the current group takes part)."""
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    matmuls = lambda: [a @ b for _ in range(8)]  # noqa: E731
    flops = 8 * 2 * 512 ** 3 / _best_seconds(matmuls)
    big = torch.randn(8 << 20)
    memory_bandwidth = 2 * big.numel() * 4 / _best_seconds(lambda: big.clone())
    small, large = torch.zeros(16), torch.zeros(4 << 20)
    latency = bandwidth = float("inf")
    overlap = 1.0
    if world_size > 1:
        def gather(t):
            out = t.new_empty(t.numel() * world_size)
            return lambda async_op=False: dist.all_gather_into_tensor(out, t, async_op=async_op)
        # ring model: (N-1) * (latency + bytes / N / bandwidth)
        latency = _best_seconds(gather(small), together=True) / (world_size - 1)
        per_step = _best_seconds(gather(large), together=True) / (world_size - 1) - latency
        bandwidth = large.numel() * 4 / per_step
        overlap = _communication_overlap(gather(large), matmuls)
    # a lower bound; fit_op_overhead replaces it with what a real step shows
    overhead = _best_seconds(lambda: torch.add(small, 1), repeat=200)
    return Hardware(name="calibrated on this machine", flops=flops,
                    memory_bandwidth=memory_bandwidth, link_bandwidth=bandwidth,
                    link_latency=latency, op_overhead=overhead,
                    communication_overlap=overlap)


def _communication_overlap(gather, compute, trials: int = 7) -> float:
    """The share of an all-gather that runs beside compute: ``gather(async_op)`` and
    ``compute`` timed alone and together (issued, computed, waited), the time saved over
    the shorter of the two; the median of ``trials`` (one trial swings by 0.3 on the 2-core
    box)."""
    def both():
        work = gather(async_op=True)
        compute()
        work.wait()

    shares = []
    for _ in range(trials):
        alone_gather = _best_seconds(gather, repeat=5, together=True)
        alone_compute = _best_seconds(compute, repeat=5, together=True)
        saved = alone_gather + alone_compute - _best_seconds(both, repeat=5, together=True)
        shares.append(min(1.0, max(0.0, saved / min(alone_gather, alone_compute))))
    return statistics.median(shares)


FIT_MODEL = dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64, bias=True)
"""The step op overhead is fitted on: a GPT so small that its ops' overhead is most of its
time (batch 2 per rank, stage 3, aot_eager)."""


def timed_gpt_step(config: dict, batch: int, stage: int, steps: int):
    """``(median seconds, compiled step)``: ``steps`` timed aot_eager steps of the example's
    GPT (``config``: GPTConfig fields) with AdamW, after 3 that compile it and create the
    optimizer state; ``batch`` sequences per rank, all ranks starting each step together."""
    from examples.gpt import GPT, GPTConfig
    from zero_fx import zero_compile
    from zero_fx.planner.offline import language_model_loss

    torch.manual_seed(0)
    cfg = GPTConfig(**config)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    @zero_compile(stage=stage, backend="aot_eager")
    def train_step(model, opt, x, y):
        loss = language_model_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    rank = dist.get_rank() if dist.is_initialized() else 0
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size),
                      generator=torch.Generator().manual_seed(rank))
    y = torch.roll(x, -1, dims=1)
    for _ in range(3):
        train_step(model, opt, x, y)
    return median_step_seconds(lambda: train_step(model, opt, x, y), steps), train_step


def fit_op_overhead(measured: Hardware) -> tuple[Hardware, dict]:
    """The op overhead that makes the cost model's step time equal a measured one. A step
    costs more per op than one op timed alone (about 15x here: 45 against 2.7 us): the graph's Python, the
    output's allocation, the runtime around the graph, which the model has no other term
    for. The test of the preset (tests/test_cost_model.py) predicts other models with it."""
    step, train_step = timed_gpt_step(FIT_MODEL, batch=2, stage=3, steps=30)
    # the step's time grows by the number of ops the model charges for each second of overhead
    at = lambda overhead: train_step.estimate(replace(measured, op_overhead=overhead)).step_seconds  # noqa: E731
    per_second = (at(1e-4) - at(0.0)) / 1e-4
    overhead = max(measured.op_overhead, (step - at(0.0)) / per_second)
    return replace(measured, op_overhead=overhead), {
        "model": FIT_MODEL, "step_seconds": step, "ops_charged": per_second,
        "single_op_seconds": measured.op_overhead}


def _best_seconds(fn, repeat: int = 15, together: bool = False) -> float:
    """The fastest of ``repeat`` runs; ``together``: all ranks start each run at once."""
    best = float("inf")
    for _ in range(repeat):
        if together:
            dist.barrier()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _rank(rank: int, world_size: int, port: int, out: str) -> None:
    join_spawned_group(rank, world_size, port)
    try:
        measured, fit = fit_op_overhead(calibrate(world_size))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        preset = {**vars(measured),
                  "name": f"cpu-gloo: one core per rank, gloo over loopback, {world_size} ranks",
                  "measured": {"on": machine(), "date": date.today().isoformat(),
                               "op_overhead_fit": fit,
                               "command": "python -m " + " ".join(["bench.helpers.calibrate", *sys.argv[1:]])}}
        with open(out, "w") as f:
            json.dump(preset, f, indent=1)
            f.write("\n")
        print(json.dumps(preset, indent=1))
        print(f"written to {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2, help="gloo ranks, one core each")
    parser.add_argument("--out", default=DEFAULT_OUT, help="where the preset's JSON goes")
    args = parser.parse_args()
    if args.world < 2:
        parser.error("--world must be at least 2: the link is measured between ranks")
    print(f"calibrating on {machine()}, {args.world} ranks ...", flush=True)
    mp.start_processes(_rank, args=(args.world, free_port(), args.out), nprocs=args.world,
                       start_method="spawn")


if __name__ == "__main__":
    main()
