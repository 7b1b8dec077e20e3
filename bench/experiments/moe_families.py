"""Every mixture-of-experts family the installed transformers ships, tried as a new user would.

    python -m bench.experiments.moe_families                          # every family, stages 0 and 3
    python -m bench.experiments.moe_families --families mixtral olmoe --stages 3
    python -m bench.experiments.moe_families --list                   # the families found, nothing run
    python -m bench.experiments.moe_families --stages 3 --expert-parallel 2   # experts split over 2 ranks

For each model type with a causal-LM class and an expert count in its config:

1. a tiny config (2 layers, width 32, 4 experts, top-2, the router's loss on where the config
   has ``output_router_logits``), built with ``AutoModelForCausalLM.from_config``;
2. 3 AdamW steps in eager on random tokens: a family that does not train there (a config the
   tiny sizes do not fit, a model that needs more than tokens) is listed as such;
3. at each stage, 2 gloo ranks: ``zero_fx.verify`` (2 steps under zero_fx against eager data
   parallelism, each parameter's update error); a ``GraphBreakWarning`` (the step then
   trains eagerly) or an exception is recorded with its first line.

A family is at parity when verify's worst update error is below 1e-3 and the step captured
without a graph break. The table goes to stdout and
``bench/out/moe_families-transformers-<version>.json`` (``-ep<P>`` after it with
``--expert-parallel``, where a family whose experts nothing splits is refused by
``zero_compile``'s own error).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..helpers.runs import OUT, free_port, join_spawned_group, write_json

EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
TINY = {
    "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 128, "max_position_embeddings": 64,
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 0, "num_layers": 2, "zero_expert_num": 2, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 8, "attention_dropout": 0.0, "hidden_dropout": 0.0,
    "output_router_logits": True, "router_aux_loss_coef": 0.02, "use_cache": False,
}
"""Sizes a tiny model takes where its config has the attribute."""
BATCH, SEQ, STEPS = 4, 16, 3
TOLERANCE = 1e-3


def families() -> dict[str, str]:
    """model type -> causal-LM class name, for every family whose default config counts
    experts."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    found = {}
    for model_type, class_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        try:
            config = transformers.AutoConfig.for_model(model_type)
        except Exception:  # noqa: BLE001 - a family whose config does not build bare
            continue
        text = getattr(config, "text_config", None) or config
        if any((getattr(text, name, 0) or 0) > 1 for name in EXPERT_COUNTS):
            found[model_type] = class_name
    return found


def tiny_model(model_type: str) -> torch.nn.Module:
    """The family's default config with ``TINY``'s sizes given to its constructor, so that
    what a config derives from them (head sizes, layer lists) follows; a nested text
    config gets them too."""
    import transformers
    default = transformers.AutoConfig.for_model(model_type)
    sizes = {name: value for name, value in TINY.items() if hasattr(default, name)}
    for name in ("mlp_only_layers", "layer_types"):  # lists sized by the default depth
        if isinstance(getattr(default, name, None), list):
            sizes[name] = getattr(default, name)[:TINY["num_hidden_layers"]]
    if hasattr(default, "kv_lora_rank"):  # latent attention: a key-value head per head
        sizes["num_key_value_heads"] = TINY["num_attention_heads"]
    if getattr(default, "pad_token_id", None) is not None:  # an id inside the tiny vocabulary
        sizes["pad_token_id"] = 0
    text = getattr(default, "text_config", None)
    if text is not None:
        sizes["text_config"] = {name: value for name, value in TINY.items()
                                if hasattr(text, name)}
    config = transformers.AutoConfig.for_model(model_type, **sizes)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def batch(rank: int = 0, world: int = 1, step: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, TINY["vocab_size"], (BATCH * 2, SEQ), generator=generator)
    return tokens[rank::world] if world > 1 else tokens


def train_step(model, opt, tokens):
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def first_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def eager(model_type: str) -> dict:
    """Does the tiny model train in eager? Its losses, or why not."""
    try:
        model = tiny_model(model_type)
        initial = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = [train_step(model, opt, batch(step=s)).item() for s in range(STEPS)]
    except Exception as error:  # noqa: BLE001 - the survey records why
        return {"trains": False, "why": first_line(error)}
    moved = sum(not torch.equal(p, q) for p, q in zip(model.parameters(), initial))
    finite = all(torch.isfinite(torch.tensor(losses)))
    return {"trains": bool(finite and moved), "losses": losses, "moved": moved,
            "parameters": sum(p.numel() for p in model.parameters()),
            "why": "" if finite and moved else "loss not finite or nothing moved"}


def _one_stage(model_type: str, stage: int, rank: int, world: int, expert_parallel: int) -> dict:
    import zero_fx
    result: dict = {"stage": stage}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = tiny_model(model_type)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            step = zero_fx.zero_compile(train_step, stage=stage, backend="aot_eager",
                                        expert_parallel=expert_parallel)
            result["worst"] = list(zero_fx.verify(step, model, opt, batch(rank, world),
                                                  steps=2).worst)
            result["split"] = [b.name for b in step.moe_blocks] if expert_parallel > 1 else []
        breaks = [str(w.message) for w in caught if w.category is zero_fx.GraphBreakWarning]
        result["graph_break"] = breaks[0][:300] if breaks else ""
    except Exception as error:  # noqa: BLE001 - the survey records why
        result["error"] = first_line(error)
        result["where"] = traceback.format_exc().strip().splitlines()[-3:-1]
    return result


