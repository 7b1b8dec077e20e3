"""zero_fx against DDP, FSDP2, DeepSpeed ZeRO and plain torch.compile: same model, same
batches, same steps, one run.

    python -m bench.peers --model gpt-small --world 2          # CPU, gloo, 2 ranks per peer
    python -m bench.peers --model gpt2-125m --world 8 --bf16   # a CUDA machine: NCCL
    python -m bench.peers --model gpt2-125m --fake-world 8     # one process simulating 8 ranks
    python -m bench.peers --model gpt-1b --fake-world 8 --bf16 --peers zero_fx-3 fsdp2   # one GPU
    python -m bench.peers --model gpt-small --world 2 --optimizer muon   # Muon + AdamW
    torchrun --nproc_per_node 8 -m bench.peers --model gpt2-125m --bf16   # a launcher of yours

Each peer runs in fresh processes (``torchrun`` started by this script; under a
torchrun of yours, one started by each rank), so one peer's compiled code,
caches and memory cannot leak into the next one's numbers. Per peer it reports: the step time (the slowest rank's, median, min and
max over the timed steps after warm-up), tokens/s per rank and MFU (GPT models on a
GPU: bench/helpers/mfu.py), the peak and the held bytes of the
allocator per rank (CUDA's statistics, or on CPU the counting allocator of
bench/helpers/cpu_memory.py: the same meter for everyone), the host's enqueue time of a
step with the device held busy (bench/helpers/host_enqueue.py), the first step's time and
the compile time (zero_fx's own measurement, for the others first step minus
median step), the bytes each rank sent per step (gloo, bench/helpers/wire.py) and the
losses. All peers must agree on the losses (the run fails otherwise: that is
what shows they trained the same thing); with ``--fake-world`` on the steps whose losses the
fake group leaves shared ([Note: losses under the fake process group] in fake_group.py).
A peer that fails or outlives ``--peer-limit-s`` is reported as failed, with its error, and
the others still run; the exit status is then 1. Writes bench/out/peers-<model>-w<N>.json
(every column, the versions, the device, the MFU formula and peak) and .md. DeepSpeed is
optional (``pip install -e ".[bench]"``); without it its rows are skipped with a note.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from zero_fx.runtime.distributed.init_distributed import DistributedSetupError, resolve_device

from ..helpers import cpu_memory
from ..helpers.runs import GROUP_TIMEOUT, machine, write_json
from ..helpers.mfu import FORMULA as MFU_FORMULA
from . import fake_group
from . import report as peers_report
from .launch import PEER_LIMIT_S, launch_peer, launch_peer_here, peer_environment
from .models import MODELS, BenchModel
from .optimizers import MUON_ITERATIONS, OPTIMIZERS
from .trainers import MOE_ONLY_PEERS, OPTIONAL_PEERS, PEERS, REFERENCE, Setting

MUON_PEERS = ("zero_fx-0", "zero_fx-1", "zero_fx-2", "zero_fx-3", "ddp", "fsdp2", "fsdp2-compiled",
              "deepspeed-1", "deepspeed-2", "deepspeed-3")
"""The peers ``--optimizer muon`` runs unless ``--peers`` says."""
OPTIMIZER_WORDS = {"adamw": "AdamW",
                   "muon": "Muon (lr 0.02) on the blocks' matrices, AdamW on the rest"}

LOSS_RTOL = {False: 2e-3, True: 3e-2}
"""How far any step's loss may be from the reference's: fp32 (Inductor's fused
kernels round differently from eager), and bf16."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt-small", choices=sorted(MODELS))
    p.add_argument("--layers", type=int, help="the GPT models with this many blocks")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: the model's)")
    p.add_argument("--batch", type=int, help="sequences per rank (default: the model's)")
    p.add_argument("--world", type=int, default=2, help="ranks per peer (torchrun's --nproc_per_node)")
    p.add_argument("--fake-world", type=int, default=0, metavar="N",
                   help="one process simulating N ranks with the fake process group: real "
                        "per-rank memory, no real communication; losses compared on the steps "
                        "the fake group leaves shared (every step from torch 2.13, else the first)")
    p.add_argument("--peers", nargs="+", choices=list(PEERS), metavar="PEER",
                   help=f"default: all of {', '.join(PEERS)} (those for a mixture of experts, "
                        f"{', '.join(sorted(MOE_ONLY_PEERS))}, with hf-mixtral only)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first, the first compiles")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the peers this many times, in alternating order (as listed, then "
                        "reversed), each time in fresh processes; the step times pool every "
                        "round's, so the machine's drift over the run (the first peer's "
                        "cold caches, another job) weighs on every peer alike")
    p.add_argument("--backend", default="inductor", help="torch.compile backend of compiled peers")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto (default): CUDA where there is a GPU per rank of this machine, "
                        "else the CPU; cuda: one GPU per rank or an error")
    p.add_argument("--bf16", action="store_true", help="bfloat16 compute (GPU mode)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="muon: torch.optim.Muon on the blocks' matrices and AdamW on the rest "
                        "(DeepSpeed: its own Muon); default peers then: "
                        + " ".join(MUON_PEERS))
    p.add_argument("--muon-iterations", choices=MUON_ITERATIONS, default="bf16",
                   help="torch.optim.Muon's Newton-Schulz in its own bf16 (default) or in fp32, "
                        "as DeepSpeed's runs on a CPU")
    p.add_argument("--bucket-mib", type=float,
                   help="cap of a fused collective for zero_fx and DeepSpeed (default: zero_fx's, "
                        "25 MiB, 16 MiB in stage 3)")
    p.add_argument("--warm-cache", action="store_true",
                   help="let compiled peers use Inductor's caches from earlier runs (default: "
                        "each peer compiles from scratch in an empty cache)")
    p.add_argument("--peer-limit-s", type=float, default=PEER_LIMIT_S, metavar="SECONDS",
                   help=f"a peer still running after this is killed and reported as failed "
                        f"(default {PEER_LIMIT_S:g})")
    p.add_argument("--profile", action="store_true",
                   help="one more step per peer under torch.profiler: its GPU busy and idle "
                        "time, kernels and launches (bench/helpers/profile_step.py)")
    p.add_argument("--name", help="output name (default peers-<model>-w<N>)")
    p.add_argument("--worker-of", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    p.add_argument("--store-prefix", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peers is None and args.optimizer == "muon":
        args.peers = list(MUON_PEERS)
    if args.peers is None:
        args.peers = [peer for peer in PEERS
                      if peer not in MOE_ONLY_PEERS or args.model == "hf-mixtral"]
    if args.fake_world and "RANK" in os.environ and not args.worker_of:
        p.error("--fake-world simulates the ranks in one process: start it with python, "
                "not torchrun")
    if args.rounds < 1:
        p.error(f"--rounds takes a positive number of runs of the peers, got {args.rounds}")
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}): nothing would be timed")
    check_model_options(p, args)
    args.device = device_of(p, args)
    return args


