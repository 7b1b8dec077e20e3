"""Evaluation steps: a ``zero_compile`` function with the model and no optimizer runs forward
on its training step's shards ([Note: evaluation steps] in zero_fx/evaluation.py).

One run of two gloo ranks per stage (1 and 3) holds every case that needs ranks: the eval
before training (the model still whole), after training (equal to eager on the gathered
weights), after more training (it sees the new weights), without ``no_grad``, a fixed-length
greedy decode, and, at stage 3, the bytes of gathered parameters alive at once on a model of
eight blocks against its training step's and the whole model's."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F

from support import models
from examples.gpt import GPT, GPTConfig
from support.ranks import run_ranks
from zero_fx import zero_compile
from zero_fx.analysis.live_memory import LiveTensorBytes
from zero_fx.analysis.memory_timeline import memory_timeline, peak_alive
from zero_fx.capture.step_graph import CaptureError

TOLERANCE = 1e-6
DECODED = 3
"""Tokens the greedy decode appends."""


def _eval_step(model, x, y):
    with torch.no_grad():
        logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten()), logits.argmax(-1)


def _forward_only(model, x):
    return model(x).float().logsumexp(-1)  # no no_grad: forward only all the same


def _next_token(model, window):
    with torch.no_grad():
        return model(window)[:, -1].argmax(-1)


def _decode(next_token, model, prompt):
    """Greedy decoding over a fixed window (one shape, one compilation): each token is the
    argmax after the window, which then slides by one."""
    window, tokens = prompt, []
    for _ in range(DECODED):
        token = next_token(model, window)
        tokens.append(token)
        window = torch.cat([window[:, 1:], token[:, None]], dim=1)
    return torch.stack(tokens, 1)


def _outputs(steps: dict, model, x, y) -> dict:
    loss, argmax = steps["eval"](model, x, y)
    return {"loss": loss, "argmax": argmax, "logsumexp": steps["forward"](model, x),
            "decoded": _decode(steps["next_token"], model, x[:2])}


def _eager(model, x, y) -> dict:
    return _outputs({"eval": _eval_step, "forward": _forward_only, "next_token": _next_token},
                    model, x, y)


def _differences(got: dict, expected: dict) -> dict:
    return {key: (got[key] - expected[key]).abs().max().item() if got[key].is_floating_point()
            else float((got[key] != expected[key]).sum()) for key in expected}


def _gathered_peak(gm) -> int:
    """Bytes of gathered parameters (and their gathered buckets) alive at once in ``gm``."""
    timeline = memory_timeline(gm)
    gathered = [(t.index, t.last_use, t.bytes) for t in timeline.tensors
                if t.what.startswith("full ") or t.what.startswith("all_gather_into_tensor")]
    return int(peak_alive(len(timeline.node_names), gathered))


def _evaluation_rank(rank: int, world_size: int, stage: int) -> dict:
    torch.manual_seed(0)
    model = models.build("gpt_dropout")  # dropout: the eval steps run in model.eval() mode
    reference = copy.deepcopy(model).eval()
    opt = models.make_optimizer(model)
    options = dict(stage=stage, backend="aot_eager")
    train_step = zero_compile(models.training_step("gpt"), **options)
    steps = {"eval": zero_compile(_eval_step, **options),
             "forward": zero_compile(_forward_only, **options),
             "next_token": zero_compile(_next_token, **options)}
    x, y = models.global_batch("gpt", 100)
    out = {}

    model.eval()  # before any training step: the model is whole, the function runs as written
    out["before training"] = _differences(_outputs(steps, model, x, y), _eager(reference, x, y))
    losses = []
    for trained in (2, 4):
        model.train()
        for step in range(trained - 2, trained):
            xs, ys = models.global_batch("gpt", step)
            share = xs.shape[0] // world_size
            train_step(model, opt, xs[rank * share:(rank + 1) * share],
                       ys[rank * share:(rank + 1) * share])
        model.eval()
        got = _outputs(steps, model, x, y)
        reference.load_state_dict(train_step.full_parameters(), strict=False)
        out[f"after {trained} steps"] = _differences(got, _eager(reference, x, y))
        losses.append(got["loss"].item())
    out["losses"] = losses
    out["eval compilations"] = len(steps["eval"].compilations)
    out["train compilations"] = len(train_step.compilations)
    if stage == 3:
        out["memory"] = _gathered_bytes(rank, world_size)
    return out


def _gathered_bytes(rank: int, world_size: int) -> dict:
    """Stage 3 on eight blocks, nothing resident: the gathered parameters alive at once in the
    training and evaluation graphs, and the eval call's measured peak above what it starts
    with, against the whole model's bytes."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=models.VOCAB, block_size=models.SEQ, n_layer=8, n_head=2,
                          n_embd=32, bias=False, dropout=0.0))
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = models.make_optimizer(model)
    options = dict(stage=3, backend="aot_eager", resident_max_numel=0)
    train_step = zero_compile(models.training_step("gpt"), **options)
    eval_step = zero_compile(_eval_step, **options)
    x, y = models.global_batch("gpt", 0, size=2)
    train_step(model, opt, x, y)
    eval_step(model, x, y)
    probe = LiveTensorBytes([*train_step.state.held_tensors(), x, y])
    start = probe.live
    with eval_step.observing(probe):
        eval_step(model, x, y)
    return {"whole": whole, "train gathered": _gathered_peak(train_step.graphs[-1]),
            "eval gathered": _gathered_peak(eval_step.graphs[-1]),
            "eval measured": probe.peak - start}


