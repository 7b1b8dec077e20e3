"""Logging: quiet by default, one switch to see what zero_fx does.

zero_fx logs through ``logging`` under ``zero_fx`` (the plan, each compilation
and why it happened) and ``zero_fx.passes`` (the pass pipeline: each pass's
name, time and op-count changes). Nothing shows until you ask::

    zero_fx.set_logs("info")                 # plan, compilations, recompilation reasons
    zero_fx.set_logs("info", passes=True)    # ... and every pass of the pipeline
    ZERO_FX_LOGS=passes python train.py      # the same from the environment ("info", "debug")

Warnings (a dump folder written, a plot that cannot be drawn) show without
any set-up, through Python's last-resort handler.

One line of torch's is dropped (``quiet_torch_probes``): "No CUDA runtime is found, using
CUDA_HOME=...", which ``torch.utils.cpp_extension`` logs when Inductor imports it on a machine
whose CUDA toolkit has no runtime beside it. It says nothing about a CPU run, and every
rank of a newcomer's first run printed it.
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Union

LOGS_ENV = "ZERO_FX_LOGS"
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_handler: Optional[logging.Handler] = None


def set_logs(level: Union[str, int, None] = "info", *, passes: bool = False) -> None:
    """Print zero_fx's logs at ``level`` to stderr (None: back to quiet); ``passes``: also
    each pass of the pipeline with its time and op-count changes."""
    global _handler
    root, pipeline = logging.getLogger("zero_fx"), logging.getLogger("zero_fx.passes")
    if level is None:
        if _handler is not None:
            root.removeHandler(_handler)
            _handler = None
        root.setLevel(logging.NOTSET)
        pipeline.setLevel(logging.NOTSET)
        return
    numeric = _LEVELS.get(level.lower()) if isinstance(level, str) else level
    if not isinstance(numeric, int):
        raise ValueError(f"log level must be one of {sorted(_LEVELS)} or a logging level, "
                         f"got {level!r}")
    if _handler is None:
        _handler = logging.StreamHandler()
        _handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        root.addHandler(_handler)
    root.setLevel(numeric)
    pipeline.setLevel(min(numeric, logging.INFO) if passes else max(numeric, logging.WARNING))


NO_CUDA_RUNTIME = "No CUDA runtime is found"
"""The start of the one line of torch's that ``quiet_torch_probes`` drops."""


class _DropNoCudaRuntime(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(NO_CUDA_RUNTIME):
            return True
        import torch  # asked when the line comes, not when zero_fx is imported

        return torch.cuda.is_available()


def quiet_torch_probes() -> None:
    """Drop torch's "No CUDA runtime is found" line where no CUDA device is at hand (there it
    says nothing); every other record of that logger passes. Idempotent."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    if not any(isinstance(f, _DropNoCudaRuntime) for f in logger.filters):
        logger.addFilter(_DropNoCudaRuntime())


def set_logs_from_environment() -> None:
    """``ZERO_FX_LOGS=info|passes|debug`` (read once, when zero_fx is imported)."""
    value = os.environ.get(LOGS_ENV, "").strip().lower()
    if not value:
        return
    if value == "passes":
        set_logs("info", passes=True)
    elif value in _LEVELS:
        set_logs(value, passes=value == "debug")
    else:
        logging.getLogger("zero_fx").warning(
            "zero_fx: ignoring %s=%r: use info, passes or debug", LOGS_ENV, value)
