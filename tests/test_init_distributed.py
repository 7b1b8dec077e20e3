"""zero_fx.init_distributed: a world of one without torchrun, torchrun's group with it, and
clear refusals. The GPU decisions are checked with torch.cuda's answers replaced (no GPU
needed); the examples and the elastic-restart test run it under a real torchrun."""

import os
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from bench.helpers.runs import free_port
from zero_fx import Distributed, init_distributed
from zero_fx.runtime.distributed.init_distributed import DistributedSetupError, resolve_device
from zero_fx.runtime.distributed.process_group import world_timeout

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")


@pytest.fixture
def no_torchrun(monkeypatch):
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)``: torch.cuda answers as if this machine had ``n`` GPUs."""
    def pretend(count: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    return pretend


def test_without_torchrun_it_is_a_world_of_one_and_creates_no_group(no_torchrun):
    run = init_distributed(device="cpu")
    assert run == Distributed(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"),
                              backend="")
    assert run.is_main and not dist.is_initialized()


def test_auto_is_cuda_with_a_gpu_per_local_rank_and_the_cpu_otherwise(gpus):
    gpus(2)
    assert resolve_device("auto", local_rank=1, local_world_size=2) == torch.device("cuda", 1)
    assert resolve_device("cpu", local_rank=1, local_world_size=2) == torch.device("cpu")
    gpus(1)  # two ranks on one GPU: NCCL refuses it, so auto falls back to gloo, and says so
    with pytest.warns(UserWarning, match=r"2 ranks on this node but 1 GPU\(s\).*--nproc_per_node ≤ 1"):
        assert resolve_device("auto", local_rank=0, local_world_size=2) == torch.device("cpu")
    gpus(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no GPU at all is not worth a warning
        assert resolve_device("auto", local_rank=0, local_world_size=2) == torch.device("cpu")


def test_more_ranks_per_node_than_gpus_is_refused_with_what_to_do(gpus):
    gpus(1)
    with pytest.raises(DistributedSetupError, match=r"more ranks per node than GPUs: local rank 1 "
                                                     r"of 2 .* 1 GPU\(s\); .*--nproc_per_node ≤ 1"):
        resolve_device("cuda", local_rank=1, local_world_size=2)
    gpus(0)
    with pytest.raises(DistributedSetupError, match="torch sees no CUDA device"):
        resolve_device("cuda", local_rank=0, local_world_size=1)
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda, got 'tpu'"):
        resolve_device("tpu", local_rank=0, local_world_size=1)


def test_a_rank_that_cannot_have_its_gpu_fails_before_joining(no_torchrun, monkeypatch, gpus):
    """The refusal comes before the rendezvous: no rank waits on a peer that already failed."""
    gpus(1)
    monkeypatch.setattr(dist, "rendezvous", lambda *a, **k: pytest.fail("joined the group"))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(DistributedSetupError, match="more ranks per node than GPUs"):
        init_distributed(device="cuda")


def test_rank_without_the_rest_of_torchrun_says_to_use_torchrun(no_torchrun, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(DistributedSetupError, match="RANK is set but MASTER_ADDR, MASTER_PORT are "
                                                     "not: start the script with torchrun"):
        init_distributed(device="cpu")


def test_under_torchrun_it_joins_with_a_timeout_and_a_store_prefix_per_restart(no_torchrun,
                                                                            monkeypatch):
    """torchrun's variables for a world of one, in its third restart attempt: the group's keys
    live under ``attempt3/`` of torchrun's store ([Note: a store prefix per restart]); a
    second call reports the same group instead of joining again."""
    port = free_port()
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                            TORCHELASTIC_RESTART_COUNT="3").items():
        monkeypatch.setenv(name, value)
    run = init_distributed(device="cpu", timeout=timedelta(seconds=42))
    try:
        assert run == Distributed(rank=0, world_size=1, local_rank=0,
                                  device=torch.device("cpu"), backend="cpu:gloo,cuda:gloo")
        assert world_timeout() == timedelta(seconds=42)
        assert init_distributed(device="cpu") == run  # idempotent: it reports the group
        dist.distributed_c10d._get_default_store().set("probe", "1")
        torchrun_store = dist.TCPStore("127.0.0.1", port, is_master=False,
                                       timeout=timedelta(seconds=10))
        keys = torchrun_store.list_keys()  # the group's own and the probe, all in the prefix
        assert "attempt3/0//probe" in keys and all(k.startswith("attempt3/") for k in keys), keys
        with pytest.raises(DistributedSetupError, match=r"already initialised \(cpu:gloo,cuda:gloo\) "
                                                         r"has no backend .* \(NCCL\)"):
            init_distributed(device="cuda")
    finally:
        dist.destroy_process_group()


def test_a_group_made_elsewhere_is_described_not_joined_again(fake_world_of_two, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    run = init_distributed()
    assert (run.rank, run.world_size, run.local_rank) == (0, 2, 0)
    assert run.device == torch.device("cpu") and "fake" in run.backend