def device_of(p: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """``--device`` made concrete, "cpu" or "cuda", alike in the driver and in every rank: the
    ranks on this machine (torchrun's LOCAL_WORLD_SIZE, else --world; one with --fake-world)
    need a GPU each (zero_fx.init_distributed's rule), or ``p`` says why not."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1 if args.fake_world else args.world))
    try:
        return resolve_device(args.device, local_rank=0, local_world_size=ranks_here).type
    except DistributedSetupError as err:
        p.error(f"--device {args.device}: {err}".replace("--nproc_per_node", "--world (or "
                                                         "torchrun's --nproc_per_node)"))


def check_model_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--layers``, ``--seq`` and ``--batch`` fit ``--model``, or ``p`` says what they take."""
    if args.layers is not None and (args.layers < 1 or MODELS[args.model].gpt is None):
        gpts = ", ".join(name for name, spec in MODELS.items() if spec.gpt is not None)
        p.error(f"--layers takes a positive number of blocks for the GPT models ({gpts}), "
                f"got {args.layers} for {args.model}")
    if args.batch is not None and args.batch < 1:
        p.error(f"--batch takes a positive number of sequences per rank, got {args.batch}")
    gpt = MODELS[args.model].gpt
    if args.seq is not None and (args.seq < 1 or (gpt and args.seq > gpt.block_size)):
        longest = f"{gpt.block_size} (its position table)" if gpt else "the model's longest"
        p.error(f"--seq takes 1 to {longest} tokens for {args.model}, got {args.seq}")


def model_of(args) -> BenchModel:
    spec = MODELS[args.model]
    spec = spec.with_layers(args.layers) if args.layers else spec
    spec = dataclasses.replace(spec, seq=args.seq) if args.seq else spec
    return dataclasses.replace(spec, batch_per_rank=args.batch) if args.batch else spec


def setting_of(args) -> Setting:
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    bucket = None if args.bucket_mib is None else int(args.bucket_mib * 2 ** 20)
    return Setting(device=device, backend=args.backend, bf16=args.bf16, bucket_bytes=bucket,
                   optimizer=args.optimizer, muon_iterations=args.muon_iterations)


NOT_SIMULATED = {"ddp": "DDP's C++ reducer needs a real process group",
                 "ddp-compiled": "DDP's C++ reducer needs a real process group",
                 "torch.compile": "one process training the whole batch has nothing to simulate"}
"""Peers the fake-process-group mode leaves out, and why."""


def missing_package(peer: str):
    for prefix, module in OPTIONAL_PEERS.items():
        if peer.startswith(prefix) and importlib.util.find_spec(module) is None:
            return module
    return None


# -- in the ranks -------------------------------------------------------------------

def join(args) -> None:
    if dist.is_initialized():
        return
    if args.fake_world:
        fake_group.join(args.fake_world)
    elif "RANK" in os.environ:
        backend = "nccl" if args.device == "cuda" else "gloo"
        if args.store_prefix:  # started by a rank under torchrun: a group of the peer's own
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  is_master=False, timeout=GROUP_TIMEOUT)
            dist.init_process_group(backend, store=dist.PrefixStore(args.store_prefix, store),
                                    rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=GROUP_TIMEOUT)
        else:
            dist.init_process_group(backend, timeout=GROUP_TIMEOUT)


