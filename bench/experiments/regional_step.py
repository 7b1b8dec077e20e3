"""Step time of stage 3 compiled by regions against the whole-step program, their steps
interleaved in the same ranks.

    torchrun --nproc_per_node 2 -m bench.experiments.regional_step --model gpt2-125m --steps 12
    torchrun --nproc_per_node 2 -m bench.experiments.regional_step --model gpt2-125m --layers 2 --seq 128

Runs started apart on a shared 2-core machine differ by up to ±10 % in step time, more than the
difference looked for. Here both programs train their own copy of the same model in the
same processes, each regional step followed by a whole-program step on the same batch,
every step starting on all ranks together: the ratio of the median steps, and the
spread of the pairs' ratios, compare the two under the same conditions. The losses must
agree (the same training). Writes bench/out/regional-step-<model>[-L<layers>]-w<N>.json
and .md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from ..helpers.runs import join_group, leave_group, machine, rows_of_every_rank, write_json
from ..peers.cli import check_model_options, model_of
from ..peers.models import MODELS, rank_batch
from ..peers.trainers import PEERS, Setting

PROGRAMS = {"regional": "zero_fx-3", "whole": "zero_fx-3-whole"}
"""Each program's peer (bench/peers/trainers.py)."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt2-125m", choices=sorted(MODELS))
    p.add_argument("--layers", type=int, help="the GPT models with this many blocks")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: the model's)")
    p.add_argument("--steps", type=int, default=12, help="timed steps of each program")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first, the first compiles")
    p.add_argument("--backend", default="inductor")
    args = p.parse_args(argv)
    check_model_options(p, args)
    return args


def interleaved_steps(args, rank: int, world: int) -> dict:
    """This rank's step times and losses of each program, steps taken in turn."""
    spec = model_of(args)
    setting = Setting(device=torch.device("cpu"), backend=args.backend, bf16=False)
    trainers = {}
    for program, peer in PROGRAMS.items():
        torch.manual_seed(0)
        trainers[program] = PEERS[peer](spec.build(), spec, setting)
    times = {program: [] for program in PROGRAMS}
    losses = {program: [] for program in PROGRAMS}
    for step in range(args.warmup + args.steps):
        x, y = rank_batch(spec, step, rank, world, setting.device)
        for program, trainer in trainers.items():
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            loss = trainer.step(x, y)
            elapsed = time.perf_counter() - start
            losses[program].append(loss.item())
            if step >= args.warmup:
                times[program].append(elapsed)
        if rank == 0:
            print(f"step {step + 1}/{args.warmup + args.steps}: "
                  + ", ".join(f"{p} {times[p][-1] * 1e3:.0f} ms" if times[p] else f"{p} (untimed)"
                              for p in PROGRAMS), flush=True)
    return {"times": times, "losses": losses}


def summary(ranks: list[dict]) -> dict:
    """Per step the slowest rank's time, per program; the ratio of medians and the pairs'."""
    slowest = {p: [max(ts) for ts in zip(*(r["times"][p] for r in ranks))] for p in PROGRAMS}
    pairs = [a / b for a, b in zip(slowest["regional"], slowest["whole"])]
    medians = {p: statistics.median(ts) for p, ts in slowest.items()}
    losses = ranks[0]["losses"]
    return {"median_step_ms": {p: 1e3 * m for p, m in medians.items()},
            "ratio_of_medians": medians["regional"] / medians["whole"],
            "pair_ratios": pairs,
            "losses": losses,
            "largest_loss_difference": max(abs(a - b) / abs(b) for a, b in
                                           zip(losses["regional"], losses["whole"]))}


def report(args, world: int, result: dict) -> str:
    pairs = sorted(result["pair_ratios"])
    spec = model_of(args)
    return (f"{machine()}; gloo, {world} ranks; {args.model} ({spec.about}; "
            f"{spec.batch_per_rank} x {spec.seq} tokens per rank); "
            f"stage 3, {args.backend}; {args.steps} timed steps of each program, interleaved, "
            f"after {args.warmup}\n\n"
            f"| program | median step ms |\n|---|---|\n"
            + "".join(f"| {p} ({PROGRAMS[p]}) | {ms:.1f} |\n" for p, ms in result["median_step_ms"].items())
            + f"\nregional / whole: {result['ratio_of_medians']:.3f} (medians); pairs from "
              f"{pairs[0]:.3f} to {pairs[-1]:.3f}, median {statistics.median(pairs):.3f}. "
              f"Losses differ by at most {result['largest_loss_difference']:.1e} (relative).\n")


def main(argv=None) -> None:
    args = parse_args(argv)
    rank, world = join_group()
    ranks = rows_of_every_rank(interleaved_steps(args, rank, world))
    if rank == 0:
        result = summary(ranks)
        text = report(args, world, result)
        depth = f"-L{args.layers}" if args.layers else ""
        path = write_json(f"regional-step-{args.model}{depth}-w{world}",
                          {"machine": machine(), "args": vars(args), "ranks": ranks, **result})
        with open(path[:-len(".json")] + ".md", "w") as f:
            f.write(text)
        print("\n" + text + f"\nwritten to {path} (and .md)")
    leave_group()


if __name__ == "__main__":
    main()
