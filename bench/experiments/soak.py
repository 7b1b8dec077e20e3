"""A long run that must stay right: the example GPT at stage 3 against the same run at stage 0.

    python -m bench.experiments.soak                        # 2,000 steps on 2 gloo ranks (torchrun inside)
    python -m bench.experiments.soak --steps 200 --backend aot_eager

Each rank trains two copies of a small GPT of the example's shape (same seed, same batches) side
by side, one under ``@zero_compile(stage=3)`` and one under stage 0 (DDP). Checked:

- the two losses agree within 1e-4 relative at every step (per rank);
- memory is flat: every 100 steps, each step's held bytes (parameters, shards, optimizer
  state), the count of live tensors, and the process's resident size (with glibc told to
  return freed memory at once: [Note: peak RSS on Linux] in bench/helpers/rss.py);
- each step compiled once;
- no drift in step time: the medians of the first and last 100 steps (after the first,
  which compiles) within 10 %.

Writes ``bench/out/<name>.json`` (per-step losses and times, the samples, the verdicts),
``<name>-summary.json`` (the verdicts and samples, losses every 10 steps: what
bench/results keeps) and ``<name>.png`` (both loss curves, memory against steps); exits 1
if a check fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from examples.gpt import GPT, GPTConfig
from examples.progress import Progress
from examples.summary import held_bytes
from zero_fx import zero_compile

from ..helpers.rss import MALLOC_ENV, resident_bytes
from ..helpers.runs import OUT, join_group, leave_group, machine, write_json

LOSS_RTOL = 1e-4
TIME_DRIFT = 0.10
WINDOW = 100
"""Steps per memory sample, and per median at each end of the run."""


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--backend", default="inductor", help="inductor | aot_eager")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--name", default="soak")
    args = parser.parse_args(argv)
    if args.steps < WINDOW:  # the checks compare the first memory sample with one at WINDOW
        parser.error(f"--steps must be at least {WINDOW}")
    if "RANK" not in os.environ:  # start the ranks: torchrun, glibc returning memory at once
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                   str(args.nproc), "-m", "bench.experiments.soak", *(argv or sys.argv[1:])]
        sys.exit(subprocess.run(command, env=dict(os.environ, **MALLOC_ENV)).returncode)
    rank, world = join_group()
    result = soak(rank, world, args.steps, args.backend)
    if rank == 0:
        result.update(machine=machine(), backend=args.backend, world=world)
        print(f"wrote {write_json(args.name, result)}")
        as_saved = json.loads(json.dumps(result))  # stages as string keys, as in the file
        print(f"wrote {write_json(args.name + '-summary', summary(as_saved))}")
        plot(as_saved, os.path.join(OUT, f"{args.name}.png"))
        for check, verdict in result["checks"].items():
            print(f"{'PASS' if verdict['pass'] else 'FAIL'}  {check}: {verdict['measured']}")
    failed = not all(v["pass"] for v in result["checks"].values())
    leave_group()
    sys.exit(1 if failed else 0)


def _example_run(backend: str, stage: int):
    """A GPT of examples/train_gpt.py's default shape (4 blocks of width 128), on a vocabulary
    of 64 with a constant learning rate: a soak checks drift and leaks, not learning, so it
    keeps the synthetic corpus below rather than the example's text and schedule."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=4, n_embd=128))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)

    @zero_compile(stage=stage, backend=backend)
    def train_step(model, opt, x, y):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return model, opt, train_step


def _batches(rank: int, world: int, batch_size: int = 8):
    """A synthetic corpus, this rank's slice of each global batch."""
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 64, (4096, 1), generator=g)
    strides = torch.randint(1, 4, (4096, 1), generator=g)
    corpus = (starts + strides * torch.arange(33)) % 64
    local = batch_size // world

    def batch(step: int):
        rows = torch.randint(0, len(corpus), (batch_size,),
                             generator=torch.Generator().manual_seed(step))
        seq = corpus[rows[rank * local:(rank + 1) * local]]
        return seq[:, :-1], seq[:, 1:]

    return batch


def soak(rank: int, world: int, steps: int, backend: str) -> dict:
    runs = {stage: _example_run(backend, stage) for stage in (3, 0)}
    batch = _batches(rank, world)
    losses = {3: [], 0: []}
    seconds = {3: [], 0: []}
    samples = []
    began = time.monotonic()
    progress = Progress(steps, enabled=rank == 0, first="compiling both steps", every=WINDOW)
    for step in progress:  # on a terminal a bar; in a log a line every WINDOW steps
        x, y = batch(step)
        for stage, (model, opt, train_step) in runs.items():
            start = time.perf_counter()
            losses[stage].append(train_step(model, opt, x, y).item())
            seconds[stage].append(time.perf_counter() - start)
        if (step + 1) % WINDOW == 0 or step == 0:
            gc.collect()
            samples.append({
                "step": step + 1,
                "held_bytes": {str(s): held_bytes(runs[s][2]) for s in runs},
                "live_tensors": _live_tensors(),
                "rss_bytes": resident_bytes(),
            })
        progress.update(f"loss {losses[3][-1]:.4f} (stage 0: {losses[0][-1]:.4f})  rss "
                        f"{samples[-1]['rss_bytes'] / 2**20:.1f} MiB  {time.monotonic() - began:.0f} s")
    everyone = [None] * world
    dist.all_gather_object(everyone, {"losses": losses, "seconds": seconds, "samples": samples,
                                      "compilations": {s: len(runs[s][2].compilations)
                                                       for s in runs}})
    return {"steps": steps, "ranks": everyone, "checks": checks(everyone)}


