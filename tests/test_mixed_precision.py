"""Mixed precision at world size 2: bf16 and fp16 against the fp32 reference, and what moves.

Tolerances: the model computes in 16 bits (8 mantissa bits in bf16, 11 in
fp16) while the reference computes in fp32. After 5 SGD steps, measured
(2026-11-24, relative error of the mean loss / of the worst fp32 master):
bf16 1.5e-5 / 2.9e-3 at every stage (1.9e-5 / 3.0e-3 with accumulation);
fp16 1.3e-6 / 3.3e-4. The bounds sit at about 3x that: bf16 5e-5 / 9e-3,
fp16 4e-6 / 1e-3. SGD, not AdamW: AdamW's update of an element with a
near-zero gradient is its sign, which 16-bit noise flips.

Each parameter's update error (training.update_error, ``‖p − p_ref‖ / ‖p_ref − p_0‖``),
measured (2026-11-28): bf16 1.27e-2 at every stage (blocks.1.ln2.weight), 1.34e-2 with
accumulation, 8.5e-3 lowered by Inductor; fp16 2.0e-3 (blocks.0.ln2.weight). The norms'
weights move least relative to their gradients' 16-bit rounding. Bounds about 3x: bf16
4e-2, fp16 6e-3.
"""

import functools

import pytest
import torch

from support import feature_runs
from support import models
from support.feature_runs import reference_run
from support.ranks import in_turn, run_ranks
from support.training import parity_errors
from zero_fx import MixedPrecision
from zero_fx.analysis.host_syncs import counting_host_syncs

BF16 = (("mixed_precision", MixedPrecision(param_dtype=torch.bfloat16, output_dtype=torch.float32)),)
FP16 = (("mixed_precision", MixedPrecision(param_dtype=torch.float16, output_dtype=torch.float32)),)
UNSCHEDULED = (("bucket_bytes", 0), ("persistence_threshold", 0))
BF16_TOLERANCES = (5e-5, 9e-3, 4e-2)  # loss, worst master, worst update (module docstring)
FP16_TOLERANCES = (4e-6, 1e-3, 6e-3)
FP32_REDUCE = (("mixed_precision", MixedPrecision(
    param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)),)

TWO_RANK_RUNS = ((0, BF16, 1), (1, FP16, 1), (3, FP16, 1), (1, UNSCHEDULED, 1),
                 *((stage, UNSCHEDULED + precision, 1) for stage in (1, 3)
                   for precision in (BF16, FP32_REDUCE)),
                 (0, BF16, 2), (3, BF16, 2))
"""(stage, options, micro-batches) of the feature_runs.zero_fx_rank runs on two ranks only
this file reads, done in one run (``two_ranks``); bf16 at stages 1-3 and UNSCHEDULED at
stage 3 are shared with test_offload and test_model_kinds through feature_runs.zero_fx_run."""


@functools.lru_cache(maxsize=None)
def two_ranks() -> dict:
    """Every two-rank run of this file not shared with another, in one run (in_turn):
    TWO_RANK_RUNS by (stage, options, micro-batches), the overflowing fp16 runs by
    ("overflow", optimizer), the sub-ulp runs by ("sub-ulp", stage)."""
    calls = [(feature_runs.zero_fx_rank, ("gpt", stage, "sgd", options, micro, False,
                                          feature_runs.STEPS))
             for stage, options, micro in TWO_RANK_RUNS]
    calls += [(overflowing_fp16_rank, (optimizer,)) for optimizer in OPTIMIZERS]
    calls += [(sub_ulp_rank, (stage,)) for stage in (0, 3)]
    keys = [*TWO_RANK_RUNS, *(("overflow", optimizer) for optimizer in OPTIMIZERS),
            *(("sub-ulp", stage) for stage in (0, 3))]
    per_rank = run_ranks(2, in_turn, calls)
    return {key: [results[i] for results in per_rank] for i, key in enumerate(keys)}


def zero_fx_run(world_size, model_name, stage, options=(), micro_batches=1):
    """What feature_runs.zero_fx_run returns: from the launch of ``two_ranks`` where it is one
    of its runs."""
    if (world_size, model_name) == (2, "gpt") and (stage, options, micro_batches) in TWO_RANK_RUNS:
        return two_ranks()[(stage, options, micro_batches)]
    return feature_runs.zero_fx_run(world_size, model_name, stage, options=options,
                                    micro_batches=micro_batches)


