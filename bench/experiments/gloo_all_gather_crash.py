"""Reproduce the gloo heap corruption behind zero_fx/runtime/distributed/gloo_all_gather.py, with PyTorch alone.

Two gloo ranks issue functional all-gathers of a few sizes, keeping ``--depth`` of them in
flight while a matmul runs, as a prefetching stage-3 step does:

    python -m bench.experiments.gloo_all_gather_crash --path coalesced   # torch's own kernel: a rank dies
    python -m bench.experiments.gloo_all_gather_crash --path zero_fx     # zero_fx's kernel: runs clean

On a 2-core machine (torch 2.13.0+cpu) ``coalesced`` died in 3 of 3 runs of 3,000
iterations, after 16-77 s ("malloc(): unaligned tcache chunk detected" or SIGSEGV);
``--depth 0`` (wait on each gather at once) and the ``_out`` path ran clean.
See [Note: gloo's coalesced all-gather corrupts the heap].
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHARD_SIZES = (1024, 4096, 64, 2048, 16384, 8, 512)


def _rank(rank: int, world: int, store_dir: str, path: str, depth: int, iterations: int) -> None:
    faulthandler.enable()
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    if path == "zero_fx":
        from zero_fx.runtime.distributed.gloo_all_gather import use_gloo_single_tensor_all_gather
        use_gloo_single_tensor_all_gather()
    c10d = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name
    shards = [torch.randn(n) for n in SHARD_SIZES]
    a = torch.randn(64, 64)
    start = time.monotonic()
    for iteration in range(iterations):
        in_flight = []
        for shard in shards:
            in_flight.append(c10d.all_gather_into_tensor(shard.clone(), world, group))
            if len(in_flight) > depth:
                c10d.wait_tensor(in_flight.pop(0))
                (a @ a).sum()
        for gathered in in_flight:
            c10d.wait_tensor(gathered)
        if rank == 0 and iteration % 500 == 0:
            print(f"iteration {iteration} at {time.monotonic() - start:.0f} s", flush=True)
    dist.barrier()
    if rank == 0:
        print(f"{path}: {iterations} iterations clean in {time.monotonic() - start:.0f} s")
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", choices=("coalesced", "zero_fx"), default="coalesced")
    parser.add_argument("--depth", type=int, default=2, help="all-gathers kept in flight")
    parser.add_argument("--iterations", type=int, default=3000)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as store_dir:
        try:
            mp.start_processes(_rank, args=(2, store_dir, args.path, args.depth, args.iterations),
                               nprocs=2, start_method="spawn")
        except mp.ProcessExitedException as err:
            print(f"{args.path}: {err}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
