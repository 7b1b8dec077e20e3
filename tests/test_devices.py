"""The device and the backend, read from the process group's own configuration ([Note: the
backend by device] in zero_fx/base/collective_backends.py), never from its name; the current
CUDA device checked; torchrun without a process group refused.

CUDA is absent here: where a test needs a group that serves CUDA with NCCL, it replaces
``dist.get_backend_config`` (what zero_fx reads) by the string such a group reports, and says so."""

from __future__ import annotations

import datetime
import os
import types

import pytest
import torch
import torch.distributed as dist

from support import models
from support import cores
from support.torchrun import torchrun_command
from support.training import STEPS, parity_errors, reference_run
from zero_fx import zero_compile
from zero_fx.runtime import sharding
from zero_fx.runtime.distributed import failures, process_group
from zero_fx.runtime.distributed.process_group import (World, backend_serving, check_current_cuda_device,
                                           check_devices_match_backend, training_device)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _params(*devices):
    return [types.SimpleNamespace(device=torch.device(d)) for d in devices]


@pytest.fixture
def undefined_group(tmp_path):
    """``init_process_group()`` with no backend, as under torchrun: its name is "undefined"."""
    dist.init_process_group(init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def gloo_and_nccl(monkeypatch):
    """What a group made by ``init_process_group("cpu:gloo,cuda:nccl")`` (or with no backend on
    a CUDA machine) reports: its name that string, gloo for CPU tensors, NCCL for CUDA ones.
    NCCL cannot be built here, so ``dist`` answers as such a group would."""
    config = "cpu:gloo,cuda:nccl"
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: config)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


# -- which backend serves which device ----------------------------------------------------------

def test_an_undefined_group_serves_cpu_tensors_with_gloo(undefined_group):
    assert dist.get_backend() == "undefined"  # what the name says: nothing zero_fx can use
    assert backend_serving("cpu") == "gloo" and backend_serving("cuda") == ""
    assert process_group.current_world().backend_for("cpu") == "gloo"
    check_devices_match_backend(_params("cpu"))  # a CPU model trains
    with pytest.raises(ValueError, match="no backend for CUDA tensors.*init_distributed"):
        check_devices_match_backend(_params("cuda:0"))


def test_an_undefined_group_takes_the_gloo_all_gather_path(undefined_group, monkeypatch):
    """[Note: gloo's coalesced all-gather corrupts the heap]: the workaround follows gloo
    serving CPU tensors, whatever the group is called."""
    used = []
    monkeypatch.setattr(sharding, "use_gloo_single_tensor_all_gather", lambda: used.append(1))
    model = models.build("mlp")
    opt = models.make_optimizer(model)
    step = zero_compile(models.training_step("mlp"), stage=3, backend="eager")
    step(model, opt, *models.global_batch("mlp", 0))
    assert used == [1]


def test_a_group_named_gloo_and_nccl_trains_cuda_models_with_the_nccl_check(gloo_and_nccl, monkeypatch):
    assert backend_serving("cpu") == "gloo" and backend_serving("cuda") == "nccl"
    check_devices_match_backend(_params("cuda:1"))
    with pytest.raises(ValueError, match="no backend for CPU|uses NCCL"):
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
        check_devices_match_backend(_params("cpu"))
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    # the NCCL completion check runs for CUDA training ([Note: failures on NCCL])...
    monkeypatch.setattr(dist.distributed_c10d, "_resolve_process_group", lambda name: name)
    world = World(size=2, rank=0, group_name="shards")
    monkeypatch.setattr(failures, "world_timeout", lambda: datetime.timedelta(seconds=7))
    check = failures.completion_check(world, torch.device("cuda", 1))
    assert isinstance(check, failures.CompletionCheck) and check.groups == ["shards"]
    assert check.timeout == datetime.timedelta(seconds=7)
    # ...and not for CPU training, where gloo raises at the collective
    assert failures.completion_check(world, torch.device("cpu")) is None
    # NCCL averages in the collective; gloo sums and the bucket code divides
    world = World(size=2, rank=0, group_name="shards", backends=process_group._backends())
    assert process_group.collectives_average(world, torch.device("cuda", 1))
    assert not process_group.collectives_average(world, torch.device("cpu"))


