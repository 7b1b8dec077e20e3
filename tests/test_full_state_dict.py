"""``full_state_dict(cpu_offload=True)`` streams the model to rank 0's host one bucket at a time
([Note: full state dict on rank 0's host] in zero_fx/checkpoint/state_dict.py): the same values
as the whole dict, ``{}`` on the other ranks, and a measured peak of one bucket beyond what
the call returns."""

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from support import models
from support.ranks import run_ranks
from zero_fx import MixedPrecision, zero_compile

BLOCKS = 16
WIDTH = 64


class Blocks(nn.Module):
    """16 small blocks: stage 3 buckets one block per collective ([Note: buckets by block])."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS))
        self.register_buffer("scale", torch.full((WIDTH,), 0.5))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x * self.scale


_train_step = models.training_step("mlp")  # the mean squared error of the model's output


class NewBytes(TorchDispatchMode):
    """Live bytes of the storages that ops create while the mode is on (not the ones they
    read or write in place: the shards and optimizer state held before), and their peak.

    On the CPU the training device and the host are one, so the streamed path's gathered
    buckets and the dict it returns are counted together; the test subtracts the dict,
    which is alive at the end. A storage counts from the op that made it until it dies
    (checked at every op, so a death between ops is seen at the next one)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        self._sweep()  # first: a dead storage's address may be the new one's
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in inputs:
                    self.live.setdefault(storage.data_ptr(), (storage._weak_ref(), storage.nbytes()))
        self.peak = max(self.peak, sum(nbytes for _, nbytes in self.live.values()))
        return out

    def _sweep(self):
        for key, (weak, _) in list(self.live.items()):
            if torch.UntypedStorage._expired(weak):
                torch.UntypedStorage._free_weak_ref(weak)
                del self.live[key]


def _peak_bytes(fn):
    """(what ``fn()`` returns, the peak bytes of the tensors allocated while it ran)."""
    with NewBytes() as tracker:
        result = fn()
    return result, tracker.peak


def _unique_bytes(state: dict) -> int:
    return sum(t.untyped_storage().nbytes()
               for t in {t.untyped_storage()._cdata: t for t in state.values()}.values())


def _state_dicts_and_peaks(rank, world_size, stage, precision):
    torch.manual_seed(0)
    model = Blocks()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = zero_compile(_train_step, stage=stage, backend=models.BACKEND, mixed_precision=precision,
                        bucket_bytes=None if stage == 3 else 20_000)
    g = torch.Generator().manual_seed(rank)
    step(model, opt, torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g))
    plan = step.plan
    largest_bucket = max(sum(plan.layout(n).padded_numel * plan.layout(n).dtype.itemsize
                             for n in bucket)  # in the masters' dtype, as the dict holds them
                         for bucket in plan.buckets([l.name for l in plan.params]))
    whole, whole_peak = _peak_bytes(lambda: step.full_state_dict(cpu_offload=False))
    streamed, streamed_peak = _peak_bytes(lambda: step.full_state_dict(cpu_offload=True))
    bf16 = step.full_state_dict(torch.bfloat16, cpu_offload=True)
    return {"whole": whole, "whole_peak": whole_peak, "streamed": streamed,
            "streamed_peak": streamed_peak, "largest_bucket": largest_bucket,
            "bf16": bf16, "model_bytes": sum(l.numel * 4 for l in plan.params)}


@pytest.mark.parametrize("stage, precision", [
    (3, None),  # sharded masters, gathered one block at a time
    (2, MixedPrecision(param_dtype=torch.bfloat16)),  # whole bf16 parameters, sharded fp32 masters
    (1, None),  # whole parameters are the masters: rank 0 copies its own, no collective
])
def test_streamed_full_state_dict_peaks_at_one_bucket_and_lands_on_rank_0_only(stage, precision):
    results = run_ranks(2, _state_dicts_and_peaks, stage, precision)
    rank0, rank1 = results
    # the values: the whole dict, every name (buffers included), on the host
    assert rank0["streamed"].keys() == rank0["whole"].keys()
    assert all(torch.equal(v, rank0["whole"][k]) for k, v in rank0["streamed"].items())
    assert {v.device.type for v in rank0["streamed"].values()} == {"cpu"}
    assert all(torch.equal(v, rank0["whole"][k].to(torch.bfloat16)) for k, v in rank0["bf16"].items())
    # what non-zero ranks get: nothing (FSDP2's cpu_offload=True convention)
    assert rank1["streamed"] == {} and rank1["bf16"] == {}
    assert rank1["whole"].keys() == rank0["whole"].keys()  # cpu_offload=False: every rank
    bucket = rank0["largest_bucket"]
    print(f"\nstage {stage}{' bf16' if precision else ''}: model {rank0['model_bytes']} B, largest bucket {bucket} B; peak "
          f"during full_state_dict, above what it returns: cpu_offload=False rank 0 "
          f"{rank0['whole_peak'] - _unique_bytes(rank0['whole'])} B, rank 1 "
          f"{rank1['whole_peak'] - _unique_bytes(rank1['whole'])} B (returning "
          f"{_unique_bytes(rank1['whole'])} B); cpu_offload=True rank 0 "
          f"{rank0['streamed_peak'] - _unique_bytes(rank0['streamed'])} B, rank 1 "
          f"{rank1['streamed_peak']} B (returning nothing)")
    # the peak: what the call returns plus at most one bucket (gathered, with its shard cut)
    one_bucket = bucket + bucket // 2  # the gathered bucket and its packed shard (1/N)
    assert rank0["streamed_peak"] - _unique_bytes(rank0["streamed"]) <= one_bucket
    assert rank1["streamed_peak"] <= one_bucket
    if stage == 3:  # today's whole dict holds the model on every rank
        assert rank1["whole_peak"] >= rank0["model_bytes"] > 4 * one_bucket


