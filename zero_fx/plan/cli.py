"""What the command lines of zero_fx share: one spelling of dtypes, both accepted.

``--dtype`` takes ``fp32`` or ``float32``, ``bf16`` or ``bfloat16``, ``fp16`` or
``float16`` (the short names and torch's), in every command line that takes one
(``python -m zero_fx.plan``, ``python -m zero_fx.estimate``).
"""

from __future__ import annotations

import argparse

import torch

DTYPES = {"fp32": torch.float32, "float32": torch.float32,
          "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
DTYPE_CHOICES = "fp32|float32, bf16|bfloat16, fp16|float16"


def parse_dtype(text: str) -> torch.dtype:
    """``--dtype``'s value: either spelling (any case) -> the torch dtype."""
    try:
        return DTYPES[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {DTYPE_CHOICES}") from None


def add_dtype_argument(parser: argparse.ArgumentParser, *, default, help: str) -> None:
    """``--dtype`` parsed by ``parse_dtype``; ``default`` is a spelling or None."""
    parser.add_argument("--dtype", type=parse_dtype, default=default,
                        metavar="DTYPE", help=f"{help} ({DTYPE_CHOICES})")
