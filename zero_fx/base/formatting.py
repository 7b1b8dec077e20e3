"""Numbers and names as the inspection reports print them."""

from __future__ import annotations

import torch

_SHORT_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
                 torch.float64: "f64", torch.int64: "i64", torch.int32: "i32", torch.bool: "b8",
                 torch.uint8: "u8", torch.int8: "i8"}


def short_dtype(dtype: torch.dtype) -> str:
    return _SHORT_DTYPES.get(dtype, str(dtype).removeprefix("torch."))


def format_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def ranks_phrase(size: int, replicas: int = 1) -> str:
    """``2 rank(s)``, or with hybrid sharding ``2 replicas of 4 rank(s)``."""
    return f"{replicas} replicas of {size} rank(s)" if replicas > 1 else f"{size} rank(s)"


def format_seconds(s: float) -> str:
    return f"{1e3 * s:.2f} ms" if s < 1 else f"{s:.2f} s"
