"""Saved steps ([Note: saved steps] in zero_fx/compiler/saved_steps.py): a new process with the
same step loads the rewritten graph an earlier one saved, and trains bitwise like it; a saved
step made for anything else, or a damaged one, is compiled from scratch with a line saying
why; ranks that do not all hold the same saved step all compile from scratch."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.distributed as dist

from support import models
from support.ranks import run_ranks
from zero_fx import zero_compile
from zero_fx.capture.kept_captures import forget_captures
from zero_fx.compiler import reuse, saved_steps

SAVED = "a saved step"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Saved steps on (the suite turns them off), in a folder of this test's own."""
    monkeypatch.setenv(saved_steps.SAVED_STEPS_ENV, "1")
    monkeypatch.setenv(saved_steps.CACHE_DIR_ENV, str(tmp_path))
    return tmp_path


def as_in_a_new_process() -> None:
    """Forget what this process kept of earlier compilations, as a new process has none."""
    torch._dynamo.reset()
    reuse.forget_all()
    forget_captures()


def trained(steps: int = 3, batch: int = 8, new_process: bool = True, seed: int = 0,
            **options):
    """The test GPT trained ``steps`` calls at stage 3 (``new_process``: as the first step of
    a new process): the step, each call's loss, the parameters and the optimizer's state
    (this rank's shards)."""
    if new_process:
        as_in_a_new_process()
    model = models.build("gpt", seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = zero_compile(models.training_step("gpt"), stage=3, backend="aot_eager", **options)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    losses = []
    for i in range(steps):
        x, y = models.global_batch("gpt", i, size=batch)
        share = batch // world
        losses.append(step(model, opt, x[rank * share:(rank + 1) * share],
                           y[rank * share:(rank + 1) * share]).item())
    with step.gathered_parameters():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return step, losses, params, state


def reasons(step) -> list[str]:
    return [c.reason for c in step.compilations]


def train_on_rank(rank: int, world_size: int, options: dict = {}):
    step, losses, params, state = trained(**options)
    return reasons(step), losses, params, state


def test_a_new_process_loads_the_saved_step_and_trains_bitwise_like_the_cold_run(cache):
    cold = run_ranks(2, train_on_rank)
    assert sorted(p.name.split("-")[0] for p in cache.rglob("*.zfx")) == ["rank0", "rank1"]
    warm = run_ranks(2, train_on_rank, fresh_interpreter=True)
    for rank, ((cold_reasons, *cold_run), (warm_reasons, *warm_run)) in enumerate(zip(cold, warm)):
        assert not any(SAVED in r for r in cold_reasons), cold_reasons
        assert [SAVED in r for r in warm_reasons] == [True], (rank, warm_reasons)
        (cold_losses, cold_params, cold_state), (warm_losses, warm_params, warm_state) = cold_run, warm_run
        assert warm_losses == cold_losses
        for name, p in cold_params.items():
            assert torch.equal(warm_params[name], p), (rank, name)
        assert len(warm_state) == len(cold_state) > 0
        assert all(torch.equal(w, c) for w, c in zip(warm_state, cold_state)), rank


def saved_files(cache) -> list:
    return sorted(cache.rglob("*.zfx"))


def test_the_same_step_loads_what_it_saved(cache, fake_world_of_two):
    first, losses, params, _ = trained()
    assert not any(SAVED in r for r in reasons(first)) and len(saved_files(cache)) == 1
    again, again_losses, again_params, _ = trained()
    assert [SAVED in r for r in reasons(again)] == [True]
    assert again_losses == losses
    assert all(torch.equal(again_params[n], p) for n, p in params.items())


def test_a_second_model_after_a_loaded_step_takes_its_lowered_program(cache, fake_world_of_two):
    trained(steps=1)
    loaded, *_ = trained(steps=1)
    second, losses, params, _ = trained(new_process=False, seed=1)
    assert [SAVED in r and "earlier step of this structure" in r for r in reasons(second)] == [True]
    assert second.graphs[0] is loaded.graphs[0]
    alone, alone_losses, alone_params, _ = trained(seed=1, saved_steps=False)
    assert losses == alone_losses
    assert all(torch.equal(alone_params[n], p) for n, p in params.items())


@pytest.mark.parametrize("plant, differs", [
    (dict(batch=4), "the inputs' shapes and dtypes"),
    (dict(world=4), "the world size and mesh"),
    (dict(torch_version="2.99.0"), "the torch version"),
])
def test_a_step_saved_for_something_else_compiles_from_scratch(cache, caplog, monkeypatch,
                                                                plant, differs):
    from support.ranks import fake_world

    with fake_world(plant.get("world", 2)), monkeypatch.context() as planting:
        if "torch_version" in plant:
            planting.setattr(torch, "__version__", plant["torch_version"])
        trained(steps=1, batch=plant.get("batch", 8))
    (planted,) = saved_files(cache)
    with fake_world(2), caplog.at_level(logging.INFO, logger="zero_fx"):
        step, *_ = trained(steps=1)
    assert not any(SAVED in r for r in reasons(step)), reasons(step)
    (line,) = [r.getMessage() for r in caplog.records if "compiles from scratch" in r.getMessage()]
    assert planted.name in line and differs in line, line
    assert len(saved_files(cache)) == 2  # its own, beside the planted one


def test_a_damaged_saved_step_is_detected_and_compiled_again(cache, caplog, fake_world_of_two):
    _, losses, params, _ = trained()
    (saved,) = saved_files(cache)
    whole = saved.read_bytes()
    saved.write_bytes(whole[:len(whole) // 2])
    with caplog.at_level(logging.WARNING, logger="zero_fx"):
        step, again_losses, again_params, _ = trained()
    assert not any(SAVED in r for r in reasons(step))
    assert any("is damaged (truncated" in r.getMessage() for r in caplog.records), caplog.text
    assert again_losses == losses
    assert saved.read_bytes() == whole  # written again, whole
    flipped = bytearray(whole)
    flipped[-100] ^= 0xFF
    saved.write_bytes(bytes(flipped))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zero_fx"):
        step, *_ = trained()
    assert not any(SAVED in r for r in reasons(step))
    assert any("do not match their digest" in r.getMessage() for r in caplog.records), caplog.text


def test_a_step_keeps_its_newest_saved_steps_only(cache, fake_world_of_two, monkeypatch):
    monkeypatch.setattr(saved_steps, "KEPT_PER_STEP", 2)
    for batch in (2, 4, 8):
        trained(steps=1, batch=batch)
    assert len(saved_files(cache)) == 2
    step, *_ = trained(steps=1, batch=8)  # the newest is still there
    assert [SAVED in r for r in reasons(step)] == [True]
    step, *_ = trained(steps=1, batch=2)  # the oldest was deleted
    assert not any(SAVED in r for r in reasons(step))


def lower_as_before(*args, **kwargs):
    return ORIGINAL_COMPILE_BODY(*args, **kwargs)


ORIGINAL_COMPILE_BODY = None


def test_a_patched_function_of_zero_fx_is_another_step_and_more_imports_are_not(
        cache, caplog, fake_world_of_two, monkeypatch):
    global ORIGINAL_COMPILE_BODY
    from zero_fx.compiler import lower

    trained(steps=1)
    import types
    monkeypatch.setitem(__import__("sys").modules, "zero_fx.imported_later",
                        types.SimpleNamespace(helper=saved_steps.save, other=torch.add))
    step, *_ = trained(steps=1)  # a process that has imported more of zero_fx
    assert [SAVED in r for r in reasons(step)] == [True]
    ORIGINAL_COMPILE_BODY = lower._compile_body
    monkeypatch.setattr(lower, "_compile_body", lower_as_before)
    with caplog.at_level(logging.INFO, logger="zero_fx"):
        step, *_ = trained(steps=1)
    assert not any(SAVED in r for r in reasons(step))
    assert any("lowering settings and zero_fx's functions" in r.getMessage()
               for r in caplog.records), caplog.text


def test_saved_steps_are_off_with_the_option(cache, fake_world_of_two):
    trained(steps=1, saved_steps=False)
    assert saved_files(cache) == []


def foreign_saved_step(saved: "Path", foreign: "Path") -> bytes:
    """``foreign``'s graph under ``saved``'s name and header: a file that is whole and matches
    its name, and holds another program (a stale cache, a copy from another job)."""
    def split(data: bytes):
        end = data.index(b"\n", len(saved_steps.MAGIC))
        return json.loads(data[len(saved_steps.MAGIC):end]), data[end + 1:]

    header, _ = split(saved.read_bytes())
    foreign_header, payload = split(foreign.read_bytes())
    header.update({k: foreign_header[k] for k in ("payload_bytes", "payload_sha256")})
    return saved_steps.MAGIC + json.dumps(header).encode() + b"\n" + payload


def test_ranks_that_hold_different_saved_steps_all_compile_from_scratch(cache):
    cold = run_ranks(2, train_on_rank)
    defaults = {p.name: p for p in saved_files(cache)}
    run_ranks(2, train_on_rank, dict(bucket_bytes=0))  # another schedule: another program
    other = next(p for p in saved_files(cache) if p.name.startswith("rank1") and p.name not in defaults)
    rank1 = next(p for name, p in defaults.items() if name.startswith("rank1"))
    rank1.write_bytes(foreign_saved_step(rank1, other))
    again = run_ranks(2, train_on_rank)
    for (cold_reasons, cold_losses, cold_params, _), (reasons_, losses, params, _) in zip(cold, again):
        assert not any(SAVED in r for r in reasons_), reasons_
        assert losses == cold_losses
        assert all(torch.equal(params[n], p) for n, p in cold_params.items())
    loaded = run_ranks(2, train_on_rank)  # the compilations saved again: both load
    assert all([SAVED in r for r in reasons_] == [True] for reasons_, *_ in loaded)
