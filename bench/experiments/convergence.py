"""Quantized communication's effect on training: loss curves against full precision.

    torchrun --nproc_per_node 4 -m bench.experiments.convergence                 # 300 steps each
    torchrun --nproc_per_node 4 -m bench.experiments.convergence --steps 20      # a quick look
    torchrun --nproc_per_node 4 -m bench.experiments.convergence --warm-start 600  # from past the plateau
    torchrun --nproc_per_node 4 -m bench.experiments.convergence --model gpt2-125m --steps 100

The README example's model (examples/train_gpt.py's defaults: a byte-level GPT of 4
layers, width 128, 4 heads, 32 tokens), or with ``--model gpt2-125m`` GPT-2 small's
shape on windows of ``--seq`` bytes, trains on examples/data/shakespeare.txt, stage 3 on
a 2 x (N/2) ``("replicate", "shard")`` mesh of gloo ranks, once per configuration of
bench/experiments/quantized.py (``CONFIGS``: none, qwZ int8, qgZ int8, both, both with int4
gradients). Every configuration starts from the same weights (``--seed``) and sees the same
batches (random windows, seeded by the step), AdamW at a constant rate; ``--block`` sets
the quantized configurations' ``quantize_block``. ``--warm-start N``: the weights of
``--seed`` trained N steps in fp32 first (``warmed_weights``), and each configuration
starts from those with a fresh optimizer.

For each: the loss of every step (the mean over ranks, which is the global batch's), and
the mean over the last ``--window`` steps against full precision's (passing within
1%, ``BOUND``). Writes ``bench/out/<--name>.json`` and, with matplotlib, the curves
beside it (``.png``); prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import textwrap
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from examples.gpt import GPT, GPTConfig
from zero_fx import QuantizationPolicy

from ..helpers.runs import OUT, join_group, leave_group, machine, write_json
from .quantized import CONFIGS, step_on_mesh
from ..peers.models import MODELS

TEXT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples",
                    "data", "shakespeare.txt")
README_MODEL = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=128)
"""examples/train_gpt.py's defaults (--layers 4 --width 128 --heads 4 --seq 32)."""
CONVERGENCE_MODELS = {"readme": README_MODEL, "gpt2-125m": MODELS["gpt2-125m"].gpt}
"""``--model``: the README example's GPT, or GPT-2 small's shape (124M parameters, its
vocabulary of 50304 of which the bytes use 256, positions up to 1024)."""
DEFAULT_SEQ = {"readme": README_MODEL.block_size, "gpt2-125m": 128}
"""Tokens per window when ``--seq`` is not given: GPT-2's shape trains on 128 of its 1024
positions, so that a step on CPU takes seconds, not half a minute."""
BOUND = 0.01
"""The relative difference of the last steps' mean loss from full precision's that passes."""


