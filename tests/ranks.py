"""Run a function on N spawned CPU ranks over gloo and collect what each returns."""

from __future__ import annotations

import datetime
import faulthandler
import os
import signal
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


PRELOADED = ["torch", "torch.distributed", "zero_fx", "models", "training"]
"""Imported once by the fork server the ranks are forked from, instead of by every rank
(about 4 s of each spawned rank's start on the 2-core CI box)."""

JOIN_TIMEOUT_S = 900
"""How long the ranks together may take before the test fails and they are killed: the
slowest multi-rank test (Inductor compiling on each rank of a loaded 2-core box) takes
about a minute, so a rank still running after this is stuck, not slow."""


def run_ranks(world_size: int, fn, *args, timeout_s: int = 120, may_die: bool = False,
              fresh_interpreter: bool = False):
    """``fn(rank, world_size, *args)`` on each rank (in-process, no group, for world size 1).

    ``timeout_s``: the process group's (a collective waiting on a dead peer fails after it).
    ``may_die``: a rank may exit on purpose (a failure test); its result is None. Otherwise
    a rank that exits other than with 0, at any point (a crash at exit included), fails the
    test, as it would fail a torchrun job. A rank still running after ``JOIN_TIMEOUT_S``
    prints its threads' stacks, is killed, and fails the test.

    Ranks are forked from a fork server that has imported ``PRELOADED``, and take the
    caller's environment variables as they are now. ``fresh_interpreter``: spawn each rank
    instead, for what is read only when a process starts (glibc's ``MALLOC_*``).
    """
    if world_size == 1:
        return [fn(0, 1, *args)]
    if fresh_interpreter:
        start_method = "spawn"
    else:
        start_method = "forkserver"
        mp.get_context("forkserver").set_forkserver_preload(PRELOADED)
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            _rank_main, args=(world_size, tmp, fn, args, timeout_s, may_die, dict(os.environ)),
            nprocs=world_size, join=False, start_method=start_method)
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for process in context.processes:  # a rank stuck on a dead peer fails after timeout_s
            process.join(max(0.0, deadline - time.monotonic()))
        stuck = [rank for rank, p in enumerate(context.processes) if p.is_alive()]
        if stuck:
            _kill_with_stacks([context.processes[r] for r in stuck])
            raise RuntimeError(f"rank(s) {stuck} still running after {JOIN_TIMEOUT_S} s: killed "
                               "(their stacks are in the output above)")
        results = []
        for rank, process in enumerate(context.processes):
            path = os.path.join(tmp, f"rank{rank}.pt")
            if not os.path.exists(path):
                if may_die:
                    results.append(None)
                    continue
                raise RuntimeError(f"rank {rank} exited ({_exit_status(process.exitcode)}) without "
                                   "a result; if it crashed, its stack is in the output above")
            result = torch.load(path, weights_only=False)
            if isinstance(result, _RankFailure):
                raise RuntimeError(f"rank {rank} failed:\n{result.text}")
            if process.exitcode != 0 and not may_die:
                raise RuntimeError(f"rank {rank} returned its result, then exited "
                                   f"({_exit_status(process.exitcode)}): a rank must exit "
                                   "cleanly; its stack, if it crashed, is in the output above")
            results.append(result)
        return results


def _kill_with_stacks(processes) -> None:
    for process in processes:
        os.kill(process.pid, signal.SIGUSR1)  # faulthandler prints every thread's stack
    time.sleep(2)
    for process in processes:
        process.kill()
        process.join(30)  # SIGKILL ends it at once; never wait on it forever


def _exit_status(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


class _RankFailure:
    def __init__(self, text):
        self.text = text


def _rank_main(rank, world_size, tmp, fn, args, timeout_s, may_die, environment):
    os.environ.clear()  # a forked rank has the fork server's, from when it started
    os.environ.update(environment)
    faulthandler.enable()  # a rank that crashes in C++ prints its Python stack
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # and a stuck one, when asked
    # a rank that fails makes its peers' collectives time out instead of hanging the suite
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world_size, *args)
    except Exception:
        result = _RankFailure(traceback.format_exc())
    finally:  # written aside and renamed, so a result file is always whole
        partial = os.path.join(tmp, f"rank{rank}.pt.partial")
        try:
            torch.save(result, partial)
        except Exception:  # a result that cannot be saved fails the test with the reason
            torch.save(_RankFailure("its result could not be saved:\n" + traceback.format_exc()),
                       partial)
        os.replace(partial, os.path.join(tmp, f"rank{rank}.pt"))
    # as a training script ends: no rank tears gloo down while a peer may still be in its
    # last collective; where a peer died on purpose, the barrier fails, as it should
    try:
        dist.barrier()
    except RuntimeError:
        if not may_die:
            raise
    dist.destroy_process_group()


def with_mesh(options: dict) -> dict:
    """``options`` with ``("mesh", (replicas, shards))`` (picklable, for the ranks) turned into
    the CPU device mesh it names."""
    if options.get("mesh") is None:
        options.pop("mesh", None)
    elif isinstance(options["mesh"], tuple):
        from torch.distributed.device_mesh import init_device_mesh

        options["mesh"] = init_device_mesh("cpu", options["mesh"],
                                           mesh_dim_names=("replicate", "shard")[-len(options["mesh"]):])
    return options


def mesh_errors(rank: int, world_size: int, cases: list) -> list[str]:
    """The ValueError ``zero_compile(stage=..., mesh=...)`` raises for each ``(shape, dimension
    names, stage)`` of ``cases`` (a CPU mesh over the ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    from zero_fx import zero_compile

    messages = []
    for shape, names, stage in cases:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        try:
            zero_compile(lambda: None, stage=stage, mesh=mesh)
        except ValueError as err:
            messages.append(str(err))
    return messages
