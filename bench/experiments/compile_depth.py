"""Compile time against depth: zero_fx-3 by regions, zero_fx-3 whole, plain torch.compile
and compiled FSDP2, each model depth in one run of ``bench.peers``.

    python -m bench.experiments.compile_depth --layers 2 6 12 24 48           # GPT-2 small's shape, 2 gloo ranks
    python -m bench.experiments.compile_depth --model tiny --layers 2 4 --backend aot_eager   # smoke test

Every peer compiles from an empty Inductor cache in fresh processes (``bench.peers``).
Compile time is what a user waits: the first step minus the median step, for every peer
alike (dynamo's trace and the first call's sharding included); zero_fx's own measure
(capture, passes, lowering) is shown beside it. Sequences are shortened (``--seq``,
default 128) to keep the timed steps short: compile time does not depend on the
sequence length. Writes bench/out/compile-depth-<model>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from ..helpers.runs import OUT, machine, write_json

PEERS = ("zero_fx-3", "zero_fx-3-whole", "torch.compile", "fsdp2-compiled")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt2-125m", choices=["tiny", "gpt-small", "gpt2-125m"])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 6, 12, 24, 48])
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--peers", nargs="+", default=list(PEERS))
    p.add_argument("--report-only", action="store_true",
                   help="rebuild the table from the runs already in bench/out/compile-depth/")
    return p.parse_args(argv)


def run_depth(args, layers: int) -> dict:
    """``{peer: summary}`` of one ``bench.peers`` run at ``layers`` blocks."""
    name = f"compile-depth/{args.model}-L{layers}"
    if args.report_only:
        return _summaries(name)
    command = [sys.executable, "-m", "bench.peers", "--model", args.model, "--layers", str(layers),
               "--seq", str(args.seq), "--world", str(args.world), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--backend", args.backend, "--name", name,
               "--peers", *args.peers]
    print(f"{layers} layers: {' '.join(command[1:])}", flush=True)
    subprocess.run(command, check=False)
    return _summaries(name)


def _summaries(name: str) -> dict:
    with open(os.path.join(OUT, f"{name}.json")) as f:
        return {s["peer"]: s for s in json.load(f)["summaries"]}


def _loss_difference(a: dict, b: dict) -> str:
    """The largest relative difference of two peers' losses over the steps."""
    if not (a and b):
        return "-"
    return f"{max(abs(x - y) / abs(y) for x, y in zip(a['losses'], b['losses'])):.1e}"


def _ratio(a: dict, b: dict, key: str) -> str:
    return f"{a[key] / b[key]:.2f}" if a and b and b[key] else "-"


COMPILE = "first_step_extra_s"
"""The compile time the table compares: the first step beyond a median one."""


def _compile_cell(summary: dict) -> str:
    if not summary:
        return "-"
    own = f" ({summary['compile_s']:.1f})" if summary["peer"].startswith("zero_fx") else ""
    return f"{summary[COMPILE]:.1f}{own}"


def table(runs: dict[int, dict]) -> str:
    peers = [p for p in PEERS if any(p in r for r in runs.values())]
    head = (["layers", *(f"{p} compile s" for p in peers), "zero_fx-3 / torch.compile",
             "zero_fx-3 / zero_fx-3-whole", "step: zero_fx-3 / whole", "peak: zero_fx-3 / whole",
             "losses vs torch.compile (regional, whole)"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for layers, summaries in runs.items():
        get = lambda peer: summaries.get(peer, {})  # noqa: E731
        cells = [str(layers), *(_compile_cell(get(p)) for p in peers),
                 _ratio(get("zero_fx-3"), get("torch.compile"), COMPILE),
                 _ratio(get("zero_fx-3"), get("zero_fx-3-whole"), COMPILE),
                 _ratio(get("zero_fx-3"), get("zero_fx-3-whole"), "median_step_ms"),
                 _ratio(get("zero_fx-3"), get("zero_fx-3-whole"), "peak_mib"),
                 f"{_loss_difference(get('zero_fx-3'), get('torch.compile'))}, "
                 f"{_loss_difference(get('zero_fx-3-whole'), get('torch.compile'))}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    runs = {layers: run_depth(args, layers) for layers in args.layers}
    text = (f"{machine()}; {args.model} at {', '.join(map(str, args.layers))} layers, seq {args.seq}, "
            f"world {args.world}, compiled peers: {args.backend}, empty Inductor caches. Compile s: "
            f"the first step minus the median step (zero_fx's own measure of capture, passes and "
            f"lowering in brackets)\n\n" + table(runs))
    first, last = (12 if 12 in args.layers else args.layers[0]), args.layers[-1]
    ours = [runs[n].get("zero_fx-3") for n in (first, last)]
    if all(ours):
        text += (f"\n\nzero_fx-3 at {last} layers compiles in {ours[1][COMPILE] / ours[0][COMPILE]:.2f}x "
                 f"its time at {first} layers.")
    path = write_json(f"compile-depth-{args.model}", {"machine": machine(), "args": vars(args),
                                                      "runs": runs, "seconds": time.perf_counter() - start})
    with open(path[:-len(".json")] + ".md", "w") as f:
        f.write(text + "\n")
    print("\n" + text + f"\n\nwritten to {path} (and .md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
