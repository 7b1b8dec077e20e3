"""Starting one peer of ``python -m bench.peers`` in fresh processes and reading its rows back:
all its ranks from here (``launch_peer``), or, under torchrun, this rank's (``launch_peer_here``)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading

from examples.progress import Progress

from ..helpers.runs import free_port, rows_of_every_rank

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PEER_LIMIT_S = 3600
"""``--peer-limit-s``'s default: a peer still running after this is stuck, not slow (GPT-2
125M takes 16-40 minutes on 2 CPU cores for every peer together): killed with its ranks,
and reported as failed."""


def peer_environment(args) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, "bench", "out", "torch_extensions"))
    if args.device == "cpu":
        env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(args.world, 1))))
    return env


def launch_peer(args, peer: str, argv: list[str]) -> tuple[list | None, str]:
    """Run one peer in fresh processes (torchrun, or one process with ``--fake-world``),
    echoing its step lines as they come; its rows, or None and why."""
    logs = os.path.join(ROOT, "bench", "out", "peer-logs")
    os.makedirs(logs, exist_ok=True)
    log = os.path.join(logs, f"{args.model}-{peer}.log")
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "rows.json")
        tail = ["-m", "bench.peers", *argv, "--worker-of", peer, "--result-file", result]
        if args.fake_world:
            command = [sys.executable, *tail]
        else:
            command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                       "--nproc_per_node", str(args.world), "--master_addr", "127.0.0.1",
                       "--master_port", str(free_port()), *tail]
        env = _fresh_environment(args, tmp)
        lines = []
        # on a terminal, the start-up and first step as a phase, then a bar; else the step lines
        progress = Progress(args.steps, label=f"  {peer}: ", first="starting, compiling if compiled")
        step_line = re.compile(rf"\s*{re.escape(peer)}: step \d+/\d+ (.*)")
        with open(log, "w") as out, subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, start_new_session=True) as process:  # torchrun and ranks: one group
            watchdog = threading.Timer(args.peer_limit_s, os.killpg,
                                       (process.pid, signal.SIGKILL))
            watchdog.start()
            if progress.terminal:
                progress.begin()
            for line in process.stdout:
                out.write(line)
                lines.append(line.rstrip("\n"))
                if (step := step_line.match(line)) and progress.terminal:
                    progress.update(step.group(1))
                elif step:
                    print(line, end="", flush=True)
            progress.close()
        watchdog.cancel()
        ranks = 1 if args.fake_world else args.world
        files = [f"{result}.{rank}" for rank in range(ranks)]
        if process.returncode != 0 or not all(os.path.exists(f) for f in files):
            why = _first_error(lines)
            if process.returncode == -signal.SIGKILL:
                why = (f"killed: still running after {args.peer_limit_s:g} s (--peer-limit-s); "
                       "its last lines:\n" + "\n".join(lines[-20:]))
            return None, f"{why}\n(whole log: {os.path.relpath(log, ROOT)})"
        rows = []
        for name in files:
            with open(name) as f:
                rows.append(json.load(f))
        return rows, ""


def launch_peer_here(args, peer: str, argv: list[str], index: int) -> tuple[list | None, str]:
    """Under torchrun, which started this script once per rank: this rank's process of
    ``peer``, fresh, in a process group of the peer's own (over torchrun's store, its keys
    prefixed by the peer); every rank's rows, or None and each failed rank's reason.
    A collective over the launcher's group: call it on every rank."""
    rank = int(os.environ["RANK"])
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "rows.json")
        command = [sys.executable, "-m", "bench.peers", *argv, "--worker-of", peer,
                   "--result-file", result, "--store-prefix", f"bench.peers/{index}/{peer}"]
        # its output is this rank's: torchrun's (rank 0 prints the step lines)
        try:
            code = subprocess.run(command, cwd=ROOT, env=_fresh_environment(args, tmp),
                                  timeout=args.peer_limit_s).returncode
        except subprocess.TimeoutExpired:
            code = f"none: killed, still running after {args.peer_limit_s:g} s (--peer-limit-s)"
        row, why = None, f"rank {rank}: exit code {code}, no row (its output is above)"
        if code == 0 and os.path.exists(f"{result}.{rank}"):
            with open(f"{result}.{rank}") as f:
                row, why = json.load(f), ""
    everyone = rows_of_every_rank((row, why))
    if any(row is None for row, _ in everyone):
        return None, "\n".join(why for row, why in everyone if row is None)
    return [row for row, _ in everyone], ""


def _fresh_environment(args, tmp: str) -> dict:
    env = peer_environment(args)
    if not args.warm_cache:  # every peer compiles from scratch, as on a user's first run
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")
    return env


def _first_error(lines: list[str]) -> str:
    """The first traceback of any rank in a torchrun log, or its last lines."""
    start = next((i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line),
                 None)
    if start is None:
        return "\n".join(lines[-20:])
    prefix = lines[start].split("Traceback")[0]
    block = [lines[start]]
    for line in lines[start + 1:]:
        if not line.startswith(prefix):
            break
        block.append(line)
        if line[len(prefix):][:1] not in (" ", "") and len(block) > 1:
            break
    return "\n".join(block[-30:])