def worker(args) -> None:
    """One peer in processes of its own: each rank writes its row, then leaves at once.
    (Skipping the teardown of the process group and the interpreter: a rare abort in
    gloo's teardown would otherwise lose rows that were measured.)"""
    from .run import run_peer

    join(args)
    row = run_peer(args.worker_of, model_of(args), setting_of(args), args.steps, args.warmup,
                   count_wire=args.device == "cpu" and not args.fake_world, profile=args.profile)
    rank = dist.get_rank() if dist.is_initialized() and not args.fake_world else 0
    with open(f"{args.result_file}.{rank}", "w") as f:
        json.dump(row, f)
    sys.stdout.flush()
    os._exit(0)


# -- the driver --------------------------------------------------------------------

def environment(results: dict) -> dict:
    """What the numbers were measured on: versions, the device (a rank's, as it saw it), the
    MFU formula and the peak it divides by."""
    row = next((rows[0] for rows in results.values()), {})
    return {"torch": torch.__version__, "cuda": torch.version.cuda,
            "python": sys.version.split()[0], "device_name": row.get("device_name"),
            "peak_bf16_flops": row.get("peak_flops"), "mfu_formula": MFU_FORMULA}


def compare_losses(args, summaries: list[dict]) -> tuple[list[str], str]:
    """The peers whose losses disagree with the reference's (as failures), and which steps
    were compared: all of them, or under the fake group those it leaves shared."""
    if not any(s["peer"] == REFERENCE for s in summaries):
        return [], f"losses not compared: {REFERENCE} did not run"
    steps = min(s["loss_steps_compared"] for s in summaries)
    if steps == 0:
        return [], "losses not compared: " + summaries[0]["loss_steps_why"]
    own_muon = [s for s in summaries if args.optimizer == "muon" and s["peer"].startswith("deepspeed")]
    compared = [s for s in summaries if s not in own_muon]
    failures = peers_report.loss_disagreements(compared, REFERENCE, LOSS_RTOL[args.bf16], steps)
    which = summaries[0]["loss_steps_why"] if args.fake_world else "every step"
    left_out = (f"; not {', '.join(s['peer'] for s in own_muon)}: DeepSpeed's own Muon picks its "
                "matrices by name and runs its own Newton-Schulz" if own_muon else "")
    return failures, (f"losses compared with {REFERENCE}'s, relative tolerance "
                      f"{LOSS_RTOL[args.bf16]:.0e}: {which} ({steps} of {args.steps}){left_out}")


