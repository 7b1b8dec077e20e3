"""The optimizer's companions inside the decorated step (learning-rate schedulers, GradScaler,
clip_grad_norm_ / clip_grad_value_) at stages 1 and 3 on 1 and 2 ranks, against the same step
run eagerly on one process and the whole batch ([Note: the optimizer's companions] in
zero_fx/runtime/update/companions.py). One launch per (stage, world) runs every case."""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import clip_grad_norm_  # a global of this module: swapped too

from support import models
from support.ranks import run_ranks
from support.training import check_updates, parity_errors
from zero_fx import MixedPrecision, zero_compile
from zero_fx.capture.step_graph import CaptureError

STEPS = 4
OVERFLOW_STEP = 1
"""The step whose loss rank 0's rows blow up past fp32 under the scale: GradScaler skips it."""
CASES = ("scheduler_clip", "scaler", "value_inf_plateau", "accumulated")
TOLERANCE = 1e-5


def _row_weights(step: int) -> torch.Tensor:
    """Per-row loss weights of the global batch: 1, except rank 0's half on OVERFLOW_STEP."""
    w = torch.ones(8)
    if step == OVERFLOW_STEP:
        w[:4] = 2.0 ** 125
    return w


def _weighted_loss(model, x, y, w):
    return (F.mse_loss(model(x), y, reduction="none").mean(1) * w).mean()


def _case(name: str):
    """``(model, opt, step, read)``: the step closes over its scheduler and scaler (neither is
    an argument); ``read()`` is what the test compares after each step besides the loss."""
    model = models.build("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if name in ("scheduler_clip", "accumulated"):
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))

        def step(model, opt, x, y, w):
            loss = _weighted_loss(model, x, y, w)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            scheduler.step()
            opt.zero_grad()
            return loss, norm
        return model, opt, step, lambda: {"lr": opt.param_groups[0]["lr"]}
    if name == "scaler":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

        def step(model, opt, x, y, w):
            loss = _weighted_loss(model, x, y, w)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norm = clip_grad_norm_(model.parameters(), 0.5)  # the imported name
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scheduler.step()
            return loss, norm
        return model, opt, step, lambda: {"lr": opt.param_groups[0]["lr"],
                                          "scaler": scaler.state_dict()}
    if name == "value_inf_plateau":
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5,
                                                               patience=0)

        def step(model, opt, x, y, w):
            loss = _weighted_loss(model, x, y, w)
            loss.backward()
            torch.nn.utils.clip_grad.clip_grad_value_(model.parameters(), 0.05)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.02, norm_type=math.inf)
            opt.step()
            opt.zero_grad()
            scheduler.step(loss)
            return loss, norm
        return model, opt, step, lambda: {"lr": opt.param_groups[0]["lr"]}
    raise ValueError(name)


def _batch(case: str, step: int):
    x, y = models.global_batch("mlp", step)
    w = _row_weights(step) if case == "scaler" else torch.ones(8)
    return x, y, w


def companions_rank(rank: int, world_size: int, stage: int) -> dict:
    """Every case, compiled, on this rank's slice of each global batch."""
    results = {}
    for case in CASES:
        model, opt, fn, read = _case(case)
        micro = 2 if case == "accumulated" else 1
        step = zero_compile(fn, stage=stage, backend=models.BACKEND, accumulation_steps=micro)
        losses, norms, reads = [], [], []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(STEPS):
                x, y, w = _batch(case, i)
                per_rank = x.shape[0] // world_size
                local = slice(rank * per_rank, (rank + 1) * per_rank)
                outs = [step(model, opt, *(t.chunk(micro)[m] for t in (x[local], y[local], w[local])))
                        for m in range(micro)]
                losses.append(sum(loss.item() for loss, _ in outs) / micro)
                norms.append([norm.item() for _, norm in outs])
                reads.append(read())
        results[case] = {
            "losses": losses, "norms": norms, "reads": reads, "params": step.full_parameters(),
            "compilations": len(step.compilations), "optimizer_steps": step.optimizer_steps,
            "warnings": [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]}
    return results


@functools.lru_cache(maxsize=None)
def companions_run(world_size: int, stage: int) -> list[dict]:
    return run_ranks(world_size, companions_rank, stage, shared=True)


