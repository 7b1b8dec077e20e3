"""A save killed midway (SIGKILL at each step of [Note: atomic checkpoints]) or failing on a
full disk leaves a checkpoint that loads and resumes the run exactly; the next save cleans up."""

import errno
import os
import pickle
import resource
import signal

import pytest
import torch
import torch.distributed.checkpoint as dcp

import models
import zero_fx.checkpoint.files as checkpoint_files
from ranks import run_ranks
from training import checkpointed_training_rank
from zero_fx import CheckpointError, checkpoint_exists, zero_compile
from zero_fx.checkpoint.save_load import load_full

STEPS = 6
FIRST_SAVE, SECOND_SAVE = 2, 4

KILL_POINTS = {
    # name: (rank killed, module, function, killed at its n-th call, before or after it runs,
    #        the step the checkpoint left behind resumes from)
    "writing its shard": (1, "dcp_filesystem", "_write_item", 2, "before", FIRST_SAVE),
    "before the manifest": (0, "checkpoint_files", "_write_manifest", 1, "before", FIRST_SAVE),
    "after the manifest": (0, "checkpoint_files", "_rename", 1, "before", FIRST_SAVE),
    "between the renames": (0, "checkpoint_files", "_rename", 2, "before", FIRST_SAVE),
    "after the renames": (0, "checkpoint_files", "_rename", 2, "after", SECOND_SAVE),
}


def _modules():
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    return {"dcp_filesystem": dcp_filesystem, "checkpoint_files": checkpoint_files}


def _kill_at(module, name: str, call: int, when: str) -> None:
    """SIGKILL this process at the ``call``-th call of ``module.name``, before or after it runs."""
    original = getattr(module, name)
    calls = 0

    def killing(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == call and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        result = original(*args, **kwargs)
        if calls == call and when == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(module, name, killing)


def _trained(rank, world_size, steps, path):
    """A stage-3 step trained ``steps`` steps, having saved ``path`` after FIRST_SAVE."""
    model = models.build("gpt", seed=1)
    opt = models.make_optimizer(model)
    step = zero_compile(models.training_step("gpt"), stage=3, backend="aot_eager")
    for i in range(steps):
        if i == FIRST_SAVE:
            step.save_checkpoint(path, extra={"next_step": i})
        x, y = models.global_batch("gpt", i)
        step(model, opt, x[rank::world_size], y[rank::world_size])
    return step


def killed_while_saving_rank(rank, world_size, point, path):
    """Save after FIRST_SAVE steps, then have one rank killed at ``point`` of the next save;
    the surviving rank returns the error it got."""
    killed_rank, module, name, call, when, _ = KILL_POINTS[point]
    step = _trained(rank, world_size, SECOND_SAVE, path)
    if rank == killed_rank:
        _kill_at(_modules()[module], name, call, when)
    try:
        step.save_checkpoint(path, extra={"next_step": SECOND_SAVE})
    except BaseException as err:  # noqa: B036 - DCP's CheckpointException is one
        return f"{type(err).__name__}: {err}"
    return "saved"


def saved_extra(path: str):
    """The ``extra`` saved at ``path`` (read as ``load_checkpoint`` would: from where a
    killed save may have moved it), after checking every file against the manifest."""
    load_full(path)
    entries = {"zero_fx.extra": None}
    dcp.load(entries, checkpoint_id=checkpoint_files.readable_path(path), no_dist=True)
    return pickle.loads(entries["zero_fx.extra"])


@pytest.fixture(scope="module")
def uninterrupted():
    return run_ranks(2, checkpointed_training_rank, 3, STEPS)


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_a_save_killed_at_any_point_leaves_a_checkpoint_that_resumes_the_run(
        tmp_path, uninterrupted, point):
    path = str(tmp_path / "ckpt")
    survivors = run_ranks(2, killed_while_saving_rank, point, path, timeout_s=30, may_die=True)
    killed = KILL_POINTS[point][0]
    assert survivors[killed] is None  # it died
    assert survivors[1 - killed] != "saved" or point == "after the renames"

    staged = checkpoint_files.staging_path(path)
    if os.path.isdir(staged) and "zero_fx.json" not in os.listdir(staged):
        with pytest.raises(CheckpointError, match="did not finish"):  # never loaded
            load_full(staged)
    resumes_from = KILL_POINTS[point][-1]
    assert checkpoint_exists(path)
    assert saved_extra(path)["next_step"] == resumes_from
    resumed = run_ranks(2, checkpointed_training_rank, 3, STEPS, path, path, STEPS)
    for rank in range(2):
        assert resumed[rank]["losses"] == {i: uninterrupted[rank]["losses"][i]
                                           for i in range(resumes_from, STEPS)}
        for name, value in uninterrupted[rank]["params"].items():
            assert torch.equal(resumed[rank]["params"][name], value), name
    # the resumed run's save cleaned up what the killed one left
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert saved_extra(path)["next_step"] == STEPS


def full_disk_rank(rank, world_size, path, failing):
    """The second save fails as on a full disk: rank 1 may write files of at most 4 KiB
    (``failing="shard"``), or rank 0's manifest finds no space (``"manifest"``); then a
    third save, on a disk with room again, must work."""
    step = _trained(rank, world_size, SECOND_SAVE, path)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    write_manifest = checkpoint_files._write_manifest
    if failing == "shard" and rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write instead of the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
    if failing == "manifest" and rank == 0:
        def no_space(*args):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        checkpoint_files._write_manifest = no_space
    try:
        step.save_checkpoint(path, extra={"next_step": SECOND_SAVE})
        error = None
    except CheckpointError as err:
        error = str(err)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        checkpoint_files._write_manifest = write_manifest
    after_failure = saved_extra(path)["next_step"]
    step.save_checkpoint(path, extra={"next_step": SECOND_SAVE})
    return {"error": error, "after_failure": after_failure,
            "after_retry": saved_extra(path)["next_step"]}


@pytest.mark.parametrize("failing, cause", [
    ("shard", "rank 1: OSError: [Errno 27] File too large"),
    ("manifest", "rank 0: OSError: [Errno 28] No space left on device"),
])
def test_a_save_that_runs_out_of_disk_says_so_on_every_rank_and_keeps_the_previous(
        tmp_path, failing, cause):
    path = str(tmp_path / "ckpt")
    results = run_ranks(2, full_disk_rank, path, failing, timeout_s=60)
    for result in results:
        assert result["error"] is not None
        assert f"could not save the checkpoint {path} ({cause}" in result["error"], result["error"]
        assert "the previous checkpoint there, if any, is unchanged" in result["error"]
        assert result["after_failure"] == FIRST_SAVE
        assert result["after_retry"] == SECOND_SAVE
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_saving_into_a_folder_that_is_not_a_checkpoint_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("the user's own files")
    step = zero_compile(models.training_step("gpt"), stage=3, backend="aot_eager")
    model = models.build("gpt", seed=1)
    opt = models.make_optimizer(model)
    step(model, opt, *models.global_batch("gpt", 0))
    with pytest.raises(CheckpointError, match="exists and is not a zero_fx checkpoint"):
        step.save_checkpoint(str(tmp_path))
    assert os.listdir(tmp_path) == ["notes.txt"]
