"""Checkpoints: resume reproduces the run, reshard 4 -> 2 -> 1 across stages, export, bad input."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

from support import models
from support.ranks import run_ranks, with_mesh
from support.training import check_updates, checkpointed_training_rank
from zero_fx import CheckpointError, MixedPrecision, zero_compile
from zero_fx.checkpoint.offline import load_full

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


RESUME_CASES = [
    (3, None, "gpt"), (0, None, "gpt"), (1, MixedPrecision(param_dtype=torch.float16), "gpt"),
    (3, None, "gpt_dropout"),  # the masks after the resume come from the restored RNG
]


def uninterrupted_and_saving_rank(rank, world_size, folder):
    """Per case of RESUME_CASES: the uninterrupted 6 steps, saving its checkpoint
    (``folder``/<case index>) after step 3 and going on, as a training script saves. One
    compilation a case instead of two for a separate run that saves: a save that changed
    the run it was taken from (its parameters, optimizer state, loss scale or RNG) would
    part the rest of that run from the resumed one, which starts from what was saved."""
    return [checkpointed_training_rank(rank, world_size, stage, 6, None, f"{folder}/{index}", 3,
                                       precision, model_name)
            for index, (stage, precision, model_name) in enumerate(RESUME_CASES)]


def resuming_rank(rank, world_size, folder):
    """Per case of RESUME_CASES: a fresh run resumed from its checkpoint to step 6."""
    return [checkpointed_training_rank(rank, world_size, stage, 6, f"{folder}/{index}", None, None,
                                       precision, model_name)
            for index, (stage, precision, model_name) in enumerate(RESUME_CASES)]


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory):
    """(uninterrupted, resumed) per case, every rank's: two 2-rank runs for all the cases
    (the first trains and saves, the second resumes) instead of runs per case (a run and its
    first compilation cost about 10 s on the 2-core box)."""
    folder = str(tmp_path_factory.mktemp("resume"))
    whole = run_ranks(2, uninterrupted_and_saving_rank, folder)
    resumed = run_ranks(2, resuming_rank, folder)
    return [([r[index] for r in whole], [r[index] for r in resumed])
            for index in range(len(RESUME_CASES))]


@pytest.mark.parametrize("case", range(len(RESUME_CASES)),
                         ids=[f"{stage}-{precision is not None}-{name}"
                              for stage, precision, name in RESUME_CASES])
def test_a_resumed_run_continues_bitwise_like_the_uninterrupted_one(resumed_runs, case):
    whole, resumed = resumed_runs[case]
    for rank in range(2):
        assert resumed[rank]["losses"] == {i: whole[rank]["losses"][i] for i in (3, 4, 5)}
        for name, value in whole[rank]["params"].items():
            assert torch.equal(resumed[rank]["params"][name], value), name
        assert resumed[rank]["optimizer_steps"] == whole[rank]["optimizer_steps"]  # fp16 skips one
        assert resumed[rank]["loss_scale"] == whole[rank]["loss_scale"]


def resharding_rank(rank, world_size, stage, load_from, save_to, mesh=None, **options):
    """``mesh``: (replicas, shards), hybrid sharding; ``options``: more of zero_compile's."""
    model = models.build("gpt", seed=1)
    opt = models.make_optimizer(model)
    step = zero_compile(models.training_step("gpt"), stage=stage, backend=models.BACKEND,
                        **with_mesh({"mesh": mesh}), **options)
    if load_from:
        step.load_checkpoint(load_from, model, opt)
    else:
        for i in range(2):
            x, y = models.global_batch("gpt", i)
            step(model, opt, x[rank::world_size], y[rank::world_size])
    step.save_checkpoint(save_to, extra={"next_step": 2})
    x, y = models.global_batch("gpt", 2)  # one more step from what was saved
    loss = step(model, opt, x[rank::world_size], y[rank::world_size]).item()
    return {"loss": loss, "params": step.full_parameters()}


def assert_same_states(paths):
    """Every checkpoint in ``paths`` holds bitwise the same parameters and optimizer state."""
    saved = [load_full(path) for path in paths]
    keys = [k for k in saved[0] if k.startswith(("model.", "optim."))]
    assert any(k.endswith(".exp_avg_sq") for k in keys)
    for other in saved[1:]:
        for key in keys:
            assert torch.equal(other[key], saved[0][key]), key


NODES_OF_TWO = {"secondary_partition": 2}


