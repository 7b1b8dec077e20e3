"""The version matrix (bench/helpers/version_matrix.py) and the GPU tier's summary: what they select and
how they report, without building a venv or touching a GPU."""

import json
import subprocess
import sys

import pytest

from bench.helpers import version_matrix as matrix
from bench.helpers.gpu_check_report import peer_runs, verdict


COLLECT = """
import json, sys
import pytest
from bench.helpers.version_matrix import CHECKS

class Collected:
    def pytest_collection_finish(self, session):
        self.ids = [item.nodeid for item in session.items]

found = {}
for check in CHECKS:
    for part, selection in (("tests", check.tests), ("smoke", check.smoke)):
        if selection:
            plugin = Collected()
            status = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *selection],
                                 plugins=[plugin])
            found[f"{check.name} {part}"] = [int(status), getattr(plugin, "ids", [])]
print("COLLECTED " + json.dumps(found))
"""


def test_every_check_selects_tests_that_exist_here():
    """A renamed test would leave its check running nothing on every torch: each check's
    selection, and its smoke part, must collect tests in this tree (one process collects
    them all)."""
    done = subprocess.run([sys.executable, "-c", COLLECT], cwd=matrix.REPO, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.split("COLLECTED ", 1)[1])
    assert len(found) == len(matrix.CHECKS) + sum(bool(c.smoke) for c in matrix.CHECKS)
    for part, (status, ids) in found.items():
        assert status == 0 and ids, f"{part}: pytest exit {status}, {len(ids)} tests"
        name = part.split()[0]
        assert set(ids) <= set(found[f"{name} tests"][1]), f"{part} runs more than the check"
    assert len(found["parity tests"][1]) == 12  # stages 0-3: mlp and gpt with AdamW, gpt with SGD


def test_the_smoke_runs_the_oldest_and_newest_supported_torch():
    from zero_fx.compat import SUPPORTED_TORCH, release
    by_name = {e.name: e for e in matrix.ENVIRONMENTS}
    oldest, newest = (release(by_name[n].torch) for n in matrix.SMOKE_ENVIRONMENTS)
    low, high = SUPPORTED_TORCH
    assert oldest == low and newest == (high[0], high[1] - 1)
    releases = {release(e.torch) for e in matrix.ENVIRONMENTS}
    assert releases == {(2, minor) for minor in range(low[1], high[1])}, "a release untested"


def test_cells_say_what_passed_and_what_did_not():
    passed = {"status": 0, "counts": {"passed": 8}, "ok": True, "seconds": 3, "tests": []}
    failed = {"status": 1, "counts": {"passed": 7, "failed": 1}, "ok": False, "seconds": 3,
              "tests": [{"test": "tests/test_x.py::test_y", "outcome": "failed",
                         "why": "AssertionError: 0.07"}]}
    assert matrix.cell(passed) == "8 passed"
    assert matrix.cell(failed) == "**1 failed, 7 passed**"
    assert matrix.cell({"status": 4, "counts": {}, "ok": False, "seconds": 1}).startswith(
        "**no tests ran**")
    assert matrix.cell({"status": None, "counts": {}, "ok": False, "seconds": 1200}) == \
        "**timed out** after 1200 s"
    env = matrix.ENVIRONMENTS[0]
    install = {"torch": "2.11.0", "transformers": "4.57.6", "kept": True, "before": {}}
    text = matrix.table([env], {env.name: {"install": install, "parity": failed}},
                        [c for c in matrix.CHECKS if c.name == "parity"])
    assert "torch 2.11.0, transformers 4.57.6" in text and "kept both" in text
    assert "- torch-2.11, parity: `tests/test_x.py::test_y` failed: AssertionError" in text


def _junit(cases: dict) -> str:
    """A JUnit XML of pytest's shape: node id -> outcome."""
    rows = []
    for node, outcome in cases.items():
        path, name = node.split("::", 1)
        body = {"passed": "", "failed": '<failure message="AssertionError: off"/>',
                "skipped": '<skipped message="no GPU"/>'}[outcome]
        rows.append(f'<testcase classname="{path[:-3].replace("/", ".")}" name="{name}" '
                    f'time="2.0">{body}</testcase>')
    return f'<testsuites><testsuite>{"".join(rows)}</testsuite></testsuites>'


