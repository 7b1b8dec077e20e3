"""Progress for a user who waits on a compilation: each phase is logged (INFO) with its
time, and one WARNING says what is compiling when a compilation passes
``SLOW_COMPILE_SECONDS``. Without ``zero_fx.set_logs("info")`` only the warning shows."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Iterator, Optional

log = logging.getLogger("zero_fx")

SLOW_COMPILE_SECONDS = 60.0
"""A compilation still running after this long logs one warning."""


class CompileProgress:
    """``with CompileProgress(name) as progress:``, then ``with progress.phase("...")``
    around each phase of the compilation."""

    def __init__(self, step_name: str, warn_after: Optional[float] = None):
        self.step_name = step_name
        self.warn_after = SLOW_COMPILE_SECONDS if warn_after is None else warn_after
        self.now = "starting"
        """The phase running now, as the warning names it."""
        self._started = 0.0
        self._timer: Optional[threading.Timer] = None

    def __enter__(self) -> "CompileProgress":
        self._started = time.perf_counter()
        self._timer = threading.Timer(self.warn_after, self._warn_slow)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()

    @contextlib.contextmanager
    def phase(self, what: str) -> Iterator[None]:
        """Log ``what`` (a phase of the compilation, in words) with its time once it ends."""
        self.now = what
        start = time.perf_counter()
        yield
        log.info("zero_fx: %s: %s in %.1f s", self.step_name, what, time.perf_counter() - start)

    def _warn_slow(self) -> None:
        log.warning(
            "zero_fx: compiling %s has taken %.0f s so far, now %s. With regional=True (the "
            "default) Inductor compiles each distinct run of compute once, so a deeper model "
            "adds little; regional=False compiles the whole step as one program, whose time "
            "grows with depth. backend='aot_eager' compiles in seconds for debugging, and "
            "zero_fx.set_logs('info') logs each phase with its time.",
            self.step_name, time.perf_counter() - self._started, self.now)
