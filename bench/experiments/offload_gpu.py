"""Offload on one GPU: the largest GPT a device budget trains without offload, and with
``offload="optimizer"``; step time, tokens/s and the CUDA peak of each.

    python -m bench.experiments.offload_gpu                         # a 12 GiB budget of the GPU, 40 GB of host
    python -m bench.experiments.offload_gpu --device-gib 0         # the whole GPU (minutes per size)

The budget caps PyTorch's allocator (``torch.cuda.set_per_process_memory_fraction``) and
is the ``device_memory`` zero_fx chooses by, so a large GPU stands for a smaller one and a
run fits a few minutes. Each mode's size comes from the planner's ``largest_model``
(model states only, [Note: planning offload] in zero_fx/planner/features/offload.py) at ``--margin``
of it, in layers of width ``--width``; a size that runs out of memory is retried a fifth
smaller, up to ``--tries`` times. The model is built on the meta device and each rank's
shards materialized by zero_fx (``init_fn``), as a model too large for the device must be;
stage 3, bf16 compute with fp32 masters and AdamW, ``recompute="blocks"``, Inductor.

Writes bench/out/offload-gpu.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
import torch.nn.functional as F

from examples.gpt import GPT, GPTConfig
from zero_fx import MixedPrecision, zero_compile
from zero_fx.planner.features.offload import largest_model

from ..helpers.runs import machine, write_json

VOCAB = 50304
ADAM_STATE_BYTES = 8
BF16_BYTES = 2


def config_of(params: float, width: int, seq: int) -> GPTConfig:
    """The deepest GPT of ``width`` with at most ``params`` parameters (one block at least)."""
    per_block = 12 * width * width
    layers = max(1, int((params - VOCAB * width - seq * width) // per_block))
    return GPTConfig(vocab_size=VOCAB, block_size=seq, n_layer=layers, n_head=width // 128,
                     n_embd=width, bias=False)


def train(cfg: GPTConfig, mode: str, budget: int, batch: int, steps: int, backend: str,
          device=torch.device("cuda", 0)) -> dict:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    offload = {} if mode == "none" else {"offload": mode, "device_memory": budget}

    @zero_compile(stage=3, backend=backend, init_fn=GPT._init_weights, recompute="blocks",
                  mixed_precision=MixedPrecision(param_dtype=torch.bfloat16), **offload)
    def train_step(model, opt, x, y):
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (batch, cfg.block_size + 1), generator=g).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    start = time.perf_counter()
    losses = [train_step(model, opt, x, y).item()]
    first = time.perf_counter() - start
    torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for _ in range(steps):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        losses.append(train_step(model, opt, x, y).item())
        seconds.append(time.perf_counter() - start)
    step_s = statistics.median(seconds)
    explained = [line.strip() for line in str(train_step.explain()).splitlines()
                 if line.strip().startswith(("offload:", "optimizer step:"))]
    return {"mode": mode, "params": params, "layers": cfg.n_layer, "width": cfg.n_embd,
            "tokens_per_step": batch * cfg.block_size, "first_call_s": first,
            "step_s": step_s, "tokens_per_s": batch * cfg.block_size / step_s,
            "cuda_peak_bytes": torch.cuda.max_memory_allocated(device),
            "tflops": 8 * params * batch * cfg.block_size / step_s / 1e12,  # recompute: 4 passes
            "losses": losses, "explain": explained}


def largest_that_runs(mode: str, args, budget: int, host: int) -> dict:
    """The planner's largest model for ``mode`` at ``args.margin``, a fifth smaller after
    each size that runs out of device memory."""
    psi, bound = largest_model(3, 1, mode, optimizer_bytes=ADAM_STATE_BYTES,
                               param_bytes=BF16_BYTES, device_memory=budget, host_memory=host)
    params = args.margin * psi
    failures = []
    for _ in range(args.tries):
        cfg = config_of(params, args.width, args.seq)
        print(f"  {mode}: {cfg.n_layer} layers of width {cfg.n_embd} (planner: {psi / 1e9:.2f}B "
              f"fit, bound by the {bound}) ...", flush=True)
        try:
            row = train(cfg, mode, budget, args.batch, args.steps, args.backend)
            row.update(planner_params=psi, planner_bound=bound, out_of_memory=failures)
            return row
        except torch.OutOfMemoryError as error:
            failures.append({"layers": cfg.n_layer, "error": str(error).split("\n")[0]})
            print(f"    out of memory: {failures[-1]['error'][:160]}", flush=True)
        finally:
            gc.collect()
            torch._dynamo.reset()
            torch.cuda.empty_cache()
        params *= 0.8
    return {"mode": mode, "planner_params": psi, "planner_bound": bound, "out_of_memory": failures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device-gib", type=float, default=12.0,
                        help="the device budget in GiB (0: the whole GPU)")
    parser.add_argument("--host-gb", type=float, default=40.0,
                        help="host memory the offloaded state may fill, GB")
    parser.add_argument("--modes", nargs="+", default=["none", "optimizer"],
                        choices=["none", "optimizer", "parameters"])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the first call")
    parser.add_argument("--margin", type=float, default=0.75,
                        help="share of the planner's largest model (activations, workspace)")
    parser.add_argument("--tries", type=int, default=3)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("torch sees no CUDA device: this benchmark measures a GPU")
    total = torch.cuda.get_device_properties(0).total_memory
    budget = total if args.device_gib <= 0 else min(total, int(args.device_gib * 2**30))
    torch.cuda.set_per_process_memory_fraction(budget / total, 0)
    print(f"{machine()}, {torch.cuda.get_device_name(0)}: a budget of {budget / 2**30:.1f} GiB "
          f"of {total / 2**30:.1f}", flush=True)
    rows = [largest_that_runs(mode, args, budget, int(args.host_gb * 1e9)) for mode in args.modes]
    result = {"machine": machine(), "device": torch.cuda.get_device_name(0),
              "budget_bytes": budget, "device_bytes": total, "host_bytes": args.host_gb * 1e9,
              "seq": args.seq, "batch": args.batch, "rows": rows}
    path = write_json("offload-gpu", result)
    print("\n| offload | parameters | layers | step s | tokens/s | TFLOP/s, recompute counted | CUDA peak | "
          "first call s |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "step_s" not in r:
            print(f"| {r['mode']} | – | out of memory at every size tried | | | | | |")
            continue
        print(f"| {r['mode']} | {r['params'] / 1e9:.2f}B | {r['layers']} | {r['step_s']:.3f} | "
              f"{r['tokens_per_s']:.0f} | {r['tflops']:.0f} | {r['cuda_peak_bytes'] / 2**30:.2f} GiB | "
              f"{r['first_call_s']:.1f} |")
    for r in rows:
        for line in r.get("explain", []):
            print(f"{r['mode']}: {line}")
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