@pytest.mark.parametrize("status, failing, expected", [
    (0, None, {"import": "2 passed", "parity": "1 passed"}),
    (1, "tests/test_parity.py::test_parity_aot_eager[3-2-gpt]",
     {"import": "2 passed", "parity": "**1 failed**"}),
    (1, None, {"import": "**2 passed**", "parity": "**1 passed**"}),  # the session failed
])
def test_the_smoke_reads_each_checks_outcome_from_its_one_pytest_process(
        monkeypatch, tmp_path, status, failing, expected):
    checks = [matrix.Check("import", "", (), smoke=("tests/test_api.py",)),
              matrix.Check("parity", "", (), smoke=(
                  "tests/test_parity.py::test_parity_aot_eager[3-2-gpt]",))]
    cases = {"tests/test_api.py::test_a": "passed", "tests/test_api.py::test_b[x]": "passed",
             "tests/test_parity.py::test_parity_aot_eager[3-2-gpt]": "passed"}
    if failing:
        cases[failing] = "failed"
    commands = []

    def fake_run(command, **kwargs):
        commands.append(command)
        junit = next(c for c in command if str(c).startswith("--junitxml="))
        open(junit.split("=", 1)[1], "w").write(_junit(cases))
        return subprocess.CompletedProcess(command, status, "", "")

    monkeypatch.setattr(matrix, "_run", fake_run)
    results = matrix.run_smoke("python", matrix.ENVIRONMENTS[0], checks, tmp_path)
    assert len(commands) == 1 and commands[0][-2:] == [
        "tests/test_api.py", "tests/test_parity.py::test_parity_aot_eager[3-2-gpt]"]
    assert {name: matrix.cell(r) for name, r in results.items()} == expected
    assert results["import"]["seconds"] == 4
    assert sorted(f.name for f in tmp_path.iterdir()) == ["torch-2.11-smoke.log",
                                                         "torch-2.11-smoke.xml"]


def test_the_doc_has_the_tables_markers_once():
    doc = matrix.DOC.read_text()
    assert doc.count(matrix.START) == 1 and doc.count(matrix.END) == 1
    assert doc.index(matrix.START) < doc.index(matrix.END)


@pytest.mark.parametrize("status, counts, expected", [
    (0, {"passed": 23}, "passed"),
    (0, {"passed": 22, "skipped": 1}, "passed"),
    (1, {"passed": 22, "failed": 1}, "failed"),
    (1, {"passed": 22, "error": 1}, "failed"),
    (2, {"passed": 5}, "failed"),  # interrupted at the time limit
    (0, {"skipped": 23}, "skipped"),  # no GPU
    (5, {}, "skipped"),
])
def test_the_gpu_summary_says_failed_when_any_test_failed(status, counts, expected):
    assert verdict(status, counts) == expected


def test_the_gpu_summary_says_failed_when_a_peer_benchmark_failed(tmp_path):
    """The peers' results fold into the verdict: a crashed run (no file), a failed peer or
    disagreeing losses fail it; runs that went well leave the tier's verdict."""
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps({"summaries": [{"peer": "fsdp2", "losses": [1.0]}],
                                "failed_peers": {}, "loss_failures": []}))
    bad.write_text(json.dumps({"summaries": [], "failed_peers": {"zero_fx-3": "timed out"},
                               "loss_failures": []}))
    runs = peer_runs([str(good), str(bad), str(tmp_path / "missing.json")])
    assert [runs[n]["failed"] for n in ("good", "bad", "missing")] == [False, True, True]
    assert "losses" not in runs["good"]["summaries"][0]  # the summary keeps the figures only
    assert verdict(0, {"passed": 3}, {"good": runs["good"]}) == "passed"
    assert verdict(0, {"passed": 3}, {"bad": runs["bad"]}) == "failed"
    assert verdict(5, {}, {"good": runs["good"]}) == "passed"  # peers only, no tier
