"""Quantized communication on a (replicate, shard) mesh: the bytes each rank sends, measured.

    torchrun --nproc_per_node 4 -m bench.experiments.quantized                  # 2 x 2 mesh, GPT-2 125M's shape
    torchrun --nproc_per_node 4 -m bench.experiments.quantized --model tiny --steps 3

For each configuration (none, ``quantize_weights="int8"``, ``quantize_gradients="int8"``,
both, both with int4 gradients, ``secondary_partition=True`` alone and with int8 both ways),
stage 3 over a 2 x 2 ``("replicate", "shard")`` mesh of
gloo ranks trains the model a few AdamW steps and records, per rank, the bytes it sent
per step as the kernel counted them (``wchar``, [Note: counting gloo's bytes on the wire]
in bench/helpers/wire.py; median over the timed steps), the ring figure ``traffic().wire_bytes()``,
the bytes by dtype, the median step time and the losses. Writes
``bench/out/quantized-<model>.json`` and prints a Markdown table (rank 0's figures; every
rank of a mesh sends the same). aot_eager: the figures compare configurations on this run;
the step time on a 2-core CPU is not a speed claim.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from zero_fx import zero_compile
from zero_fx.planner.features.quantization import CONFIGURATIONS, SECONDARY_CONFIGURATIONS

from ..helpers import wire
from ..helpers.runs import join_group, leave_group, machine, rows_of_every_rank, write_json
from ..peers.models import MODELS, loss_of, rank_batch

CONFIGS = {"fp32" if name == "none" else name: options
           for name, options in CONFIGURATIONS.items()} | {
    name: {**options, "secondary_partition": True}
    for name, options in SECONDARY_CONFIGURATIONS.items()}
"""The planner's configurations (zero_fx/planner/features/quantization.py), the unquantized one named
by what these benchmarks train in; hpZ's with the mesh's "shard" dimension as the node."""


def step_on_mesh(loss_of_batch, world: int, options: dict):
    """The training step these benchmarks compile: ``loss_of_batch(model, x, y)``, its
    backward and the optimizer's step, at stage 3 on a 2 x (world / 2) ``("replicate",
    "shard")`` mesh, with ``options`` (a configuration of ``CONFIGS``)."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))

    @zero_compile(stage=3, backend="aot_eager", mesh=mesh, **options)
    def train_step(model, opt, x, y):
        loss = loss_of_batch(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return train_step


def measure(name: str, options: dict, spec, rank: int, world: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = spec.build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step = step_on_mesh(functools.partial(loss_of, spec), world, options)
    losses, sent, seconds = [], [], []
    for step in range(steps):
        x, y = rank_batch(spec, step, rank, world, "cpu")
        dist.barrier()
        before, start = wire.bytes_sent(), time.perf_counter()
        losses.append(train_step(model, opt, x, y).item())
        seconds.append(time.perf_counter() - start)
        sent.append(wire.bytes_sent() - before)
    report = train_step.traffic()
    return {"config": name, "options": options, "losses": losses,
            "sent_bytes_per_step": statistics.median(sent[1:]),
            "ring_bytes_per_step": report.wire_bytes(),
            "ring_bytes_by_group": report.wire_bytes_by_group(),
            "bytes_by_dtype": report.bytes_by_dtype(),
            "step_seconds": statistics.median(seconds[1:]), "psi": report.psi}


def markdown(rows: list[dict]) -> str:
    base = rows[0]
    lines = ["| configuration | sent / rank / step (gloo) | ring figure (traffic()) | "
             "step s (median) | last loss |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['sent_bytes_per_step'] / 2**20:.1f} MiB "
                     f"({r['sent_bytes_per_step'] / base['sent_bytes_per_step']:.2f}×) | "
                     f"{r['ring_bytes_per_step'] / 2**20:.1f} MiB "
                     f"({r['ring_bytes_per_step'] / base['ring_bytes_per_step']:.2f}×) | "
                     f"{r['step_seconds']:.2f} | {r['losses'][-1]:.5f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2-125m", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=4, help="per configuration: 1 compiles, the rest are timed")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--name", default=None,
                        help="the output's name in bench/out (default quantized-MODEL)")
    args = parser.parse_args()
    rank, world = join_group()
    if world < 4 or world % 2:
        raise SystemExit("run it on an even number of ranks, 4 or more (torchrun --nproc_per_node 4)")
    spec = MODELS[args.model]
    rows = []
    for name in args.configs:
        if rank == 0:
            print(f"{name} ...", flush=True)
        rows.append(measure(name, CONFIGS[name], spec, rank, world, args.steps))
    everyone = rows_of_every_rank(rows)
    if rank == 0:
        result = {"machine": machine(), "world_size": world, "mesh": [2, world // 2],
                  "model": args.model, "about": spec.about, "steps": args.steps,
                  "ranks": everyone}
        path = write_json(args.name or f"quantized-{args.model}", result)
        print(f"\n{result['machine']}; stage 3 on a 2 x {world // 2} (replicate, shard) mesh of "
              f"gloo ranks; {spec.about}; rank 0:\n")
        print(markdown(rows))
        print(f"\nwritten to {path}")
    leave_group()


if __name__ == "__main__":
    main()
