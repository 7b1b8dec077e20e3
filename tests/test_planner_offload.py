"""Offload planned and priced (``python -m zero_fx.plan --offload``; [Note: planning offload]
in zero_fx/planner/features/offload.py, [Note: pricing offload] in zero_fx/analysis/cost_model.py):
device and host bytes per mode against the formulas written out here, ZeRO-Offload's 13B
on one 32 GB V100 (fits with offload, not without), the streamed gradients priced again,
the copies and the host's step, what ``auto`` picks, the largest model each mode holds,
and what a bad flag says.

Kept fast: zero-offload-13b is zero_fx's torch GPT built on the meta device (0.2 s); one
plan traces its working set on fake tensors (3 and 4 blocks, about 2 s), shared by the
tests that read it.
"""

from __future__ import annotations

import pytest
import torch

from zero_fx.analysis.hardware import PRESETS
from zero_fx.analysis.transfer_seconds import (host_device_seconds, host_optimizer_bytes,
                                               host_optimizer_seconds)
from zero_fx.planner.cli import main as plan_main
from zero_fx.planner.models import model_source
from zero_fx.planner.features.offload import (OFFLOAD_MODES, OffloadOptions, largest_model,
                                     offload_states)
from zero_fx.planner.plan_model import plan_model
from zero_fx.planner.printing import format_report
from zero_fx.planner.question import Workload

GB = 1e9
V100 = "1xv100-32gb-pcie3"
PSI_13B = 40 * 12 * 5120 ** 2 + 40 * 2 * 5120 + 5120 + (50304 + 1024) * 5120
"""zero-offload-13b from its config: 40 blocks of 12h² (qkv, projection, a 4x MLP) and two
LayerNorms (no biases), the final norm, the tied embedding and the positions."""


@pytest.fixture(scope="module")
def source_13b():
    return model_source("zero-offload-13b")


@pytest.fixture(scope="module")
def traced_13b(source_13b):
    """ZeRO-Offload's setup: one V100 32 GB, fp16, 1024 tokens, recompute of blocks (the
    paper checkpoints activations), every mode side by side."""
    return plan_model(source_13b, Workload(world_size=1, stage=3, dtype=torch.float16, seq=1024,
                                           recompute="blocks"),
                      offload=OffloadOptions(mode="auto", device_memory=32 * GB), hardware=V100)


def rows(report):
    return {row.mode: row for row in report.offload_rows}


# ------------------------------------------------------------------ device and host bytes


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_device_and_host_bytes_per_mode_are_the_formulas(stage):
    psi, n, staging = 1e9, 8, (3e6, 5e6)
    expected = {  # bf16 parameters, fp32 masters and gradient the optimizer reads, Adam 8
        "none": ({1: 2 * psi + 2 * psi + 12 * psi / n, 2: 2 * psi + 16 * psi / n,
                  3: 16 * psi / n}[stage], 0.0),
        "optimizer": ({1: 2 * psi + 2 * psi, 2: 2 * psi + 3e6, 3: 2 * psi / n + 3e6}[stage],
                      16 * psi / n),
        "parameters": (3e6 + 5e6, 2 * psi / n + 16 * psi / n),
    }
    for mode in OFFLOAD_MODES if stage == 3 else OFFLOAD_MODES[:2]:
        device, host = offload_states(stage, psi, n, mode, optimizer_bytes=8, param_bytes=2,
                                      staging=staging)
        assert (sum(device.values()), sum(host.values())) == pytest.approx(expected[mode]), mode
    # fp32: the host's master is the parameter, not stored twice
    device, host = offload_states(3, psi, n, "parameters", optimizer_bytes=8, param_bytes=4)
    assert sum(host.values()) == pytest.approx(16 * psi / n) and sum(device.values()) == 0


def test_the_13b_model_states_per_mode(source_13b):
    report = plan_model(source_13b, Workload(world_size=1, dtype=torch.float16),
                        offload=OffloadOptions(mode="optimizer", device_memory=32 * GB),
                        hardware=V100)
    assert report.psi == PSI_13B == 12_846_126_080
    buckets = {kind: max(b.bytes for b in bs) for kind, bs in report.buckets.items()}
    by_mode = rows(report)
    assert by_mode["none"].device_bytes == pytest.approx(16 * PSI_13B)  # 205.6 GB
    assert by_mode["none"].host_bytes == 0
    assert by_mode["optimizer"].device_bytes == pytest.approx(
        2 * PSI_13B + 2 * buckets["reduce_scatter"])  # 25.7 GB + two 629 MB buckets
    assert by_mode["optimizer"].host_bytes == pytest.approx(16 * PSI_13B)
    assert by_mode["parameters"].device_bytes == pytest.approx(
        2 * buckets["reduce_scatter"] + 2 * buckets["all_gather"])
    assert by_mode["parameters"].host_bytes == pytest.approx(18 * PSI_13B)
    assert report.host_memory == 1.5e12 and report.offload == "optimizer"


