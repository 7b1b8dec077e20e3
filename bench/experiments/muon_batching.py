"""Muon's Newton-Schulz batched by shape against torch.optim.Muon's per-matrix loop, on one
rank's share of a GPT's hidden matrices ([Note: Newton-Schulz batched by shape] in
zero_fx/runtime/update/batched_muon.py).

    python -m bench.experiments.muon_batching                      # gpt-small (width 320), 6 blocks, 2 ranks
    python -m bench.experiments.muon_batching --width 768 --blocks 12 --ranks 8 --device cuda

Each block holds the four matrices of a GPT block (qkv 3d x d, proj d x d, fc 4d x d, mlp proj
d x 4d); the owners' groups deal each rank one of each per N blocks, so a rank steps
``blocks / ranks`` of each. Both optimizers step the same matrices and gradients; the result
is the least of ``--repeats`` steps each, and whether the two ended bit for bit equal. Writes
bench/out/muon-batching.json.
"""

from __future__ import annotations

import argparse
import time

import torch

from zero_fx.runtime.update.batched_muon import ShapesBatched, batched_by_shape

from ..helpers.runs import machine, write_json


def _seconds(opt: torch.optim.Optimizer, batched: bool, device: str) -> float:
    start = time.perf_counter()
    if batched:
        with batched_by_shape(ShapesBatched()):
            opt.step()
    else:
        opt.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=320)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    d = args.width
    shapes = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * max(1, args.blocks // args.ranks)
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(*s, generator=generator) * 0.02 for s in shapes]
    grads = [torch.randn(*s, generator=generator) for s in shapes]
    runs = {}
    for batched in (False, True):
        params = [torch.nn.Parameter(v.clone().to(args.device)) for v in values]
        for p_, g in zip(params, grads):
            p_.grad = g.to(args.device)
        opt = torch.optim.Muon(params, lr=0.02)
        runs[batched] = (min(_seconds(opt, batched, args.device) for _ in range(args.repeats)),
                         params)
    equal = all(torch.equal(a, b) for a, b in zip(runs[False][1], runs[True][1]))
    result = {"machine": machine(), "device": args.device, "width": d, "matrices": len(shapes),
              "torch_loop_ms": runs[False][0] * 1e3, "batched_ms": runs[True][0] * 1e3,
              "bit_for_bit": equal}
    print(f"{len(shapes)} matrices of width {d} on {args.device}: torch's loop "
          f"{result['torch_loop_ms']:.1f} ms, batched by shape {result['batched_ms']:.1f} ms "
          f"a step (least of {args.repeats}); bit for bit: {equal}")
    print("written to", write_json("muon-batching", result))
    return result


if __name__ == "__main__":
    main()
