"""A step of the same structure as one compiled before reuses its rewritten graph and lowered
program ([Note: one compilation per step structure] in zero_fx/compiler/reuse.py), and trains
exactly as a compilation of its own would; a step that differs in anything the compilation
reads compiles afresh."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from support import models
from zero_fx import zero_compile
from zero_fx.compiler import reuse

REUSED = "earlier step of this structure"


@pytest.fixture(autouse=True)
def no_kept_compilations():
    reuse.forget_all()
    yield
    reuse.forget_all()


def trained(name: str = "gpt", steps: int = 3, *, seed: int = 0, lr: float = 1e-2,
            model=None, backend: str = "eager", **options):
    """A fresh model trained ``steps`` calls by a fresh ``zero_compile`` of the plain step;
    the step, the model's parameters and each call's loss."""
    model = model if model is not None else models.build(name, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    step = zero_compile(models.training_step(name), backend=backend, **options)
    losses = [step(model, opt, *models.global_batch(name, i)).item() for i in range(steps)]
    with step.gathered_parameters():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return step, params, losses


def reasons(step) -> list[str]:
    return [c.reason for c in step.compilations]


@pytest.mark.parametrize("stage, backend", [(1, "eager"), (3, "eager"), (3, "aot_eager")])
def test_a_second_model_reuses_the_compilation_and_trains_as_its_own(stage, backend):
    first, _, _ = trained(stage=stage, seed=0, backend=backend)
    assert not any(REUSED in r for r in reasons(first))
    second, params, losses = trained(stage=stage, seed=1, lr=3e-2, backend=backend)
    assert [REUSED in r for r in reasons(second)] == [True], reasons(second)
    assert second.graphs[0] is first.graphs[0]
    reuse.forget_all()  # the same model and optimizer, compiled on their own
    alone, alone_params, alone_losses = trained(stage=stage, seed=1, lr=3e-2, backend=backend)
    assert not any(REUSED in r for r in reasons(alone))
    assert losses == alone_losses
    for name, p in params.items():
        assert torch.equal(p, alone_params[name]), name


def test_a_step_of_another_structure_compiles_afresh():
    trained(stage=3)
    other, _, _ = trained("mlp", stage=3)
    wider, _, _ = trained(stage=2)  # another stage: another plan
    unbucketed, _, _ = trained(stage=3, bucket_bytes=0)  # other options
    for step in (other, wider, unbucketed):
        assert not any(REUSED in r for r in reasons(step)), reasons(step)


class Scaled(nn.Module):
    """A model whose forward multiplies by a Python number it holds: dynamo bakes it into the
    graph as a constant, so two such models differ only in the graph's constants."""

    def __init__(self, scale: float):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(models.FEATURES, 7)
        self.scale = scale
        self.register_buffer("table", torch.full((7,), scale))

    def forward(self, x):
        return self.lin(x) * self.scale + torch.tensor([self.scale] * 7)


def scaled_losses(scale: float) -> list[float]:
    model = Scaled(scale)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, opt, x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    compiled = zero_compile(step, stage=3, backend="eager")
    return [compiled(model, opt, *models.global_batch("mlp", i)).item() for i in range(2)], compiled


def test_a_graph_constant_that_differs_is_not_reused():
    first, _ = scaled_losses(2.0)
    second, step = scaled_losses(3.0)
    assert not any(REUSED in r for r in reasons(step)), reasons(step)
    reuse.forget_all()
    alone, _ = scaled_losses(3.0)
    assert second == alone and second != first


def test_the_key_refuses_what_it_cannot_read():
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    key = reuse.structure_key(gm, [torch.ones(2)], [None])
    assert key == reuse.structure_key(gm, [torch.zeros(2)], [None])  # values are inputs
    assert key != reuse.structure_key(gm, [torch.ones(3)], [None])
    assert key != reuse.structure_key(gm, [torch.ones(2)], ["w"])
    gm.meta["zero_x"] = object()
    with pytest.raises(reuse.NotReusable, match="known by its identity"):
        reuse.structure_key(gm, [torch.ones(2)], [None])


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_kept_compilation_holds_nothing_of_its_model(backend):
    """What is kept for later steps is the structure's: the first model, its optimizer and
    their tensors die with the step even while its compilation is kept."""
    import gc
    import weakref

    model = models.build("gpt")
    step, _, _ = trained(model=model, stage=3, backend=backend)
    alive = [weakref.ref(t) for t in [*model.parameters(), *step.state.shards.values()]]
    assert reuse._KEPT, "the compilation is kept"
    del model, step
    gc.collect()
    gc.collect()  # the first runs the step's finalizers, which let go of the rest
    assert reuse._KEPT and not any(ref() is not None for ref in alive)


def test_what_the_process_changes_between_compilations_is_in_the_key(monkeypatch):
    """Inductor's settings and zero_fx's own functions decide a lowering too: a compilation
    under other settings, or with one of our functions patched, is not a kept one."""
    from zero_fx.compiler import lower

    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    key = reuse.structure_key(gm, [torch.ones(2)], [None])
    with torch._inductor.config.patch(max_autotune=True):
        assert reuse.structure_key(gm, [torch.ones(2)], [None]) != key
    monkeypatch.setattr(lower, "_compile_body", lambda *args, **kwargs: None)
    assert reuse.structure_key(gm, [torch.ones(2)], [None]) != key
    monkeypatch.undo()
    assert reuse.structure_key(gm, [torch.ones(2)], [None]) == key
