"""Steps that cannot be one graph fail with a CaptureError that says what to change."""

import pytest
import torch

import models
from ranks import run_ranks
from zero_fx import CaptureError, zero_compile


def branches_on_a_value(model, opt, x, y):
    loss = models.loss_fn("mlp", model, x, y)
    if loss.item() > 100:
        loss = loss * 0
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def selects_with_a_mask(model, opt, x, y):
    loss = model(x)[y > 0].pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _capture_error(rank, world_size, step_fn, model_name="mlp", loss_type="unchanged"):
    model = models.build(model_name)
    if loss_type != "unchanged":
        model.loss_type = loss_type
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = zero_compile(step_fn, stage=3, backend="aot_eager")
    x, y = models.global_batch(model_name, 0)
    try:
        step(model, opt, x, y)
    except CaptureError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("step_fn, advice", [
    (branches_on_a_value, "use `torch.where`"),
    (selects_with_a_mask, "Use a fixed-shape form"),
])
def test_the_error_names_the_fix(step_fn, advice):
    message = run_ranks(1, _capture_error, step_fn)[0]
    assert message.startswith("zero_fx captures the whole step as one graph, and PyTorch could not")
    assert advice in message


def test_a_logging_hf_model_says_what_to_set():
    pytest.importorskip("transformers")
    # loss_type None, as a model from from_config / from_pretrained comes: its loss logs
    message = run_ranks(1, _capture_error, models.training_step("hf_gpt2"), "hf_gpt2", None)[0]
    assert "logging.Logger" in message
    assert 'model.loss_type = "ForCausalLM"' in message