@functools.lru_cache(maxsize=None)
def _evaluation_run(stage: int) -> list:
    return run_ranks(2, _evaluation_rank, stage)


@pytest.mark.parametrize("stage", [1, 3])
def test_evaluation_step_equals_eager_on_the_trained_weights(stage):
    for rank, out in enumerate(_evaluation_run(stage)):
        for case in ("before training", "after 2 steps", "after 4 steps"):
            assert all(d <= TOLERANCE for d in out[case].values()), (rank, case, out[case])
        assert out["losses"][0] != out["losses"][1], "the eval did not see the new weights"
        # dropout off in eval(): one compilation of the eval step, none more of training's
        assert out["eval compilations"] == 1 and out["train compilations"] == 1, out


def test_stage3_evaluation_gathers_block_by_block():
    for rank, out in enumerate(_evaluation_run(3)):
        memory = out["memory"]
        assert 0 < memory["eval gathered"] <= memory["train gathered"], (rank, memory)
        assert memory["eval gathered"] < memory["whole"] / 2, (rank, memory)
        assert memory["eval measured"] < memory["whole"], (rank, memory)


# -- refusals, one process -------------------------------------------------------------------


def _trained_mlp(**options):
    model = models.build("mlp")
    opt = models.make_optimizer(model)
    train_step = zero_compile(models.training_step("mlp"), backend="aot_eager", **options)
    train_step(model, opt, *models.global_batch("mlp", 0))
    return model, train_step


def test_an_option_other_than_the_training_step_s_is_refused():
    model, _ = _trained_mlp(stage=1)
    eval_step = zero_compile(lambda model, x: model(x), stage=3, backend="aot_eager")
    with pytest.raises(ValueError, match="stage=3.*stage=1"):
        eval_step(model, models.global_batch("mlp", 0)[0])
    # plain @zero_compile, or options of its own graph only: runs with the training step's plan
    eval_step = zero_compile(lambda model, x: model(x), backend="eager")
    eval_step(model, models.global_batch("mlp", 0)[0])
    assert eval_step.plan.stage == 1


def test_a_backward_without_an_optimizer_is_refused():
    model, _ = _trained_mlp(stage=3)

    def backward_only(model, x, y):
        models.loss_fn("mlp", model, x, y).backward()

    with pytest.raises(CaptureError, match="takes no optimizer"):
        zero_compile(backward_only, backend="aot_eager")(model, *models.global_batch("mlp", 0))


def test_a_training_step_closing_over_its_optimizer_does_not_train_unsharded():
    """Without the optimizer among its arguments a step is an evaluation step; before any
    training step it would run eagerly on the whole model, where its backward is refused."""
    model = models.build("mlp")
    opt = models.make_optimizer(model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    step = zero_compile(lambda model, x, y: models.training_step("mlp")(model, opt, x, y))
    with pytest.raises(CaptureError, match="takes no optimizer.*optimizer=") as raised:
        step(model, *models.global_batch("mlp", 0))
    assert "<lambda>" in str(raised.value)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_a_meta_model_before_its_training_step_is_refused():
    with torch.device("meta"):
        model = models.build("mlp")
    with pytest.raises(RuntimeError, match="meta device.*call the training step"):
        zero_compile(lambda model, x: model(x))(model, torch.zeros(2, models.FEATURES))
