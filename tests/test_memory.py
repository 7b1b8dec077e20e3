"""Stage 3 holds 1/N of the model states per rank, and no full parameter outlives the step.

Measured on the tensors themselves after 5 steps of the parity runs (GPT,
AdamW: parameter + exp_avg + exp_avg_sq per element), not on what the plan
says.
"""

import pytest

from training import zero_fx_run

FP32 = 4
ADAMW_TENSORS_PER_PARAM = 3  # the parameter shard, exp_avg, exp_avg_sq


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_model_states_are_one_nth_per_rank(world_size):
    for rank, result in enumerate(zero_fx_run(world_size, "gpt", "aot_eager")):
        memory = result["memory"]
        unsharded = ADAMW_TENSORS_PER_PARAM * memory["unsharded_numel"] * FP32
        held = memory["shard_bytes"] + memory["optimizer_state_bytes"]
        steps = memory["optimizer_state_bytes"] - 2 * memory["shard_numel"] * FP32  # scalar `step`s
        assert steps < 1024, f"rank {rank}: optimizer state larger than two shard-sized tensors"
        padding_bytes = ADAMW_TENSORS_PER_PARAM * (memory["shard_numel"] * world_size
                                                   - memory["unsharded_numel"]) * FP32 / world_size
        assert unsharded / world_size <= held - steps <= unsharded / world_size + padding_bytes, (
            f"rank {rank} holds {held} bytes of model states; 1/{world_size} of {unsharded} expected")


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_no_full_parameter_survives_the_step(world_size):
    for rank, result in enumerate(zero_fx_run(world_size, "gpt", "aot_eager")):
        memory = result["memory"]
        assert memory["full_param_storage_bytes"] == 0, "the model's parameters still hold storage"
        assert memory["full_size_parameters_alive"] == [], (
            f"rank {rank}: tensors of a parameter's full shape alive after the step: "
            f"{memory['full_size_parameters_alive']}")


def test_more_ranks_hold_less():
    """Live tensor bytes in the whole process shrink as ranks are added."""
    held = [zero_fx_run(n, "gpt", "aot_eager")[0]["memory"]["all_live_tensor_bytes"] for n in (1, 2, 4)]
    assert held[0] > held[1] > held[2], held
