"""Steps of other shapes than one forward and one backward on batches of one size: several
``backward()`` calls in one step ([Note: several backward calls in one step] in
zero_fx/capture/accumulated_gradients.py), and lengths that change from call to call
([Note: one dynamic graph for every length] in zero_fx/capture/dynamic_shapes.py).

One launch per (stage, world size) runs every case; each is compared with the same
function run eagerly in one process on the global batch (losses and parameters within 1e-5
relative, and each parameter's update within 1e-3 of its size)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from support import models
from support.ranks import run_ranks
from support.training import parity_errors
from zero_fx import CaptureError, ZeroConfig, zero_compile

TOLERANCE = 1e-5
CALLS = 3
LENGTHS = (16, 16, 9, 12, 9, 16, 5, 14, 12, 7)
"""Ten calls over six distinct sequence lengths."""


class TwoHeads(nn.Module):
    """A shared body and two heads: ``head_a`` gets a gradient from the first backward only,
    ``head_b`` from the second only, the body from both."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(models.FEATURES, 13), nn.GELU(), nn.LayerNorm(13))
        self.head_a = nn.Linear(13, 7)
        self.head_b = nn.Linear(13, 7)


def two_micro_batches(model, opt, xa, ya, xb, yb, scale=0.5):
    loss_a = F.mse_loss(model.head_a(model.body(xa)), ya) * scale
    loss_a.backward()
    loss_b = F.mse_loss(model.head_b(model.body(xb)), yb) * scale
    loss_b.backward()
    opt.step()
    opt.zero_grad()
    return loss_a + loss_b


def two_losses_one_graph(model, opt, xa, ya, xb, yb, scale=0.5):
    """The second backward runs through the first's graph again (``retain_graph=True``)."""
    hidden = model.body(torch.cat([xa, xb]))
    loss_a = F.mse_loss(model.head_a(hidden), torch.cat([ya, yb])) * scale
    loss_b = model.head_b(hidden).pow(2).mean() * scale
    loss_a.backward(retain_graph=True)
    loss_b.backward()
    opt.step()
    opt.zero_grad()
    return loss_a + loss_b


def masked_lm_step(model, opt, x, y):
    """A cross-entropy over the positions whose target is not 0: a length the data decides."""
    logits = model(x)
    keep = y != 0
    # summed over the kept positions, divided by all: each rank's share of the global mean
    loss = F.cross_entropy(logits[keep], y[keep], reduction="sum") / y.numel()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


STEPS = {"two_micro_batches": two_micro_batches, "two_losses_one_graph": two_losses_one_graph}
ACCUMULATION = 2


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # sees the gradient's scale


def _halves(x, y, rank: int, world_size: int):
    """This rank's slice of the global batch, cut into its two micro-batches."""
    per_rank = x.shape[0] // world_size
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    xa, xb = x[local].chunk(2)
    ya, yb = y[local].chunk(2)
    return xa, ya, xb, yb


def _lengths_batch(call: int):
    x, y = models.global_batch("gpt", call)
    return x[:, :LENGTHS[call]], y[:, :LENGTHS[call]]


def _backward_case(rank, world_size, stage, name, accumulation):
    model = TwoHeads()
    step = zero_compile(STEPS[name], stage=stage, backend=models.BACKEND,
                        accumulation_steps=accumulation)
    opt = _sgd(model)
    losses = []
    with step.counting_collectives() as counted:
        for call in range(CALLS * accumulation):
            x, y = models.global_batch("mlp", call)
            # not divided by the accumulation: zero_fx averages the window's calls itself
            losses.append(step(model, opt, *_halves(x, y, rank, world_size)).item())
    return {"losses": losses, "params": step.full_parameters(), "counted": dict(counted.numel),
            "compilations": len(step.compilations), "optimizer_steps": step.optimizer_steps}


