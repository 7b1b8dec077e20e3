"""``python -m zero_fx.estimate``: plan a language model's step on fake tensors and print
the cost model's estimate (see [Note: the cost model] in cost_model.py).

    python -m zero_fx.estimate --model llama-8b --world 8 --hardware 8xh100-nvlink \\
        --batch 1 --seq 4096 --dtype bfloat16
    python -m zero_fx.estimate --model llama-8b --world 32 --hardware 4x8xh100-ib   # flat
    python -m zero_fx.estimate --model llama-8b --mesh 4,8 --hardware 4x8xh100-ib   # hybrid
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from .analysis.cost_model import PRESETS, estimate
from .plan.offline import rewritten_step_on_fake
from .analysis.traffic import traffic_report
from .inspection.explain import explain_graph
from .plan.models import embedding_rows, import_builder, on_meta

MODELS = {"gpt-1b": "examples.gpt:gpt_1b", "llama-8b": "examples.llama:llama_8b"}
"""Shortcuts for --model (they live in this repository's examples/)."""


def load_model_builder(spec: str):
    """``module:function`` (or a shortcut in MODELS) -> a callable building the model."""
    spec = MODELS.get(spec, spec)
    if ":" not in spec:
        raise SystemExit(f"--model must be one of {sorted(MODELS)} or module:function, got {spec!r}")
    return import_builder(spec)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zero_fx.estimate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-1b",
                        help=f"{', '.join(MODELS)}, or module:function returning a model that "
                             "maps token ids (batch, seq) to logits")
    parser.add_argument("--vocab", type=int, default=None, help="default: the model's embedding rows")
    parser.add_argument("--world", type=int, default=None, help="ranks (default 8, or the mesh's)")
    parser.add_argument("--mesh", default=None, metavar="R,S",
                        help="hybrid sharding: R replicas of S-rank shard groups (R*S ranks)")
    parser.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3))
    parser.add_argument("--hardware", default="8xh100-nvlink", choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--bucket-bytes", type=int, default=None)
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--traffic", action="store_true", help="also print every collective")
    parser.add_argument("--explain", action="store_true",
                        help="print the whole explain() report of the planned step instead")
    args = parser.parse_args(argv)
    replicas, shards = mesh_shape(parser, args.mesh, args.world)
    over = f"{replicas} x {shards} ranks (hybrid)" if args.mesh else f"{shards} ranks"
    build = load_model_builder(args.model)
    start = time.perf_counter()
    print(f"planning {args.model} on fake tensors at {over}, stage {args.stage} ...",
          file=sys.stderr, flush=True)
    gm, plan = rewritten_step_on_fake(
        build, batch=args.batch, seq=args.seq, vocab_size=args.vocab or vocab_size_of(build),
        world_size=shards, replicas=replicas, stage=args.stage, dtype=getattr(torch, args.dtype),
        bucket_bytes=args.bucket_bytes, prefetch=args.prefetch)
    print(f"planned in {time.perf_counter() - start:.1f} s: {plan.total_numel / 1e9:.2f}B "
          f"parameters, {len(gm.graph.nodes)} nodes", file=sys.stderr)
    if args.explain:
        print(explain_graph(gm, plan, hardware=args.hardware,
                            title=f"zero_fx explain: {args.model}, planned on fake tensors, stage "
                                  f"{args.stage} over {over}"))
        return
    report = traffic_report(gm, plan)
    print(report if args.traffic else report.summary())
    print(estimate(gm, plan, args.hardware))


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