def trained_by_four_rank(rank, world_size, flat_path, hybrid_path, secondary_paths):
    """resharding_rank's training and save by 4 ranks, flat (stage 3), on a 2 x 2 mesh, and
    flat as 2 nodes of 2 with the secondary partition (saved, then loaded from the flat
    run's checkpoint): each test's first run, fresh model and step each."""
    saved, resaved = secondary_paths
    return (resharding_rank(rank, world_size, 3, None, flat_path),
            resharding_rank(rank, world_size, 3, None, hybrid_path, (2, 2)),
            resharding_rank(rank, world_size, 3, None, saved, **NODES_OF_TWO),
            resharding_rank(rank, world_size, 3, flat_path, resaved, **NODES_OF_TWO))


@pytest.fixture(scope="module")
def trained_by_four(tmp_path_factory):
    """(the flat run's results per rank, its checkpoint, the hybrid checkpoint, the
    secondary partition's (results, checkpoints)): the tests' first 4-rank runs in one
    launch instead of one each (a 4-rank launch and its first compilations cost ~20 s on
    the 2-core box)."""
    folder = tmp_path_factory.mktemp("trained_by_four")
    flat, hybrid = str(folder / "at4"), str(folder / "hybrid")
    secondary = (str(folder / "hpz"), str(folder / "hpz-resaved"))
    results = run_ranks(4, trained_by_four_rank, flat, hybrid, secondary)
    return ([r[0] for r in results], flat, hybrid,
            ([(r[2], r[3]) for r in results], secondary))


def test_the_secondary_partition_saves_and_loads_the_flat_runs_states(trained_by_four):
    """hpZ changes only where the backward gathers from: 4 ranks as 2 nodes of 2 save
    bitwise the flat run's checkpoint, load the flat run's and save it unchanged, and the
    step after either trains bitwise as the flat run's does."""
    flat_runs, flat_path, _, (secondary_runs, secondary_paths) = trained_by_four
    assert_same_states([flat_path, *secondary_paths])
    for flat, (saved, loaded) in zip(flat_runs, secondary_runs):
        for run in (saved, loaded):
            assert run["loss"] == flat["loss"]
            assert all(torch.equal(run["params"][n], p) for n, p in flat["params"].items())


def test_a_checkpoint_reshards_from_4_ranks_to_2_and_1_and_across_stages(tmp_path,
                                                                          trained_by_four):
    """Saved by 4 ranks in stage 3, loaded by 2 in stage 1 and saved again, loaded by 1 in
    stage 0: the same parameters and optimizer state each time, and the next step trains
    the same (the mean loss over ranks; parameters to reduction-order rounding)."""
    at4, at4_path = trained_by_four[:2]
    paths = [at4_path] + [str(tmp_path / name) for name in ("at2", "at1")]
    runs = [at4,
            run_ranks(2, resharding_rank, 1, paths[0], paths[1]),
            run_ranks(1, resharding_rank, 0, paths[1], paths[2])]
    assert_same_states(paths)
    mean_losses = [sum(r["loss"] for r in run) / len(run) for run in runs]
    assert max(mean_losses) - min(mean_losses) < 1e-5 * mean_losses[0]
    for name, value in runs[0][0]["params"].items():
        assert torch.allclose(runs[2][0]["params"][name], value, rtol=1e-5, atol=1e-6), name
    # the step after the load: each parameter's update from the saved state against the 4
    # ranks' (measured 1.7e-7, blocks.1.attn.proj.weight)
    saved = load_full(at4_path)
    initial = {name: saved[f"model.{name}"] for name in runs[0][0]["params"]}
    check_updates([*runs[1], *runs[2]], {"params": runs[0][0]["params"], "initial": initial},
                  1e-3)


def test_a_hybrid_checkpoint_loads_flat_and_at_one_rank_and_back(tmp_path, trained_by_four):
    """Saved on a 2 x 2 mesh (each shard once: its replica is skipped), loaded by a flat 4
    and saved, by 1 rank and saved, by a 2 x 2 mesh again: bitwise the same states."""
    paths = [trained_by_four[2]] + [str(tmp_path / name)
                                    for name in ("flat4", "one", "hybrid-again")]
    run_ranks(4, resharding_rank, 3, paths[0], paths[1])
    run_ranks(1, resharding_rank, 3, paths[1], paths[2])
    run_ranks(4, resharding_rank, 3, paths[2], paths[3], (2, 2))
    assert_same_states(paths)


