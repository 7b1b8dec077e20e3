"""HuggingFace transformers GPT-2 and Llama (from a config, random weights) train under
@zero_compile with parity against single-process training, world size 2, stages 0-3."""

import pytest
import torch

pytest.importorskip("transformers")

from support import models  # noqa: E402
from support.feature_runs import reference_run, zero_fx_run  # noqa: E402
from support.training import parity_errors  # noqa: E402


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
