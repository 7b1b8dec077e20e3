"""Checkpoints on the devices a GPU run has, checked on the CPU: the RNG saved is the training
device's ([Note: the training device's generator] in zero_fx/checkpoint/contents.py), and
object collectives, barriers and DCP's coordination go over a group that serves the CPU
([Note: object traffic goes over the CPU] in zero_fx/runtime/distributed/cpu_group.py)."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from support import models
from support.ranks import run_ranks
from zero_fx import zero_compile
from zero_fx.checkpoint import contents
from zero_fx.runtime.distributed import cpu_group as cpu_group_module
from zero_fx.runtime.distributed.cpu_group import cpu_group


class FakeCudaGenerators:
    """torch.cuda's generator functions, recording the device each call names. This machine
    has no GPU, so the real ones would fail; what is checked is which device zero_fx asks
    for, with the current device set to another one (cuda:0, as on a rank that placed its
    model with ``.to(f"cuda:{local_rank}")`` and never called ``torch.cuda.set_device``)."""

    def __init__(self, monkeypatch):
        self.read, self.written = [], []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_rng_state", self.get_rng_state)
        monkeypatch.setattr(torch.cuda, "set_rng_state", self.set_rng_state)

    def get_rng_state(self, device="cuda"):
        self.read.append(torch.device(device))
        return torch.tensor([7], dtype=torch.uint8)

    def set_rng_state(self, state, device="cuda"):
        self.written.append((torch.device(device), state.tolist()))


def test_the_training_devices_generator_is_saved_and_restored_not_the_current_ones(monkeypatch):
    cuda = FakeCudaGenerators(monkeypatch)
    training = torch.device("cuda", 1)
    states = contents.rng_states(3, training)
    assert cuda.read == [training]  # not the current device, cuda:0
    assert set(states) == {"rng.rank3", "rng.rank3.cuda"}
    contents.set_rng_states(3, states, training)
    assert cuda.written == [(training, [7])]


def test_a_run_on_the_cpu_saves_no_cuda_generator_even_when_cuda_is_initialized(monkeypatch):
    cuda = FakeCudaGenerators(monkeypatch)  # CUDA in use by something else in the process
    states = contents.rng_states(0, torch.device("cpu"))
    assert set(states) == {"rng.rank0"} and cuda.read == []
    contents.set_rng_states(0, {**states, "rng.rank0.cuda": torch.tensor([1])}, torch.device("cpu"))
    assert cuda.written == []


CPU_BACKENDS = (True, False)


def _object_traffic(rank, world_size, folder, cpu_backends):
    """Per ``cpu_backend`` of ``cpu_backends``: train, save and load a checkpoint with every
    object collective, barrier and DCP call recorded with the group it was given.
    ``cpu_backend=False`` makes zero_fx read the default group as one with no CPU backend
    (pure NCCL; gloo here, since NCCL needs GPUs). Each case has its own model, step and
    checkpoint, and the patches are undone after it."""
    return {cpu_backend: _object_traffic_case(rank, world_size, f"{folder}/{cpu_backend}",
                                              cpu_backend)
            for cpu_backend in cpu_backends}


def _object_traffic_case(rank, world_size, path, cpu_backend: bool):
    originals = [(cpu_group_module, "serves_cpu", cpu_group_module.serves_cpu)]
    if not cpu_backend:
        cpu_group_module.serves_cpu = lambda group=None: False
    calls = []

    def spy(module, name, group_arg):
        original = getattr(module, name)
        originals.append((module, name, original))

        def recorded(*args, **kwargs):
            calls.append((name, kwargs.get(group_arg)))
            return original(*args, **kwargs)
        setattr(module, name, recorded)

    try:
        for name in ("all_gather_object", "broadcast_object_list", "barrier", "all_reduce"):
            spy(dist, name, "group")
        for name in ("save", "load"):
            spy(dcp, name, "process_group")
        model = models.build("gpt", seed=1)
        opt = models.make_optimizer(model)
        step = zero_compile(models.training_step("gpt"), stage=3, backend="aot_eager")
        x, y = models.global_batch("gpt", 0)
        step(model, opt, x[rank::world_size], y[rank::world_size])
        step.save_checkpoint(path)
        step.load_checkpoint(path)
        group = cpu_group()
        return {"calls": [(name, "none" if given is None else "cpu group" if given is group
                           else "another group") for name, given in calls],
                "is_world": group is dist.group.WORLD,
                "backend": dist.get_backend(group), "same_group_again": cpu_group() is group,
                "ranks": dist.get_process_group_ranks(group)}
    finally:
        for module, name, original in reversed(originals):
            setattr(module, name, original)


@pytest.fixture(scope="module")
def object_traffic(tmp_path_factory):
    """Both cases' results on every rank, from one 2-rank launch: a launch and the first
    compilation in it cost about half of each case's time on the 2-core box, so one launch
    for both saves one of them."""
    return run_ranks(2, _object_traffic, str(tmp_path_factory.mktemp("ckpt")), CPU_BACKENDS)


@pytest.mark.parametrize("cpu_backend", CPU_BACKENDS)
def test_object_collectives_and_dcp_go_over_the_cpu_group(object_traffic, cpu_backend):
    for result in (r[cpu_backend] for r in object_traffic):
        assert result["is_world"] == cpu_backend  # a gloo group is made only where needed
        assert result["backend"] == "gloo" and result["same_group_again"]
        assert result["ranks"] == [0, 1]
        names = {name for name, _ in result["calls"]}
        assert {"all_gather_object", "broadcast_object_list", "save", "load"} <= names
        assert "barrier" not in names  # NCCL's barrier guesses a device
        elsewhere = [(name, group) for name, group in result["calls"] if group != "cpu group"]
        assert not elsewhere, f"went over the default group's own choice of device: {elsewhere}"