@pytest.mark.parametrize("config, device, message", [
    ("cpu:gloo,cuda:gloo", "cuda", "gloo for CUDA tensors"),  # init_process_group("gloo")
    ("cuda:nccl", "cpu", "no backend for CPU tensors"),        # init_process_group("nccl")
])
def test_device_and_backend_must_match(monkeypatch, config, device, message):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    with pytest.raises(ValueError, match=message):
        check_devices_match_backend(_params(device))


def test_parameters_on_several_devices():
    with pytest.raises(ValueError, match="several device types"):
        check_devices_match_backend(_params("cpu", "meta"))


# -- where a rank trains -------------------------------------------------------------------------

def test_the_training_device_is_the_parameters_device(gloo_and_nccl):
    assert training_device(_params("cpu", "cpu")) == torch.device("cpu")
    assert training_device(_params("cuda:3")) == torch.device("cuda", 3)


def test_a_meta_model_trains_on_the_local_rank_gpu_where_the_group_serves_cuda(gloo_and_nccl, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert training_device(_params("meta")) == torch.device("cuda", 1)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo")
    assert training_device(_params("meta")) == torch.device("cpu")  # the group moves CPU tensors only


def test_one_gpu_without_a_group_trains_a_meta_model_on_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert not dist.is_initialized()
    assert training_device(_params("meta")) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert training_device(_params("meta")) == torch.device("cpu")


def test_training_on_another_gpu_than_the_current_one_names_set_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(ValueError, match=r"trains on cuda:1 but the current CUDA device is cuda:0: "
                                         r"call torch.cuda.set_device\(local_rank\)"):
        check_current_cuda_device(torch.device("cuda", 1))
    check_current_cuda_device(torch.device("cuda", 0))
    check_current_cuda_device(torch.device("cpu"))


# -- torchrun ------------------------------------------------------------------------------------

def test_torchrun_without_a_process_group_is_refused(monkeypatch):
    """Each rank would train its own copy, silently; refused before anything is sharded."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = models.build("mlp")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = models.make_optimizer(model)
    step = zero_compile(models.training_step("mlp"), stage=3, backend="eager")
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE is 2 .* zero_fx.init_distributed\(\)"):
        step(model, opt, *models.global_batch("mlp", 0))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert step.state is None


UNDEFINED_BACKEND_SCRIPT = """
import json, sys
import torch, torch.distributed as dist
sys.path[:0] = [{tests!r}, {root!r}]
from support import models
from support.training import STEPS
from zero_fx import zero_compile

dist.init_process_group()  # no backend: the group's name is "undefined"
rank, world = dist.get_rank(), dist.get_world_size()
model = models.build("gpt")
opt = models.make_optimizer(model)
step = zero_compile(models.training_step("gpt"), stage=3, backend="aot_eager")
losses = []
for i in range(STEPS):
    x, y = models.global_batch("gpt", i)
    per_rank = x.shape[0] // world
    losses.append(step(model, opt, x[rank * per_rank:(rank + 1) * per_rank],
                       y[rank * per_rank:(rank + 1) * per_rank]).item())
params = step.full_parameters()
torch.save({{"backend": dist.get_backend(), "losses": losses, "params": params}},
           {out!r} + str(rank))
dist.destroy_process_group()
"""


def test_torchrun_with_an_undefined_backend_trains_stage_3_at_parity(tmp_path):
    """The usual script: ``init_process_group()`` with no backend, under torchrun on 2 CPU ranks."""
    script, out = tmp_path / "train.py", str(tmp_path / "result.pt")
    script.write_text(UNDEFINED_BACKEND_SCRIPT.format(tests=os.path.join(ROOT, "tests"), root=ROOT,
                                                            out=out))
    done = cores.run(torchrun_command(2, str(script)), cwd=ROOT, capture_output=True,
                     text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [torch.load(out + str(rank), weights_only=False) for rank in range(2)]
    assert [r["backend"] for r in results] == ["undefined"] * 2
    errors = parity_errors(results, reference_run("gpt"))
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-5, f"{worst}: relative error {errors[worst]:.2e}"
