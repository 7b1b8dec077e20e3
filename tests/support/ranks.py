"""Run a function on N CPU ranks over gloo and collect what each returns.

Most runs go to ranks that stay up for the whole session (``StandingRanks``, one group per
world size): a fresh rank spends most of a small run on its first compile (Dynamo's and
AOTAutograd's one-off set-up, lazy imports), which standing ranks pay once. Between runs
each rank puts back what a run may change in the process (``_ProcessState``), so every run
is captured and compiled from scratch as in a new process. Runs that need a process of
their own (a rank that dies on purpose, another group timeout, ``MALLOC_*`` read at start)
get freshly started ranks. Every multi-rank run holds the machine's cores (tests/support/cores.py)
while it runs."""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import gc
import io
import os
import queue
import random
import signal
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from support.cores import the_cores

PRELOADED = ["torch", "torch.distributed", "zero_fx", "support.models", "support.training",
             "support.warm_ranks"]
"""Imported once by the fork server the ranks are forked from, instead of by every rank
(about 4 s of each spawned rank's start on the 2-core CI box); ``warm_ranks`` also imports
transformers and compiles the test GPT's step there once (tests/support/warm_ranks.py)."""

JOIN_TIMEOUT_S = 900
"""How long the ranks together may take over one run before the test fails and they are
killed: the slowest multi-rank run (Inductor compiling on each rank of a loaded 2-core box)
takes about a minute, so a rank still running after this is stuck, not slow."""

GROUP_TIMEOUT_S = 120
"""The process group's timeout unless a run asks for another: a collective waiting on a
failed peer fails after it."""


def run_ranks(world_size: int, fn, *args, timeout_s: int = GROUP_TIMEOUT_S,
              may_die: bool = False, fresh_interpreter: bool = False, shared: bool = False):
    """``fn(rank, world_size, *args)`` on each rank (in-process, no group, for world size 1).

    ``timeout_s``: the process group's (a collective waiting on a dead peer fails after it).
    ``may_die``: a rank may exit on purpose (a failure test); its result is None. Otherwise
    a rank that fails or exits fails the test, as it would fail a torchrun job; a rank that
    exits other than with 0 after its last run fails the session (``close_standing_ranks``).
    A rank still running after ``JOIN_TIMEOUT_S`` prints its threads' stacks, is killed,
    and fails the test.

    The ranks take the caller's environment variables as they are now. They are the
    standing ranks of ``world_size`` unless the run needs its own processes: ``may_die``,
    a ``timeout_s`` other than ``GROUP_TIMEOUT_S``, or ``fresh_interpreter`` (each rank
    spawned, for what is read only when a process starts, as glibc's ``MALLOC_*``).

    ``shared``: the run may be shared with the session's other tests that make the same run
    on standing ranks ([Note: shared runs]). Only for a ``fn`` whose result is all a test
    reads of the run, and not for a test that runs it twice to compare the two."""
    if world_size == 1:
        return [fn(0, 1, *args)]
    standing = not _needs_own_processes(timeout_s, may_die, fresh_interpreter)
    key = _shared_key(world_size, fn, args) if shared and standing else None
    if key is not None and (saved := _shared_result(key)) is not None:
        return [_loaded(s) for s in saved]
    with the_cores():
        if key is None:
            return _run_ranks(world_size, fn, args, timeout_s, may_die, fresh_interpreter)
        saved = _shared_result(key)  # the other test process may have made it meanwhile
        if saved is not None:
            return [_loaded(s) for s in saved]
        results, saved = _standing(world_size, lambda group: group.run_keeping_saved(fn, args))
        _share(key, saved)
        return results


SHARED_RUNS_FOLDER: str | None = None
"""Where this session's shared runs are kept (set by conftest), for every test process of
the session to read; None: no run is shared.

[Note: shared runs]
Several test files make the same baseline run: test_parity's, test_hybrid's and
test_memory's stage-3 GPT on 2 and on 4 ranks, test_mixed_precision's and test_offload's
bf16 runs. The multi-rank runs are what the suite waits on (docs/testing.md), and each of
those took 3-25 s of the cores. A run is the same run when the function, its arguments
and the environment the ranks take are the same (rank processes put back what a run
changes, ``_ProcessState``), so the first test to make it keeps what each rank returned,
as the ranks saved it, and a later test, in either test process, loads its own copy: each
test still checks a result of its own, computed as if it had run the ranks itself."""

