"""Quantized communication on one GPU: what quantizing costs a rank per step, against the
wire time it saves.

    python -m bench.experiments.quantize_gpu                        # CUDA, GPT-2 125M's shape, fake group of 8
    python -m bench.experiments.quantize_gpu --device cpu --model tiny --backend aot_eager   # anywhere, a look

1. The kernels. ``quantize_rows`` and ``dequantize_rows`` ([Note: quantized blocks on the
   wire] in passes/common/quantized_code.py), each compiled as the step lowers it, on a bucket of
   one block's parameters and on one of the whole model's, 50 calls back to back: the
   microseconds a call keeps the device busy, and GB/s of the bf16 values it reads.
2. The step. Stage 3 in bf16 on a fake process group of 8 in this process: one rank of 8,
   its shapes, kernels and memory real; its collectives move nothing and cost nothing.
   For each configuration, the median step time: its difference from the run without
   quantization is the quantize and dequantize work a rank adds to a step.
3. The cost model's side: the same model planned on fake tensors flat over 32 ranks of
   the ``4x8xh100-ib`` preset, as ``python -m zero_fx.plan --quantize`` prices it: the bytes
   each rank sends per step, the communication seconds, and the step time, for each
   configuration.

Writes bench/out/quantize-gpu-<model>.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time

import torch
import torch.distributed as dist

from examples.gpt import GPT
from zero_fx import MixedPrecision, zero_compile
from zero_fx.passes.common.quantized_code import dequantize_rows, quantize_rows
from zero_fx.planner.models import ModelSource
from zero_fx.planner.working_set import STEADY_FROM
from zero_fx.planner.features.quantization import CONFIGURATIONS, price_quantization
from zero_fx.planner.question import Workload

from ..helpers.runs import machine, write_json
from ..peers.models import MODELS, loss_of, rank_batch

PRESET = "4x8xh100-ib"
PRESET_RANKS = 32
BLOCK = 256


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` after two warm-up calls (the first compiles)."""
    for _ in range(2):
        fn()
    seconds = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def kernel_seconds(fn, device: torch.device, calls: int = 50) -> float:
    """Seconds a call of ``fn`` keeps the device busy: ``calls`` calls back to back, one
    synchronization (on a GPU the launches overlap the work, as in a compiled step)."""
    for _ in range(2):
        fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / calls


def kernel_rows(buckets: dict, world: int, device: torch.device, backend: str) -> list[dict]:
    return [dict(row, bucket=name) for name, numel in buckets.items()
            for row in bucket_kernel_rows(numel, world, device, backend)]


