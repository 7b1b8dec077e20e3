"""``python -m zero_fx.estimate``: plan a language model's step on fake tensors and print
the cost model's estimate (see [Note: the cost model] in cost_model.py).

    python -m zero_fx.estimate --model llama3-8b --world 8 --hardware 8xh100-nvlink \\
        --batch 1 --seq 4096 --dtype bf16
    python -m zero_fx.estimate --model llama3-8b --world 32 --hardware 4x8xh100-ib   # flat
    python -m zero_fx.estimate --model llama3-8b --mesh 4,8 --hardware 4x8xh100-ib   # hybrid
    python -m zero_fx.estimate --model llama3-8b --layers 2 --seq 512   # a quick look

--model takes the same names as python -m zero_fx.plan; their shapes ship with zero_fx
(zero_fx/planner/models.py) and are built as zero_fx's own torch modules, with torch
alone. The old name llama-8b still means llama3-8b. --dtype takes either spelling:
fp32|float32, bf16|bfloat16, fp16|float16.
"""

from __future__ import annotations

import argparse
import sys
import time

from .analysis.hardware import PRESETS
from .analysis.cost_model import estimate
from .planner.offline import rewritten_step_on_fake
from .analysis.traffic import traffic_report
from .config import GRADIENT_FORMATS, WEIGHT_FORMATS
from .inspection.explain import explain_graph
from .planner.arguments import add_dtype_argument
from .planner.models import (MODEL_NAMES_HELP, NAMED, embedding_rows, import_builder, named_builder,
                          named_model, on_meta)
from .models import max_positions


def load_model_builder(spec: str, layers: int | None = None):
    """A name in ``zero_fx.planner.models.NAMED`` (or an old name), or ``module:function`` -> a
    callable building the model; ``layers``: a named model with that many blocks."""
    name = named_model(spec)
    if name is not None:
        return named_builder(name, layers)
    if ":" not in spec:
        raise SystemExit(f"--model must be one of {MODEL_NAMES_HELP}, or module:function; "
                         f"got {spec!r}")
    if layers is not None:
        raise SystemExit("--layers changes the depth of a named model only")
    return import_builder(spec)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m zero_fx.estimate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-1b",
                        help=f"{MODEL_NAMES_HELP}; or module:function returning a model that "
                             "maps token ids (batch, seq) to logits (default: gpt-1b)")
    parser.add_argument("--layers", type=int, default=None,
                        help="a named model with this many blocks instead of its own: a quicker "
                             "plan, whose numbers are the shallower model's")
    parser.add_argument("--vocab", type=int, default=None, help="default: the model's embedding rows")
    parser.add_argument("--world", type=int, default=None, help="ranks (default 8, or the mesh's)")
    parser.add_argument("--mesh", default=None, metavar="R,S",
                        help="hybrid sharding: R replicas of S-rank shard groups (R*S ranks)")
    parser.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3))
    parser.add_argument("--hardware", default="8xh100-nvlink", choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=2048,
                        help="tokens per sequence (at most a named model's positions)")
    add_dtype_argument(parser, default="bf16",
                       help="the dtype the model is built in; default bf16")
    parser.add_argument("--bucket-bytes", type=int, default=None)
    parser.add_argument("--prefetch-buckets", type=int, default=None, metavar="N",
                        help="stage 3: each all-gather is issued N buckets ahead of its use "
                             "(zero_compile's prefetch_buckets; default 1)")
    parser.add_argument("--reduce-overlap-buckets", type=int, default=None, metavar="N",
                        help="each gradient reduction is waited for N reductions after it is "
                             "issued (zero_compile's reduce_overlap_buckets; default 1)")
    parser.add_argument("--prefetch", type=int, default=None, metavar="N",
                        help="the old option: both of the above")
    parser.add_argument("--quantize-weights", default=None, choices=WEIGHT_FORMATS,
                        help="stage 3: gathers move quantized blocks (docs/quantization.md)")
    parser.add_argument("--quantize-gradients", default=None, choices=GRADIENT_FORMATS,
                        help="reductions move quantized blocks, summed in fp32")
    parser.add_argument("--quantize-block", type=int, default=256, metavar="N",
                        help="elements per quantized block (default 256)")
    parser.add_argument("--traffic", action="store_true", help="also print every collective")
    parser.add_argument("--explain", action="store_true",
                        help="print the whole explain() report of the planned step instead")
    return parser