def assert_close_to_fp32(results, loss_tolerance, param_tolerance, update_tolerance):
    errors = parity_errors(results, reference_run("gpt"), update_tolerance)
    assert errors.pop("loss") < loss_tolerance
    worst = max(errors, key=errors.get)
    assert errors[worst] < param_tolerance, f"{worst}: relative error {errors[worst]:.2e}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_trains_like_fp32_with_fp32_masters(stage):
    results = zero_fx_run(2, "gpt", stage, options=BF16)
    assert_close_to_fp32(results, *BF16_TOLERANCES)
    result = results[0]
    # the model computes in bf16; the optimizer steps on fp32 masters with fp32 state
    assert set(result["model_dtypes"].values()) == {torch.bfloat16}
    assert set(result["shard_dtypes"].values()) == {torch.float32}
    assert result["optimizer_state_dtypes"] == {torch.float32}
    assert {p.dtype for p in result["params"].values()} == {torch.float32}


@pytest.mark.inductor
def test_bf16_lowers_with_inductor():
    assert_close_to_fp32(zero_fx_run(2, "gpt", 3, options=BF16 + (("backend", "inductor"),)),
                         *BF16_TOLERANCES)


@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_with_loss_scaling_trains_like_fp32(stage):
    assert_close_to_fp32(zero_fx_run(2, "gpt", stage, options=FP16), *FP16_TOLERANCES)


@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_halves_the_bytes_every_gather_moves(stage):
    """Each all-gather moves bf16: half the bytes of the fp32 run, the same elements.
    Gradients are reduced in bf16 by default, in fp32 when reduce_dtype says so."""
    fp32 = zero_fx_run(2, "gpt", stage, options=UNSCHEDULED)[0]["traffic"]
    bf16 = zero_fx_run(2, "gpt", stage, options=UNSCHEDULED + BF16)[0]["traffic"]
    bf16_fp32_reduce = zero_fx_run(2, "gpt", stage, options=UNSCHEDULED + FP32_REDUCE)[0]["traffic"]
    assert bf16.numel_by_kind() == fp32.numel_by_kind()
    assert bf16.bytes_by_kind()["all_gather"] * 2 == fp32.bytes_by_kind()["all_gather"] > 0
    assert bf16.bytes_by_kind()["reduce_scatter"] * 2 == fp32.bytes_by_kind()["reduce_scatter"]
    assert bf16_fp32_reduce.bytes_by_kind()["reduce_scatter"] == fp32.bytes_by_kind()["reduce_scatter"]
    assert {c.dtype for c in bf16.collectives if c.kind == "all_gather"} == {torch.bfloat16}


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    # skips an overflowed step on the device ([Note: clipping and overflow])
    "fused adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True),
}


OVERFLOW_HISTORY = [
    (2.0 ** 16, 1, 0),  # 2^17: the fp16 seed is inf, skipped, halved
    (2.0 ** 15, 2, 0),  # 2^16 = 65536 > 65504, still inf
    (2.0 ** 15, 2, 1),  # fits: the first real step
    (2.0 ** 16, 2, 2),  # two clean steps in a row: doubled
    (2.0 ** 15, 3, 2),  # overflows again
]
"""(loss scale, skipped steps, optimizer steps) after each of ``overflowing_fp16_rank``'s five
calls: GradScaler's rule."""


def overflowing_fp16_rank(rank, world_size, optimizer="sgd"):
    """fp16 with the loss itself in fp16: a loss scale above 65504 makes the backward's seed
    inf, so the step overflows until the scale has halved below it."""
    from support import models
    from zero_fx import zero_compile

    model = models.build("gpt")
    opt = OPTIMIZERS[optimizer](model.parameters())
    policy = MixedPrecision(param_dtype=torch.float16, initial_scale=2.0 ** 17, growth_interval=2)
    step = zero_compile(models.training_step("gpt"), stage=3, backend=models.BACKEND,
                        mixed_precision=policy)
    history, params = [], []
    for i in range(5):
        x, y = models.global_batch("gpt", i)
        step(model, opt, x[rank::world_size], y[rank::world_size])
        history.append((step.loss_scale, step.skipped_steps, step.optimizer_steps))
        params.append(step.full_parameters())
    return {"history": history, "params": params}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_fp16_overflow_skips_the_step_and_the_scale_follows_gradscalers_rule(optimizer):
    from support import models

    initial = {n: p.detach().clone() for n, p in models.build("gpt").named_parameters()}
    result = two_ranks()[("overflow", optimizer)][0]
    assert result["history"] == OVERFLOW_HISTORY
    for name, value in initial.items():  # skipped steps changed nothing
        assert torch.equal(result["params"][1][name], value), name
    assert not torch.equal(result["params"][2]["wte.weight"], initial["wte.weight"])
    assert all(torch.equal(result["params"][4][n], result["params"][3][n]) for n in initial)


