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

from support import models
import zero_fx.checkpoint.files as checkpoint_files
from support.ranks import run_ranks
from support.training import checkpointed_training_rank
from zero_fx import CheckpointError, checkpoint_exists, zero_compile
from zero_fx.checkpoint.offline import load_full

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
    step = zero_compile(models.training_step("gpt"), stage=3, backend=models.BACKEND)
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


class Outcome:
    """What a call returned, or the exception it raised, to be read (raised) in the test."""

    def __init__(self, call, *args, **kwargs):
        try:
            self.value, self.error = call(*args, **kwargs), None
        except Exception as err:  # noqa: BLE001 - re-raised by get(), in the test
            self.value, self.error = None, err

    def get(self):
        if self.error is not None:
            raise self.error
        return self.value


def left_behind(path: str) -> dict:
    """What a killed save left at ``path``, read before anything resumes from it."""
    staged = checkpoint_files.staging_path(path)
    unfinished = os.path.isdir(staged) and "zero_fx.json" not in os.listdir(staged)
    return {"unfinished_staged": unfinished,
            "loading_it": Outcome(load_full, staged) if unfinished else None,
            "exists": checkpoint_exists(path), "next_step": Outcome(
                lambda: saved_extra(path)["next_step"])}


def uninterrupted_and_resumed_rank(rank, world_size, paths):
    """The uninterrupted run, then a fresh run resumed from each of ``paths`` in turn (each
    saving its end over the checkpoint it resumed from)."""
    return [checkpointed_training_rank(rank, world_size, 3, STEPS)] + [
        checkpointed_training_rank(rank, world_size, 3, STEPS, path, path, STEPS)
        for path in paths]


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    """Per kill point: the surviving ranks' results, what the killed save left, and the
    resumed run; with the uninterrupted run. Each kill needs its own launch; the
    uninterrupted run and the five resumes share one (other processes than the killed
    ones), instead of a launch each: a launch and its first compilation cost ~10 s of each
    on the 2-core box."""
    runs = {}
    for index, point in enumerate(KILL_POINTS):
        folder = tmp_path_factory.mktemp(f"killed{index}")
        path = str(folder / "ckpt")
        survivors = Outcome(run_ranks, 2, killed_while_saving_rank, point, path, timeout_s=30,
                            may_die=True)
        runs[point] = {"folder": folder, "path": path, "survivors": survivors,
                       "left": left_behind(path)}
    resumable = [run for run in runs.values() if run["left"]["exists"]]  # others fail before
    launch = Outcome(run_ranks, 2, uninterrupted_and_resumed_rank,
                     [run["path"] for run in resumable])
    for index, run in enumerate(resumable):
        run["launch"], run["index"] = launch, index
        run["after"] = {"listing": sorted(os.listdir(run["folder"])),
                        "next_step": Outcome(lambda path: saved_extra(path)["next_step"],
                                             run["path"])}
    return runs


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_a_save_killed_at_any_point_leaves_a_checkpoint_that_resumes_the_run(
        killed_and_resumed, point):
    run = killed_and_resumed[point]
    survivors = run["survivors"].get()
    killed = KILL_POINTS[point][0]
    assert survivors[killed] is None  # it died
    assert survivors[1 - killed] != "saved" or point == "after the renames"

    left = run["left"]  # before the resume
    if left["unfinished_staged"]:
        with pytest.raises(CheckpointError, match="did not finish"):  # never loaded
            left["loading_it"].get()
    resumes_from = KILL_POINTS[point][-1]
    assert left["exists"]
    assert left["next_step"].get() == resumes_from
    results = run["launch"].get()
    uninterrupted = [r[0] for r in results]
    resumed = [r[1 + run["index"]] for r in results]
    for rank in range(2):
        assert resumed[rank]["losses"] == {i: uninterrupted[rank]["losses"][i]
                                           for i in range(resumes_from, STEPS)}
        for name, value in uninterrupted[rank]["params"].items():
            assert torch.equal(resumed[rank]["params"][name], value), name
    # the resumed run's save cleaned up what the killed one left
    assert run["after"]["listing"] == ["ckpt"]
    assert run["after"]["next_step"].get() == STEPS


FULL_DISKS = {"shard": "rank 1: OSError: [Errno 27] File too large",
              "manifest": "rank 0: OSError: [Errno 28] No space left on device"}


def full_disk_rank(rank, world_size, folder, failings):
    """full_disk_case for each of ``failings``, its checkpoint at ``folder``/<failing>/ckpt."""
    return {failing: full_disk_case(rank, world_size, f"{folder}/{failing}/ckpt", failing)
            for failing in failings}


def full_disk_case(rank, world_size, path, failing):
    """The second save fails as on a full disk: rank 1 may write files of at most 4 KiB
    (``failing="shard"``), or rank 0's manifest finds no space (``"manifest"``); then a
    third save, on a disk with room again, must work."""
    step = _trained(rank, world_size, SECOND_SAVE, path)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    write_manifest = checkpoint_files._write_manifest
    on_too_large = signal.getsignal(signal.SIGXFSZ)
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
        signal.signal(signal.SIGXFSZ, on_too_large)
        checkpoint_files._write_manifest = write_manifest
    after_failure = saved_extra(path)["next_step"]
    step.save_checkpoint(path, extra={"next_step": SECOND_SAVE})
    return {"error": error, "after_failure": after_failure,
            "after_retry": saved_extra(path)["next_step"]}


@pytest.fixture(scope="module")
def full_disks(tmp_path_factory):
    """(the folder, every rank's results) of both failings in one 2-rank launch (each with
    its own model, step and checkpoint, its limits undone after it) instead of a launch
    each: a launch and its first compilation cost ~10 s on the 2-core box."""
    folder = tmp_path_factory.mktemp("full_disks")
    for failing in FULL_DISKS:
        (folder / failing).mkdir()
    return folder, run_ranks(2, full_disk_rank, str(folder), list(FULL_DISKS), timeout_s=60)


@pytest.mark.parametrize("failing", FULL_DISKS)
def test_a_save_that_runs_out_of_disk_says_so_on_every_rank_and_keeps_the_previous(
        full_disks, failing):
    folder, results = full_disks
    path, cause = str(folder / failing / "ckpt"), FULL_DISKS[failing]
    for result in (r[failing] for r in results):
        assert result["error"] is not None
        assert f"could not save the checkpoint {path} ({cause}" in result["error"], result["error"]
        assert "the previous checkpoint there, if any, is unchanged" in result["error"]
        assert result["after_failure"] == FIRST_SAVE
        assert result["after_retry"] == SECOND_SAVE
    assert sorted(os.listdir(folder / failing)) == ["ckpt"]


def test_saving_into_a_folder_that_is_not_a_checkpoint_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("the user's own files")
    step = zero_compile(models.training_step("gpt"), stage=3, backend=models.BACKEND)
    model = models.build("gpt", seed=1)
    opt = models.make_optimizer(model)
    step(model, opt, *models.global_batch("gpt", 0))
    with pytest.raises(CheckpointError, match="exists and is not a zero_fx checkpoint"):
        step.save_checkpoint(str(tmp_path))
    assert os.listdir(tmp_path) == ["notes.txt"]
