"""Compile time of steps of one structure in one process: the first model's first call, then
further models built alike (new model, new optimizer, new ``zero_compile``), with the kept
compilations ([Note: one compilation per step structure] in zero_fx/compiler/reuse.py) and,
for comparison, with them dropped before each model.

    python -m bench.experiments.compile_reuse                                  # one process
    torchrun --nproc_per_node 2 -m bench.experiments.compile_reuse             # 2 gloo ranks
    python -m bench.experiments.compile_reuse --backend aot_eager --models 3

A model's time is its first call (dynamo's trace, the capture, our passes, the lowering and
the first run); its second call is timed too, as the steady step. Rank 0 writes
bench/out/compile-reuse-<backend>.json.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..helpers.runs import machine, write_json


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--models", type=int, default=3, help="models built alike, one after another")
    return p.parse_args(argv)


def _step(model, opt, x, y):
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _times(args, keep: bool) -> list[dict]:
    from zero_fx import zero_compile
    from zero_fx.compiler import reuse
    from zero_fx.models import GPT, GPTConfig

    rows = []
    x = torch.randint(0, 512, (4, 64))
    for i in range(args.models):
        if not keep:
            reuse.forget_all()
        torch.manual_seed(i)
        model = GPT(GPTConfig(n_layer=args.layers, n_embd=args.width, n_head=4, vocab_size=512,
                              block_size=64, bias=False))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = zero_compile(_step, stage=args.stage, backend=args.backend)
        times = []
        for _ in range(2):
            start = time.perf_counter()
            step(model, opt, x, torch.roll(x, -1, 1)).item()
            times.append(time.perf_counter() - start)
        rows.append({"model": i, "first_call_s": round(times[0], 3),
                     "second_call_s": round(times[1], 3),
                     "reason": step.compilations[0].reason})
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    kept = _times(args, keep=True)
    dropped = _times(args, keep=False)
    if rank == 0:
        result = {"machine": machine(), "torch": torch.__version__, "args": vars(args),
                  "world": dist.get_world_size() if dist.is_initialized() else 1,
                  "kept": kept, "dropped": dropped}
        path = write_json(f"compile-reuse-{args.backend}", result)
        for label, rows in (("kept", kept), ("dropped", dropped)):
            print(label + ": " + ", ".join(f"model {r['model']} {r['first_call_s']:.2f} s"
                                           for r in rows))
        print(f"wrote {path}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
