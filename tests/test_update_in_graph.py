"""The optimizer's update in the graph, bucket by bucket ([Note: the update in the graph] in
zero_fx/runtime/update/graph_update.py), against the update after the graph: the parameters and
the optimizer's state bit for bit after every step, at stages 1-3 on 2 and 4 gloo ranks,
fp32 and bf16, AdamW (its fused kernel too) and SGD with momentum, a scheduler,
accumulation; each parameter's update against single-process eager; what stays after the
graph (clipping, fp16 loss scaling with an overflowed step) and says why; checkpoints passed
both ways between the two modes. One launch per world size runs every case."""

from __future__ import annotations

import functools
import os
import tempfile

import pytest
import torch

from support import models
from support.ranks import run_ranks
from support.training import check_updates
from zero_fx import MixedPrecision, zero_compile
from zero_fx.passes.common.predicates import is_update, is_wait

STEPS = 5
OVERFLOW_STEP = 2
"""fp16: the step whose loss is scaled past fp16's range, so the loss scaler skips it."""
EXACT = 0.0
"""The two modes' difference: torch's own step on the same shards, one bucket at a time, is
elementwise the same arithmetic (measured 0 in every case)."""

CASES = {
    # name: (stage, optimizer, zero_compile options, with a scheduler)
    "stage1_adamw": (1, "adamw", {}, True),
    "stage2_adamw": (2, "adamw_fused", {}, True),
    "stage3_adamw": (3, "adamw", {}, True),
    "stage3_sgd": (3, "sgd_nesterov", {}, True),
    "stage2_bf16": (2, "adamw", {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)},
                    True),
    "stage3_bf16_sgd": (3, "sgd", {"mixed_precision": MixedPrecision(
        param_dtype=torch.bfloat16)}, True),
    "stage2_accumulated": (2, "adamw", {"accumulation_steps": 2}, True),
    "stage3_accumulated": (3, "sgd", {"accumulation_steps": 2}, True),
    "stage3_clipped": (3, "adamw", {"max_grad_norm": 0.05}, False),
    "stage3_fp16": (3, "adamw", {"mixed_precision": MixedPrecision(param_dtype=torch.float16)},
                    False),
}
WORLD_4_CASES = ("stage3_adamw", "stage2_accumulated")
AFTER_THE_GRAPH = ("stage3_clipped", "stage3_fp16")
"""Cases whose update waits for the graph in "auto" (the eager update itself: trained once)."""
FP32_CASES = ("stage1_adamw", "stage2_adamw", "stage3_adamw", "stage3_sgd", "stage2_accumulated",
              "stage3_accumulated", "stage3_clipped")


def _optimizer(model, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw_fused":  # one fused kernel over the tensors it steps (each bucket's)
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    if kind == "sgd_nesterov":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True,
                               weight_decay=0.01)
    return models.make_optimizer(model, kind)


def _step_fn(scheduler):
    def step(model, opt, x, y, scale):
        loss = models.loss_fn("gpt", model, x, y) * scale
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        opt.zero_grad()
        return loss
    return step


def _built(case: str):
    stage, kind, options, scheduled = CASES[case]
    model = models.build("gpt")
    opt = _optimizer(model, kind)
    scheduler = (torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if scheduled
                 else None)
    return model, opt, _step_fn(scheduler)


def _scale(case: str, step: int) -> torch.Tensor:
    return torch.tensor(1e8 if case == "stage3_fp16" and step == OVERFLOW_STEP else 1.0)


def _state(opt: torch.optim.Optimizer) -> list:
    """The optimizer's state tensors (this rank's shards of them), parameter by parameter in
    the groups' order (the update in the graph makes each parameter's state bucket by
    bucket, in the backward's order), each one's by name."""
    return [state[key].clone() for group in opt.param_groups for p in group["params"]
            for state in [opt.state.get(p, {})] for key in sorted(state)
            if isinstance(state[key], torch.Tensor)]