_VOLATILE_ENVIRONMENT = ("PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER")
"""Variables that differ between tests or test processes but not between runs."""


def _shared_key(world_size: int, fn, args) -> str | None:
    """The name of the run ``fn(rank, world_size, *args)`` in the shared-runs folder; None
    when nothing is shared or the run cannot be named (arguments that do not pickle)."""
    if SHARED_RUNS_FOLDER is None:
        return None
    import hashlib
    import pickle

    environment = sorted((k, v) for k, v in os.environ.items() if k not in _VOLATILE_ENVIRONMENT)
    try:
        named = pickle.dumps((world_size, fn.__module__, fn.__qualname__, args, environment),
                             protocol=4)
    except Exception:
        return None
    return hashlib.sha256(named).hexdigest()


def _shared_result(key: str) -> list[bytes] | None:
    import pickle

    try:
        with open(os.path.join(SHARED_RUNS_FOLDER, key), "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        return None


def _share(key: str, saved: list[bytes]) -> None:
    """Keeps a run's results whole or not at all (written aside, then renamed)."""
    import pickle

    os.makedirs(SHARED_RUNS_FOLDER, exist_ok=True)
    path = os.path.join(SHARED_RUNS_FOLDER, key)
    with open(f"{path}.{os.getpid()}", "wb") as f:
        pickle.dump(saved, f)
    os.replace(f"{path}.{os.getpid()}", path)


def _needs_own_processes(timeout_s, may_die, fresh_interpreter) -> bool:
    """Whether a run needs ranks started for it rather than the standing ones."""
    return may_die or fresh_interpreter or timeout_s != GROUP_TIMEOUT_S


def _run_ranks(world_size, fn, args, timeout_s, may_die, fresh_interpreter):
    if _needs_own_processes(timeout_s, may_die, fresh_interpreter):
        return _launch(world_size, fn, args, timeout_s, may_die, fresh_interpreter)
    return _standing(world_size, lambda group: group.run(fn, args))


def _standing(world_size: int, run):
    """``run(group)`` on the standing ranks of ``world_size`` (started if none are up)."""
    group = _STANDING.get(world_size)
    if group is None:
        group = _STANDING[world_size] = StandingRanks(world_size)
    try:
        return run(group)
    except BaseException:
        # a failed or interrupted run may leave the ranks mid-collective: the next starts anew
        _STANDING.pop(world_size, None)
        group.kill()
        raise


@contextlib.contextmanager
def fake_world(size: int):
    """A fake process group of ``size`` ranks in this process, as rank 0: shapes and the
    collectives issued are real, values are not (for tests that count, not compare)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def gloo_world_of_one():
    """A real gloo process group of one rank in this process (its store a file in a folder of
    its own), as ``init_process_group("gloo")`` alone on one machine makes it."""
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=0,
                                world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _forkserver():
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)
    return context


class StandingRanks:
    """``world_size`` ranks in one gloo group that serve one run after another:
    ``run(fn, args)`` returns what each rank's ``fn(rank, world_size, *args)`` returned.
    Measured on the loaded 2-core box (test_fuzz): a whole 2-rank example took 9-11 s on
    fresh ranks and 3.4 s on standing ones; a fresh rank's first example 9.7 s at 2 ranks and
    22.9 s at 4, the same example again 1.7 and 3.6 s."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.folder = tempfile.TemporaryDirectory()
        context = _forkserver()
        self.tasks = [context.SimpleQueue() for _ in range(world_size)]
        self.results = context.Queue()
        self.processes = [
            context.Process(target=_serve, args=(rank, world_size, self.folder.name,
                                                 self.tasks[rank], self.results))
            for rank in range(world_size)]
        for process in self.processes:
            process.start()

    def run(self, fn, args) -> list:
        return self.run_keeping_saved(fn, args)[0]

    def run_keeping_saved(self, fn, args) -> tuple[list, list[bytes]]:
        """What each rank returned, and as it saved it (``_call``); a rank's failure raises."""
        for tasks in self.tasks:
            tasks.put((fn, args, dict(os.environ)))
        results, deadline = [None] * self.world_size, time.monotonic() + JOIN_TIMEOUT_S
        saves = [b""] * self.world_size
        waiting = set(range(self.world_size))
        while waiting:
            try:
                rank, saved = self.results.get(timeout=1)
            except queue.Empty:
                dead = [r for r in sorted(waiting) if not self.processes[r].is_alive()]
                if dead:
                    raise RuntimeError(
                        f"rank(s) {dead} exited ({', '.join(_exit_status(self.processes[r].exitcode) for r in dead)}) "
                        "without a result; if one crashed, its stack is in the output above")
                if time.monotonic() > deadline:
                    _kill_with_stacks([self.processes[r] for r in sorted(waiting)])
                    raise RuntimeError(f"rank(s) {sorted(waiting)} still running after "
                                       f"{JOIN_TIMEOUT_S} s: killed (their stacks are in the "
                                       "output above)")
                continue
            result = _loaded(saved)
            if isinstance(result, _RankFailure):
                raise RuntimeError(f"rank {rank} failed:\n{result.text}")
            results[rank], saves[rank] = result, saved
            waiting.discard(rank)
        return results, saves

    def close(self, timeout_s: float = 60) -> list[str]:
        """Ends the ranks as a training script ends (a barrier, then the group torn down):
        for each rank that did not then exit with 0, what happened."""
        for tasks in self.tasks:
            tasks.put(None)
        problems = []
        for rank, process in enumerate(self.processes):
            process.join(timeout_s)
            if process.is_alive():
                process.kill()
                problems.append(f"rank {rank} of {self.world_size} did not exit within {timeout_s} s")
            elif process.exitcode != 0:
                problems.append(f"rank {rank} of {self.world_size} exited "
                                f"({_exit_status(process.exitcode)}) after its last run")
        self.folder.cleanup()
        return problems

    def kill(self) -> None:
        for process in self.processes:
            process.kill()
            process.join(30)  # SIGKILL ends it at once; never wait on it forever
        self.folder.cleanup()


_STANDING: dict[int, StandingRanks] = {}
"""The standing ranks of each world size, started by the first run of that size."""


def close_standing_ranks() -> list[str]:
    """Ends every group of standing ranks (conftest, at the end of the session): what went
    wrong as they exited, for the session to fail on."""
    problems = []
    while _STANDING:
        problems += _STANDING.popitem()[1].close()
    return problems


class _ProcessState:
    """What a run may change in a rank's process and the next run must not see: Dynamo's
    caches and the compile configs, the random generators, the default dtype, grad mode,
    the working directory, and the process groups it made (each gloo group keeps threads
    that poll its sockets: a hundred left behind took most of a core on the 2-core box).
    ``restore()`` puts back what ``__init__`` saw."""

    def __init__(self):
        import torch._dynamo.config
        import torch._functorch.config
        import torch._inductor.config

        self.configs = [(c, c.get_config_copy()) for c in
                        (torch._dynamo.config, torch._inductor.config, torch._functorch.config)]
        self.torch_rng = torch.get_rng_state()
        self.python_rng = random.getstate()
        self.dtype = torch.get_default_dtype()
        self.cwd = os.getcwd()
        self.groups = set(dist.distributed_c10d._world.pg_map)

    def restore(self) -> None:
        dist.barrier()  # every rank is done with the run's groups before any is destroyed
        for group in list(dist.distributed_c10d._world.pg_map):
            if group not in self.groups:
                dist.destroy_process_group(group)
        _forget_groups()
        torch._dynamo.reset()
        for config, saved in self.configs:  # only what changed: setting a deprecated key warns
            now = config.get_config_copy()
            config.load_config({k: v for k, v in saved.items() if now.get(k) is not v})
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.python_rng)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(True)
        os.chdir(self.cwd)
        settle()