def _live_tensors() -> int:
    with warnings.catch_warnings():  # isinstance on some of torch's lazy objects warns
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def checks(ranks: list) -> dict:
    differences = [[abs(a - b) / abs(b) for a, b in zip(r["losses"][3], r["losses"][0])]
                   for r in ranks]
    worst_loss = max(max(d) for d in differences)
    first_apart = min((next((step for step, d in enumerate(rank, 1) if d > LOSS_RTOL), None)
                       for rank in differences), key=lambda s: s or float("inf"))
    first_different = min((next((step for step, d in enumerate(rank, 1) if d > 0), None)
                           for rank in differences), key=lambda s: s or float("inf"))
    growth = {}  # from the first full window to the end: the first step holds compile-time state
    for key in ("live_tensors", "rss_bytes"):
        growth[key] = max(r["samples"][-1][key] - r["samples"][1][key] for r in ranks)
    held_change = max(abs(r["samples"][-1]["held_bytes"][s] - r["samples"][1]["held_bytes"][s])
                      for r in ranks for s in ("3", "0"))
    drift = {}
    for stage in (3, 0):
        first = statistics.median(ranks[0]["seconds"][stage][1:WINDOW + 1])
        last = statistics.median(ranks[0]["seconds"][stage][-WINDOW:])
        drift[stage] = last / first - 1
    compilations = {s: max(r["compilations"][s] for r in ranks) for s in (3, 0)}
    rss_tolerance = 4 * 2 ** 20
    return {
        "losses agree (stage 3 vs 0, relative, worst step)": {
            "measured": f"{worst_loss:.2e} (first differing at step {first_different}, apart by "
                        f"more than the bound from step {first_apart})",
            "bound": LOSS_RTOL, "pass": worst_loss <= LOSS_RTOL},
        "held bytes unchanged": {"measured": held_change, "pass": held_change == 0},
        "live tensors unchanged": {"measured": growth["live_tensors"],
                                   "pass": growth["live_tensors"] <= 0},
        "resident size growth after the first window (bytes)": {
            "measured": growth["rss_bytes"], "bound": rss_tolerance,
            "pass": growth["rss_bytes"] <= rss_tolerance},
        "compilations per step": {"measured": compilations,
                                  "pass": all(c == 1 for c in compilations.values())},
        "step time drift, last vs first 100 steps (median)": {
            "measured": {s: f"{d:+.1%}" for s, d in drift.items()},
            "bound": TIME_DRIFT, "pass": all(abs(d) <= TIME_DRIFT for d in drift.values())},
    }


def summary(result: dict) -> dict:
    """What to commit (a few KB): the verdicts, the memory samples, rank 0's losses every
    10 steps; ``result`` as read back from its JSON."""
    kept = {k: result[k] for k in ("machine", "backend", "world", "steps", "checks")}
    kept["samples"] = [rank["samples"] for rank in result["ranks"]]
    kept["rank0_loss_every_10_steps"] = {
        f"stage {stage}": result["ranks"][0]["losses"][stage][::10] for stage in ("3", "0")}
    return kept


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rank0 = result["ranks"][0]
    fig, (losses, apart, memory) = plt.subplots(1, 3, figsize=(17, 4.5))
    for stage, style in (("0", "-"), ("3", "--")):
        losses.plot(range(1, result["steps"] + 1), rank0["losses"][stage], style,
                    label=f"stage {stage}", linewidth=1)
    losses.set(xlabel="step", ylabel="loss (rank 0)", yscale="log",
               title=f"{result['steps']} steps, stage 3 against stage 0")
    losses.legend()
    apart.plot(range(1, result["steps"] + 1),
               [abs(a - b) / b or float("nan") for a, b in zip(rank0["losses"]["3"],
                                                               rank0["losses"]["0"])],
               linewidth=0.8)
    apart.axhline(LOSS_RTOL, color="red", linestyle=":", label=f"bound {LOSS_RTOL:g}")
    apart.set(xlabel="step", ylabel="|stage 3 - stage 0| / stage 0 (rank 0)", yscale="log",
              title="how far apart the losses are (equal: no point)")
    apart.legend()
    steps = [s["step"] for s in rank0["samples"]]
    for rank, run in enumerate(result["ranks"]):
        memory.plot(steps, [s["rss_bytes"] / 2**20 for s in run["samples"]], marker=".",
                    label=f"resident, rank {rank}")
    memory.plot(steps, [(s["held_bytes"]["3"] + s["held_bytes"]["0"]) / 2**20
                        for s in rank0["samples"]], marker=".", label="held by both steps, rank 0")
    memory.set(xlabel="step", ylabel="MiB", ylim=(0, None),
               title="memory between steps (every 100 steps)")
    memory.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