def _train(rank, world_size, case, mode, steps=range(STEPS), step=None, built=None):
    model, opt, fn = built or _built(case)
    stage, _, options, _ = CASES[case]
    step = step or zero_compile(fn, stage=stage, backend=models.BACKEND, bucket_bytes=4096,
                                optimizer_update=mode, **options)
    micro = options.get("accumulation_steps", 1)
    losses, states = [], []
    for i in steps:
        x, y = models.global_batch("gpt", i)
        per_rank = x.shape[0] // world_size
        local = slice(rank * per_rank, (rank + 1) * per_rank)
        outs = [step(model, opt, x[local].chunk(micro)[m], y[local].chunk(micro)[m], _scale(case, i))
                for m in range(micro)]
        losses.append(sum(loss.item() for loss in outs) / micro)
        states.append(_state(opt))
    return step, model, opt, {
        "losses": losses, "states": states, "params": step.full_parameters(),
        "reason": step.compilations[-1].update_reason, "compilations": len(step.compilations),
        "lr": opt.param_groups[0]["lr"], "optimizer_steps": step.optimizer_steps,
        "explain": str(step.explain())}


def both_modes_rank(rank: int, world_size: int, cases: tuple) -> dict:
    results = {case: {mode: _train(rank, world_size, case, mode)[3]
                      for mode in (("auto",) if case in AFTER_THE_GRAPH else ("auto", "eager"))}
               for case in cases}
    if world_size == 2:
        results["checkpoints"] = _checkpoints_both_ways(rank, world_size)
    return results


def _checkpoints_both_ways(rank: int, world_size: int) -> dict:
    """Two steps in one mode, a checkpoint, three in the other, from the checkpoint."""
    case = "stage3_adamw"
    out = {}
    folder = os.environ.get("ZERO_FX_TEST_CHECKPOINTS") or tempfile.gettempdir()
    for first, then in (("auto", "eager"), ("eager", "auto")):
        path = os.path.join(folder, f"update-in-graph-{first}-{os.getppid()}")
        built = _built_unscheduled(case)
        step, _, _, _ = _train(rank, world_size, case, first, range(2), built=built)
        step.save_checkpoint(path)
        model, opt, fn = _built_unscheduled(case)
        resumed = zero_compile(fn, stage=3, backend=models.BACKEND, bucket_bytes=4096,
                               optimizer_update=then)
        resumed.load_checkpoint(path, model, opt)
        out[f"{first}->{then}"] = _train(rank, world_size, case, then, range(2, STEPS),
                                         step=resumed, built=(model, opt, fn))[3]
    out["straight"] = _train(rank, world_size, case, "eager", built=_built_unscheduled(case))[3]
    return out


def _built_unscheduled(case: str):
    model = models.build("gpt")
    return model, _optimizer(model, CASES[case][1]), _step_fn(None)


@functools.lru_cache(maxsize=None)
def both_modes_run(world_size: int) -> list[dict]:
    cases = tuple(CASES) if world_size == 2 else WORLD_4_CASES
    return run_ranks(world_size, both_modes_rank, cases, shared=True)


def _assert_same(graph: dict, eager: dict, what: str) -> None:
    for i, (a, b) in enumerate(zip(graph["states"], eager["states"])):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)), (
            f"{what}: the optimizer's state after step {i} differs between the modes")
    for name, value in eager["params"].items():
        assert torch.equal(graph["params"][name], value), f"{what}: {name} differs"
    assert graph["losses"] == eager["losses"], what


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_update_in_the_graph_equals_the_update_after_it(world_size):
    """Bit for bit, every step: parameters, optimizer state (moments, momentum buffers, step
    counters), losses; the scheduler's rate read without recompiling."""
    for rank, result in enumerate(both_modes_run(world_size)):
        for case, modes in result.items():
            if case in ("checkpoints", *AFTER_THE_GRAPH):
                continue
            graph, eager = modes["auto"], modes["eager"]
            _assert_same(graph, eager, f"{case} at {world_size} ranks, rank {rank}")
            assert graph["compilations"] == 1, case
            assert eager["reason"] == "optimizer_update='eager'"
            assert graph["reason"] == "", f"{case}: {graph['reason']}"
            assert "Optimizer update: in the graph" in graph["explain"], case
            kind = CASES[case][1]
            kernels = ("fused kernel (fused=True)" if kind == "adamw_fused" else
                       "loop over each tensor (torch's default on a CPU); fused=True runs one")
            optimizer = "SGD" if kind.startswith("sgd") else "AdamW"
            assert f"  kernels: {optimizer}'s {kernels}" in graph["explain"], case