def bucket_kernel_rows(numel: int, world: int, device: torch.device, backend: str) -> list[dict]:
    """Each format's quantize of a rank's shard of a bucket and dequantize of the gathered
    bucket (a weight gather), and quantize of the whole bucket as ``world`` rows (a
    gradient reduction), each compiled on its own."""
    numel -= numel % world
    shard = torch.randn(1, numel // world, device=device, dtype=torch.bfloat16)
    bucket = torch.randn(world, numel // world, device=device, dtype=torch.bfloat16)
    rows = []
    for fmt in ("int8", "int4", "fp8"):
        torch._dynamo.reset()  # three compilations a format; dynamo keeps eight of one function
        quantize = torch.compile(functools.partial(quantize_rows, fmt=fmt, block=BLOCK),
                                 backend=backend, dynamic=False)
        dequantize = torch.compile(functools.partial(dequantize_rows, numel=numel // world,
                                                     fmt=fmt, block=BLOCK, dtype=torch.bfloat16),
                                   backend=backend, dynamic=False)
        gathered = quantize(bucket)
        cases = {"quantize shard (gather)": (lambda: quantize(shard), numel // world),
                 "dequantize bucket (gather)": (lambda: dequantize(gathered), numel),
                 "quantize bucket (reduction)": (lambda: quantize(bucket), numel)}
        for what, (fn, elements) in cases.items():
            seconds = kernel_seconds(fn, device)
            rows.append({"format": fmt, "kernel": what, "elements": elements,
                         "us": 1e6 * seconds, "gb_per_s_of_bf16": 2 * elements / seconds / 1e9})
    return rows


def step_rows(spec, configs, device: torch.device, backend: str, world: int, steps: int) -> list[dict]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        rows = []
        for name in configs:
            print(f"  step: {name} ...", flush=True)
            torch.manual_seed(0)
            model = spec.build().to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

            @zero_compile(stage=3, backend=backend, **CONFIGURATIONS[name],
                          mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
            def train_step(model, opt, x, y):
                loss = loss_of(spec, model, x, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                return loss

            x, y = rank_batch(spec, 0, 0, world, device)
            start = time.perf_counter()
            train_step(model, opt, x, y)
            synchronize(device)
            compile_s = time.perf_counter() - start
            seconds = timed(lambda: train_step(model, opt, x, y), device, repeats=steps)
            report = train_step.traffic()
            rows.append({"config": name, "step_ms": 1e3 * seconds, "first_call_s": compile_s,
                         "sent_bytes_per_rank": report.wire_bytes(),
                         "bytes_by_dtype": report.bytes_by_dtype()})
            del train_step, model, opt
            torch._dynamo.reset()
        return rows
    finally:
        dist.destroy_process_group()


def cost_model_rows(spec, configs) -> list[dict]:
    """The same model priced by the planner (``python -m zero_fx.plan --quantize``) over
    ``PRESET_RANKS`` ranks of ``PRESET``."""
    config = spec.gpt
    source = ModelSource(spec.about, lambda layers: GPT(dataclasses.replace(
        config, n_layer=layers or config.n_layer)), config.n_layer, spec.vocab_size,
        config.block_size)
    workload = Workload(world_size=PRESET_RANKS, stage=3, dtype=torch.bfloat16,
                        batch=spec.batch_per_rank, seq=spec.seq)
    rows = price_quantization(source, workload,
                              hardware=PRESET, steady_from=STEADY_FROM, names=configs)
    return [{"config": row.name, "sent_bytes_per_rank": row.sent_bytes,
             "step_ms": 1e3 * row.step_seconds, "compute_ms": 1e3 * row.compute_seconds,
             "communication_ms": 1e3 * row.communication_seconds} for row in rows]


def markdown(measured: list[dict], modelled: list[dict], world: int) -> str:
    base, model_base = measured[0], modelled[0]
    lines = [f"| configuration | step here, one rank of {world} (ms) | added by quantizing (ms) | "
             f"sent / rank ({PRESET_RANKS} ranks) | {PRESET}: communication ms | "
             f"{PRESET}: compute ms | {PRESET}: step ms |", "|---|---|---|---|---|---|---|"]
    for m, c in zip(measured, modelled):
        lines.append(f"| {m['config']} | {m['step_ms']:.2f} | {m['step_ms'] - base['step_ms']:+.2f} | "
                     f"{c['sent_bytes_per_rank'] / 2**20:.1f} MiB "
                     f"({c['sent_bytes_per_rank'] / model_base['sent_bytes_per_rank']:.2f}×) | "
                     f"{c['communication_ms']:.2f} | {c['compute_ms']:.2f} | {c['step_ms']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2-125m", choices=sorted(MODELS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--world", type=int, default=8, help="ranks of the fake group")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per configuration")
    parser.add_argument("--configs", nargs="+", default=["none", "qwZ + qgZ int8",
                                                         "qwZ int8 + qgZ int4"],
                        choices=list(CONFIGURATIONS))
    args = parser.parse_args()
    if args.configs[0] != "none":
        parser.error("the first configuration is the baseline: none")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("torch sees no CUDA device; --device cpu runs it on the CPU")
    spec = MODELS[args.model]
    if spec.gpt is None:
        raise SystemExit("--model takes one of the GPT models (tiny, gpt-small, gpt2-125m)")
    model = spec.build()
    buckets = {"one block": sum(p.numel() for p in model.blocks[0].parameters()),
               "whole model": sum(p.numel() for p in model.parameters())}
    print(f"{machine()}; {spec.about}; kernels on buckets of {buckets} elements ...", flush=True)
    kernels = kernel_rows(buckets, args.world, device, args.backend)
    measured = step_rows(spec, args.configs, device, args.backend, args.world, args.steps)
    print(f"  cost model: {PRESET} over {PRESET_RANKS} ranks ...", flush=True)
    modelled = cost_model_rows(spec, args.configs)
    result = {"machine": machine(), "device": (torch.cuda.get_device_name(device)
                                               if device.type == "cuda" else "cpu"),
              "model": args.model, "about": spec.about, "backend": args.backend,
              "fake_world": args.world, "block": BLOCK, "kernels": kernels,
              "steps": measured, "cost_model": {"preset": PRESET, "ranks": PRESET_RANKS,
                                                "rows": modelled}}
    path = write_json(f"quantize-gpu-{args.model}", result)
    print("\n| bucket | format | kernel | elements | µs | GB/s of bf16 |\n|---|---|---|---|---|---|")
    for k in kernels:
        print(f"| {k['bucket']} | {k['format']} | {k['kernel']} | {k['elements']} | {k['us']:.1f} | "
              f"{k['gb_per_s_of_bf16']:.0f} |")
    print()
    print(markdown(measured, modelled, args.world))
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