def settle() -> None:
    """Collects what a run left, then freezes what remains (the process between runs:
    modules, caches) out of the collector's sight. Each later ``gc.collect()`` and
    ``gc.get_objects()`` (the harness's memory probe calls three and two per run) then walks
    the run's own objects only: a full walk of a rank's ~360k objects took 0.22 s per collect
    on the 2-core box, about 0.9 s per run with the probe and this clean-up. What was frozen
    stays alive for good; it is what a rank keeps between runs anyway."""
    gc.collect()
    gc.freeze()


def _forget_groups() -> None:
    """Empties the per-process caches that hold a group (destroyed after each run)."""
    import sys

    import zero_fx.runtime.distributed.cpu_group

    zero_fx.runtime.distributed.cpu_group._made = None
    tensor_parallel_models = sys.modules.get("support.tensor_parallel_models")
    if tensor_parallel_models is not None:
        tensor_parallel_models.device_mesh.cache_clear()


def _serve(rank, world_size, folder, tasks, results):
    _start_rank(rank, world_size, folder, GROUP_TIMEOUT_S)
    clean = _ProcessState()
    settle()
    while (task := tasks.get()) is not None:
        fn, args, environment = task
        _take_environment(environment)
        results.put((rank, _call(fn, rank, world_size, args)))
        clean.restore()
    _end_rank(may_die=False)