def test_what_needs_every_gradient_updates_after_the_graph_and_says_why():
    result = both_modes_run(2)[0]
    clipped = result["stage3_clipped"]["auto"]
    assert "max_grad_norm" in clipped["reason"] and "max_grad_norm" in clipped["explain"]
    fp16 = result["stage3_fp16"]["auto"]
    assert "loss scaling" in fp16["reason"]
    assert fp16["optimizer_steps"] < STEPS  # the overflowed step skipped


@pytest.mark.parametrize("case", FP32_CASES)
def test_each_parameter_updates_like_single_process_eager(case):
    """``‖p − p_ref‖ / ‖p_ref − p_0‖`` against plain PyTorch on the whole batch."""
    results = [r[case]["auto"] for r in both_modes_run(2)]
    check_updates(results, _reference(case))


@functools.lru_cache(maxsize=None)
def _reference(case: str) -> dict:
    model = models.build("gpt")
    opt = _optimizer(model, CASES[case][1])
    scheduler = (torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
                 if CASES[case][3] else None)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    clip = CASES[case][2].get("max_grad_norm")
    for i in range(STEPS):
        x, y = models.global_batch("gpt", i)
        models.loss_fn("gpt", model, x, y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if scheduler is not None:
            scheduler.step()
        opt.zero_grad()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "initial": initial}


def test_checkpoints_pass_both_ways_between_the_modes():
    for rank, result in enumerate(both_modes_run(2)):
        straight = result["checkpoints"]["straight"]
        for way in ("auto->eager", "eager->auto"):
            resumed = result["checkpoints"][way]
            for name, value in straight["params"].items():
                assert torch.equal(resumed["params"][name], value), f"{way}, rank {rank}: {name}"
            assert resumed["losses"] == straight["losses"][2:], way


def test_each_update_follows_its_reduction_and_the_last_read_of_its_masters(fake_world_of_two):
    """In the rewritten graph: one update per reduction bucket, right after the wait that
    lands it, each after every node that reads its parameters' shards; no gradient output."""
    model, opt, fn = _built_unscheduled("stage3_adamw")
    step = zero_compile(fn, stage=3, backend="eager", bucket_bytes=4096)
    x, y = models.global_batch("gpt", 0)
    step(model, opt, x[:4], y[:4], torch.tensor(1.0))
    gm = step.graphs[-1]
    nodes = list(gm.graph.nodes)
    updates = [n for n in nodes if is_update(n)]
    reductions = [n for n in nodes if "reduce_scatter" in str(n.target)]
    assert len(updates) == len(reductions) > 1
    updated = [name for u in updates for name in u.args[0]]
    assert sorted(updated) == sorted(n for n, p in model.named_parameters() if p.requires_grad)
    position = {n: i for i, n in enumerate(nodes)}
    shards = {n.meta["zero_param"]: n for n in nodes if "zero_param" in n.meta}
    for update in updates:
        for name in update.args[0]:  # every read of the shard, and the gathers' waits
            readers = [u for u in shards[name].users]
            readers += [w for r in readers for w in r.users if is_wait(w)]
            assert all(position[r] < position[update] for r in readers), (name, update)
    grads = [gm.graph.output_node().args[0][i] for i in gm.meta["zero_grad_slots"]]
    assert all(g is None for g in grads)
    explained = str(step.explain())
    assert f"{len(updates)} buckets" in explained and "in the graph" in explained


