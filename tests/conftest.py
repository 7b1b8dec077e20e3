import os
import sys

# One intra-op thread per test process, set before torch starts its pool, and for the processes
# they start (command-line tools; a torchrun job keeps one per rank as it does by default): the
# suite's models are tiny, and a second thread costs more than it saves. Six planner tests
# alone took 100-101 s of CPU with two threads, 84-90 s with one. The suite's time under
# `-n 2` did not change with it (2078 s before, 2072 s after, on the same box within the hour):
# there the multi-rank jobs, one at a time, are what it waits on.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Saved steps off for the suite and the processes it starts: a test compiles what it checks
# (its capture, its passes), not what an earlier test or an earlier run left in the user's
# cache. tests/test_saved_steps.py turns them on, each test in a folder of its own.
os.environ["ZERO_FX_SAVED_STEPS"] = "0"

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# tests import the example's GPT (the model the example trains) as `examples.gpt`
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fake_world(size: int):
    from support import ranks

    with ranks.fake_world(size):
        yield


@pytest.fixture
def fake_world_of_two():
    """A fake process group of two ranks in this process (shapes real, values not)."""
    yield from _fake_world(2)


@pytest.fixture
def fake_world_of_four():
    """A fake process group of four ranks in this process (shapes real, values not)."""
    yield from _fake_world(4)


CUDA_SKIP_REASON = ("the cuda tier needs a CUDA GPU and torch sees none; on a GPU machine "
                    "bench/gpu_check.sh runs it (pytest -m cuda) and writes its summary")


def pytest_sessionfinish(session, exitstatus):
    """Ends the ranks that stayed up between tests (ranks.StandingRanks) as a training script
    ends; a rank that then fails to exit cleanly fails the session."""
    from support import ranks

    problems = ranks.close_standing_ranks()
    if problems:
        print("\nstanding ranks did not exit cleanly:\n  " + "\n  ".join(problems))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_runtest_logfinish(nodeid, location):
    """After each test, what the session keeps (modules, cached runs' results, the session's
    meta DeepSeek-V3: ~1M objects) is frozen out of the collector's sight, as standing ranks
    freeze theirs (``ranks.settle``). Otherwise every ``gc.collect()`` and ``gc.get_objects()``
    of a run in this process (world size 1, fake groups; the memory probe calls five a run)
    walks all of it: after test_cli, a one-rank parity run took 6-7 s instead of 3."""
    from support import ranks

    ranks.settle()


@pytest.fixture(scope="session", autouse=True)
def shared_runs(tmp_path_factory):
    """The folder of the session's shared runs ([Note: shared runs] in tests/support/ranks.py): in
    the session's own temporary folder, which both test processes of ``-n 2`` share (each
    has a folder of its own in it)."""
    from support import ranks

    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-runs"
    ranks.SHARED_RUNS_FOLDER = str(folder)
    yield
    ranks.SHARED_RUNS_FOLDER = None


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` are skipped, with the reason, where torch sees no GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=CUDA_SKIP_REASON)
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def named_model_on_meta():
    """``get(spec)``: the model ``python -m zero_fx.estimate --model spec`` builds (the
    package's torch module of a name in zero_fx.planner.models.NAMED or an old name, built by
    estimate.load_model_builder) on the meta device, built once a session and shared by
    test_cli and test_planner: DeepSeek-V3's 45k expert linears take ~5 s and ~170 MB.
    Read it; do not change it."""
    import importlib

    from zero_fx.planner.models import on_meta

    estimate = importlib.import_module("zero_fx.estimate")  # zero_fx.estimate is also a function
    built = {}

    def get(spec):
        if spec not in built:
            built[spec] = on_meta(estimate.load_model_builder(spec))
        return built[spec]

    return get
