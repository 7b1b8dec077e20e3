"""Optimizer offload ([Note: optimizer offload] in zero_fx/runtime/offload.py): masters and
optimizer state in host memory change where values live, not what they are. On this
machine host and device are the same memory, so what is tested is the mathematics: every
run with ``offload="optimizer"`` equals the same run without, bit for bit, and checkpoints
pass between the two."""

import pytest
import torch

from feature_runs import zero_fx_run
from ranks import run_ranks
from zero_fx import MixedPrecision, ZeroConfig, zero_compile

BF16 = (("mixed_precision", MixedPrecision(param_dtype=torch.bfloat16, output_dtype=torch.float32)),)
FP16 = (("mixed_precision", MixedPrecision(param_dtype=torch.float16, output_dtype=torch.float32)),)
"""test_mixed_precision's runs (the same options: its results are reused within one session)."""
OFFLOAD = (("offload", "optimizer"),)


def assert_bitwise_equal(offloaded, kept):
    for a, b in zip(offloaded, kept):
        assert a["losses"] == b["losses"]
        assert a["norms"] == b["norms"]
        for name, value in b["params"].items():
            assert torch.equal(a["params"][name], value), name


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_with_the_optimizer_offloaded_equals_the_run_without(stage):
    offloaded = zero_fx_run(2, "gpt", stage, options=BF16 + OFFLOAD)
    assert_bitwise_equal(offloaded, zero_fx_run(2, "gpt", stage, options=BF16))
    result = offloaded[0]
    assert set(result["shard_dtypes"].values()) == {torch.float32}  # the masters
    assert result["optimizer_state_dtypes"] == {torch.float32}
    # stage 3's graph reads each shard on the device, in the compute dtype
    assert set(result["device_shard_dtypes"].values()) == ({torch.bfloat16} if stage == 3 else set())


def test_fp16_loss_scaling_and_clipping_with_the_optimizer_offloaded():
    """The loss scale and the clipping coefficient live on the device, the gradients they
    scale on the host; the norm is reduced on the device."""
    options = FP16 + (("max_grad_norm", 0.5),)
    assert_bitwise_equal(zero_fx_run(2, "gpt", 3, options=options + OFFLOAD),
                         zero_fx_run(2, "gpt", 3, options=options))


@pytest.mark.parametrize("world_size", [1, 4])
def test_fp32_at_one_and_four_ranks(world_size):
    assert_bitwise_equal(zero_fx_run(world_size, "gpt", 3, options=OFFLOAD),
                         zero_fx_run(world_size, "gpt", 3))


def checkpoint_rank(rank, world_size, path):
    """Train with offload at stage 3 and save; load into a run without offload at stage 2,
    and into an offloaded stage 3 again: the whole parameters the three hold."""
    import models

    results = {}

    def trained(stage, offload, load=None):
        model = models.build("gpt", seed=1 if load else 0)  # a load must replace all of it
        opt = models.make_optimizer(model)
        step = zero_compile(models.training_step("gpt"), stage=stage, backend="aot_eager",
                            offload=offload, mixed_precision=BF16[0][1])
        if load:
            step.load_checkpoint(load, model, opt)
            results[f"loaded at {stage}"] = step.full_parameters()
        x, y = models.global_batch("gpt", 0)
        half = slice(rank * 4, rank * 4 + 4)
        step(model, opt, x[half], y[half])
        return step

    saved = trained(3, "optimizer")
    saved.save_checkpoint(path)
    expected = saved.full_parameters()
    results["explain"] = str(saved.explain())
    x, y = models.global_batch("gpt", 0)
    saved(saved.state.model, saved.state.optimizer, x[rank * 4:rank * 4 + 4], y[rank * 4:rank * 4 + 4])
    results["continued"] = saved.full_parameters()
    for stage, offload in [(2, None), (3, "optimizer")]:
        loaded = trained(stage, offload, load=path)  # loads, then takes one step
        results[stage] = loaded.full_parameters()
    results["saved"] = expected
    return results


def test_checkpoints_pass_between_offloaded_runs_and_others(tmp_path):
    """Saved with offload, loaded without (stage 2) and with (stage 3) into models built
    from another seed: both hold the saved parameters bitwise, and the same next step
    leaves them equal to each other and to the saved run's own next step (the optimizer's
    state was read too); explain() says what is offloaded."""
    results = run_ranks(2, checkpoint_rank, str(tmp_path / "ckpt"))[0]
    for name, value in results["saved"].items():
        assert torch.equal(results["loaded at 2"][name], value), name
        assert torch.equal(results["loaded at 3"][name], value), name
        assert torch.equal(results[3][name], results[2][name]), name
        assert torch.equal(results[3][name], results["continued"][name]), name
    assert "offload: the fp32 masters and the optimizer's state in host memory" in results["explain"]


def test_offload_modes_not_built_and_stage_0_say_so():
    with pytest.raises(NotImplementedError, match="offload='parameters' is not built yet"):
        ZeroConfig(stage=3, offload="parameters")
    with pytest.raises(ValueError, match="needs stage 1, 2 or 3"):
        ZeroConfig(stage=0, offload="optimizer")
    with pytest.raises(ValueError, match="offload must be None or 'optimizer'"):
        ZeroConfig(stage=3, offload="gpu")