def report(args, results: dict, notes: list[str], failed: dict, seconds: float) -> int:
    summaries = [peers_report.summarize(peer, ranks) for peer, ranks in results.items()]
    failures, compared = compare_losses(args, summaries) if summaries else ([], "")
    failures += peers_report.round_disagreements(summaries, LOSS_RTOL[args.bf16])
    world = args.fake_world or args.world
    wire = args.device == "cpu" and not args.fake_world
    spec = model_of(args)
    mode = ("fake process group: one process, real per-rank memory, no communication "
            "(step times leave it out)" if args.fake_world else
            f"{args.device}, {'NCCL' if args.device == 'cuda' else 'gloo'}")
    env = environment(results)
    describe = (f"{machine()}; {env['device_name'] or args.device}; {mode}; world size {world}; "
                f"{args.model}: {spec.about}; "
                f"{spec.batch_per_rank} × {spec.seq} tokens per rank; "
                f"{OPTIMIZER_WORDS[args.optimizer]}"
                + (f" (torch's Newton-Schulz in {args.muon_iterations}); "
                   if args.optimizer == "muon" else "; ")
                + f"{'bf16 compute' if args.bf16 else 'fp32'}; compiled peers: {args.backend}; "
                f"buckets: {'default' if args.bucket_mib is None else f'{args.bucket_mib:g} MiB'}; "
                f"Inductor caches: {'warm' if args.warm_cache else 'empty (cold compiles)'}; "
                f"{args.steps} steps, {args.warmup} untimed"
                + (f"; {args.rounds} rounds, in alternating order" if args.rounds > 1 else ""))
    peak = env["peak_bf16_flops"]
    columns = peers_report.COLUMNS + (" No peak known here: no MFU." if peak is None else
                                      f" Peak used: {peak:.4g} FLOP/s.")
    table = (peers_report.markdown(summaries, REFERENCE, wire, losses=True)
             if summaries else "no peer ran")
    targets = peers_report.targets(summaries)
    goals = peers_report.targets_markdown(targets)
    dagger = (["† trains the whole global batch in one process (no data parallelism)."]
              if any(s["whole_batch"] for s in summaries) else [])
    profiles = peers_report.profile_lines(summaries)
    rounds = peers_report.round_lines(summaries)
    text = "\n\n".join(filter(None, [describe, columns, table, *dagger, rounds, compared, profiles,
                                      goals, *notes, *failures]))
    name = args.name or (f"peers-{args.model}" + (f"-L{args.layers}" if args.layers else "")
                         + f"-w{world}" + ("-fake" if args.fake_world else "")
                         + ("-muon" if args.optimizer == "muon" else "")
                         + ("-fp32" if args.optimizer == "muon" and args.muon_iterations == "fp32"
                            else ""))
    path = write_json(name, {"machine": machine(), "environment": env,
                             "description": describe, "columns": columns, "args": vars(args),
                             "summaries": summaries, "ranks": results,
                             "failed_peers": failed,
                             "losses_compared": compared, "targets": targets, "notes": notes,
                             "loss_failures": failures, "seconds": seconds})
    with open(path[:-len(".json")] + ".md", "w") as f:
        f.write(text + "\n")
    print("\n" + text + f"\n\nwritten to {path} (and .md), {seconds / 60:.1f} min")
    return 1 if failures or failed or not summaries else 0


def drive(args, argv: list[str], launch=launch_peer) -> int:
    """Each peer in turn, in fresh processes (``launch``), ``--rounds`` times in alternating
    order; the report on rank 0. A peer that fails is noted with its error, is not run
    again, and the next one runs."""
    start = time.perf_counter()
    leader = not dist.is_initialized() or dist.get_rank() == 0
    say = print if leader else (lambda *a, **k: None)
    if args.device == "cpu":
        os.environ.update(peer_environment(args))
        cpu_memory.build()  # once here, rather than by every rank at once
    rounds, notes, failed = {}, [], {}
    runnable = []
    for peer in args.peers:
        if args.fake_world and peer in NOT_SIMULATED:
            notes.append(f"{peer}: not run with --fake-world: {NOT_SIMULATED[peer]}")
        elif missing := missing_package(peer):
            notes.append(f"{peer}: skipped, `{missing}` is not installed (pip install -e \".[bench]\")")
            say(notes[-1], flush=True)
        else:
            runnable.append(peer)
    for number in range(args.rounds):
        order = runnable if number % 2 == 0 else runnable[::-1]
        for i, peer in enumerate(order, 1):
            if peer in failed:
                continue
            round_ = f"round {number + 1}/{args.rounds}, " if args.rounds > 1 else ""
            say(f"[{round_}{i}/{len(order)}] {peer} ...", flush=True)
            rows, why = launch(args, peer, argv)
            if rows is None:
                failed[peer] = why
                rounds.pop(peer, None)
                notes.append(f"{peer}: failed:\n\n```\n{why}\n```")
                say(notes[-1], flush=True)
                continue
            rounds.setdefault(peer, []).append(rows)
    if not leader:
        return 1 if failed else 0
    pooled = (lambda rows: rows[0]) if args.rounds == 1 else peers_report.pool_rounds
    results = {peer: pooled(rounds[peer]) for peer in runnable if peer in rounds}
    return report(args, results, notes, failed, time.perf_counter() - start)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker_of:
        worker(args)
        return 0
    if "RANK" in os.environ:  # started by torchrun: each rank starts its process of each peer
        # the launched processes only agree on rows and failures, over gloo (no GPU context)
        dist.init_process_group("gloo")
        args.world = dist.get_world_size()
        try:
            launches = itertools.count()  # each launch's store keys its own, round after round
            return drive(args, argv, launch=lambda args, peer, argv: launch_peer_here(
                args, peer, argv, next(launches)))
        finally:
            dist.destroy_process_group()
    return drive(args, argv)

