"""One multi-process job at a time across the suite's test processes (``pytest -n 2``).

A job of several ranks (a gloo group, a torchrun) wants every core of the 2-core CI box, and
its collectives wait on its slowest rank. Two such jobs at once, one per test process, put
4 to 8 busy processes on 2 cores: each rank waits at each collective for a peer the
scheduler has set aside, and a job took 2.5-2.8x its time alone (the MoE parity launch 170 s
against 61 s, the fine-tuning example 96 s against 35 s), more than the 2x of sharing the
cores. So a job takes the cores with ``the_cores()``: the other test process meanwhile runs
its one-process tests, or waits for the cores and then has them to itself.

The lease is a lock on a file that every test process of this checkout opens (a second
checkout, as a CI clone, has its own). It is re-entrant within a process, so a job that
starts another (a test's helper calling ``run_ranks``) does not wait on itself, and it is
released when the process exits, however it exits. Its file descriptor is not inherited:
a rank or torchrun started under it cannot keep holding it."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEASE_PATH = os.path.join(
    tempfile.gettempdir(), f"zero_fx-tests-cores-{hashlib.sha1(ROOT.encode()).hexdigest()[:12]}.lock")

_held = threading.RLock()
_depth = 0
_lease = None


@contextlib.contextmanager
def the_cores():
    """Holds the machine's cores for a multi-process job: waits while another test process
    holds them."""
    global _depth, _lease
    with _held:
        if _depth == 0:
            _lease = open(LEASE_PATH, "a")
            fcntl.flock(_lease, fcntl.LOCK_EX)
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
            if _depth == 0:
                fcntl.flock(_lease, fcntl.LOCK_UN)
                _lease.close()
                _lease = None
