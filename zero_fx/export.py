"""Write a plain PyTorch ``state_dict`` from a zero_fx checkpoint, offline, in one process.

    python -m zero_fx.export CHECKPOINT_DIR model.pt [--dtype bfloat16]

The result loads with ``model.load_state_dict(torch.load("model.pt"))`` into the
model the run trained, without zero_fx or a process group: every parameter
whole (fp32 masters unless ``--dtype``), tied names and buffers included.
Only the model's entries are read, and with ``--dtype`` they are cast a group at a
time, so memory is the written state dict plus one group as saved ([Note: exporting
in bounded memory] in checkpoint/offline.py); the optimizer's state stays on disk.
"""

from __future__ import annotations

import argparse
import time

import torch

from .checkpoint.offline import model_state_dict
from .base.formatting import format_bytes
from .planner.arguments import add_dtype_argument


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zero_fx.export", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a folder written by step.save_checkpoint")
    parser.add_argument("output", help="the .pt file to write")
    add_dtype_argument(parser, default=None,
                       help="cast floating parameters (default: as saved, the fp32 masters)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    print(f"reading {args.checkpoint} ...", flush=True)
    state = model_state_dict(args.checkpoint, args.dtype)
    torch.save(state, args.output)
    size = sum(t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values())
    print(f"wrote {args.output}: {len(state)} entries, {format_bytes(size)}, "
          f"in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
