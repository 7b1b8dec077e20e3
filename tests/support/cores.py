"""Multi-process jobs take turns on the cores across the suite's test processes (``pytest -n 2``).

A job of several ranks (a gloo group, a torchrun) wants every core of the 2-core CI box, and
its collectives wait on its slowest rank. Two such jobs at once, one per test process, put
4 to 8 busy processes on 2 cores: each rank waits at each collective for a peer the
scheduler has set aside, and a job took 2.5-2.8x its time alone (the MoE parity launch 170 s
against 61 s, the fine-tuning example 96 s against 35 s), more than the 2x of sharing the
cores. So a job takes the cores with ``the_cores()``: the other test process meanwhile runs
its one-process tests, or waits for the cores and then has them to itself.

The cores are leased in slots of two, one slot a job: on the 2-core box one job runs at a
time; with 16 cores and ``-n 8``, eight. A slot is a lock on a file that every test process
of this checkout opens (a second checkout, as a CI clone, has its own). The lease is
re-entrant within a process, so a job that starts another (a test's helper calling
``run_ranks``) does not wait on itself, and it is released when the process exits, however
it exits. Its file descriptor is not inherited: a rank or torchrun started under it cannot
keep holding it."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import subprocess
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORES_PER_JOB = 2
SLOTS = max(1, len(os.sched_getaffinity(0)) // CORES_PER_JOB)
_CHECKOUT = hashlib.sha1(ROOT.encode()).hexdigest()[:12]

_held = threading.RLock()
_depth = 0
_lease = None
_since = 0.0

JOB_LOG = os.environ.get("ZERO_FX_TESTS_JOB_LOG")
"""A file to which each job appends ``seconds held<TAB>test``: on 2 cores the suite takes
about as long as its jobs one after another, so this says where its time goes (pytest's
``--durations`` count the waits for the cores too)."""


def _log_job(seconds: float) -> None:
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
    with open(JOB_LOG, "a") as log:
        log.write(f"{seconds:.1f}\t{test}\n")


def _slot_path(slot: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"zero_fx-tests-cores-{_CHECKOUT}-{slot}.lock")


def _take_a_slot():
    """A free slot's file, locked; if none is free, waits for one."""
    for slot in range(SLOTS):
        lease = open(_slot_path(slot), "a")
        try:
            fcntl.flock(lease, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return lease
        except BlockingIOError:
            lease.close()
    lease = open(_slot_path(os.getpid() % SLOTS), "a")
    fcntl.flock(lease, fcntl.LOCK_EX)
    return lease


@contextlib.contextmanager
def the_cores():
    """Holds a slot of the machine's cores for a multi-process job: waits while other test
    processes hold them all."""
    global _depth, _lease, _since
    with _held:
        if _depth == 0:
            _lease = _take_a_slot()
            _since = time.monotonic()
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
            if _depth == 0:
                if JOB_LOG:
                    _log_job(time.monotonic() - _since)
                fcntl.flock(_lease, fcntl.LOCK_UN)
                _lease.close()
                _lease = None


def run(command: list[str], **options) -> subprocess.CompletedProcess:
    """``subprocess.run(command, **options)`` of a multi-process job (a torchrun, a benchmark
    that starts its ranks) holding the cores."""
    with the_cores():
        return subprocess.run(command, **options)