def batch(text: torch.Tensor, step: int, size: int, rank: int, world: int,
          seq: int = README_MODEL.block_size):
    """This rank's slice of step ``step``'s global batch: random windows of ``seq`` bytes."""
    generator = torch.Generator().manual_seed(1_000_003 + step)
    starts = torch.randint(0, len(text) - seq - 1, (size,), generator=generator)
    mine = starts[rank * size // world:(rank + 1) * size // world]
    windows = torch.stack([text[s:s + seq + 1] for s in mine.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]


def seeded_model_and_optimizer(args) -> tuple:
    """``args.model`` with the initial weights of ``args.seed``, and a fresh AdamW."""
    torch.manual_seed(args.seed)
    model = GPT(CONVERGENCE_MODELS[args.model])
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)


def next_byte_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def warmed_weights(text: torch.Tensor, args) -> dict:
    """The weights every configuration starts from: seed ``args.seed``'s, trained in fp32
    for ``args.warm_start`` steps on whole global batches of windows none of the measured
    steps sees, in this process (the same on every rank). From scratch, the loss sits on a
    plateau until the model leaves it, and when each run leaves it decides its last
    steps' mean (bench/README, "Quantized communication on a 2 x 2 mesh"); from past the
    plateau, the measured steps compare the training itself."""
    model, opt = seeded_model_and_optimizer(args)
    for step in range(args.warm_start):
        x, y = batch(text, WARM_START_BATCHES + step, args.batch_size, 0, 1, args.seq)
        next_byte_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


WARM_START_BATCHES = 1_000_000
"""The warm start's batches are steps from here on: never one of the measured steps'."""


def train(options: dict, text: torch.Tensor, args, rank: int, world: int,
          initial: dict | None = None) -> list[float]:
    """The global batch's loss at every step of one configuration, from the weights of
    ``args.seed`` or from ``initial`` (with a fresh optimizer)."""
    model, opt = seeded_model_and_optimizer(args)
    if initial is not None:
        model.load_state_dict(initial)
    train_step = step_on_mesh(next_byte_loss, world, options)
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = batch(text, step, args.batch_size, rank, world, args.seq)
        loss = train_step(model, opt, x, y).detach()
        dist.all_reduce(loss)  # SUM, then divide: gloo's AVG sums in some paths
        losses.append(loss.item() / world)
        if rank == 0 and (step + 1) % max(1, args.steps // 10) == 0:
            print(f"  step {step + 1}: loss {losses[-1]:.4f} "
                  f"({time.perf_counter() - start:.0f} s, the first step's compilation included)",
                  flush=True)
    return losses


def compared(curves: dict[str, list[float]], window: int) -> list[dict]:
    """Each configuration's mean over the last ``window`` steps and its relative difference
    from the first (full precision)."""
    base = statistics.mean(next(iter(curves.values()))[-window:])
    rows = []
    for name, losses in curves.items():
        last = statistics.mean(losses[-window:])
        rows.append({"config": name, "last_mean": last, "relative": (last - base) / base,
                     "within_bound": abs(last - base) <= BOUND * base})
    return rows


def markdown(rows: list[dict], window: int) -> str:
    lines = [f"| configuration | mean loss, last {window} steps | against fp32 | within 1% |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['last_mean']:.4f} | {100 * r['relative']:+.2f}% | "
                     f"{'yes' if r['within_bound'] else 'NO'} |")
    return "\n".join(lines)


def plot(curves: dict[str, list[float]], path: str, title: str) -> bool:
    """The curves (a 20-step running mean) as a PNG; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for name, losses in curves.items():
        smooth = [statistics.mean(losses[max(0, i - 19):i + 1]) for i in range(len(losses))]
        axis.plot(range(1, len(losses) + 1), smooth, label=name, linewidth=1)
    axis.set_xlabel("step")
    axis.set_ylabel("training loss (20-step running mean)")
    axis.set_title(textwrap.fill(title, 90), fontsize=8)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True


def describe(args, world: int) -> str:
    cfg = CONVERGENCE_MODELS[args.model]
    title = "the README example's GPT" if args.model == "readme" else "GPT-2 small's shape"
    return (f"{title} ({cfg.n_layer} layers, width {cfg.n_embd}, {args.seq} tokens), stage 3 "
            f"on a 2 x {world // 2} mesh, AdamW lr {args.lr}, global batch {args.batch_size}, "
            f"blocks of {args.block or QuantizationPolicy.block}, weights of seed {args.seed}"
            + (f" trained {args.warm_start} steps in fp32" if args.warm_start else ""))


def write_results(curves: dict[str, list[float]], args, world: int) -> tuple[str, str, bool]:
    """``bench/out/<args.name>.json`` with the curves so far, compared with the first's, and
    the plot beside it: (the JSON's path, the plot's, whether it was drawn)."""
    about = describe(args, world)
    result = {"machine": machine(), "about": about, "steps": args.steps, "window": args.window,
              "bound": BOUND, "compared": compared(curves, args.window), "losses": curves}
    path = write_json(args.name, result)
    picture = os.path.join(OUT, f"{args.name}.png")
    return path, picture, plot(curves, picture, about)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="readme", choices=list(CONVERGENCE_MODELS))
    parser.add_argument("--seq", type=int, default=None,
                        help=f"tokens per window (default: {DEFAULT_SEQ})")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--window", type=int, default=50, help="last steps the loss is averaged over")
    parser.add_argument("--batch-size", type=int, default=16, help="global; split over the ranks")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--block", type=int, default=None,
                        help=f"quantize_block of the quantized configurations (zero_fx's default: "
                             f"{QuantizationPolicy.block})")
    parser.add_argument("--seed", type=int, default=0, help="of the initial weights (the batches stay)")
    parser.add_argument("--warm-start", type=int, default=0,
                        help="steps of fp32 training (eager, in each process) that every "
                             "configuration starts from, on other batches (default 0: from the "
                             "initial weights)")
    parser.add_argument("--name", default="convergence-readme-gpt", help="of the files in bench/out/")
    args = parser.parse_args()
    args.seq = args.seq or DEFAULT_SEQ[args.model]
    if args.seq > CONVERGENCE_MODELS[args.model].block_size:
        parser.error(f"--seq {args.seq} is longer than {args.model}'s "
                     f"{CONVERGENCE_MODELS[args.model].block_size} positions")
    if args.window > args.steps:
        parser.error(f"--window {args.window} is longer than --steps {args.steps}")
    rank, world = join_group()
    if world < 4 or world % 2:
        raise SystemExit("run it on an even number of ranks, 4 or more (torchrun --nproc_per_node 4)")
    if args.batch_size % world:
        parser.error(f"--batch-size {args.batch_size} must split evenly over {world} ranks")
    with open(TEXT, "rb") as file:
        text = torch.frombuffer(bytearray(file.read()), dtype=torch.uint8)
    initial = warmed_weights(text, args) if args.warm_start else None
    curves = {}
    for name in args.configs:
        if rank == 0:
            print(f"{name} ...", flush=True)
        options = dict(CONFIGS[name])
        if options and args.block is not None:
            options["quantize_block"] = args.block
        curves[name] = train(options, text, args, rank, world, initial)
        if rank == 0:  # after each configuration: a run stopped early keeps the curves so far
            path, picture, drawn = write_results(curves, args, world)
    if rank == 0:
        print(f"\n{machine()}; {describe(args, world)}:\n")
        print(markdown(compared(curves, args.window), args.window))
        print(f"\nwritten to {path}" + (f" and {picture}" if drawn else ""))
    leave_group()


if __name__ == "__main__":
    main()