def _rank(rank: int, world: int, port: int, model_type: str, stages: list, expert_parallel: int,
          queue) -> None:
    join_spawned_group(rank, world, port)
    import transformers
    transformers.logging.set_verbosity_error()
    results = [_one_stage(model_type, stage, rank, world, expert_parallel) for stage in stages]
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def under_zero_fx(model_type: str, stages: list, world: int, expert_parallel: int = 1) -> list[dict]:
    """Each stage on ``world`` spawned gloo ranks (fresh processes for each family, so no
    family's compiled code or patched classes reach the next)."""
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    port = free_port()
    procs = [context.Process(target=_rank,
                             args=(r, world, port, model_type, stages, expert_parallel, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=900)
    if any(p.exitcode != 0 for p in procs) or queue.empty():
        for p in procs:
            p.kill()
        return [{"stage": s, "error": f"a rank exited with {[p.exitcode for p in procs]}"}
                for s in stages]
    return queue.get()


CAPTURE_PREFIX = "CaptureError: zero_fx captures the whole step as one graph, and PyTorch could not: "
NOISE = ("Consider annotating your code using torch._check*(). ",)


def reason(error: str) -> str:
    """An error's first line, without what every capture error starts with."""
    if error.startswith(CAPTURE_PREFIX):
        error = "CaptureError: " + error[len(CAPTURE_PREFIX):]
    for noise in NOISE:
        error = error.replace(noise, "")
    return error[:110]


def verdict(result: dict) -> str:
    if "error" in result:
        return f"refused: {reason(result['error'])}"
    if result["graph_break"]:
        return "graph break: trains eagerly"
    name, error = result["worst"]
    if error >= TOLERANCE:
        return f"WRONG: {name} update {error:.1e}"
    return f"parity ({error:.0e})"


def main(argv=None) -> int:
    import transformers
    transformers.logging.set_verbosity_error()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", nargs="+", help="model types (default: every MoE family)")
    p.add_argument("--stages", nargs="+", type=int, default=[0, 3])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--expert-parallel", type=int, default=1, metavar="P",
                   help="zero_compile(expert_parallel=P) at every stage (results apart)")
    p.add_argument("--list", action="store_true")
    p.add_argument("--table", action="store_true",
                   help="print the table of this release's saved results, run nothing")
    args = p.parse_args(argv)
    if args.table:
        found = saved(args.expert_parallel)
        if not found:
            raise SystemExit(f"no saved results for transformers {transformers.__version__}: "
                             f"run python -m bench.experiments.moe_families first")
        print(table(found["families"], found["stages"], found["world"]))
        return 0
    found = families()
    if args.list:
        for model_type, class_name in found.items():
            print(f"{model_type:24} {class_name}")
        return 0
    chosen = args.families or list(found)
    started = time.monotonic()
    rows = {}
    for i, model_type in enumerate(chosen, 1):
        row = {"class": found.get(model_type, "?"), "eager": eager(model_type)}
        print(f"[{time.monotonic() - started:5.0f} s] {i}/{len(chosen)} {model_type}: eager "
              f"{'trains' if row['eager']['trains'] else 'does not train: ' + row['eager']['why']}",
              flush=True)
        if row["eager"]["trains"]:
            for result in under_zero_fx(model_type, args.stages, args.world,
                                        args.expert_parallel):
                row[f"stage {result['stage']}"] = result
                print(f"        stage {result['stage']}: {verdict(result)}", flush=True)
        rows[model_type] = row
        write(rows, args)  # after each family: a long survey stopped early keeps what it found
    path = write(rows, args)
    print(table(rows, args.stages, args.world))
    print(f"wrote {path}")
    return 0


def table(rows: dict, stages: list, world: int) -> str:
    lines = ["| family | eager, tiny config | "
             + " | ".join(f"stage {s}, {world} ranks" for s in stages) + " |",
             "|---|---|" + "---|" * len(stages)]
    for model_type, row in sorted(rows.items()):
        eager = "trains" if row["eager"]["trains"] else f"does not: {row['eager']['why'][:70]}"
        cells = [verdict(row[f"stage {s}"]) if f"stage {s}" in row else "" for s in stages]
        lines.append(f"| {model_type} | {eager} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _results_name(expert_parallel: int = 1) -> str:
    """This transformers release's results: bench/out/<name>.json (with expert parallelism,
    apart)."""
    import transformers
    split = f"-ep{expert_parallel}" if expert_parallel > 1 else ""
    return f"moe_families-transformers-{transformers.__version__}{split}"


def saved(expert_parallel: int = 1) -> dict:
    """This release's saved results, or {} before the first run."""
    path = os.path.join(OUT, f"{_results_name(expert_parallel)}.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def write(rows: dict, args) -> str:
    """The rows into this transformers release's JSON, beside the families an earlier run
    there found (a run of a few families updates theirs)."""
    import transformers
    earlier = saved(args.expert_parallel)
    same_run = earlier.get("stages") == args.stages and earlier.get("world") == args.world
    families = {**(earlier["families"] if same_run else {}), **rows}
    return write_json(_results_name(args.expert_parallel), {
        "transformers": transformers.__version__, "torch": torch.__version__,
        "stages": args.stages, "world": args.world, "expert_parallel": args.expert_parallel,
        "families": families})


if __name__ == "__main__":
    sys.exit(main())
