"""The optimizer's update alone: AdamW's three implementations in torch.optim (a loop of
element-wise ops per tensor, ``foreach=True``, ``fused=True``) on a bench model's
parameters, stepped whole and bucket by bucket as the update in the graph steps them.

    python -m bench.experiments.optimizer_kernels --model gpt-small             # CPU, one thread
    python -m bench.experiments.optimizer_kernels --model gpt2-125m --device cuda

The update in the graph ([Note: the update in the graph] in zero_fx/runtime/update/graph_update.py)
calls the user's optimizer on each bucket's shards, with its settings: this says what
choosing ``fused=True`` saves, and what splitting one update into buckets costs. The
buckets here are runs of parameters of at most ``--bucket-mib`` each, in the model's order
(the graph's are in the backward's order: the cost per call is the same). Writes
bench/out/optimizer-kernels-<model>-<device>.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from zero_fx.plan.build import PlanOptions, PlanRanks, plan_for_module
from zero_fx.runtime.update.graph_update import step_on

from ..helpers.runs import machine, write_json
from ..peers.models import MODELS

IMPLEMENTATIONS = {"torch's default": {}, "foreach=True": {"foreach": True},
                   "fused=True": {"fused": True}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt-small", choices=sorted(MODELS))
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--bucket-mib", type=float, default=16.0,
                   help="the most bytes of parameters in one bucket (zero_fx's stage-3 default)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (the median is reported)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (a rank's share: 1 for 2 ranks on the 2-core box)")
    return p.parse_args(argv)


def buckets_of(model: torch.nn.Module, bucket_bytes: int) -> list[list[torch.Tensor]]:
    """The model's trainable parameters cut into buckets as zero_fx's passes cut them
    (``ShardPlan.buckets``: runs of at most ``bucket_bytes``, whole parameters, one dtype
    each), in the model's order."""
    plan = plan_for_module(model, PlanRanks(world_size=1),
                           PlanOptions(stage=3, bucket_bytes=bucket_bytes))
    params = dict(model.named_parameters())
    trainable = [layout.name for layout in plan.params if layout.requires_grad]
    return [[params[name] for name in bucket] for bucket in plan.buckets(trainable)]


def step_seconds(params: list[torch.Tensor], options: dict, buckets, steps: int,
                 device: torch.device) -> float:
    """The median time of one update of every parameter: ``step()`` over all of them, or
    (``buckets``) once per bucket, narrowed to it as the update in the graph narrows it
    (``step_on``)."""
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, **options)
    times = []
    for i in range(steps + 2):  # the first two make the state, untimed
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        if buckets is None:
            opt.step()
        for bucket in buckets or ():
            step_on(opt, bucket, opt.step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    with torch.device(device):
        model = MODELS[args.model].build()
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    buckets = buckets_of(model, int(args.bucket_mib * 2 ** 20))
    psi = sum(p.numel() for p in params)
    rows = []
    for name, options in IMPLEMENTATIONS.items():
        whole = step_seconds(params, options, None, args.steps, device)
        bucketed = step_seconds(params, options, buckets, args.steps, device)
        rows.append({"implementation": name, "whole_ms": 1e3 * whole,
                     "per_bucket_ms": 1e3 * bucketed})
        print(f"  {name}: {1e3 * whole:.1f} ms whole, {1e3 * bucketed:.1f} ms in "
              f"{len(buckets)} buckets", flush=True)
    describe = (f"{machine()}; {args.device}"
                + (f", {args.threads} thread(s)" if args.device == "cpu" else "")
                + f"; {args.model}: {psi / 1e6:.1f}M parameters in {len(params)} tensors, "
                f"{len(buckets)} buckets of at most {args.bucket_mib:g} MiB; AdamW, fp32; "
                f"median of {args.steps} updates")
    table = ["| AdamW | whole update, one step() | per bucket, one step() each |",
             "|---|---|---|"]
    table += [f"| {r['implementation']} | {r['whole_ms']:.1f} ms | {r['per_bucket_ms']:.1f} ms |"
              for r in rows]
    text = describe + "\n\n" + "\n".join(table)
    name = f"optimizer-kernels-{args.model}-{args.device}"
    path = write_json(name, {"machine": machine(), "description": describe, "args": vars(args),
                             "buckets": len(buckets), "psi": psi, "rows": rows})
    with open(path[:-len(".json")] + ".md", "w") as f:
        f.write(text + "\n")
    print("\n" + text + f"\n\nwritten to {path} (and .md)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
