"""Gradient accumulation, clipping by global norm, and schedules, at world size 2, against
plain PyTorch on one process and the whole batch (fp32; relative error under 1e-5)."""

import pytest

from support.feature_runs import reference_run, zero_fx_run
from support.training import parity_errors

TOLERANCE = 1e-5
CLIP = (("max_grad_norm", 0.5),)
"""Small enough that every step of the test GPT clips."""


def assert_parity(results, reference):
    errors = parity_errors(results, reference)
    worst = max(errors, key=errors.get)
    assert errors[worst] < TOLERANCE, f"{worst}: relative error {errors[worst]:.2e}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_two_micro_batches_equal_one_large_batch(stage):
    results = zero_fx_run(2, "gpt", stage, micro_batches=2)
    assert_parity(results, reference_run("gpt"))
    assert results[0]["optimizer_steps"] == 5


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_accumulation_reduces_once_per_step_in_stages_0_and_1(stage):
    """Stages 0-1 sum whole gradients locally and reduce them once per optimizer step; stages
    2-3 reduce-scatter each micro-batch's and sum the shards."""
    counted = zero_fx_run(2, "gpt", stage, micro_batches=2)[0]["counted"]  # one optimizer step
    single = zero_fx_run(2, "gpt", stage, micro_batches=1)[0]["counted"]
    reduction = "all_reduce" if stage == 0 else "reduce_scatter"
    calls_reducing = 1 if stage in (0, 1) else 2
    assert counted[reduction] == calls_reducing * single[reduction] > 0


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_clipping_returns_the_global_norm_and_clips_like_clip_grad_norm(stage):
    results = zero_fx_run(2, "gpt", stage, options=CLIP)
    reference = reference_run("gpt", max_grad_norm=0.5)
    assert min(reference["norms"]) > 0.5  # every step clips
    for result in results:  # the same norm on every rank, the single process's
        for got, expected in zip(result["norms"], reference["norms"]):
            assert abs(got - expected) <= TOLERANCE * expected
    assert_parity(results, reference)


def test_clipping_with_accumulation_and_padding_in_stage_3():
    """The norm is taken on shards (padding included, which must hold zeros) after the
    micro-batches are summed and averaged."""
    results = zero_fx_run(2, "gpt", 3, options=CLIP + (("bucket_bytes", 0),), micro_batches=2)
    reference = reference_run("gpt", max_grad_norm=0.5)
    assert [round(n, 4) for n in results[1]["norms"]] == [round(n, 4) for n in reference["norms"]]
    assert_parity(results, reference)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_scheduler_and_changed_hyperparameters_never_recompile(stage):
    """20 steps while StepLR halves the learning rate and the weight decay changes every
    step: one compilation, and the schedule takes effect (parity with the same schedule)."""
    results = zero_fx_run(2, "mlp", stage, optimizer="adamw", scheduled=True, steps=20)
    assert [r["compilations"] for r in results] == [1, 1]
    assert_parity(results, reference_run("mlp", "adamw", scheduled=True, steps=20))