def main(argv=None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    replicas, shards = mesh_shape(parser, args.mesh, args.world)
    over = f"{replicas} x {shards} ranks (hybrid)" if args.mesh else f"{shards} ranks"
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers must be >= 1, got {args.layers}")
    name = named_model(args.model)
    if name is not None and args.seq > max_positions(NAMED[name]):
        parser.error(f"--seq {args.seq} is longer than {name}'s "
                     f"{max_positions(NAMED[name])} positions")
    build = load_model_builder(name or args.model, args.layers)
    label = name or args.model
    if args.layers is not None:
        label += f" with {args.layers} of its {NAMED[name].n_layer} blocks"
    start = time.perf_counter()
    print(f"planning {label} on fake tensors at {over}, stage {args.stage} ...",
          file=sys.stderr, flush=True)
    gm, plan = rewritten_step_on_fake(
        build, batch=args.batch, seq=args.seq, vocab_size=args.vocab or vocab_size_of(build),
        world_size=shards, replicas=replicas, stage=args.stage, dtype=args.dtype,
        bucket_bytes=args.bucket_bytes, quantize_weights=args.quantize_weights,
        quantize_gradients=args.quantize_gradients, quantize_block=args.quantize_block,
        **overlap_options(args))
    print(f"planned in {time.perf_counter() - start:.1f} s: {plan.total_numel / 1e9:.2f}B "
          f"parameters, {len(gm.graph.nodes)} nodes", file=sys.stderr)
    if args.explain:
        print(explain_graph(gm, plan, hardware=args.hardware,
                            title=f"zero_fx explain: {label}, planned on fake tensors, stage "
                                  f"{args.stage} over {over}"))
        return
    report = traffic_report(gm, plan)
    print(report if args.traffic else report.summary())
    print(estimate(gm, plan, args.hardware))


def overlap_options(args) -> dict:
    """``prefetch_buckets`` and ``reduce_overlap_buckets`` from their flags, or from the old
    ``--prefetch`` (which set both)."""
    if args.prefetch is not None:
        print("note: --prefetch is now --prefetch-buckets and --reduce-overlap-buckets",
              file=sys.stderr)
    old = 1 if args.prefetch is None else args.prefetch
    return {"prefetch_buckets": old if args.prefetch_buckets is None else args.prefetch_buckets,
            "reduce_overlap_buckets": (old if args.reduce_overlap_buckets is None
                                       else args.reduce_overlap_buckets)}


def mesh_shape(parser, mesh, world) -> tuple[int, int]:
    """(replicas, ranks per shard group) from ``--mesh R,S`` or ``--world N`` (flat: 1, N)."""
    if mesh is None:
        world = 8 if world is None else world
        if world < 1:
            parser.error(f"--world must be >= 1, got {world}")
        return 1, world
    try:
        replicas, shards = (int(x) for x in mesh.split(","))
    except ValueError:
        parser.error(f"--mesh takes replicas,shards (e.g. 4,8), got {mesh!r}")
    if replicas < 1 or shards < 2:
        parser.error(f"--mesh {mesh}: at least 1 replica of at least 2 ranks")
    if world is not None and world != replicas * shards:
        parser.error(f"--world {world} is not --mesh {mesh}'s {replicas * shards} ranks")
    return replicas, shards


def vocab_size_of(build) -> int:
    """Rows of the model's first ``nn.Embedding`` (built on the meta device)."""
    rows = embedding_rows(on_meta(build))
    if rows is None:
        raise SystemExit("the model has no nn.Embedding; pass --vocab")
    return rows


if __name__ == "__main__":
    main()
