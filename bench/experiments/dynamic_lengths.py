"""Step time on batches of changing length: one dynamic graph against one static graph per
length (``dynamic_shapes="auto"`` against ``"static"``), world 1, the example's GPT.

    python -m bench.experiments.dynamic_lengths --backend aot_eager
    python -m bench.experiments.dynamic_lengths --backend inductor --rounds 6

Both steps train their own copy of the same model in one process, each call of the dynamic
step followed by a call of the static step on the same batch, so that both run under the same
conditions (runs started apart on a shared 2-core machine differ by up to ±10 %). Every length is
called once by both before timing (the static step compiles once per length there, the
dynamic one twice in all), then ``--rounds`` rounds call every length in a shuffled order.
Prints, and writes to bench/out/dynamic-lengths-<backend>.json: per length the median call of
each step and their ratio, the median of all calls' ratios, the compilations and their
seconds. The losses must agree (the same training). [Note: one dynamic graph for every
length] in zero_fx/capture/dynamic_shapes.py.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F

from examples.gpt import GPT, GPTConfig
from zero_fx import zero_compile

from ..helpers.runs import machine, write_json

MODES = ("auto", "static")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="aot_eager", choices=("aot_eager", "inductor", "eager"))
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 24, 40, 56, 32, 48])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=8, help="timed calls of every length")
    return p.parse_args(argv)


def train_step(model, opt, x, y):
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def batch(config: GPTConfig, length: int, size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, config.vocab_size, (size, length), generator=g)
    return x, torch.roll(x, -1, dims=1)


def run(args) -> dict:
    config = GPTConfig(block_size=max(args.lengths))
    steps, models, optimizers = {}, {}, {}
    for mode in MODES:
        torch.manual_seed(0)
        models[mode] = GPT(config)
        optimizers[mode] = torch.optim.AdamW(models[mode].parameters(), lr=1e-3)
        steps[mode] = zero_compile(train_step, stage=args.stage, backend=args.backend,
                                   dynamic_shapes=mode)
    times = {mode: {n: [] for n in args.lengths} for mode in MODES}
    ratios, losses = [], {mode: [] for mode in MODES}
    order = random.Random(0)
    schedule = [("warm-up", list(args.lengths))]
    for r in range(args.rounds):
        lengths = list(args.lengths)
        order.shuffle(lengths)
        schedule.append((f"round {r + 1}", lengths))
    call = 0
    for label, lengths in schedule:
        for length in lengths:
            x, y = batch(config, length, args.batch, call)  # the same tensors: the marks are not theirs
            elapsed = {}
            for mode in MODES:
                start = time.perf_counter()
                losses[mode].append(steps[mode](models[mode], optimizers[mode], x, y).item())
                elapsed[mode] = time.perf_counter() - start
                if label != "warm-up":
                    times[mode][length].append(elapsed[mode])
            if label != "warm-up":
                ratios.append(elapsed["auto"] / elapsed["static"])
            call += 1
        print(f"{label}: {len(steps['auto'].compilations)} compilations dynamic, "
              f"{len(steps['static'].compilations)} static", flush=True)
    worst_loss = max(abs(a - b) / abs(b) for a, b in zip(losses["auto"], losses["static"]))
    per_length = {n: {"dynamic_ms": 1e3 * statistics.median(times["auto"][n]),
                      "static_ms": 1e3 * statistics.median(times["static"][n])}
                  for n in args.lengths}
    for row in per_length.values():
        row["ratio"] = row["dynamic_ms"] / row["static_ms"]
    return {
        "machine": machine(), "backend": args.backend, "stage": args.stage,
        "model": f"examples/gpt.py GPT, {config.n_layer} layers, width {config.n_embd}",
        "batch": args.batch, "lengths": args.lengths, "rounds": args.rounds,
        "per_length": per_length,
        "median_ratio": statistics.median(ratios),
        "median_ms": {mode: 1e3 * statistics.median([t for ts in times[mode].values() for t in ts])
                      for mode in MODES},
        "compilations": {mode: len(steps[mode].compilations) for mode in MODES},
        "compile_seconds": {mode: round(sum(steps[mode].compile_seconds), 1) for mode in MODES},
        "worst_loss_difference": worst_loss,
    }


def report(result: dict) -> str:
    lines = [f"dynamic lengths, {result['backend']}, stage {result['stage']}, world 1, "
             f"{result['model']}, batch {result['batch']}; {result['machine']}",
             "| length | dynamic graph (ms) | static graph per length (ms) | ratio |",
             "|---|---|---|---|"]
    for n, row in result["per_length"].items():
        lines.append(f"| {n} | {row['dynamic_ms']:.1f} | {row['static_ms']:.1f} | "
                     f"{row['ratio']:.2f} |")
    lines.append(f"median of the calls' ratios: {result['median_ratio']:.2f}; compilations "
                 f"{result['compilations']['auto']} dynamic ({result['compile_seconds']['auto']} s) "
                 f"against {result['compilations']['static']} static "
                 f"({result['compile_seconds']['static']} s); losses agree within "
                 f"{result['worst_loss_difference']:.1e}")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    result = run(args)
    path = write_json(f"dynamic-lengths-{args.backend}", result)
    print(report(result))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
