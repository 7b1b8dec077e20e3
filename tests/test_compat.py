"""zero_fx/base/compat.py: the supported torch range, checked at import, and the differences
between releases, each handled by a probe that both releases take."""

import os
import re

import pytest
import torch

from zero_fx import compat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("version", ["2.11.0", "2.13.0+cpu", "2.15.0+cu128", "2.15.2"])
def test_a_supported_torch_passes(version):
    compat.check_torch(version)


@pytest.mark.parametrize("version", ["2.10.1", "2.16.0", "3.0.0", "1.13.1"])
def test_a_torch_outside_the_range_is_refused_naming_the_range(version):
    with pytest.raises(compat.UnsupportedTorchError, match=re.escape(
            f"zero_fx supports torch>=2.11,<2.16; this environment has torch {version}")):
        compat.check_torch(version)


def test_the_installed_torch_is_in_the_range():
    compat.check_torch()  # what importing zero_fx did


def test_only_compat_reads_a_version_string():
    readers = []
    for folder in ("zero_fx", "passes"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                path = os.path.join(dirpath, name)
                if name.endswith(".py") and os.path.basename(path) != "compat.py":
                    with open(path) as f:
                        if re.search(r"torch\.__version__|transformers\.__version__", f.read()):
                            readers.append(os.path.relpath(path, ROOT))
    assert readers == []


class _Recording(compat.CustomGraphPass):
    def __init__(self, name, log, uuid="u"):
        self.name, self.log, self._uuid = name, log, uuid

    def __call__(self, graph):
        self.log.append(self.name)

    def uuid(self):
        return self._uuid


@pytest.mark.parametrize("existing", ["none", "one", "tuple"])
def test_the_users_post_grad_passes_run_before_ours_as_one_pass(existing):
    log = []
    users = {"none": None, "one": _Recording("user", log),
             "tuple": (_Recording("user", log), _Recording("user2", log))}[existing]
    composed = compat.one_post_grad_pass(users, [_Recording("ours", log)])
    composed(torch.fx.Graph())
    assert log == {"none": ["ours"], "one": ["user", "ours"],
                   "tuple": ["user", "user2", "ours"]}[existing]
    assert composed.uuid() is not None  # Inductor's graph cache keys on every pass


def test_a_pass_without_a_uuid_keeps_the_composition_out_of_the_cache():
    composed = compat.one_post_grad_pass(lambda graph: None, [_Recording("ours", [])])
    assert composed.uuid() is None


@pytest.mark.parametrize("model_name", ["llama", "mixtral"])
def test_transformers_output_hooks_are_in_place_before_the_capture(model_name):
    """transformers 5 installs its output-recording hooks under a lock Dynamo cannot trace,
    on the first forward that asks for outputs (Mixtral's router logits): installed by
    zero_fx beforehand, the captured forward finds them. Skipped where transformers has no
    such hooks (4.x)."""
    pytest.importorskip("transformers.utils.output_capturing")
    from examples import hf_models
    from zero_fx.base.compat import hf_install_output_hooks

    make_config = {"llama": hf_models.llama_config, "mixtral": hf_models.mixtral_config}[model_name]
    model = hf_models.causal_lm(make_config(vocab_size=64, seq=8, layers=1, width=16, heads=2,
                                            kv_heads=2, ffn=32))
    recording = [m for m in model.modules() if getattr(m, "_can_record_outputs", None)]
    assert recording, "the model records no outputs: the test checks nothing"
    hf_install_output_hooks(model)
    assert all(getattr(m, "_output_capturing_hooks_installed", False) for m in recording)
