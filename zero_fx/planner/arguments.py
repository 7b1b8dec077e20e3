"""What the command lines of zero_fx share: one spelling of dtypes, both accepted; the
planner's expert- and tensor-parallelism options.

``--dtype`` takes ``fp32`` or ``float32``, ``bf16`` or ``bfloat16``, ``fp16`` or
``float16`` (the short names and torch's), in every command line that takes one
(``python -m zero_fx.plan``, ``python -m zero_fx.estimate``).

``--expert-parallel 1,2,4,8`` (with ``--hardware``) compares degrees of expert
parallelism in ``python -m zero_fx.plan`` ([Note: planning expert parallelism] in
zero_fx/planner/features/expert_parallel.py): ``add_expert_parallel_arguments(parser)`` adds them,
``expert_parallel_options(parser, args)`` checks them and gives what ``plan_model``'s
``ExpertParallelOptions`` and ``hardware`` are built from.

``--tp T`` (and ``--sequence-parallel``) plans Megatron's tensor parallelism over T ranks
with ZeRO over the rest, beside data parallelism alone ([Note: planning tensor
parallelism] in zero_fx/planner/features/tensor_parallel.py): ``add_tensor_parallel_arguments(parser)``,
``tensor_parallel_options(parser, args)``.

``--offload none|optimizer|parameters|auto`` (and ``--host-memory``) plans
``zero_compile(offload=...)``: device and host bytes, copies and the host's optimizer step
([Note: planning offload] in zero_fx/planner/features/offload.py): ``add_offload_arguments(parser)``,
``offload_options(parser, args)``.
"""

from __future__ import annotations

import argparse

import torch

from ..analysis.hardware import PRESETS
from .features.offload import check_offload

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


def parse_degrees(text: str) -> tuple[int, ...]:
    """``--expert-parallel``'s value: degrees separated by commas, ``1,2,4,8``."""
    try:
        degrees = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of degrees such as 1,2,4,8") from None
    if not degrees or min(degrees) < 1:
        raise argparse.ArgumentTypeError(f"degrees must be >= 1, got {text!r}")
    return degrees


def add_expert_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """The planner's ``--expert-parallel`` and ``--hardware``."""
    parser.add_argument("--expert-parallel", type=parse_degrees, default=(), metavar="P,P,...",
                        help="stage 3, mixture-of-experts models, with --seq: compare these "
                             "degrees of expert parallelism (each divides --world and a block's "
                             "experts): peak per rank, bytes per rank and step time")
    parser.add_argument("--expert-capacity-factor", type=float, default=None, metavar="C",
                        help="with --expert-parallel: size the buffers of received rows for "
                             "zero_compile(expert_capacity_factor=C) (rows past an expert's "
                             "capacity dropped) instead of the worst case")
    parser.add_argument("--hardware", default=None, choices=sorted(PRESETS),
                        help="cost-model preset for the step times of --expert-parallel, --tp, "
                             "--offload and --quantize "
                             "(default 8xh100-nvlink up to 8 ranks, else 4x8xh100-ib: nodes "
                             "of 8)")


def expert_parallel_options(parser: argparse.ArgumentParser, args) -> dict:
    """What ``plan_model``'s ``ExpertParallelOptions`` and ``hardware`` are built from
    ``args``: its degrees, capacity factor and the preset; a usage error where expert
    parallelism cannot apply."""
    degrees = args.expert_parallel
    if degrees:
        if args.stage != 3:
            parser.error(f"--expert-parallel needs --stage 3 (expert parallelism splits the "
                         f"experts' sharded weights; stages 0-2 keep every parameter whole), "
                         f"got --stage {args.stage}")
        if args.seq is None:
            parser.error("--expert-parallel compares working sets and step times: give --seq")
        uneven = [p for p in degrees if args.world % p]
        if uneven:
            parser.error(f"--expert-parallel {uneven[0]} does not divide --world {args.world}")
    factor = args.expert_capacity_factor
    if factor is not None and (not degrees or factor <= 0):
        parser.error(f"--expert-capacity-factor {factor} goes with --expert-parallel and must "
                     "be > 0")
    return {"expert_parallel": degrees, "hardware": args.hardware,
            "expert_capacity_factor": factor}


def add_tensor_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """The planner's ``--tp`` and ``--sequence-parallel``."""
    parser.add_argument("--tp", type=int, default=1, metavar="T",
                        help="tensor parallelism: split each block's attention and MLP "
                             "matrices (and the vocabulary-parallel embedding and head) over T "
                             "ranks, ZeRO over --world/T; per-rank figures are then a rank's "
                             "piece, set beside data parallelism alone (T divides --world, the "
                             "heads, key/value heads, width and feed-forward width)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="with --tp: split the norms' and residuals' activations over the "
                             "sequence too (Megatron's sequence parallelism)")


def tensor_parallel_options(parser: argparse.ArgumentParser, args) -> dict:
    """What ``plan_model``'s ``TensorParallelOptions`` are built from ``args``; a usage
    error where they cannot apply (the model's own sizes are checked by ``plan_model``)."""
    if args.tp < 1 or args.world % args.tp:
        divisors = ", ".join(str(d) for d in range(1, args.world + 1) if args.world % d == 0)
        parser.error(f"--tp {args.tp} must divide --world {args.world}: use one of {divisors}")
    if args.sequence_parallel and args.tp == 1:
        parser.error("--sequence-parallel splits what tensor parallelism leaves whole: give "
                     "--tp > 1 too")
    if args.tp > 1 and args.expert_parallel:
        parser.error("plan --tp and --expert-parallel one at a time")
    if args.tp > 1 and args.nodes > 1:
        parser.error("--tp with --nodes is not planned: leave out --nodes (--hardware "
                     "4x8xh100-ib prices ZeRO's data-parallel group across nodes)")
    return {"tensor_parallel": args.tp, "sequence_parallel": args.sequence_parallel}


def add_offload_arguments(parser: argparse.ArgumentParser) -> None:
    """The planner's ``--offload`` and ``--host-memory``."""
    parser.add_argument("--offload", default="none",
                        choices=("none", "optimizer", "parameters", "auto"),
                        help="plan zero_compile(offload=...): 'optimizer' keeps fp32 masters "
                             "and optimizer state on the host and steps there, 'parameters' "
                             "(stage 3) the parameter shards too, 'auto' the least that fits "
                             "--device-memory; sets every mode side by side (device and host "
                             "bytes, copies, the host's step on --hardware)")
    parser.add_argument("--host-memory", type=float, default=None, metavar="GB",
                        help="with --offload: host memory a rank may fill (default: the "
                             "--hardware preset's, 250 GB a rank of a DGX H100)")


def offload_options(parser: argparse.ArgumentParser, args) -> dict:
    """What ``plan_model``'s ``OffloadOptions`` are built from ``args``: the mode,
    ``host_memory`` and ``device_memory`` (bytes); a usage error where offload cannot
    apply."""
    try:
        check_offload(args.offload, stage=args.stage, device_memory=args.device_memory,
                      others=args.tp > 1 or bool(args.expert_parallel))
    except ValueError as err:
        parser.error(str(err))
    if args.host_memory is not None and (args.offload == "none" or args.host_memory <= 0):
        parser.error(f"--host-memory {args.host_memory:g} goes with --offload and must be > 0")
    gb = 1e9
    return {"offload": args.offload,
            "host_memory": None if args.host_memory is None else args.host_memory * gb,
            "device_memory": None if args.device_memory is None else args.device_memory * gb}