def _lengths_case(rank, world_size, stage, step_fn):
    model = models.build("gpt")
    step = zero_compile(step_fn, stage=stage, backend="aot_eager")
    opt = models.make_optimizer(model)
    losses = []
    for call in range(len(LENGTHS)):
        x, y = _lengths_batch(call)
        per_rank = x.shape[0] // world_size
        mine = slice(rank * per_rank, (rank + 1) * per_rank)  # views: [Note: a marked view is copied]
        losses.append(step(model, opt, x[mine], y[mine]).item())
    return {"losses": losses, "params": step.full_parameters(),
            "compilations": len(step.compilations)}


def shapes_rank(rank: int, world_size: int, stage: int) -> dict:
    """Every case of this file at ``stage`` on this rank."""
    results = {}
    for name in STEPS:
        results[name] = _backward_case(rank, world_size, stage, name, 1)
    results["accumulated"] = _backward_case(rank, world_size, stage, "two_micro_batches",
                                            ACCUMULATION)
    results["one_backward"] = _one_backward_traffic(rank, world_size, stage)
    results["lengths"] = _lengths_case(rank, world_size, stage, models.training_step("gpt"))
    results["masked"] = _lengths_case(rank, world_size, stage, masked_lm_step)
    return results


def _one_backward_traffic(rank, world_size, stage) -> dict:
    """The collectives of one call of the same model with a single backward on both heads."""
    def one_backward(model, opt, xa, ya, xb, yb):
        loss = (F.mse_loss(model.head_a(model.body(xa)), ya)
                + F.mse_loss(model.head_b(model.body(xb)), yb)) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    model = TwoHeads()
    step = zero_compile(one_backward, stage=stage, backend=models.BACKEND)
    x, y = models.global_batch("mlp", 0)
    with step.counting_collectives() as counted:
        step(model, _sgd(model), *_halves(x, y, rank, world_size))
    return dict(counted.numel)


@functools.lru_cache(maxsize=None)
def shapes_run(world_size: int, stage: int) -> list:
    return run_ranks(world_size, shapes_rank, stage, shared=True)


# -- the references: the same functions, eagerly, on the global batch ---------------------------

