"""Frozen, tied and buffer-carrying models, and running the model outside the step (world size 2)."""

import pytest
import torch
import torch.nn as nn

from support import models
from support.feature_runs import reference_run, zero_fx_run
from support.ranks import run_ranks
from support.training import parity_errors
from zero_fx import MixedPrecision, zero_compile

UNSCHEDULED = (("bucket_bytes", 0), ("persistence_threshold", 0))
FROZEN = ("net.0.base.weight", "net.0.base.bias", "net.2.base.weight", "net.2.base.bias",
          "net.3.weight", "net.3.bias")


def _buckets(traffic, kind, phase=None):
    return [name for c in traffic.collectives if c.kind == kind and phase in (None, c.phase)
            for name in c.bucket]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_frozen_parameters_are_not_reduced_or_stepped_but_are_sharded(stage):
    results = zero_fx_run(2, "frozen_mlp", stage, options=UNSCHEDULED)
    reference = reference_run("frozen_mlp")
    errors = parity_errors(results, reference)
    assert max(errors.values()) < 1e-5, max(errors, key=errors.get)
    result = results[0]
    for name in FROZEN:  # unchanged, and no reduction carries them
        assert torch.equal(result["params"][name], reference["params"][name])
    traffic = result["traffic"]
    reduced = _buckets(traffic, "all_reduce") + _buckets(traffic, "reduce_scatter")
    assert reduced and not set(FROZEN) & set(reduced)
    if stage in (1, 2):  # a frozen parameter never changes: nothing to gather after the step
        assert not set(FROZEN) & set(_buckets(traffic, "all_gather", "after step"))
    if stage == 3:  # still sharded: gathered where used, no storage of its own
        assert set(FROZEN) <= set(_buckets(traffic, "all_gather"))
        assert all(result["storage_bytes"][name] == 0 for name in FROZEN)


def test_a_tied_embedding_is_gathered_once_and_reduced_once():
    """The test GPT ties lm_head.weight to wte.weight: one parameter, used at both ends. As
    the head it is the last weight the forward reads and the first the backward reads, so
    its forward gather serves the backward ([Note: a weight kept through the loss])."""
    traffic = zero_fx_run(2, "gpt", 3, options=UNSCHEDULED)[0]["traffic"]
    assert _buckets(traffic, "all_gather", "forward").count("wte.weight") == 1
    assert _buckets(traffic, "all_gather", "backward").count("wte.weight") == 0
    assert _buckets(traffic, "reduce_scatter").count("wte.weight") == 1
    assert "lm_head.weight" not in _buckets(traffic, "all_gather") + _buckets(traffic, "reduce_scatter")


def batchnorm_rank(rank, world_size, stage):
    """Batch norm first, so its running statistics depend on the data only: each rank's
    must follow an eager BatchNorm1d fed the same local batches."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(models.FEATURES), nn.Linear(models.FEATURES, 7))
    eager = nn.BatchNorm1d(models.FEATURES)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = zero_compile(models.training_step("mlp"), stage=stage, backend="aot_eager")
    for i in range(3):
        x, y = models.global_batch("mlp", i)
        step(model, opt, x[rank::world_size], y[rank::world_size])
        eager(x[rank::world_size])
    return [(getattr(model[0], k), getattr(eager, k))
            for k in ("running_mean", "running_var", "num_batches_tracked")]


@pytest.mark.parametrize("stage", [0, 3])
def test_batchnorm_running_statistics_are_updated_by_the_step(stage):
    for pairs in run_ranks(2, batchnorm_rank, stage):
        for got, expected in pairs:
            assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6)


def outside_the_step_rank(rank, world_size, stage, precision):
    model = models.build("gpt")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = zero_compile(models.training_step("gpt"), stage=stage, backend="aot_eager",
                        mixed_precision=precision)
    x, y = models.global_batch("gpt", 0)
    step(model, opt, x[rank::world_size], y[rank::world_size])
    masters = step.full_parameters()
    errors = {}
    try:
        model(x)
    except RuntimeError as err:
        errors["forward"] = str(err)
    try:
        model.state_dict()
    except RuntimeError as err:
        errors["state_dict"] = str(err)
    with step.gathered_parameters():
        with torch.no_grad():
            logits = model(x).float()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            step(model, opt, x[rank::world_size], y[rank::world_size])
        except RuntimeError as err:
            errors["step inside"] = str(err)
    storage_after = sum(p.untyped_storage().nbytes() for p in model.parameters())
    loss = step(model, opt, x[rank::world_size], y[rank::world_size]).item()  # still trains
    return {"errors": errors, "logits": logits, "state": state, "storage_after": storage_after,
            "masters": masters, "loss": loss, "x": x}


def _eager_logits(full_parameters, x):
    model = models.build("gpt")
    model.load_state_dict(full_parameters, strict=False)
    with torch.no_grad():
        return model(x)


def test_stage3_model_runs_inside_gathered_parameters_and_refuses_outside():
    for result in run_ranks(2, outside_the_step_rank, 3, None):
        assert "with train_step.gathered_parameters()" in result["errors"]["forward"]
        assert "gathered_parameters" in result["errors"]["state_dict"]
        assert "inside `with step.gathered_parameters():`" in result["errors"]["step inside"]
        assert result["storage_after"] == 0
        assert result["loss"] > 0
        # inside, the model holds the trained values (tied ones included)
        for name, value in result["masters"].items():
            assert torch.equal(result["state"][name], value), name
        assert torch.equal(result["state"]["lm_head.weight"], result["masters"]["wte.weight"])
        assert torch.allclose(result["logits"], _eager_logits(result["masters"], result["x"]),
                              atol=1e-6)


@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_model_evaluates_in_bf16_close_to_its_fp32_masters(stage):
    policy = MixedPrecision(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    result = run_ranks(2, outside_the_step_rank, stage, policy)[0]
    if stage == 1:  # whole parameters, always current: no error and no gather needed
        assert result["errors"] == {}
    assert {v.dtype for k, v in result["state"].items() if "weight" in k} == {torch.bfloat16}
    expected = _eager_logits(result["masters"], result["x"])
    assert (result["logits"] - expected).abs().max() < 5e-2 * expected.abs().max()