# ------------------------------------------------------------------ ZeRO-Offload's headline


def test_zero_offload_13b_fits_32_gb_with_offload_and_not_without(traced_13b):
    by_mode = rows(traced_13b)
    none, optimizer = by_mode["none"], by_mode["optimizer"]
    assert none.peak_bytes == pytest.approx(16 * PSI_13B) and none.peak_bytes > 32 * GB
    assert 2 * PSI_13B < optimizer.peak_bytes <= 32 * GB  # 26.95 GB
    assert optimizer.host_bytes <= traced_13b.host_memory
    assert traced_13b.offload == "optimizer"  # auto: the least offload that fits
    text = format_report(traced_13b, device_memory_gb=32)
    assert "| optimizer ← | 26.95 GB |" in text
    assert "--offload auto: 'optimizer', the least offload that fits." in text
    assert "none 2.00B (device), optimizer 16.00B (device), parameters 83.33B (host)" in text


def test_streamed_gradients_no_longer_pile_up(traced_13b, source_13b):
    """Traced, the reduced gradient shards live to the end of the step: on one rank the
    working set grows by a block's fp16 gradients (12h² x 2 bytes) more per block than
    with the gradients streamed to the host, and the streamed one barely grows."""
    from zero_fx.planner.working_set import traced_working_set

    workload = Workload(world_size=1, stage=3, dtype=torch.float16, batch=1, seq=1024,
                        recompute="blocks")
    _, _, per_block = traced_working_set(source_13b, workload,
                                         hardware=V100, offload=True)
    block_gradients = (12 * 5120 ** 2 + 2 * 5120) * 2
    kept = 2 * 1024 * 5120 * 2  # b·s·h in fp16, twice: what the traced peak keeps of a block
    assert block_gradients <= per_block[1] - per_block["streamed"] <= block_gradients + kept
    assert per_block["streamed"] < 0.02 * GB
    by_mode = rows(traced_13b)
    assert by_mode["none"].working_set - by_mode["optimizer"].working_set > 2 * PSI_13B * 0.95


# ------------------------------------------------------------------ copies and time


def test_copies_and_the_host_step_are_priced_from_the_preset(traced_13b):
    hw = PRESETS[V100]
    by_mode = rows(traced_13b)
    optimizer, parameters = by_mode["optimizer"], by_mode["parameters"]
    assert optimizer.to_host == optimizer.to_device == pytest.approx(2 * PSI_13B)
    assert parameters.to_host == pytest.approx(2 * PSI_13B)
    # stage 3 gathers twice (forward, backward): the shards come over twice
    assert parameters.to_device == pytest.approx(
        traced_13b.stages[3].traffic["all_gather"])
    assert optimizer.copy_seconds[0] == pytest.approx(2 * PSI_13B / 12e9)  # PCIe gen3, 2.1 s
    assert host_optimizer_bytes(optimizer_bytes=8, param_bytes=2) == 30
    assert optimizer.host_step_seconds == pytest.approx(PSI_13B * 30 / 100e9)  # 3.9 s
    assert optimizer.step_seconds == pytest.approx(
        max(optimizer.compute_seconds, optimizer.copy_seconds[0]) + optimizer.host_step_seconds
        + optimizer.copy_seconds[1])
    # offloaded, the device no longer steps: its compute is shorter than without
    assert optimizer.compute_seconds < by_mode["none"].compute_seconds
    assert host_device_seconds(50e9, PRESETS["8xh100-nvlink"]) == pytest.approx(1.0)
    assert host_optimizer_seconds(1e9, hw, optimizer_bytes=8, param_bytes=2) == \
        pytest.approx(0.3)