def _start_rank(rank, world_size, folder, timeout_s) -> None:
    faulthandler.enable()  # a rank that crashes in C++ prints its Python stack
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # and a stuck one, when asked
    # the cores shared among the ranks, as torchrun does (OMP_NUM_THREADS=1 for several ranks):
    # four ranks of two OpenMP threads each, spinning on two cores, took 0.6 s over a step
    # of the test GPT that takes 0.05 s at two ranks
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    # a rank that fails makes its peers' collectives time out instead of hanging the suite
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))


def _take_environment(environment: dict) -> None:
    os.environ.clear()  # a forked rank has the fork server's, from when it started
    os.environ.update(environment)


def _loaded(saved: bytes):
    """A rank's result from what ``_call`` saved."""
    return torch.load(io.BytesIO(saved), weights_only=False)


def _call(fn, rank, world_size, args) -> bytes:
    """What ``fn`` returned, or the failure, as ``torch.save`` wrote it."""
    try:
        result = fn(rank, world_size, *args)
    except Exception:
        result = _RankFailure(traceback.format_exc())
    saved = io.BytesIO()
    try:
        torch.save(result, saved)
    except Exception:  # a result that cannot be saved fails the test with the reason
        saved = io.BytesIO()
        torch.save(_RankFailure("its result could not be saved:\n" + traceback.format_exc()), saved)
    return saved.getvalue()


def _end_rank(may_die: bool) -> None:
    # as a training script ends: no rank tears gloo down while a peer may still be in its
    # last collective; where a peer died on purpose, the barrier fails, as it should
    try:
        dist.barrier()
    except RuntimeError:
        if not may_die:
            raise
    dist.destroy_process_group()


def _launch(world_size, fn, args, timeout_s, may_die, fresh_interpreter):
    """One run on ranks started for it, which end after it."""
    context = mp.get_context("spawn") if fresh_interpreter else _forkserver()
    with tempfile.TemporaryDirectory() as tmp:
        processes = [context.Process(target=_rank_main,
                                     args=(rank, world_size, tmp, fn, args, timeout_s, may_die,
                                           dict(os.environ)))
                     for rank in range(world_size)]
        for process in processes:
            process.start()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for process in processes:  # a rank stuck on a dead peer fails after timeout_s
            process.join(max(0.0, deadline - time.monotonic()))
        stuck = [rank for rank, p in enumerate(processes) if p.is_alive()]
        if stuck:
            _kill_with_stacks([processes[r] for r in stuck])
            raise RuntimeError(f"rank(s) {stuck} still running after {JOIN_TIMEOUT_S} s: killed "
                               "(their stacks are in the output above)")
        results = []
        for rank, process in enumerate(processes):
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


def _rank_main(rank, world_size, tmp, fn, args, timeout_s, may_die, environment):
    _take_environment(environment)
    _start_rank(rank, world_size, tmp, timeout_s)
    saved = _call(fn, rank, world_size, args)
    partial = os.path.join(tmp, f"rank{rank}.pt.partial")  # written aside and renamed, so a
    with open(partial, "wb") as file:                        # result file is always whole
        file.write(saved)
    os.replace(partial, os.path.join(tmp, f"rank{rank}.pt"))
    _end_rank(may_die)


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
def in_turn(rank: int, world_size: int, calls: tuple) -> list:
    """Each ``(fn, args)`` of ``calls`` as ``fn(rank, world_size, *args)`` on this rank, one
    after another in one run (a barrier between them, so what one call saved is whole
    before the next reads it): what each returned. For runs that build on each other (a
    checkpoint saved by one and loaded by the next) or share what a process makes once (a
    device mesh)."""
    results = []
    for fn, args in calls:
        results.append(fn(rank, world_size, *args))
        dist.barrier()
    return results


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
