"""The cost model on hand-built graphs (what overlap buys, what it counts) and the
offline planner on a fake-tensor GPT at a world size this machine could not run."""

import subprocess
import sys

import pytest
import torch

from test_schedule import WEIGHT_BYTES, rewritten
from zero_fx import Hardware, estimate, rewritten_step_on_fake
from zero_fx.analysis.cost_model import node_seconds

# Slow links, fast compute: communication dominates, so overlap shows.
SLOW_LINK = Hardware(name="test", flops=1e9, memory_bandwidth=1e9, link_bandwidth=1e6,
                     link_latency=1e-5, op_overhead=1e-6)


def test_prefetch_hides_communication():
    plain, plan = rewritten(prefetch=0)
    scheduled, _ = rewritten(prefetch=1)
    before, after = estimate(plain, plan, SLOW_LINK), estimate(scheduled, plan, SLOW_LINK)
    assert after.exposed_seconds < before.exposed_seconds
    assert after.step_seconds < before.step_seconds
    assert after.communication_seconds == pytest.approx(before.communication_seconds)


def test_buckets_pay_latency_once():
    latency_bound = Hardware(name="test", flops=1e12, memory_bandwidth=1e12, link_bandwidth=1e12,
                             link_latency=1e-3, op_overhead=0.0)
    plain, plan = rewritten(bucket_bytes=0)
    fused, _ = rewritten(bucket_bytes=6 * WEIGHT_BYTES)
    assert estimate(fused, plan, latency_bound).communication_seconds == pytest.approx(
        3 * 1e-3, rel=0.01)  # 3 launches (forward, backward gathers; one reduce-scatter), 1 step each
    assert estimate(plain, plan, latency_bound).communication_seconds == pytest.approx(
        (6 + 5 + 6) * 1e-3, rel=0.01)


def test_a_matmul_costs_its_flops():
    gm, plan = rewritten()
    mm = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.mm.default)
    a, b = mm.args[0].meta["val"], mm.args[1].meta["val"]
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    assert node_seconds(mm, SLOW_LINK) == pytest.approx(flops / 1e9 + 1e-6)


def test_peak_memory_grows_with_what_is_resident():
    plain, plan = rewritten()
    resident, resident_plan = rewritten(resident=("w0", "w1", "w2"))
    assert estimate(resident, resident_plan, SLOW_LINK).peak_bytes > \
        estimate(plain, plan, SLOW_LINK).peak_bytes


def test_unknown_preset_names_the_presets():
    gm, plan = rewritten()
    with pytest.raises(ValueError, match="8xh100-nvlink"):
        estimate(gm, plan, "a100")


def tiny_gpt():
    from examples.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=64, bias=False))


def test_planning_on_fake_tensors_at_sixteen_ranks():
    gm, plan = rewritten_step_on_fake(tiny_gpt, batch=2, seq=32, vocab_size=128, world_size=16,
                                      persistence_threshold=0, bucket_bytes=0)
    assert plan.world_size == 16 and plan.total_numel == sum(p.numel() for p in tiny_gpt().parameters())
    shards = [n for n in gm.graph.nodes if n.op == "placeholder" and "zero_param" in n.meta]
    assert all(n.meta["val"].numel() == plan.layout(n.meta["zero_param"]).shard_numel for n in shards)
    result = estimate(gm, plan, "8xh100-nvlink")
    assert 0 < result.exposed_seconds < result.step_seconds


def test_the_command_line_prints_traffic_and_estimate():
    out = subprocess.run(
        [sys.executable, "-m", "zero_fx.estimate", "--model", "test_cost_model:tiny_gpt",
         "--world", "8", "--seq", "32", "--dtype", "float32", "--hardware", "cpu-gloo"],
        capture_output=True, text=True, check=True, timeout=300,
        env={"PYTHONPATH": ":".join(sys.path)})
    assert "all_gather" in out.stdout and "exposed" in out.stdout, out.stdout + out.stderr


def test_the_command_line_explains_a_planned_step():
    out = subprocess.run(
        [sys.executable, "-m", "zero_fx.estimate", "--model", "test_cost_model:tiny_gpt",
         "--world", "16", "--seq", "32", "--dtype", "float32", "--explain"],
        capture_output=True, text=True, check=True, timeout=300,
        env={"PYTHONPATH": ":".join(sys.path)})
    assert "stage 3 over 16 ranks" in out.stdout, out.stdout + out.stderr
    for section in ("Plan", "Collectives per step", "Gathered parameters", "Memory per rank"):
        assert f"\n{section}" in out.stdout, section


def timed_step_rank(rank: int, world_size: int, stage: int):
    """Median of 8 steps of a GPT (2 layers x 128, seq 64, batch 4 per rank), one thread
    per rank as ``bench.calibrate`` measured; and the cost model's prediction of one."""
    from bench.calibrate import timed_gpt_step

    torch.set_num_threads(1)
    config = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128, bias=True)
    seconds, train_step = timed_gpt_step(config, batch=4, stage=stage, steps=8)
    return seconds, train_step.estimate("cpu-gloo").step_seconds


@pytest.mark.parametrize("stage", [0, 3])
def test_the_cpu_gloo_preset_predicts_a_measured_step_on_this_machine(stage):
    """The preset is what ``python -m bench.calibrate`` measured on the CI machine
    (zero_fx/analysis/presets/cpu-gloo.json; its op overhead is fitted on a smaller GPT,
    2 x 64, seq 32). Measured over predicted here, 2026-11-24, over three calibrations:
    stage 0 0.80-0.96x, stage 3 1.07-1.13x (a GPT 4 x 256, seq 128, batch 8: 0.98-1.11x).
    The band, 40%, is twice the worst error: time on a shared box moves more than values do.
    On another machine, recalibrate (and commit the JSON) before trusting this test."""
    from ranks import run_ranks

    measured, predicted = run_ranks(2, timed_step_rank, stage)[0]
    assert abs(measured / predicted - 1) <= 0.4, \
        f"measured {1e3 * measured:.1f} ms, predicted {1e3 * predicted:.1f} ms"