def test_presets_state_host_memory_and_links():
    assert PRESETS[V100].host_device_bandwidth == 12e9  # PCIe gen3 x16
    assert PRESETS[V100].device_memory == 32e9
    assert PRESETS["8xh100-nvlink"].host_device_bandwidth == 50e9  # PCIe gen5 x16
    assert PRESETS["8xh100-nvlink"].host_memory == 250e9  # 2 TB / 8
    assert PRESETS["1xgh200-c2c"].host_device_bandwidth == pytest.approx(360e9)  # C2C
    assert all(PRESETS[name].host_optimizer_bandwidth > 0
               for name in PRESETS if name != "cpu-gloo")


# ------------------------------------------------------------------ auto and largest model


@pytest.mark.parametrize("device_gb, picked, fits", [
    (300, "none", True), (32, "optimizer", True), (3, "parameters", True),
    (1, "parameters", False)])
def test_auto_picks_the_least_offload_that_fits(source_13b, device_gb, picked, fits):
    report = plan_model(source_13b, Workload(world_size=1, dtype=torch.float16),
                        offload=OffloadOptions(mode="auto", device_memory=device_gb * GB),
                        hardware=V100)
    assert report.offload == picked
    text = format_report(report, device_memory_gb=device_gb)
    assert ("the least offload that fits" in text) == fits
    assert ("no mode fits" in text) == (not fits)


def test_a_host_too_small_moves_auto_on(source_13b):
    # 32 GB device, 100 GB host: optimizer offload needs 205.5 GB of host, parameters more
    report = plan_model(source_13b, Workload(world_size=1, dtype=torch.float16),
                        offload=OffloadOptions(mode="auto", host_memory=100 * GB,
                                               device_memory=32 * GB),
                        hardware=V100)
    assert report.offload == "parameters" and report.host_memory == 100 * GB
    text = format_report(report, device_memory_gb=32)
    assert "| optimizer | 26.95 GB (fits) | — | — | 205.54 GB (does NOT fit) |" in text
    assert "--offload auto: no mode fits; 'parameters' is the most offload." in text
    assert "none 2.00B (device), optimizer 6.25B (host), parameters 5.56B (host)" in text


def test_the_largest_model_each_mode_holds():
    def largest(mode, device, host):
        return largest_model(3, 1, mode, optimizer_bytes=8, param_bytes=2,
                             device_memory=device * GB, host_memory=host * GB)

    assert largest("none", 32, 1500) == (pytest.approx(2e9), "device")  # 16 bytes each
    assert largest("optimizer", 32, 1500) == (pytest.approx(16e9), "device")  # 2 bytes
    assert largest("none", 80, 250) == (pytest.approx(5e9), "device")
    assert largest("optimizer", 80, 250) == (pytest.approx(250e9 / 16), "host")
    assert largest("optimizer", 80, 2000) == (pytest.approx(40e9), "device")
    assert largest("parameters", 80, 2000) == (pytest.approx(2000e9 / 18), "host")


# ------------------------------------------------------------------ bad flags


@pytest.mark.parametrize("args, message", [
    # the config's own offload check answers the planner too, in the same words
    (["--stage", "2", "--offload", "parameters"],
     "offload='parameters' needs stage 3 (got stage 2): stages 1-2 keep whole parameters on "
     "the device; offload='optimizer' moves the masters and the optimizer's state"),
    (["--stage", "0", "--offload", "optimizer"], "offload='optimizer' needs stage 1, 2 or 3"),
    (["--offload", "auto"], "--offload auto picks the least offload that fits the device: give "
                            "--device-memory GB"),
    (["--offload", "cpu"], "argument --offload: invalid choice: 'cpu'"),
    (["--host-memory", "100"], "--host-memory 100 goes with --offload and must be > 0"),
    (["--offload", "optimizer", "--hardware", "cpu-gloo"],
     "the preset cpu-gloo states no host memory: give --host-memory GB"),
    (["--offload", "optimizer", "--world", "2", "--tp", "2"],
     "plan --offload with --tp or --expert-parallel one at a time"),
])
def test_bad_offload_flags_say_what_to_do(capsys, args, message):
    argv = ["--model", "zero-offload-13b", "--world", "1", *args]
    if argv.count("--world") > 1:
        argv[2:4] = []
    with pytest.raises(SystemExit):
        plan_main(argv)
    err = " ".join(capsys.readouterr().err.split())
    assert message in err, err


def test_plan_model_refuses_an_unknown_mode(source_13b):
    with pytest.raises(ValueError, match="offload must be one of none, optimizer, parameters "
                                         "or auto, got 'cpu'"):
        plan_model(source_13b, Workload(world_size=1), offload=OffloadOptions(mode="cpu"))
