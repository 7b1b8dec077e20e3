"""``python -m zero_fx.plan``: will this model fit at this world size, and what will a step move?

    python -m zero_fx.plan --model llama3-70b --world 64 --stage 3 --dtype bf16
    python -m zero_fx.plan --model zero-paper-7.5b --world 64 --dtype fp16
    python -m zero_fx.plan --model path/to/config.json --world 8 --seq 4096 --device-memory 80
    python -m zero_fx.plan --model llama3-70b --nodes 8 --world 64 --dtype bf16   # flat or hybrid
    python -m zero_fx.plan --model gpt-64k --world 64 --dtype fp16 --seq 2048 --tp 8 --device-memory 80
    python -m zero_fx.plan --model zero-offload-13b --world 1 --dtype fp16 --offload optimizer \
        --hardware 1xv100-32gb-pcie3 --device-memory 32 --seq 1024 --recompute blocks
    python -m zero_fx.plan --model gpt2 --world 32 --dtype bf16 --seq 512 --quantize \
        --hardware 4x8xh100-ib
    python -m zero_fx.plan --model llama3-8b --world 8 --dtype bf16 --optimizer muon

Nothing is allocated: the model is built on the meta device (see [Note: what the
planner counts] in zero_fx/planner/report.py).

--model takes the same names as python -m zero_fx.estimate; their shapes ship with
zero_fx (zero_fx/planner/models.py). A named model is built with HuggingFace transformers
when it is installed (pip install 'transformers>=4.57,<6'), else as zero_fx's own torch
module of the same shapes and parameter count (gpt-1b always: transformers has no GPT-2
without biases). A config.json needs transformers. --dtype takes either spelling:
fp32|float32, bf16|bfloat16, fp16|float16.
"""

from __future__ import annotations

import argparse
import sys

from .arguments import (add_dtype_argument, add_expert_parallel_arguments, add_offload_arguments,
                        add_tensor_parallel_arguments, expert_parallel_options,
                        offload_options, tensor_parallel_options)
from .features.expert_parallel import ExpertParallelOptions
from .models import MODEL_NAMES_HELP, model_source
from .features.offload import OffloadOptions
from .plan_model import plan_model
from .printing import format_report
from .question import Workload
from .report import OPTIMIZER_BYTES
from .features.whole_updates import MUON
from .features.tensor_parallel import TensorParallelOptions


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m zero_fx.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True,
                        help=f"{MODEL_NAMES_HELP}; a HuggingFace config.json (or its folder); "
                             "or module:function returning an nn.Module")
    parser.add_argument("--world", type=int, required=True, help="number of ranks")
    parser.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3),
                        help="the stage to detail (buckets, working set); the tables show all")
    add_dtype_argument(parser, default="fp32",
                       help="compute dtype, default fp32; bf16/fp16 mean mixed precision with fp32 "
                            "masters")
    parser.add_argument("--optimizer", default="adamw", choices=sorted([*OPTIMIZER_BYTES, MUON]),
                        help="muon: Muon on the blocks' 2-D weights, each stepped whole on one "
                             "owner rank, AdamW on the rest (its owners' compute, memory and "
                             "exchanges are priced)")
    parser.add_argument("--seq", type=int, default=None,
                        help="tokens per sequence: trace the step's working set at this length")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank (with --seq)")
    parser.add_argument("--recompute", default="none", choices=("none", "blocks", "auto"),
                        help="activation recompute, as zero_compile(recompute=...), in the "
                             "working set")
    parser.add_argument("--activation-budget", type=float, default=None, metavar="FRACTION",
                        help="with --recompute auto: the fraction of activations kept (default 0.5)")
    parser.add_argument("--device-memory", type=float, default=None, metavar="GB",
                        help="say whether the estimate fits in this many GB per device")
    parser.add_argument("--nodes", type=int, default=1,
                        help="ranks are on this many nodes: set flat and hybrid sharding (one "
                             "replica per node) side by side, bytes sent within and across nodes")
    parser.add_argument("--buckets", action="store_true", help="list every bucket")
    add_expert_parallel_arguments(parser)
    add_tensor_parallel_arguments(parser)
    add_offload_arguments(parser)
    parser.add_argument("--quantize", action="store_true",
                        help="price ZeRO++'s quantized collectives (zero_compile's "
                             "quantize_weights / quantize_gradients, with --seq) on --hardware: "
                             "bytes, quantizing's compute and the step of each, and what pays")
    return parser


def main(argv=None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.world < 1:
        parser.error(f"--world must be >= 1, got {args.world}")
    if args.nodes < 1 or args.world % args.nodes:
        parser.error(f"--world {args.world} must split evenly over --nodes {args.nodes}")
    if args.batch < 1 or (args.seq is not None and args.seq < 1):
        parser.error("--batch and --seq must be >= 1")
    experts, tp = expert_parallel_options(parser, args), tensor_parallel_options(parser, args)
    offload = offload_options(parser, args)
    source = model_source(args.model)
    print(f"building {source.description} on the meta device ...", file=sys.stderr, flush=True)
    if args.quantize:
        print("--quantize traces the step on fake tensors twice for each configuration of "
              "quantized collectives (about a minute for GPT-2) ...", file=sys.stderr, flush=True)
    workload = Workload(world_size=args.world, stage=args.stage, dtype=args.dtype,
                        optimizer=args.optimizer, batch=args.batch, seq=args.seq,
                        recompute=None if args.recompute == "none" else args.recompute,
                        activation_memory_budget=args.activation_budget)
    try:
        report = plan_model(
            source, workload,
            expert_parallel=ExpertParallelOptions(experts["expert_parallel"],
                                                  experts["expert_capacity_factor"]),
            tensor_parallel=TensorParallelOptions(tp["tensor_parallel"],
                                                  tp["sequence_parallel"]),
            offload=OffloadOptions(offload["offload"], offload["host_memory"],
                                   offload["device_memory"]),
            quantize=args.quantize, nodes=args.nodes, hardware=experts["hardware"])
    except ValueError as err:  # what the model's own sizes rule out (--tp, --expert-parallel,
        # a preset without host memory for --offload)
        parser.error(str(err))
    print(format_report(report, device_memory_gb=args.device_memory, all_buckets=args.buckets))