def test_bad_options_are_refused_with_what_to_pass():
    model = Blocks()
    step = zero_compile(_train_step, stage=3, backend=models.BACKEND)
    step(model, torch.optim.AdamW(model.parameters()), torch.randn(4, WIDTH), torch.randn(4, WIDTH))
    with pytest.raises(TypeError, match="cpu_offload must be True, False or None"):
        step.full_state_dict(cpu_offload="yes")
    with pytest.raises(TypeError, match="floating-point torch.dtype"):
        step.full_state_dict(torch.int8)
    sd = step.full_state_dict(cpu_offload=True)  # world size 1: rank 0 gets it all
    assert sd.keys() == step.full_state_dict().keys()


def test_export_reads_only_the_model_and_casts_a_group_at_a_time(tmp_path):
    """[Note: exporting in bounded memory]: besides the dict it returns, ``model_state_dict``
    (what ``python -m zero_fx.export`` writes) holds one group of fp32 parameters, never the
    optimizer's state (here twice the model) or the whole model in fp32 next to its cast."""
    from zero_fx.checkpoint.offline import model_state_dict

    path = str(tmp_path / "ckpt")
    model = Blocks()
    step = zero_compile(_train_step, stage=3, backend=models.BACKEND)
    step(model, torch.optim.AdamW(model.parameters()), torch.randn(4, WIDTH), torch.randn(4, WIDTH))
    step.save_checkpoint(path)
    expected = step.full_state_dict()
    group = 40_000  # two of the 16.6 KB blocks
    with NewBytes() as tracker:
        exported = model_state_dict(path, torch.bfloat16, group_bytes=group)
    assert exported.keys() == expected.keys()
    assert all(torch.equal(v, expected[k].to(torch.bfloat16)) for k, v in exported.items())
    largest = max(p.numel() * 4 for p in model.parameters())
    above = tracker.peak - _unique_bytes(exported)
    print(f"\nexport to bf16: returns {_unique_bytes(exported)} B, holds {above} B more at its peak "
          f"(group {group} B; model in fp32 {sum(p.numel() * 4 for p in model.parameters())} B)")
    assert above <= group + largest
    with pytest.raises(ValueError, match="group_bytes must be positive"):
        model_state_dict(path, group_bytes=0)


def test_gathered_parameters_says_what_it_gathers(caplog):
    """Entering ``gathered_parameters()`` logs the bytes this rank is about to hold whole."""
    from zero_fx.formatting import format_bytes

    model = Blocks()
    step = zero_compile(_train_step, stage=3, backend=models.BACKEND)
    step(model, torch.optim.AdamW(model.parameters()), torch.randn(4, WIDTH), torch.randn(4, WIDTH))
    whole = sum(p.numel() * 4 for p in model.parameters())
    assert step.state.gathered_bytes() == whole
    with caplog.at_level("INFO", logger="zero_fx"), step.gathered_parameters():
        model(torch.randn(2, WIDTH))
    said = [r.getMessage() for r in caplog.records if "gathered_parameters" in r.getMessage()]
    assert len(said) == 1 and format_bytes(whole) in said[0] and "float32" in said[0], said


def _on_a_mesh(rank, world_size):
    from support.ranks import with_mesh

    torch.manual_seed(0)
    model = Blocks()
    step = zero_compile(_train_step, stage=3, backend=models.BACKEND, **with_mesh({"mesh": (2, 2)}))
    g = torch.Generator().manual_seed(rank)
    step(model, torch.optim.AdamW(model.parameters()), torch.randn(4, WIDTH, generator=g),
         torch.randn(4, WIDTH, generator=g))
    streamed, peak = _peak_bytes(lambda: step.full_state_dict(cpu_offload=True))
    return {"streamed": streamed, "peak": peak, "whole": step.full_state_dict(cpu_offload=False)}


def test_on_a_hybrid_mesh_only_rank_0s_shard_group_gathers():
    """2 replicas of 2 shards: ranks 0 and 1 (replica 0) gather, rank 0 keeps the dict, and
    the other replica's ranks return at once, allocating nothing."""
    results = run_ranks(4, _on_a_mesh)
    assert results[0]["streamed"].keys() == results[0]["whole"].keys()
    assert all(torch.equal(v, results[0]["whole"][k]) for k, v in results[0]["streamed"].items())
    assert all(r["streamed"] == {} for r in results[1:])
    assert results[1]["peak"] > 0 and results[2]["peak"] == results[3]["peak"] == 0
