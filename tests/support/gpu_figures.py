"""What the cuda tier measured (CUDA peaks, estimates, step times), for bench/gpu_check.sh's
summary: ``record(test, **figures)`` appends one JSON line to the file named by
``ZERO_FX_GPU_FIGURES``, and does nothing when it is not set (a plain pytest run)."""

from __future__ import annotations

import json
import os

FIGURES_ENV = "ZERO_FX_GPU_FIGURES"


def record(test: str, **figures) -> None:
    """Append ``{"test": test, **figures}`` (numbers, strings, lists: JSON) to the figures file."""
    path = os.environ.get(FIGURES_ENV)
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:  # one line per write: parallel writers do not interleave lines
        f.write(json.dumps({"test": test, **figures}, default=str) + "\n")
