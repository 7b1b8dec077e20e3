"""Elastic restart: under ``torchrun --max-restarts``, a rank killed (SIGKILL) or hung (SIGSTOP)
in the middle of the example's run restarts the group, which resumes from the last
checkpoint and ends in exactly the state of a run that was never interrupted."""

import os
import re
import signal
import subprocess
import threading
import time

import pytest
import torch

from support import models
from support.cores import the_cores
from support.torchrun import torchrun_command
from zero_fx.checkpoint.offline import load_full

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_gpt.py")
STEPS, EVERY = 16, 4
LAYERS = 1
"""The example's --layers (its default is 4): what is checked (a restart, a resume that
ends bitwise like the uninterrupted run) does not depend on the depth, and each of the five
torchrun starts compiles the model; one block took a job from 94 s to 57 s on the loaded
2-core box. The width stays the default, so a step still takes ~100 ms there: the kill or
stop after step EVERY's save lands long before the last step, as the tests need."""
HANG_TIMEOUT_S = 10
"""The example's --timeout for the hang test: how long rank 0 waits for the stopped rank."""
RUN_LIMIT_S = 300


class TorchrunJob:
    """The example under ``torchrun --nproc_per_node 2 --max-restarts 2``, its output read
    line by line as it comes."""

    def __init__(self, folder: str, *example_args: str):
        command = torchrun_command(2, "--max-restarts", "2", EXAMPLE, "--device", "cpu",
                                   "--backend", models.BACKEND, "--layers", str(LAYERS),
                                   "--steps", str(STEPS), "--checkpoint-every", str(EVERY),
                                   "--checkpoint-dir", folder, *example_args)
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, cwd=ROOT,
                                        env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.lines: list[str] = []
        self._watchdog = threading.Timer(RUN_LIMIT_S, self.process.kill)
        self._watchdog.start()

    def wait_for(self, pattern: str) -> re.Match:
        for line in self.process.stdout:
            self.lines.append(line)
            if found := re.search(pattern, line):
                return found
        raise AssertionError(f"the job ended without printing {pattern!r}:\n{self.output[-4000:]}")

    def finish(self) -> str:
        self.lines.extend(self.process.stdout)
        self.process.wait()
        self._watchdog.cancel()
        assert self.process.returncode == 0, self.output[-4000:]
        return self.output

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def worker(self, rank: int) -> int:
        """The pid of the worker process of ``rank`` (a child of torchrun's agent)."""
        for child in _children(self.process.pid):
            with open(f"/proc/{child}/environ", "rb") as f:
                if f"RANK={rank}".encode() in f.read().split(b"\0"):
                    return child
        raise AssertionError(f"no worker of rank {rank} under torchrun's pid {self.process.pid}")


def _children(pid: int) -> list[int]:
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children += [int(child) for child in f.read().split()]
    return children


def _losses(output: str) -> dict[int, str]:
    """Each step's printed loss, by step (the last printing of a step that ran twice)."""
    return dict(re.findall(r"step +(\d+)/\d+  loss (\d+\.\d+)  ", output))


@pytest.fixture(scope="module", autouse=True)
def cores():
    """Every test here is a torchrun job, or waits on one: the module holds the cores."""
    with the_cores():
        yield


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("uninterrupted"))
    output = TorchrunJob(folder).finish()
    return _losses(output), load_full(os.path.join(folder, "latest"))


def _assert_ends_like(uninterrupted, output: str, folder: str) -> None:
    resumed_after = int(re.search(r"resumed from \S+ after step (\d+)", output).group(1))
    assert 0 < resumed_after < STEPS and resumed_after % EVERY == 0
    losses, state = uninterrupted
    assert _losses(output) == losses
    final = load_full(os.path.join(folder, "latest"))
    assert final.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(final[key], value), key


def test_a_killed_rank_restarts_the_group_which_resumes_from_the_last_checkpoint(
        tmp_path, uninterrupted):
    job = TorchrunJob(str(tmp_path))
    job.wait_for(rf"saved \S+ after step {EVERY}\b")
    os.kill(job.worker(1), signal.SIGKILL)
    output = job.finish()
    assert re.search(r"Restarting|restart", output, re.IGNORECASE), output[-3000:]
    _assert_ends_like(uninterrupted, output, str(tmp_path))


def test_a_hung_rank_fails_its_peers_within_the_timeout_naming_the_collective(
        tmp_path, uninterrupted):
    job = TorchrunJob(str(tmp_path), "--timeout", str(HANG_TIMEOUT_S))
    job.wait_for(rf"saved \S+ after step {EVERY}\b")
    hung = job.worker(1)
    os.kill(hung, signal.SIGSTOP)
    stopped = time.monotonic()
    failure = job.wait_for(r"CollectiveFailedError: .*")
    waited = time.monotonic() - stopped
    assert HANG_TIMEOUT_S - 1 < waited < HANG_TIMEOUT_S + 30, waited
    # rank 0 names the collective it waited in: the next call's first one (the check that
    # ranks agree) when rank 1 stopped between steps, or a collective of the compiled step
    # when the stop landed inside one (a loaded box delays when the save's line is read)
    assert re.search(r"in the check that ranks agree \(an all-gather|in the compiled step at "
                     r"`wait_tensor = torch\.ops\._c10d_functional\.wait_tensor",
                     failure.group(0)), failure.group(0)
    # torchrun then ends the group with SIGTERM, which a stopped process receives only once
    # continued: left stopped, it is killed 30 s later (SIGKILL), an idle wait of the suite's
    job.wait_for(rf"process {hung} (closing signal|via signal) SIGTERM")
    os.kill(hung, signal.SIGCONT)
    output = job.finish()
    _assert_ends_like(uninterrupted, output, str(tmp_path))