@functools.lru_cache(maxsize=None)
def reference(case: str) -> dict:
    """The same step, eager, on one process and the whole batch."""
    model, opt, fn, read = _case(case)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses, norms, reads = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(STEPS):
            loss, norm = fn(model, opt, *_batch(case, i))
            losses.append(loss.item())
            norms.append(norm.item())
            reads.append(read())
    return {"losses": losses, "norms": norms, "reads": reads, "initial": initial,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "warnings": [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]}


GRID = [(1, 1), (1, 3), (2, 1), (2, 3)]


@pytest.mark.parametrize("world_size,stage", GRID)
@pytest.mark.parametrize("case", CASES)
def test_companions_train_like_eager(world_size, stage, case):
    results = [r[case] for r in companions_run(world_size, stage)]
    expected = reference(case)
    errors = parity_errors(results, expected)
    worst = max(errors, key=errors.get)
    assert errors[worst] < TOLERANCE, f"{worst}: relative error {errors[worst]:.2e}"
    check_updates(results, expected)
    assert expected["warnings"] == []
    for result in results:
        assert result["compilations"] == 1  # a new learning rate or scale recompiles nothing
        assert result["warnings"] == []
        assert [r["lr"] for r in result["reads"]] == pytest.approx(
            [r["lr"] for r in expected["reads"]], rel=1e-12)
        assert len({r["lr"] for r in result["reads"]}) > 1  # the schedule moved
        # the norm the step returned is eager's (the last micro-batch's: the window's)
        last = [n[-1] for n in result["norms"]]
        assert last == pytest.approx(expected["norms"], rel=TOLERANCE, nan_ok=True)
        if case == "accumulated":  # inside the window there is no norm yet
            assert all(math.isnan(n[0]) for n in result["norms"])


@pytest.mark.parametrize("world_size,stage", GRID)
def test_gradscaler_skips_the_overflowed_step_and_keeps_its_state(world_size, stage):
    expected = reference("scaler")
    scales = [r["scaler"]["scale"] for r in expected["reads"]]
    # eager: step 1 overflowed (skipped, scale halved), growth every 2 clean steps
    assert scales == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9, 2.0 ** 10]
    assert not math.isfinite(expected["norms"][OVERFLOW_STEP])
    for result in (r["scaler"] for r in companions_run(world_size, stage)):
        assert [r["scaler"] for r in result["reads"]] == [r["scaler"] for r in expected["reads"]]
        assert result["optimizer_steps"] == STEPS - 1
        assert not math.isfinite(result["norms"][OVERFLOW_STEP][0])


def _refused(fn, **options) -> str:
    model = models.build("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = zero_compile(fn, backend=models.BACKEND, **options)
    with pytest.raises(CaptureError) as raised:
        step(model, opt, *models.global_batch("mlp", 0))
    return str(raised.value)


def test_what_zero_fx_cannot_do_as_eager_is_refused_clearly():
    def subset(model, opt, x, y):
        F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.net[0].parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    assert "pass model.parameters()" in _refused(subset)

    def zero_norm(model, opt, x, y):
        F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=0.0)
        opt.step()
        opt.zero_grad()
    assert "p-norm with p > 0 or inf" in _refused(zero_norm)

    def reads_the_norm(model, opt, x, y):
        F.mse_loss(model(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        print("norm", norm.item())  # computed after the graph: no value inside it
        opt.step()
        opt.zero_grad()
    assert "Log or return the tensor itself" in _refused(reads_the_norm)

    scaler = torch.amp.GradScaler("cpu")

    def scaled_twice(model, opt, x, y):
        scaler.scale(F.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    message = _refused(scaled_twice, mixed_precision=MixedPrecision(param_dtype=torch.float16))
    assert "MixedPrecision(loss_scale=None)" in message


def test_a_disabled_gradscaler_passes_through():
    scaler = torch.amp.GradScaler("cpu", enabled=False)

    def step(model, opt, x, y):
        loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return loss

    runs = []
    for compiled in (False, True):
        model = models.build("mlp")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        fn = zero_compile(step, backend=models.BACKEND) if compiled else step
        losses = [fn(model, opt, *models.global_batch("mlp", i)).item() for i in range(2)]
        runs.append((losses, fn.full_parameters() if compiled else dict(model.named_parameters())))
    (eager, eager_params), (ours, our_params) = runs
    assert ours == pytest.approx(eager, rel=TOLERANCE)
    for name, p in eager_params.items():
        assert torch.allclose(our_params[name], p, rtol=TOLERANCE, atol=1e-7)