def _mlp_step(**options):
    model = models.build("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, options


def _plain(model, opt, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _clipping(model, opt, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss


def test_optimizer_update_graph_refuses_what_needs_every_gradient():
    """"graph" raises, naming the reason, where "auto" would wait: an option at the first call,
    a clip in the step before anything compiles."""
    x, y = models.global_batch("mlp", 0)
    model, opt, _ = _mlp_step()
    with pytest.raises(ValueError, match="max_grad_norm clips by the global norm"):
        zero_compile(_plain, stage=3, backend="eager", optimizer_update="graph",
                     max_grad_norm=1.0)(model, opt, x, y)
    model, opt, _ = _mlp_step()
    with pytest.raises(Exception, match="clips its gradients or calls a GradScaler.*Nothing was "
                                        "compiled"):
        zero_compile(_clipping, stage=3, backend="eager", optimizer_update="graph")(model, opt, x, y)
    with pytest.raises(ValueError, match="optimizer_update must be one of"):
        zero_compile(_plain, optimizer_update="fused")


def test_auto_waits_for_a_clip_in_the_step_and_for_step_hooks():
    x, y = models.global_batch("mlp", 0)
    model, opt, _ = _mlp_step()
    step = zero_compile(_clipping, stage=3, backend="eager")
    step(model, opt, x, y)
    assert "clips its gradients" in step.compilations[-1].update_reason
    assert "clips its gradients" in str(step.explain())
    model, opt, _ = _mlp_step()
    opt.register_step_post_hook(lambda *args: None)
    step = zero_compile(_plain, stage=3, backend="eager")
    step(model, opt, x, y)
    assert "step hooks" in str(step.explain())
    model, opt, _ = _mlp_step()
    step = zero_compile(_plain, stage=3, backend="eager")
    step(model, opt, x, y)
    assert step.compilations[-1].update_reason == "" and "in the graph" in str(step.explain())


@pytest.mark.parametrize("stage, kept_layers", [(2, 3), (3, 0.125)])
def test_the_peak_drops_by_the_gradient_shards(stage, kept_layers):
    """The step's peak (every tensor alive, counted by ``LiveTensorBytes``, the update
    included in both modes) without the gradient shards that lived until the end: a deep
    MLP whose model states dominate (16 layers, two per bucket), at one rank, where the
    shards are whole gradients. Measured: stage 3 drops all but 1/8 of a layer's (the peak
    is in the backward's last layer), stage 2 all but 3 layers' (its peak is where a
    bucket of whole gradients waits for its reduction)."""
    from bench.experiments.stages import measure_stage

    width, depth = 256, 16
    layer = width * width * 4
    peaks = {mode: measure_stage(stage, 1, width=width, depth=depth, optimizer_update=mode)
             for mode in ("auto", "eager")}
    drop = peaks["eager"]["peak_bytes"] - peaks["auto"]["peak_bytes"]
    assert drop == pytest.approx((depth - kept_layers) * layer, rel=0.01), (drop, layer)


def test_the_optimizer_kernel_benchmark_buckets_in_order_and_times_each_implementation():
    """bench/experiments/optimizer_kernels.py: buckets are runs of the parameters in order,
    each at most the cap unless one parameter is larger; a run on the tiny model reports
    every implementation, whole and per bucket."""
    import json

    from bench.experiments import optimizer_kernels

    params = torch.nn.ParameterList(torch.empty(n) for n in (10, 10, 30, 5, 5, 5))  # fp32
    buckets = optimizer_kernels.buckets_of(params, bucket_bytes=80)
    assert [[p.numel() for p in b] for b in buckets] == [[10, 10], [30], [5, 5, 5]]
    assert optimizer_kernels.main(["--model", "tiny", "--steps", "2", "--bucket-mib",
                                   "0.002"]) == 0
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "bench", "out", "optimizer-kernels-tiny-cpu.json")) as f:
        result = json.load(f)
    assert result["buckets"] > 1
    assert [r["implementation"] for r in result["rows"]] == list(optimizer_kernels.IMPLEMENTATIONS)
    assert all(r["whole_ms"] > 0 and r["per_bucket_ms"] > 0 for r in result["rows"])
