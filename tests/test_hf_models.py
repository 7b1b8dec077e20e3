"""HuggingFace transformers GPT-2 and Llama (from a config, random weights) train under
@zero_compile with parity against single-process training, world size 2, stages 0-3."""

import pytest
import torch

pytest.importorskip("transformers")

import models  # noqa: E402
from feature_runs import reference_run, zero_fx_run  # noqa: E402
from ranks import run_ranks  # noqa: E402
from training import parity_errors  # noqa: E402
from zero_fx import CaptureError, zero_compile  # noqa: E402


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("model_name", models.HF_MODELS)
def test_hf_model_trains_as_single_process(model_name, stage):
    results = zero_fx_run(2, model_name, stage)
    errors = parity_errors(results, reference_run(model_name))
    assert max(errors.values()) < 1e-5, (max(errors, key=errors.get), max(errors.values()))
    assert results[0]["compilations"] == 1
    initial = dict(models.build(model_name).named_parameters())
    moved = [name for name, p in results[0]["params"].items() if not torch.equal(p, initial[name])]
    assert len(moved) == len(initial)  # every parameter trained (parity alone allows none)


def _unset_loss_type_rank(rank, world_size):
    model = models.build("hf_gpt2")
    model.loss_type = None  # as a model from from_config / from_pretrained comes
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = zero_compile(models.training_step("hf_gpt2"), stage=3, backend="aot_eager")
    x, y = models.global_batch("hf_gpt2", 0)
    try:
        step(model, opt, x, y)
    except CaptureError as err:
        return str(err)
    return "no error"


def test_a_logging_model_is_a_capture_error_that_says_what_to_set():
    message = run_ranks(1, _unset_loss_type_rank)[0]
    assert "logging.Logger" in message
    assert 'model.loss_type = "ForCausalLM"' in message
