"""The planner's pricing of quantized collectives (``python -m zero_fx.plan --quantize``,
[Note: when quantizing pays] in zero_fx/planner/features/quantization.py), on a small GPT."""

import dataclasses
import re

import pytest
import torch

from examples.gpt import GPT, GPTConfig
from zero_fx.analysis.hardware import PRESETS
from zero_fx.planner.cli import main as plan_main
from zero_fx.planner.models import ModelSource
from zero_fx.planner.features.quantization import CONFIGURATIONS, configurations, price_quantization
from zero_fx.planner.question import Workload

CONFIG = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=128)
NVLINK = PRESETS["8xh100-nvlink"]


def source(depth_changes: bool = True, depth: int = CONFIG.n_layer) -> ModelSource:
    """The GPT at ``depth`` blocks; ``depth_changes``: the planner may trace it shallower."""
    def build(layers=None):
        return GPT(dataclasses.replace(CONFIG, n_layer=layers or depth))

    return ModelSource(f"a {depth}-block GPT of width 128", build,
                       depth if depth_changes else None, CONFIG.vocab_size, CONFIG.block_size)


def priced(hardware=NVLINK, depth_changes=True, names=None, depth=CONFIG.n_layer,
           recompute=None):
    workload = Workload(world_size=8, stage=3, dtype=torch.float32, batch=2, seq=32,
                        recompute=recompute)
    return price_quantization(source(depth_changes, depth), workload,
                              hardware=hardware, steady_from=1, names=names)


def test_the_prices_extrapolated_from_two_depths_are_those_of_the_whole_model():
    """Traced at 2 and 3 blocks and extrapolated to 4, against the 4 blocks traced whole:
    bytes within 0.1 % (each block adds the same collectives; a quantized row pads its last
    block, measured 2.9e-4 off), seconds within 1 %."""
    names = ["qwZ int8 + qgZ int4"]
    extrapolated, whole = priced(names=names), priced(depth_changes=False, names=names)
    assert [r.name for r in extrapolated] == ["none", *names]
    for a, b in zip(extrapolated, whole):
        assert a.sent_bytes == pytest.approx(b.sent_bytes, rel=1e-3), a.name
        for field in ("communication_seconds", "compute_seconds", "step_seconds"):
            assert getattr(a, field) == pytest.approx(getattr(b, field), rel=1e-2), (a.name, field)


def test_quantizing_pays_where_the_link_is_slow_and_not_where_it_is_free():
    """The same graphs priced on NVLink's preset with a link 1000x slower, and with one that
    costs nothing: quantizing saves three quarters of the bytes (int8 for fp32) and adds
    its quantize and dequantize ops to the compute, so it pays on the first and never on
    the second."""
    two_blocks = dict(names=["qwZ + qgZ int8"], depth=2, depth_changes=False)
    slow = priced(dataclasses.replace(NVLINK, link_bandwidth=NVLINK.link_bandwidth / 1000),
                  **two_blocks)
    free = priced(dataclasses.replace(NVLINK, link_bandwidth=1e18, link_latency=0.0),
                  **two_blocks)
    for none, quantized in (slow, free):
        assert 0.25 <= quantized.sent_bytes / none.sent_bytes <= 0.35
        assert quantized.compute_seconds > none.compute_seconds
    assert slow[1].step_seconds < slow[0].step_seconds
    assert free[1].step_seconds > free[0].step_seconds


def test_each_configuration_is_priced_with_the_recompute_asked_for():
    """``--quantize --recompute blocks`` traces each step with recompute, as zero_compile runs
    it: the blocks' forward again in the backward (more compute), fewer activations kept
    (a lower peak). Measured on two blocks: compute +13 % (+6 % beside quantizing's own
    ops), peak -17 %. The recompute was once left out, and the rows were those without it."""
    two_blocks = dict(names=["qwZ + qgZ int8"], depth=2, depth_changes=False)
    kept, recomputed = priced(**two_blocks), priced(recompute="blocks", **two_blocks)
    assert [r.name for r in recomputed] == ["none", "qwZ + qgZ int8"]
    for a, b in zip(kept, recomputed):
        assert b.sent_bytes == a.sent_bytes, a.name
        assert 1.03 < b.compute_seconds / a.compute_seconds < 1.25, a.name
        assert 0.7 < b.peak_bytes / a.peak_bytes < 0.95, a.name


def test_each_stage_prices_what_it_can_quantize():
    assert list(configurations(3)) == list(CONFIGURATIONS)
    assert list(configurations(1)) == list(configurations(2)) == ["none", "qgZ int8"]


@pytest.mark.parametrize("argv, says", [
    (["--stage", "0", "--seq", "32"], "quantized reductions start at stage 1"),
    (["--seq", "32", "--world", "1"], "one rank sends nothing"),
    ([], "give seq \\(--seq\\)"),
])
def test_the_command_line_says_what_cannot_be_priced(argv, says, capsys):
    world = [] if "--world" in argv else ["--world", "8"]
    with pytest.raises(SystemExit):
        plan_main(["--model", "gpt2", "--quantize", *world, *argv])
    assert re.search(says, capsys.readouterr().err)


def test_the_secondary_partition_is_priced_where_the_ranks_fill_several_nodes():
    """16 ranks as 2 nodes of 8 (4x8xh100-ib): hpZ moves the backward's gathers onto the
    node's links, so communication takes less time for about the same bytes, and each rank
    keeps its secondary shards, 1/8 of the parameters, from the forward to the backward. On
    one node there is nothing to price."""
    ib = PRESETS["4x8xh100-ib"]
    workload = Workload(world_size=16, stage=3, dtype=torch.float32, batch=2, seq=32)
    none, secondary = price_quantization(source(depth_changes=False, depth=2), workload,
                                         hardware=ib, steady_from=1, names=["hpZ"])
    assert secondary.options == {"secondary_partition": 8}
    assert secondary.communication_seconds < 0.8 * none.communication_seconds
    assert 0.9 < secondary.sent_bytes / none.sent_bytes <= 1.0
    assert secondary.peak_bytes > none.peak_bytes
    assert list(configurations(3, ranks_per_node=8, world_size=8)) == list(CONFIGURATIONS)
    assert "hpZ" not in configurations(2, ranks_per_node=8, world_size=16)