def _trained_at_world_1(path, stage=3, steps=2):
    model = models.build("gpt", seed=1)
    opt = models.make_optimizer(model)
    step = zero_compile(models.training_step("gpt"), stage=stage, backend=models.BACKEND)
    for i in range(steps):
        step(model, opt, *models.global_batch("gpt", i))
    step.save_checkpoint(path, extra={"next_step": steps})
    return step, model, opt


@pytest.fixture(scope="module")
def trained_at_world_1(tmp_path_factory):
    """(the step, its checkpoint) of _trained_at_world_1, compiled and trained once for the
    tests that only read the checkpoint or copy it (a compilation and two steps cost ~25 s
    on the loaded 2-core box). Do not train the step or write into the folder."""
    path = str(tmp_path_factory.mktemp("trained_at_world_1") / "ckpt")
    step, _, _ = _trained_at_world_1(path)
    return step, path


def test_export_writes_a_state_dict_plain_pytorch_loads(tmp_path, trained_at_world_1):
    output = str(tmp_path / "model.pt")
    step, path = trained_at_world_1
    live = step.full_state_dict()
    run = subprocess.run([sys.executable, "-m", "zero_fx.export", path, output],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "wrote" in run.stdout
    plain = models.build("gpt", seed=2)  # other values, same architecture
    plain.load_state_dict(torch.load(output))  # strict: every name, tied ones included
    for name, value in plain.state_dict().items():
        assert torch.equal(value, live[name]), name
    assert torch.equal(plain.lm_head.weight, plain.wte.weight)
    run = subprocess.run([sys.executable, "-m", "zero_fx.export", path, output, "--dtype",
                          "bfloat16"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    assert {v.dtype for v in torch.load(output).values()} == {torch.bfloat16}


def _fresh_step(model=None, optimizer="adamw"):
    model = model or models.build("gpt", seed=1)
    return (zero_compile(models.training_step("gpt"), stage=3, backend=models.BACKEND), model,
            models.make_optimizer(model, optimizer))


def test_loading_into_a_different_model_names_the_parameter(trained_at_world_1):
    path = trained_at_world_1[1]
    from examples.gpt import GPT, GPTConfig

    wider = GPT(GPTConfig(vocab_size=models.VOCAB, block_size=models.SEQ, n_layer=2, n_head=2,
                          n_embd=48, bias=False))
    step, model, opt = _fresh_step(wider)
    with pytest.raises(CheckpointError, match=r"parameter wte.weight: checkpoint \[64, 32\], "
                                              r"model \[64, 48\]"):
        step.load_checkpoint(path, model, opt)
    deeper = GPT(GPTConfig(vocab_size=models.VOCAB, block_size=models.SEQ, n_layer=3, n_head=2,
                           n_embd=32, bias=False))
    step, model, opt = _fresh_step(deeper)
    with pytest.raises(CheckpointError, match="parameter blocks.2.attn.qkv.weight is not in the"):
        step.load_checkpoint(path, model, opt)
    step, model, opt = _fresh_step(optimizer="sgd")
    with pytest.raises(CheckpointError, match="state of AdamW, the optimizer is SGD"):
        step.load_checkpoint(path, model, opt)


@pytest.mark.parametrize("damage, message", [
    ("truncate", "is truncated"),
    ("flip", "is corrupted"),
    ("unfinished", "did not finish"),
])
def test_a_damaged_checkpoint_is_detected(tmp_path, trained_at_world_1, damage, message):
    path = str(tmp_path / "ckpt")
    shutil.copytree(trained_at_world_1[1], path)  # damaged here, the original kept whole
    data = [f for f in os.listdir(path) if f.endswith(".distcp")][0]
    file = os.path.join(path, data)
    if damage == "truncate":
        os.truncate(file, os.path.getsize(file) // 2)
    elif damage == "flip":
        with open(file, "r+b") as f:
            f.seek(os.path.getsize(file) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    else:  # what a save interrupted before its manifest leaves
        os.remove(os.path.join(path, "zero_fx.json"))
    step, model, opt = _fresh_step()
    with pytest.raises(CheckpointError, match=message):
        step.load_checkpoint(path, model, opt)


def test_saving_over_a_checkpoint_replaces_it_whole(tmp_path):
    path = str(tmp_path / "ckpt")
    step, model, opt = _trained_at_world_1(path, steps=1)
    first = load_full(path)["model.wte.weight"]
    step(model, opt, *models.global_batch("gpt", 5))
    step.save_checkpoint(path)
    assert not torch.equal(load_full(path)["model.wte.weight"], first)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # nothing staged or replaced left behind
