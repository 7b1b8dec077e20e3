"""Memory: each stage's per-rank peak is its row of the ZeRO table; stage 3 holds 1/N between steps.

Measured on the tensors themselves, not on what the plan says. The peak during
a step is counted by ``LiveTensorBytes`` (see [Note: measuring peak memory on
CPU] in zero_fx/analysis/live_memory.py): bytes of tensor storage alive, from the
compiled graph's start to the end of the optimizer step.
"""

import os

import pytest

from bench.helpers.rss import MALLOC_ENV
from support.ranks import run_ranks
from support.training import peak_memory_run, rss_growth_run, zero_fx_rank, zero_fx_run

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


# 16 layers of 384 x 384 (2.4M parameters, 9 MiB in fp32) with a batch of 2
# rows: model states are ~99% of what a rank holds.
WIDTH, DEPTH = 384, 16
PEAK_TOLERANCE = 0.15
"""How far the measured peak may sit above (or 10% below) the formula: optimizer
temporaries for one parameter, a gradient and its reduced copy alive together,
and the activations."""


def test_peak_memory_follows_the_table_at_four_ranks():
    """Stage 0 > 1 > 2 > 3, each near its formula (stage 3 plus its working set:
    prefetched buckets of gathered parameters and of full gradients in flight)."""
    results = peak_memory_run(4, (0, 1, 2, 3), WIDTH, DEPTH)
    for rank, rows in enumerate(results):
        peaks = [row["peak_bytes"] for row in rows]
        assert peaks[0] > peaks[1] > peaks[2] > peaks[3], f"rank {rank}: {peaks}"
        for row in rows:
            expected = row["formula_bytes"] + row["working_set_bytes"]
            assert 0.9 * expected <= row["peak_bytes"] <= (1 + PEAK_TOLERANCE) * expected, (
                f"rank {rank}, stage {row['stage']}: peak {row['peak_bytes'] / 2**20:.2f} MiB, "
                f"table {expected / 2**20:.2f} MiB")


@pytest.mark.inductor
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_stage3_release_survives_inductor(monkeypatch):
    """Inductor must not undo the release (say, by merging the forward and backward
    gathers, which would keep every parameter whole from forward to backward), measured
    on real ranks (test_lowered_order.py reads the same from the generated code, exactly).

    Measured by resident memory (the tensor probe cannot see Inductor's buffers;
    see [Note: peak RSS on Linux] in bench/helpers/rss.py), 16 layers of 1024 x 1024 at 2
    ranks: 64 MiB of parameters, one layer (4 MiB) per bucket. A step holds the
    gradient shards (32 MiB) and the layers in use or in flight: 42 MiB by the graph's
    timeline and by Inductor's program alike. A broken release would add all 64 MiB.
    On top, gloo copies the buffer of each collective while it runs (measured: 4 MiB
    for a 4 MiB gather or reduce-scatter), and with the schedule's overlap one or two
    run at Inductor's peak, depending on thread timing: measured 45-50 MiB against
    aot_eager's 42, so the bound is three such copies.
    """
    for name, value in MALLOC_ENV.items():
        monkeypatch.setenv(name, value)  # read by glibc when each spawned rank starts
    bucket = 1024 * 1024 * 4
    one_layer = (("bucket_bytes", bucket),)
    growth = {backend: rss_growth_run(2, 3, backend, 1024, 16, one_layer)
              for backend in ("aot_eager", "inductor")}
    for rank in range(2):
        param_bytes = growth["inductor"][rank]["param_bytes"]
        inductor, aot_eager = (growth[b][rank]["growth_bytes"] for b in ("inductor", "aot_eager"))
        assert inductor < param_bytes, f"rank {rank}: rose {inductor / 2**20:.1f} MiB"
        assert inductor < aot_eager + 3 * bucket, (
            f"rank {rank}: Inductor {inductor / 2**20:.1f} MiB vs aot_eager {aot_eager / 2**20:.1f} MiB")


def _graph_modules_left_by_dropped_steps(rank, world_size):
    """Graph modules alive after two steps were compiled and dropped, less those alive after
    one (Dynamo keeps the latest compile's: the count must stay, not grow)."""
    import gc

    import torch

    def graph_modules():  # no torch._dynamo.reset(): users compile many steps without one
        gc.collect()
        return sum(isinstance(o, torch.fx.GraphModule) for o in gc.get_objects())

    zero_fx_rank(rank, world_size, "mlp", "aot_eager", "adamw")
    after_one = graph_modules()
    zero_fx_rank(rank, world_size, "mlp", "aot_eager", "adamw")
    return graph_modules() - after_one


def test_a_dropped_step_frees_its_graphs():
    """Dynamo keeps each backend until a reset, and a compiled frame's globals as long as the
    objects its guards match live (modules): neither may hold the step, or every step a
    process compiles keeps its graphs, and through them its state, for good ([Note: compiled
    graphs die with their step] in zero_fx/compiled_step.py)."""
    left = run_ranks(2, _graph_modules_left_by_dropped_steps)
    assert left == [0, 0], f"graph modules left per rank by a dropped step: {left}"