def _reference(model, opt, calls):
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = [call(model, opt) for call in calls]
    return {"losses": losses, "initial": initial,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


class _Later:
    """The optimizer as the step sees it in the reference: stepped once per window, after."""
    step = zero_grad = staticmethod(lambda: None)


@functools.lru_cache(maxsize=None)
def backward_reference(name: str, world_size: int, accumulation: int) -> dict:
    """The micro-batches of every rank side by side: ``a`` the ranks' first halves, ``b``
    their second halves (a mean squared error over equal halves is the mean of theirs)."""
    model = TwoHeads()
    opt = _sgd(model)

    def call(index):
        def run(model, _opt):
            x, y = models.global_batch("mlp", index)
            halves = [_halves(x, y, rank, world_size) for rank in range(world_size)]
            xa, ya, xb, yb = (torch.cat([h[i] for h in halves]) for i in range(4))
            scale = 0.5 / accumulation  # the window's mean, as zero_fx's accumulation takes
            loss = STEPS[name](model, _Later, xa, ya, xb, yb, scale=scale).item() * accumulation
            if (index + 1) % accumulation == 0:
                opt.step()
                opt.zero_grad()
            return loss
        return run

    return _reference(model, opt, [call(i) for i in range(CALLS * accumulation)])


@functools.lru_cache(maxsize=None)
def lengths_reference(masked: bool) -> dict:
    model = models.build("gpt")
    opt = models.make_optimizer(model)
    step_fn = masked_lm_step if masked else models.training_step("gpt")
    calls = [lambda m, o, c=c: step_fn(m, o, *_lengths_batch(c)).item() for c in range(len(LENGTHS))]
    return _reference(model, opt, calls)


def _assert_parity(results, reference):
    errors = parity_errors(results, reference)
    worst = max(errors, key=errors.get)
    assert errors[worst] < TOLERANCE, f"{worst}: relative error {errors[worst]:.2e}"


GRID = [(1, 1), (1, 3), (2, 1), (2, 3)]


@pytest.mark.parametrize("world_size, stage", GRID)
@pytest.mark.parametrize("name", list(STEPS))
def test_several_backward_calls_train_as_eager(world_size, stage, name):
    results = [r[name] for r in shapes_run(world_size, stage)]
    _assert_parity(results, backward_reference(name, world_size, 1))
    assert all(r["compilations"] == 1 and r["optimizer_steps"] == CALLS for r in results)


@pytest.mark.parametrize("world_size, stage", GRID)
def test_several_backward_calls_accumulate_over_calls(world_size, stage):
    results = [r["accumulated"] for r in shapes_run(world_size, stage)]
    _assert_parity(results, backward_reference("two_micro_batches", world_size, ACCUMULATION))
    assert all(r["optimizer_steps"] == CALLS for r in results)


@pytest.mark.parametrize("stage", [1, 3])
def test_several_backward_calls_reduce_each_gradient_once(stage):
    """The summed gradient is reduced after the last backward: the reductions of one call
    are those of a single backward, not one per backward."""
    for result in shapes_run(2, stage):
        one, two = result["one_backward"], result["two_micro_batches"]["counted"]
        assert two["reduce_scatter"] == CALLS * one["reduce_scatter"] > 0, (one, two)


@pytest.mark.parametrize("world_size, stage", GRID)
def test_changing_lengths_compile_at_most_twice_and_train_as_eager(world_size, stage):
    results = [r["lengths"] for r in shapes_run(world_size, stage)]
    assert len(set(LENGTHS)) == 6
    assert all(r["compilations"] == 2 for r in results), [r["compilations"] for r in results]
    _assert_parity(results, lengths_reference(masked=False))


@pytest.mark.parametrize("world_size, stage", GRID)
def test_a_length_the_data_decides_captures_and_trains_as_eager(world_size, stage):
    results = [r["masked"] for r in shapes_run(world_size, stage)]
    _assert_parity(results, lengths_reference(masked=True))


# -- in one process: the option, and what is refused --------------------------------------------

def _mlp_calls(dynamic_shapes: str, sizes) -> int:
    model = models.build("mlp")
    step = zero_compile(models.training_step("mlp"), stage=1, backend=models.BACKEND,
                        dynamic_shapes=dynamic_shapes)
    opt = models.make_optimizer(model)
    x, y = models.global_batch("mlp", 0)
    given = []
    for size in sizes:
        given += [x[:size], y[:size]]
        step(model, opt, *given[-2:])
    assert not any(hasattr(t, "_dynamo_weak_dynamic_indices") for t in given)  # the step's own
    return len(step.compilations)


def test_static_shapes_compile_once_per_shape_and_auto_twice():
    sizes = (8, 6, 4, 6, 8, 2)
    assert _mlp_calls("static", sizes) == 4
    assert _mlp_calls("auto", sizes) == 2


def test_dynamic_shapes_is_checked():
    with pytest.raises(ValueError, match="dynamic_shapes must be 'auto'.*or 'static'"):
        ZeroConfig(dynamic_shapes="dynamic")


def test_a_gradient_read_between_two_backward_calls_is_refused():
    def peeks(model, opt, xa, ya, xb, yb):
        F.mse_loss(model.head_a(model.body(xa)), ya).backward()
        model.head_a.weight.grad.mul_(0.5)
        F.mse_loss(model.head_a(model.body(xb)), yb).backward()
        opt.step()
        opt.zero_grad()

    model = TwoHeads()
    step = zero_compile(peeks, stage=1, backend=models.BACKEND)
    x, y = models.global_batch("mlp", 0)
    with pytest.raises(CaptureError, match="changes the gradient of head_a.weight between two "
                                           "backward"):
        step(model, _sgd(model), *_halves(x, y, 0, 1))