def growing_scale_rank(rank, world_size):
    """fp16 (the loss in fp32) with a loss scale that doubles after every clean step, so it
    climbs until the gradients overflow; every rank's quarter of each global batch holds the
    same rows, so each rank's gradients are the single process's (a rank's own backward on
    other rows would reach other magnitudes, which is the data, not the reduction)."""
    from support import models
    from zero_fx import zero_compile

    model = models.build("gpt")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = MixedPrecision(param_dtype=torch.float16, output_dtype=torch.float32,
                            initial_scale=2.0 ** 16, growth_interval=1)
    step = zero_compile(models.training_step("gpt"), stage=3, backend=models.BACKEND,
                        mixed_precision=policy)
    history = []
    for i in range(6):
        x, y = models.global_batch("gpt", i, size=2)
        x, y = x.repeat(4, 1), y.repeat(4, 1)  # the same global batch at 1 and 4 ranks
        rows = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
        step(model, opt, x[rows], y[rows])
        history.append((step.loss_scale, step.skipped_steps))
    return history


def test_fp16_loss_scale_does_not_fall_with_the_world_size():
    """[Note: divide before the sum] in passes/common/collective_code.py: each rank's gradients are
    divided by 4 before the reduce-scatter sums them, so 4 ranks overflow exactly where one
    does: the same skipped steps and the same scale. Summed first, the sum of 4 gradients
    overflowed at a quarter of the scale (measured before the change: of 6 steps 2 skipped at
    1 rank, 3 at 4 ranks; final scale 2^18 at 1 rank, 2^16 at 4)."""
    single = run_ranks(1, growing_scale_rank)[0]
    assert single[-1][1] > 0, single  # the scale reached the gradients' limit
    assert run_ranks(4, growing_scale_rank)[0] == single


@pytest.mark.parametrize("optimizer, reads", [("fused adamw", 0), ("sgd", 1)])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_an_fp16_step_reads_nothing_on_the_host_but_the_overflow_of_an_unfused_optimizer(
        optimizer, reads, clip):
    """Unscaling, the norm, the overflow check and the new scale stay on the device; only an
    optimizer that cannot skip on the device has the overflow flag read, once a step."""
    from support import models
    from zero_fx import zero_compile

    model = models.build("gpt")
    opt = OPTIMIZERS[optimizer](model.parameters())
    step = zero_compile(models.training_step("gpt"), stage=3, backend=models.BACKEND,
                        mixed_precision=FP16[0][1], max_grad_norm=clip)
    counts = []
    for i in range(3):
        with counting_host_syncs(step) as syncs:  # the graph and the optimizer update
            step(model, opt, *models.global_batch("gpt", i))
        counts.append(len(syncs))
    assert counts == [reads] * 3
    assert step.optimizer_steps == 3 and step.skipped_steps == 0


@pytest.mark.parametrize("stage", [0, 3])
def test_bf16_with_accumulation_sums_in_fp32(stage):
    """Stage 0 sums whole bf16 gradients into fp32 and reduces once; stage 3 sums fp32 shards."""
    results = zero_fx_run(2, "gpt", stage, options=BF16, micro_batches=2)
    assert_close_to_fp32(results, *BF16_TOLERANCES)
    assert results[0]["optimizer_steps"] == 5


SUB_ULP_LR, SUB_ULP_STEPS = 1e-3, 12


def sub_ulp_rank(rank, world_size, stage):
    """A weight of ones, a gradient of exactly one per element: each SGD step subtracts 1e-3,
    an eighth of bf16's spacing at 1.0 (2^-7)."""
    from zero_fx import zero_compile

    model = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    opt = torch.optim.SGD(model.parameters(), lr=SUB_ULP_LR)

    @zero_compile(stage=stage, backend=models.BACKEND, mixed_precision=BF16[0][1])
    def train_step(model, opt, x):
        loss = model(x).sum()  # d loss / d weight = x = ones, on every rank
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for _ in range(SUB_ULP_STEPS):
        train_step(model, opt, torch.ones(1, 4))
    return {"master": train_step.full_parameters()["weight"],
            "model": None if stage == 3 else model.weight.detach().clone()}


@pytest.mark.parametrize("stage", [0, 3])
def test_updates_below_one_bf16_ulp_accumulate_in_the_fp32_masters(stage):
    """In bf16 alone the weight would never move: 1 - 1e-3 rounds back to 1. The fp32 masters
    take every step; the bf16 copy the model computes with follows them once they have moved
    past half an ulp."""
    assert torch.tensor(1 - SUB_ULP_LR).bfloat16().item() == 1.0
    expected = torch.ones(1, 4)
    for _ in range(SUB_ULP_STEPS):
        expected -= SUB_ULP_LR  # fp32, the order the optimizer does it in
    result = two_ranks()[("sub-ulp", stage)][0]
    assert result["master"].dtype == torch.float32
    assert torch.equal(result["master"], expected), result["master"]
    if result["model"] is not None:  # stage 3's model holds no storage between steps
        assert torch.equal(result["model"], expected.bfloat16())
        assert result["model"].ne(1).all()
