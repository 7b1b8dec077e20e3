"""The public entry point at world size 1: decorator forms, backends, and clear errors."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from support.training import check_updates
from zero_fx import CaptureError, MixedPrecision, zero_compile


def tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))


def batch():
    return torch.randn(3, 4), torch.randn(3, 2)


def standard_step(model, opt, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_bare_decorator_and_backends_match_eager_pytorch(backend):
    model, ref = tiny(), tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    step = zero_compile(standard_step, backend=backend)
    for _ in range(3):
        x, y = batch()
        assert torch.allclose(step(model, opt, x, y), standard_step(ref, ref_opt, x, y))
    full = step.full_parameters()
    for name, p in ref.named_parameters():
        assert torch.allclose(full[name], p, rtol=1e-6, atol=1e-7), name
    assert_updates_like(full, ref)


def assert_updates_like(params: dict, ref: nn.Module, tolerance: float = 1e-5) -> None:
    """Each parameter's update error (training.check_updates) against ``ref``'s, both from
    ``tiny()``'s initial values (measured 0: one rank runs eager's ops)."""
    initial = dict(tiny().named_parameters())
    check_updates([{"params": params}],
                  {"params": {n: p.detach() for n, p in ref.named_parameters()},
                   "initial": initial}, tolerance)


def test_callable_backend_receives_the_rewritten_graph():
    seen = []

    def compiler(gm, example_inputs):
        seen.append(gm)
        return gm

    model = tiny()
    opt = torch.optim.AdamW(model.parameters())
    zero_compile(backend=compiler)(standard_step)(model, opt, *batch())
    assert len(seen) == 1 and any(n.op == "placeholder" for n in seen[0].graph.nodes)


def test_model_and_optimizer_named_when_closed_over():
    model = tiny()
    opt = torch.optim.AdamW(model.parameters())

    @zero_compile(backend="eager", model=model, optimizer=opt)
    def step(x, y):
        return standard_step(model, opt, x, y)

    step(*batch())
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())


def test_closed_over_model_without_naming_it_is_an_error():
    model = tiny()
    opt = torch.optim.AdamW(model.parameters())
    step = zero_compile(lambda x, y: standard_step(model, opt, x, y), backend="eager")
    with pytest.raises(ValueError, match="no model among the step's arguments"):
        step(*batch())


def test_two_models_are_ambiguous():
    a, b = tiny(), tiny()
    opt = torch.optim.AdamW(a.parameters())
    step = zero_compile(lambda a, b, opt, x, y: standard_step(a, opt, x, y), backend="eager")
    with pytest.raises(ValueError, match="2 different models"):
        step(a, b, opt, *batch())


def test_non_elementwise_optimizer_says_why():
    model = tiny()
    opt = torch.optim.LBFGS(model.parameters())
    with pytest.raises(TypeError, match="LBFGS.*line search"):
        zero_compile(standard_step, backend="eager")(model, opt, *batch())


def test_unknown_optimizer_steps_whole_tensors_unless_declared_elementwise():
    """An optimizer zero_fx does not know takes the whole-tensor rule ([Note: update rules]),
    where each tensor's owner steps it whole; declared elementwise, it steps flat shards."""
    class MySGD(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.sub_(group["lr"] * p.grad)

    for declared, shape in ((None, (6, 4)), (True, (24,))):
        model = tiny()
        step = zero_compile(standard_step, backend="eager", stage=1, elementwise_optimizer=declared)
        opt = MySGD(model.parameters())
        step(model, opt, *batch())
        assert tuple(opt.param_groups[0]["params"][0].shape) == shape


def test_step_without_backward_is_an_error():
    def forward_only(model, opt, x, y):
        return F.mse_loss(model(x), y)

    model = tiny()
    with pytest.raises(Exception, match="loss.backward"):
        zero_compile(forward_only, backend="eager")(model, torch.optim.AdamW(model.parameters()), *batch())


def _no_zero_grad(model, opt, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


def _two_steps(model, opt, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.fixture
def compiles(monkeypatch):
    """Every entry point that starts compiling the captured step (our capture, passes and
    lowering, and aot_eager's and Inductor's own), each call recorded instead of run."""
    import torch._dynamo.backends.debugging as debugging
    import torch._inductor.compile_fx as compile_fx
    from zero_fx.compiler import backend

    started = []
    for module, name in [(backend, "capture_step_graph"), (backend, "run_pipeline"),
                         (backend, "lower"), (debugging, "aot_eager"),
                         (compile_fx, "compile_fx"), (compile_fx, "compile_fx_inner")]:
        monkeypatch.setattr(module, name, lambda *a, _name=name, **k: started.append(_name))
    return started


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("step_fn, message", [
    (_no_zero_grad, r"never calls opt.zero_grad\(\); call it after opt.step\(\).*Nothing was compiled"),
    (_two_steps, r"calls opt.step\(\) 2 times; zero_fx needs exactly one.*Nothing was compiled"),
])
def test_a_step_of_the_wrong_shape_raises_before_anything_compiles(compiles, backend, step_fn,
                                                                   message):
    model = tiny()
    with pytest.raises(CaptureError, match=message):
        zero_compile(step_fn, backend=backend)(model, torch.optim.AdamW(model.parameters()),
                                               *batch())
    assert compiles == []


def test_the_step_shape_check_does_not_stop_a_good_step(compiles):
    """The spies see a well-formed step start compiling: the check above is not vacuous."""
    model = tiny()
    with pytest.raises(Exception):
        zero_compile(standard_step, backend="aot_eager")(
            model, torch.optim.AdamW(model.parameters()), *batch())
    assert compiles[0] == "capture_step_graph"


def test_exceptions_users_handle_are_exported():
    import zero_fx
    from zero_fx import (CollectiveFailedError, DistributedSetupError, InvariantError,
                         RanksDisagreeError)

    assert {"CollectiveFailedError", "DistributedSetupError", "InvariantError",
            "RanksDisagreeError"} <= set(zero_fx.__all__)
    assert issubclass(CollectiveFailedError, RuntimeError) and issubclass(RanksDisagreeError, RuntimeError)
    assert InvariantError is zero_fx.passes.InvariantError
    assert DistributedSetupError is zero_fx.runtime.init_distributed.DistributedSetupError


ERRORS_AND_THEIR_OLD_HOMES = {
    "CaptureError": ("zero_fx.capture.step_graph", "zero_fx.capture.errors"),
    "CheckpointError": ("zero_fx.checkpoint.files", "zero_fx.checkpoint_error"),
    "CollectiveFailedError": ("zero_fx.runtime.failures",),
    "DistributedSetupError": ("zero_fx.runtime.init_distributed",),
    "GraphBreakWarning": ("zero_fx.capture.graph_breaks",),
    "InvariantError": ("zero_fx.passes.check_invariants", "zero_fx.passes"),
    "MaterializeError": ("zero_fx.materialize", "zero_fx.materialize.replay"),
    "RanksDisagreeError": ("zero_fx.runtime.rank_agreement",),
    "UnsupportedTorchError": ("zero_fx.compat",),
}


def test_every_public_error_is_defined_in_zero_fx_errors_and_keeps_its_old_paths():
    import importlib

    import zero_fx
    import zero_fx.errors

    defined = {name for name, value in vars(zero_fx.errors).items()
               if isinstance(value, type) and issubclass(value, (Exception, Warning))
               and value.__module__ == "zero_fx.errors"}
    assert defined == set(ERRORS_AND_THEIR_OLD_HOMES)
    exported = {name for name in zero_fx.__all__
                if isinstance(getattr(zero_fx, name), type)
                and issubclass(getattr(zero_fx, name), (Exception, Warning))}
    assert exported == defined, "zero_fx exports an error defined outside zero_fx.errors"
    for name, homes in ERRORS_AND_THEIR_OLD_HOMES.items():
        assert getattr(zero_fx, name) is getattr(zero_fx.errors, name)
        for home in homes:
            assert getattr(importlib.import_module(home), name) is getattr(zero_fx.errors, name), (
                f"{home}.{name} is not zero_fx.errors.{name}")


def test_the_version_is_the_package_s():
    """``zero_fx.__version__`` is pyproject.toml's version."""
    import pathlib
    import re

    import zero_fx

    pyproject = (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert re.search(r'^version = "(.+)"$', pyproject, re.M).group(1) == zero_fx.__version__


def test_a_user_pass_that_breaks_an_invariant_is_named_unwrapped():
    """A collective nobody waits for breaks "every collective has exactly one wait"; the error
    reaches the user as InvariantError, not dynamo's BackendCompilerFailed, and names the pass."""
    import zero_fx

    def unwaited_all_reduce(gm):
        loss = gm.graph.output_node().args[0][0]
        with gm.graph.inserting_after(loss):
            gm.graph.call_function(torch.ops._c10d_functional.all_reduce.default,
                                   (loss, "sum", "0"))

    model = tiny()
    step = zero_compile(standard_step, stage=3, backend="aot_eager",
                        passes=[zero_fx.after("reduce_grads", unwaited_all_reduce)])
    with pytest.raises(zero_fx.InvariantError,
                       match=r"your pass unwaited_all_reduce broke an invariant: collective "
                             r"all_reduce_default must have exactly one user, a wait; has \[\]\. "
                             r"Fix unwaited_all_reduce") as err:
        step(model, torch.optim.AdamW(model.parameters()), *batch())
    assert err.value.pass_name == "unwaited_all_reduce"
    assert "zero_fx" not in err.value.pass_name and "reduce_grads" not in str(err.value)


def test_clipping_through_a_name_zero_fx_does_not_see_is_an_error_that_names_the_fixes():
    """``torch.nn.utils.clip_grad_norm_`` inside the step runs on the reduced gradients
    (tests/test_step_companions.py); held under another name, the real function reads the
    unreduced ones, and the capture refuses."""
    hidden = torch.nn.utils.clip_grad_norm_  # a closure's cell: not swapped

    def clipping_step(model, opt, x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        hidden(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    model = tiny()
    with pytest.raises(CaptureError, match=r"torch.nn.utils.clip_grad_norm_.*max_grad_norm=.*"
                                           r"last_grad_norm"):
        zero_compile(clipping_step, backend="eager")(model, torch.optim.SGD(model.parameters()),
                                                     *batch())


@pytest.mark.parametrize("kwargs, message", [
    ({"stage": 5}, "stage must be 0, 1, 2 or 3"),
    ({"backend": "tensorrt"}, "backend must be one of"),
    ({"accumulation_steps": 0}, "accumulation_steps must be an int >= 1"),
    ({"max_grad_norm": -1.0}, "max_grad_norm must be a number > 0"),
])
def test_bad_configuration(kwargs, message):
    with pytest.raises(ValueError, match=message):
        zero_compile(standard_step, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"param_dtype": torch.int8}, "param_dtype must be a floating dtype"),
    ({"loss_scale": "sometimes"}, "loss_scale must be"),
    ({"loss_scale": -2.0}, "loss_scale must be"),
])
def test_bad_mixed_precision_policy(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MixedPrecision(**kwargs)
    with pytest.raises(TypeError, match="zero_fx.MixedPrecision"):
        zero_compile(standard_step, mixed_precision=torch.bfloat16)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_below_stage3_the_model_stays_usable_outside_the_step(stage):
    """Stages 0-2 keep whole, current parameters: evaluating the model needs nothing special."""
    model, ref = tiny(), tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    step = zero_compile(standard_step, stage=stage, backend="aot_eager")
    for _ in range(3):
        x, y = batch()
        step(model, opt, x, y)
        standard_step(ref, ref_opt, x, y)
    x, _ = batch()
    with torch.no_grad():
        assert torch.allclose(model(x), ref(x), rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for p in model.parameters())
    assert_updates_like({n: p.detach() for n, p in model.named_parameters()}, ref)


def test_stage0_leaves_the_optimizer_on_the_model():
    model = tiny()
    opt = torch.optim.AdamW(model.parameters())
    step = zero_compile(standard_step, stage=0, backend="aot_eager")
    step(model, opt, *batch())
    assert [id(p) for g in opt.param_groups for p in g["params"]] == [id(p) for p in model.parameters()]
    assert all(opt.state[p]["exp_avg"].shape == p.shape for p in model.parameters())


def test_stage3_frees_the_models_parameters():
    model = tiny()
    step = zero_compile(standard_step, stage=3, backend="aot_eager")
    step(model, torch.optim.AdamW(model.parameters()), *batch())
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())


def test_traffic_before_the_first_call_says_what_to_do():
    step = zero_compile(standard_step, backend="aot_eager")
    with pytest.raises(RuntimeError, match="call it once first"):
        step.traffic()


def test_the_shipped_models_old_path_is_the_same_module():
    """The GPT and Llama moved from the planner to ``zero_fx.models``; code importing them
    from ``zero_fx.planner.torch_models`` gets the same classes."""
    import zero_fx.models
    from zero_fx.planner.torch_models import GPT, Llama

    assert GPT is zero_fx.models.GPT and Llama is zero_fx.models.Llama
