"""Compile time of a restart: each model's first call in a new 2-rank job, three times over
([Note: saved steps] in zero_fx/compiler/saved_steps.py):

- ``cold``: empty caches (Inductor's and zero_fx's saved steps);
- ``inductor-warm``: a restart with Inductor's caches warm and saved steps off (dynamo's
  trace, the capture and our passes run again);
- ``warm``: a restart with both warm (the saved step loaded: no capture, no passes);

and, in the cold job, a second model of the same structure in the same process (a new model,
optimizer and ``zero_compile`` of the same function: [Note: one compilation per step
structure] in zero_fx/compiler/reuse.py).

    python -m bench.experiments.warm_restart --models gpt-small gpt2-125m

Each job is ``torchrun --nproc_per_node 2`` of this module with ``--job``, in folders of
its own for both caches; a job trains 3 steps and rank 0 reports its first call, the
losses and a digest of the parameters (the warm jobs must train bitwise like the cold one).
Writes bench/out/warm-restart.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch

from ..helpers.runs import machine, write_json

PHASES = (("cold", True), ("inductor-warm", False), ("warm", True))
"""Each job in order: its name, and whether saved steps are on."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["gpt-small"])
    p.add_argument("--backend", default="inductor")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def job(args) -> None:
    """One rank of one job: 3 steps of the model, then a second model of its structure's
    first call; rank 0 prints one JSON line."""
    import torch.distributed as dist

    from zero_fx import zero_compile
    from ..helpers.runs import join_group, leave_group
    from ..peers.models import MODELS, loss_of, rank_batch

    rank, world = join_group()
    spec = MODELS[args.job]

    def loop(model, opt, x, y):
        loss = loss_of(spec, model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def new_model(seed: int):
        torch.manual_seed(seed)
        model = spec.build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, opt, zero_compile(loop, stage=args.stage, backend=args.backend)

    model, opt, step = new_model(0)
    times, losses = [], []
    for i in range(3):
        x, y = rank_batch(spec, i, rank, world, "cpu")
        start = time.perf_counter()
        losses.append(step(model, opt, x, y).item())
        times.append(time.perf_counter() - start)
    digest = hashlib.sha256()
    with step.gathered_parameters():
        for name, p in model.named_parameters():
            digest.update(name.encode() + p.detach().clone().numpy().tobytes())
    # a second model of the same structure in the same process: a new model, optimizer and
    # zero_compile of the same function
    second_model, second_opt, second_step = new_model(1)
    x, y = rank_batch(spec, 0, rank, world, "cpu")
    start = time.perf_counter()
    second_step(second_model, second_opt, x, y).item()
    second_model_s = time.perf_counter() - start
    if rank == 0:
        print("RESULT " + json.dumps({"first_call_s": round(times[0], 3),
                                      "second_call_s": round(times[1], 3), "losses": losses,
                                      "params": digest.hexdigest()[:16],
                                      "second_model_first_call_s": round(second_model_s, 3),
                                      "second_model_reason": second_step.compilations[0].reason,
                                      "reason": step.compilations[0].reason}), flush=True)
    dist.barrier()
    leave_group()


def run_job(args, model: str, caches: str, saved: bool) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"),
               ZERO_FX_CACHE_DIR=os.path.join(caches, "zero_fx"),
               ZERO_FX_SAVED_STEPS="1" if saved else "0")
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.world}",
               "-m", "bench.experiments.warm_restart", "--job", model, "--backend", args.backend,
               "--stage", str(args.stage)]
    start = time.perf_counter()
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"the {model} job failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    line = next(l for l in out.stdout.splitlines() if l.startswith("RESULT "))
    return dict(json.loads(line[len("RESULT "):]), job_s=round(time.perf_counter() - start, 1))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.job:
        return job(args)
    rows = []
    for model in args.models:
        with tempfile.TemporaryDirectory(prefix="zero_fx-warm-restart-") as caches:
            runs = {}
            for phase, saved in PHASES:
                runs[phase] = run_job(args, model, caches, saved)
                if phase == "cold":
                    files = list(pathlib.Path(caches, "zero_fx").rglob("*.zfx"))
                    saved_bytes = max((f.stat().st_size for f in files), default=0)
                print(f"{model} {phase}: first call {runs[phase]['first_call_s']:.2f} s "
                      f"({runs[phase]['reason']})", flush=True)
        cold = runs["cold"]["first_call_s"]
        rows.append({"model": model, **{p: runs[p] for p, _ in PHASES},
                     "saved_step_bytes_per_rank": saved_bytes,
                     "same_process_over_cold": round(
                         runs["cold"]["second_model_first_call_s"] / cold, 3),
                     "warm_over_cold": round(runs["warm"]["first_call_s"] / cold, 3),
                     "inductor_warm_over_cold": round(runs["inductor-warm"]["first_call_s"] / cold, 3),
                     "bitwise": all(runs[p]["losses"] == runs["cold"]["losses"]
                                    and runs[p]["params"] == runs["cold"]["params"]
                                    for p, _ in PHASES)})
    result = {"machine": machine(), "torch": torch.__version__, "args": vars(args), "rows": rows}
    path = write_json("warm-restart", result)
    for row in rows:
        print(f"{row['model']}: cold {row['cold']['first_call_s']:.2f} s, inductor-warm "
              f"{row['inductor-warm']['first_call_s']:.2f} s ({row['inductor_warm_over_cold']:.0%}), "
              f"warm {row['warm']['first_call_s']:.2f} s ({row['warm_over_cold']:.0%}), "
              f"same process {row['cold']['second_model_first_call_s']:.2f} s "
              f"({row['same_process_over_cold']:.0%}); "
              f"bitwise: {row['bitwise']}; saved step {row['saved_step_bytes_per_rank'] / 1e3:.0f} kB "
              "per rank")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
