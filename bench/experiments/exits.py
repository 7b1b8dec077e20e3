"""Run the README example under torchrun many times and count the runs that did not exit 0.

    python -m bench.experiments.exits --runs 50                 # aot_eager, 2 ranks
    python -m bench.experiments.exits --runs 10 -- --stage 1    # arguments after -- go to the example

A rank that crashes at interpreter exit (after its last step printed) turns the whole
torchrun job non-zero, so this counts what a user's scheduler would see. Each failing
run's output is kept under --out for its backtrace.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "examples", "train_gpt.py")

RUN_LIMIT_S = 600
"""A run still going after this is stuck (one takes about 30 s on the 2-core box): killed,
and counted as a failure."""


def _run(command: list[str]) -> tuple[int | str, str]:
    """Exit code (or "timeout") and output of one run; a stuck run is killed with its ranks."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as process:  # torchrun and its ranks: one group
        try:
            output = process.communicate(timeout=RUN_LIMIT_S)[0]
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            return "timeout", process.communicate()[0]
    return process.returncode, output


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", default="bench/out/exits")
    parser.add_argument("example_args", nargs="*", help="after --: passed to the example")
    args = parser.parse_args(argv)
    example_args = args.example_args or ["--backend", "aot_eager"]
    os.makedirs(args.out, exist_ok=True)
    failures = []
    started = time.monotonic()
    for run in range(1, args.runs + 1):
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                   str(args.nproc), EXAMPLE, *example_args]
        code, output = _run(command)
        if code != 0:
            path = os.path.join(args.out, f"run{run}.txt")
            with open(path, "w") as f:
                f.write(output)
            failures.append({"run": run, "exit": code, "output": path})
        print(f"run {run}/{args.runs}: exit {code} "
              f"({len(failures)} failed so far, {time.monotonic() - started:.0f} s)", flush=True)
    summary = {"command": " ".join(["torchrun", "--nproc_per_node", str(args.nproc),
                                    "examples/train_gpt.py", *example_args]),
               "runs": args.runs, "exited_0": args.runs - len(failures), "failures": failures}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"{summary['exited_0']} of {args.runs} runs exited 0")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
