"""Run a function on N spawned CPU ranks over gloo and collect what each returns."""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_ranks(world_size: int, fn, *args, timeout_s: int = 120, may_die: bool = False):
    """``fn(rank, world_size, *args)`` on each rank (in-process, no group, for world size 1).

    ``may_die``: a rank may exit on purpose (a failure test); its result is None.
    """
    if world_size == 1:
        return [fn(0, 1, *args)]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank_main, args=(world_size, tmp, fn, args, timeout_s),
                           nprocs=world_size, join=True, start_method="spawn")
        results = []
        for rank in range(world_size):
            path = os.path.join(tmp, f"rank{rank}.pt")
            if may_die and not os.path.exists(path):
                results.append(None)
                continue
            result = torch.load(path, weights_only=False)
            if isinstance(result, _RankFailure):
                raise RuntimeError(f"rank {rank} failed:\n{result.text}")
            results.append(result)
        return results


class _RankFailure:
    def __init__(self, text):
        self.text = text


def _rank_main(rank, world_size, tmp, fn, args, timeout_s):
    # a rank that fails makes its peers' collectives time out instead of hanging the suite
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world_size, *args)
    except Exception:
        result = _RankFailure(traceback.format_exc())
    finally:
        torch.save(result, os.path.join(tmp, f"rank{rank}.pt"))
    # no rank tears gloo down while a peer may still be finishing its last collective
    # (seen once: a rank aborting with SIGABRT at exit); a peer that died on purpose fails it
    try:
        dist.barrier()
        dist.destroy_process_group()
    except RuntimeError:
        pass
    # The results are saved. Skip interpreter teardown, where a C++ thread is
    # sometimes destroyed while joinable ("terminate called without an active
    # exception", SIGABRT) after all work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
