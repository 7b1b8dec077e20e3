"""Wrong batches and a model changed after compiling: each gives eager's result or a clear
error, on 2 ranks at stage 3 (README, "Errors and what they mean")."""

import pytest
import torch

from support import models
from support.ranks import run_ranks
from support.training import check_updates, relative_error
from zero_fx import MixedPrecision, zero_compile


def _eager(batches, initial=None):
    """Single-process training on each global batch; the losses and the parameters after
    (and, into ``initial``, those before)."""
    model = models.build("gpt", seed=1)
    if initial is not None:
        initial.update({n: p.detach().clone() for n, p in model.named_parameters()})
    opt = models.make_optimizer(model)
    losses = []
    for x, y in batches:
        loss = models.loss_fn("gpt", model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def batches(case: str):
    good = [models.global_batch("gpt", i) for i in range(2)]
    if case == "empty":
        return good + [tuple(t[:0] for t in models.global_batch("gpt", 2))]
    if case == "int32 ids":
        x, y = models.global_batch("gpt", 2)
        return good + [(x.int(), y)]
    return good


def bad_batch_rank(rank, world_size, case):
    model = models.build("gpt", seed=1)
    opt = models.make_optimizer(model)
    step = zero_compile(models.training_step("gpt"), stage=3, backend=models.BACKEND)
    losses = []
    for x, y in batches(case):
        per_rank = x.shape[0] // world_size
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        losses.append(step(model, opt, x[mine], y[mine]).item())
    return losses, step.full_parameters(), len(step.compilations)


@pytest.mark.parametrize("case", ["empty", "int32 ids"])
def test_an_unusual_batch_trains_as_eager_does(case):
    """An empty batch: the loss is NaN (a mean over no tokens) and the update is AdamW's with
    zero gradients, as in eager. int32 token ids: the embedding takes them, as in eager
    (one recompilation)."""
    initial = {}
    expected_losses, expected_params = _eager(batches(case), initial)
    results = run_ranks(2, bad_batch_rank, case)
    mean_losses = torch.tensor([losses for losses, _, _ in results]).mean(0)
    torch.testing.assert_close(mean_losses, torch.tensor(expected_losses), rtol=1e-6, atol=0,
                               equal_nan=True)
    for _, params, compilations in results:  # relative to the norm, as the parity tests
        for name, value in expected_params.items():  # (AdamW's m/sqrt(v) makes single
            assert relative_error(params[name], value) < 1e-5, name  # near-zero elements noisy)
        if case == "int32 ids":
            assert compilations == 2  # the new dtype recompiles once
    check_updates([{"params": params} for _, params, _ in results],
                  {"params": expected_params, "initial": initial}, UPDATE_TOLERANCE)


UPDATE_TOLERANCE = 1e-3
"""Each parameter's update error (training.check_updates) against eager: measured 5.0e-6
(blocks.0.mlp.2.weight) in both cases, the suite's bound."""


def test_int32_targets_raise_what_eager_raises():
    x, y = models.global_batch("gpt", 0)
    model = models.build("gpt", seed=1)
    with pytest.raises(RuntimeError, match="expected target dtype to be Long") as eager:
        models.loss_fn("gpt", model, x, y.int())
    step = zero_compile(models.training_step("gpt"), stage=3, backend=models.BACKEND)
    with pytest.raises(RuntimeError) as ours:
        step(model, models.make_optimizer(model), x, y.int())
    assert str(eager.value) in str(ours.value)


def nan_rank(rank, world_size, precision):
    """A NaN in one input of rank 1's slice of the second batch (the MLP reads floats)."""
    model = models.build("mlp")
    opt = models.make_optimizer(model)
    step = zero_compile(models.training_step("mlp"), stage=3, backend=models.BACKEND,
                        mixed_precision=precision)
    mine = slice(rank * 4, (rank + 1) * 4)
    x, y = models.global_batch("mlp", 0)
    step(model, opt, x[mine], y[mine])
    before = step.full_parameters()
    x, y = nan_batch()
    loss = step(model, opt, x[mine], y[mine])
    return {"loss": loss.item(), "before": before, "after": step.full_parameters(),
            "optimizer_steps": step.optimizer_steps, "loss_scale": step.loss_scale}


def nan_batch():
    x, y = models.global_batch("mlp", 1)
    x[5, 0] = float("nan")  # row 5: rank 1's slice
    return x, y


def test_a_batch_with_a_nan_in_fp32_gives_what_eager_gives():
    """Rank 1's loss is NaN and the reduced gradients carry the NaN to every rank: the
    parameters become what eager's do (NaN), and nothing else is touched."""
    model = models.build("mlp")
    opt = models.make_optimizer(model)
    for x, y in (models.global_batch("mlp", 0), nan_batch()):
        loss = models.loss_fn("mlp", model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.isnan()
    ranks = run_ranks(2, nan_rank, None)
    assert not torch.tensor(ranks[0]["loss"]).isnan() and torch.tensor(ranks[1]["loss"]).isnan()
    for result in ranks:
        for name, param in model.named_parameters():
            torch.testing.assert_close(result["after"][name], param.detach(), equal_nan=True,
                                       msg=name)
        assert result["optimizer_steps"] == 2


def test_a_batch_with_a_nan_in_fp16_is_skipped_on_every_rank():
    """fp16 loss scaling finds the non-finite gradients (after the reduction, so on every
    rank) and skips the update, halving the scale, as torch.amp's GradScaler does."""
    for result in run_ranks(2, nan_rank, MixedPrecision(param_dtype=torch.float16)):
        assert result["optimizer_steps"] == 1
        assert result["loss_scale"] == 2.0 ** 15  # from 2**16
        for name, value in result["before"].items():
            assert torch.equal(result["after"][name], value), name


def test_a_model_cast_after_compiling_is_refused_and_keeps_training():
    model = models.build("gpt", seed=1)
    opt = models.make_optimizer(model)
    step = zero_compile(models.training_step("gpt"), stage=3, backend=models.BACKEND)
    step(model, opt, *models.global_batch("gpt", 0))
    for convert in (lambda m: m.to(torch.float64), lambda m: m.half(),
                    lambda m: m.blocks[0].bfloat16()):
        with pytest.raises(ValueError, match=r"turn the model's torch.float32 parameters on cpu "
                                             r"into torch.(float64|float16|bfloat16) on cpu"):
            convert(model)
    with pytest.raises(ValueError, match=r"replace the model's parameters with new tensors"):
        model.to_empty(device="cpu")
    model.to("cpu")  # changes nothing: allowed
    model.float()
    model.share_memory()
    losses, params = _eager([models.global_batch("gpt", i) for i in range(2)])
    assert step(model, opt, *models.global_batch("gpt", 1)).item() == pytest.approx(losses[1],
                                                                                      rel=1e-6)
