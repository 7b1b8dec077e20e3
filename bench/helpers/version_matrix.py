"""The version matrix: a named subset of the tests on every supported torch and transformers.

    python -m bench.helpers.version_matrix            # every environment and check; rewrites the table
                                              # in docs/testing.md ("Supported versions")
    python -m bench.helpers.version_matrix --smoke    # CI's smoke: the oldest and newest torch, quick checks
    python -m bench.helpers.version_matrix --only torch-2.11 --checks parity inductor
    python -m bench.helpers.version_matrix --list     # the environments and checks

Each environment is a venv of its own, built from the user's side: first the user's stack
(torch, transformers) is installed, then zero_fx the way a user installs it
(``pip install -e ".[hf]"``, plus the test tools). The ``install`` row says whether that left
torch and transformers as they were. The venvs lie under ``~/.cache/zero_fx/version-matrix``
(``ZERO_FX_MATRIX_VENVS``) and are reused while their versions hold: a new one costs about
3 GB and 1-2 minutes, since every torch but the CPU wheel of 2.13 comes as the registry's
CUDA build (it runs on the CPU). pip runs with ``PIP_CONFIG_FILE=/dev/null``: a machine's
pip configuration may cap torch below the newest release.

Every check is a list of pytest node ids or ``-k`` selections run in the repository with the
venv's Python (the smoke's checks, node ids and files only, in one pytest process per
environment, and its two environments at once: see ``SMOKE_AT_ONCE``); its cell says how
many passed and failed (from pytest's JUnit XML), and the JSON
(bench/out/version_matrix.json) keeps each test's outcome and the first line of why.
A full run writes its table, dated and with the commit, into docs/testing.md between the
``version-matrix`` markers, and the tests that failed below it. The exit status is 1 when any
check failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .gpu_check_report import count_outcomes, outcomes
from .runs import OUT, write_json

REPO = Path(__file__).resolve().parent.parent.parent
DOC = REPO / "docs" / "testing.md"
START, END = "<!-- version-matrix: start -->", "<!-- version-matrix: end -->"
VENVS = Path(os.environ.get("ZERO_FX_MATRIX_VENVS",
                            Path.home() / ".cache" / "zero_fx" / "version-matrix"))
CHECK_TIMEOUT_S = 1200
"""A check's limit: the longest takes about 4 minutes on 2 CPU cores; this only stops a hang."""


@dataclasses.dataclass(frozen=True)
class Environment:
    name: str
    torch: str
    transformers: str
    """A version, or a range (the newest release in it is installed)."""

    def column(self, found: dict) -> str:
        return f"torch {found.get('torch', self.torch)}, transformers " \
               f"{found.get('transformers', self.transformers)}"


TRANSFORMERS_4 = "4.57.6"
ENVIRONMENTS = [
    Environment("torch-2.11", "2.11.0", TRANSFORMERS_4),
    Environment("torch-2.12", "2.12.1", TRANSFORMERS_4),
    Environment("torch-2.13", "2.13.0", TRANSFORMERS_4),
    Environment("torch-2.14", "2.14.1", TRANSFORMERS_4),
    Environment("torch-2.15", "2.15.0", TRANSFORMERS_4),
    Environment("transformers-5", "2.13.0", ">=5,<6"),
]
SMOKE_ENVIRONMENTS = ("torch-2.11", "torch-2.15")
"""The oldest and the newest supported torch: what CI runs beside the main suite."""
SMOKE_AT_ONCE = 2
"""How many of the smoke's environments are tested at the same time (built one after the
other: each editable install writes this checkout's egg-info). On the 2-core CI box the
smoke took 265 s one environment and one check after another, 8 pytest processes each
paying ~10 s to import torch and collect while the other core idled; 133 s this way. The
multi-rank tests still take turns on the cores (tests/support/cores.py), since both environments
test this checkout. The full matrix stays one environment at a time: a new venv downloads
~3 GB."""


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    what: str
    tests: tuple[str, ...]
    smoke: tuple[str, ...] = ()
    """The part CI's smoke runs; empty: not in the smoke."""


def _ids(test: str, params) -> tuple[str, ...]:
    return tuple(f"{test}[{p}]" for p in params)


PARITY = "tests/test_parity.py"
CHECKS = [
    Check("import", "import, the supported range, the API's refusals",
          ("tests/test_compat.py", "tests/test_api.py"),
          smoke=("tests/test_compat.py", "tests/test_api.py")),
    Check("parity", "parity with one process, stages 0-3 at 2 ranks (aot_eager, AdamW and SGD)",
          _ids(f"{PARITY}::test_parity_aot_eager", [f"{s}-2-{m}" for s in range(4)
                                                     for m in ("mlp", "gpt")])
          + _ids(f"{PARITY}::test_parity_sgd_momentum", range(4)),
          smoke=_ids(f"{PARITY}::test_parity_aot_eager", [f"{s}-2-gpt" for s in range(4)])),
    Check("inductor", "Inductor at stage 3, 2 ranks: by regions and one whole-step program "
          "(parity), the lowered schedule read back",
          (f"{PARITY}::test_parity_inductor_gpt[3-2]",
           f"{PARITY}::test_parity_inductor_whole_program_stage_3",
           "tests/test_lowered_order.py::test_inductor_runs_the_planned_schedule[3-1]"),
          smoke=(f"{PARITY}::test_parity_inductor_whole_program_stage_3",)),
    Check("muon", "Muon's iterations batched by shape against torch.optim.Muon's own loop, "
          "bit for bit (it replaces a torch internal)", ("tests/test_batched_muon.py",),
          smoke=("tests/test_batched_muon.py",)),
    Check("idioms", "the twelve step idioms at stages 1 and 3, 2 ranks",
          ("tests/test_step_idioms.py", "-k", "1-2 or 3-2")),
    Check("step-state", "the Python state a step reads (hyperparameters written in the step, "
          "requires_grad toggled, zero_grad modes, buffers) against eager, stages 0-3 at 1 and "
          "2 ranks", ("tests/test_step_state.py",),
          smoke=_ids("tests/test_step_state.py::test_state_the_step_reads_trains_as_eager",
                     ["3-2-auto-unfrozen_late", "3-2-auto-lr_by_hand_adamw",
                      "0-2-auto-lr_read_first"])),
    Check("hf-dense", "HF GPT-2 and Llama, stages 0-3 at 2 ranks",
          ("tests/test_hf_models.py", "-k", "gpt2 or llama"),
          smoke=("tests/test_hf_models.py::test_hf_model_trains_as_single_process[hf_llama-3]",)),
    Check("hf-moe", "HF mixture of experts: DeepSeek-V3, Mixtral, Qwen3-MoE at 2 ranks; "
          "Qwen2-MoE, OLMoE, DeepSeek-V3 blocks rewritten",
          ("tests/test_hf_models.py::test_hf_model_trains_as_single_process",
           "tests/test_moe.py::test_moe_trains_as_single_process",
           "tests/test_moe.py::test_recognised_hf_blocks_train_like_eager",
           "-k", "deepseek or mixtral or qwen or olmoe")),
    Check("checkpoint", "checkpoint round trips: a resumed run continues bit for bit, export",
          ("tests/test_checkpoint.py::test_a_resumed_run_continues_bitwise_like_the_uninterrupted_one",
           "tests/test_checkpoint.py::test_export_writes_a_state_dict_plain_pytorch_loads")),
    Check("docs", "the docs' samples have the structure of what the code prints",
          ("tests/test_docs.py",)),
]


def _run(command: list, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in command], text=True, capture_output=True, **kwargs)


def _pip_env() -> dict:
    # the machine's pip configuration may cap torch (a constraints file): a venv of ours lifts it
    return {**os.environ, "PIP_CONFIG_FILE": os.devnull}


def installed(python: Path) -> dict:
    """The torch and transformers a venv's Python imports (empty where it has none)."""
    probe = _run([python, "-c", "import json, importlib.metadata as m\nfound = {}\n"
                  "for name in ('torch', 'transformers'):\n    try: found[name] = m.version(name)\n"
                  "    except m.PackageNotFoundError: pass\nprint(json.dumps(found))"])
    return json.loads(probe.stdout) if probe.returncode == 0 else {}


def _test_tools() -> list[str]:
    """The test extra's requirements but transformers: the environment brings its own."""
    with open(REPO / "pyproject.toml", "rb") as f:
        test = tomllib.load(f)["project"]["optional-dependencies"]["test"]
    return [r for r in test if not r.startswith("transformers")]


def _requirement(package: str, version: str) -> str:
    return f"{package}{version}" if version[0] in "<>=!~" else f"{package}=={version}"


def build(env: Environment, log) -> dict:
    """The environment's venv, with the user's stack installed first and zero_fx after it."""
    venv = VENVS / env.name
    python = venv / "bin" / "python"
    if not python.exists():
        log(f"  making the venv {venv}")
        made = _run([sys.executable, "-m", "venv", venv])
        if made.returncode:
            return {"error": f"python -m venv failed: {made.stderr.strip()[-500:]}"}
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    stack = [_requirement("torch", env.torch), _requirement("transformers", env.transformers)]
    log(f"  installing the user's stack: {' '.join(stack)}")
    started = time.monotonic()
    first = _run(pip + stack, env=_pip_env())
    if first.returncode:
        return {"error": f"pip install {' '.join(stack)} failed: {first.stderr.strip()[-500:]}"}
    before = installed(python)
    log(f"  installing zero_fx: pip install -e \".[hf]\" and the test tools")
    second = _run(pip + ["-e", f"{REPO}[hf]", *_test_tools()], env=_pip_env())
    if second.returncode:
        return {"error": f"pip install -e .[hf] failed: {second.stderr.strip()[-500:]}"}
    after = installed(python)
    return {"python": str(python), "before": before, **after, "kept": before == after,
            "seconds": round(time.monotonic() - started)}


def _pytest(python: str, selection, stem: Path) -> tuple[int | None, list[dict]]:
    """pytest on ``selection`` with the venv's Python: its exit status (None: timed out) and
    each test's outcome; its output goes to ``stem``.log, its JUnit XML to ``stem``.xml."""
    junit = Path(f"{stem}.xml")  # not with_suffix: "torch-2.11-smoke" has the suffix ".11-smoke"
    junit.unlink(missing_ok=True)
    command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
               f"--junitxml={junit}", *selection]
    try:
        done = _run(command, cwd=REPO, timeout=CHECK_TIMEOUT_S)
        status, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as timeout:
        status, output = None, f"timed out after {CHECK_TIMEOUT_S} s\n{timeout.stdout or ''}"
    Path(f"{stem}.log").write_text(
        " ".join(map(str, command)) + "\n" + (output if isinstance(output, str) else ""))
    return status, outcomes(str(junit))


def _check_result(status: int | None, tests: list[dict], seconds: float) -> dict:
    """A check's result: pytest's status for it, its counts, its seconds, whether it passed
    (some test passed, none failed), and the tests that neither passed nor were skipped."""
    counts = count_outcomes(tests)
    failed = counts.get("failed", 0) + counts.get("error", 0)
    return {"status": status, "counts": counts, "seconds": round(seconds),
            "ok": status == 0 and not failed and counts.get("passed", 0) > 0,
            "tests": [t for t in tests if t["outcome"] not in ("passed", "skipped")]}


def run_check(python: str, env: Environment, check: Check, smoke: bool, logs: Path) -> dict:
    """One check in one venv: pytest's counts, each test's outcome, the seconds it took."""
    started = time.monotonic()
    status, tests = _pytest(python, check.smoke if smoke else check.tests,
                            logs / f"{env.name}-{check.name}")
    return _check_result(status, tests, time.monotonic() - started)


def _selected_by(entry: str, test: str) -> bool:
    """Whether the smoke selection ``entry`` (a file or a node id) selects the test ``test``."""
    return test == entry or test.startswith(entry + "::") or test.startswith(entry + "[")


def run_smoke(python: str, env: Environment, checks: list[Check], logs: Path) -> dict:
    """Every check's smoke part in one pytest process: check name -> run_check's result, each
    from its own tests' outcomes in the one JUnit XML (its seconds: its tests' own)."""
    selections = list(dict.fromkeys(entry for c in checks for entry in c.smoke))
    if any(entry.startswith("-") for entry in selections):
        raise ValueError(f"a smoke selection must be files or node ids, not options: {selections}")
    status, tests = _pytest(python, selections, logs / f"{env.name}-smoke")
    # pytest failed with no test failing (a selection that collects nothing, the session's
    # teardown): every check shares that failure, as its own process would have
    unexplained = status != 0 and not any(t["outcome"] in ("failed", "error") for t in tests)
    results = {}
    for check in checks:
        own = [t for t in tests if any(_selected_by(e, t["test"]) for e in check.smoke)]
        failed = any(t["outcome"] in ("failed", "error") for t in own)
        own_status = status if status is None or failed or unexplained else 0
        results[check.name] = _check_result(own_status, own, sum(t["seconds"] for t in own))
    return results


def cell(result: dict) -> str:
    if result is None:
        return "not run"
    if "kept" in result:  # the install row
        return "kept both" if result["kept"] else f"CHANGED: {result['before']} -> " \
               f"{ {k: result[k] for k in ('torch', 'transformers')} }"
    if result["status"] is None:
        return f"**timed out** after {result['seconds']} s"
    counts = result["counts"]
    parts = [f"{counts[k]} {k}" for k in ("failed", "error", "passed", "skipped") if counts.get(k)]
    if not parts:
        return f"**no tests ran** (pytest exit {result['status']})"
    text = ", ".join(parts)
    return text if result["ok"] else f"**{text}**"


def table(envs: list[Environment], results: dict, checks: list[Check]) -> str:
    found = {e.name: results[e.name].get("install", {}) for e in envs}
    lines = ["| check | " + " | ".join(e.column(found[e.name]) for e in envs) + " |",
             "|---" * (len(envs) + 1) + "|",
             "| install: `pip install -e \".[hf]\"` after the stack | "
             + " | ".join(cell(found[e.name]) if "error" not in found[e.name]
                          else f"**{found[e.name]['error'][:80]}**" for e in envs) + " |"]
    for check in checks:
        lines.append(f"| {check.name}: {check.what} | "
                     + " | ".join(cell(results[e.name].get(check.name)) for e in envs) + " |")
    failed = [f"- {e.name}, {check.name}: `{t['test']}` {t['outcome']}: {t['why'][:160]}"
              for e in envs for check in checks
              for t in (results[e.name].get(check.name) or {}).get("tests", [])]
    if failed:
        lines += ["", "What did not pass:", "", *failed]
    return "\n".join(lines)


def commit() -> str:
    head = _run(["git", "rev-parse", "--short=7", "HEAD"], cwd=REPO).stdout.strip() or "unknown"
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO).stdout.strip()
    return head + (" with uncommitted changes" if dirty else "")


def write_doc(text: str, when: str, at: str, seconds: float) -> None:
    doc = DOC.read_text()
    if START not in doc or END not in doc:
        raise SystemExit(f"{DOC}: the markers {START} and {END} are missing")
    head, rest = doc.split(START, 1)
    _, tail = rest.split(END, 1)
    body = (f"\n`python -m bench.helpers.version_matrix` on {when}, at commit `{at}`, "
            f"{seconds / 60:.0f} minutes on {os.cpu_count()} CPU cores:\n\n"
            f"{text}\n")
    DOC.write_text(head + START + body + END + tail)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", metavar="ENV", help="environments to run (default: all)")
    p.add_argument("--checks", nargs="+", metavar="CHECK", help="checks to run (default: all)")
    p.add_argument("--smoke", action="store_true",
                   help=f"CI's smoke: {' and '.join(SMOKE_ENVIRONMENTS)}, the quick checks")
    p.add_argument("--build-only", action="store_true", help="build the venvs and stop")
    p.add_argument("--list", action="store_true", help="list environments and checks")
    args = p.parse_args(argv)
    by_name = {e.name: e for e in ENVIRONMENTS}
    if args.list:
        for e in ENVIRONMENTS:
            print(f"{e.name:16} torch {e.torch}, transformers {e.transformers}")
        for c in CHECKS:
            print(f"{c.name:16} {c.what}")
        return 0
    names = args.only or (SMOKE_ENVIRONMENTS if args.smoke else [e.name for e in ENVIRONMENTS])
    unknown = [n for n in names if n not in by_name] + [
        c for c in args.checks or () if c not in {c.name for c in CHECKS}]
    if unknown:
        raise SystemExit(f"unknown: {', '.join(unknown)} (python -m bench.helpers.version_matrix --list)")
    envs = [by_name[n] for n in names]
    checks = [c for c in CHECKS if (args.checks is None or c.name in args.checks)
              and (c.smoke or not args.smoke)]
    logs = Path(OUT) / "version_matrix"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    def log(text: str) -> None:
        print(f"[{time.monotonic() - started:6.0f} s] {text}", flush=True)

    results: dict[str, dict] = {env.name: {} for env in envs}

    def build_one(env: Environment) -> None:
        log(f"{env.name}: torch {env.torch}, transformers {env.transformers}")
        built = build(env, lambda text: log(f"{env.name}: {text.strip()}"))
        results[env.name]["install"] = built
        if "error" in built:
            log(f"{env.name}: {built['error']}")
            return
        log(f"{env.name}: has torch {built['torch']}, transformers {built['transformers']}; "
            f"the install {'kept' if built['kept'] else 'CHANGED'} them ({built['seconds']} s)")

    def test_one(env: Environment) -> None:
        built = results[env.name]["install"]
        if "error" in built:
            return
        if args.smoke:
            log(f"{env.name}: {', '.join(c.name for c in checks)} (one pytest process) ...")
            found = run_smoke(built["python"], env, checks, logs)
        else:
            found = {}
            for check in checks:
                log(f"{env.name}: {check.name} ...")
                found[check.name] = run_check(built["python"], env, check, args.smoke, logs)
        for name, result in found.items():
            results[env.name][name] = result
            log(f"{env.name}: {name}: {cell(result)} in {result['seconds']} s")

    for env in envs:  # one at a time: each editable install writes the checkout's egg-info
        build_one(env)
    if args.build_only:
        return 0 if all("error" not in r["install"] for r in results.values()) else 1
    with ThreadPoolExecutor(max_workers=SMOKE_AT_ONCE if args.smoke else 1) as pool:
        list(pool.map(test_one, envs))  # list(): raises what a worker raised
    seconds = time.monotonic() - started
    text = table(envs, results, checks)
    print(text)
    when, at = datetime.date.today().isoformat(), commit()
    write_json("version_matrix_smoke" if args.smoke else "version_matrix",
               {"date": when, "commit": at, "seconds": round(seconds), "smoke": args.smoke,
                "results": results})
    complete = not (args.only or args.checks or args.smoke)
    if complete:
        write_doc(text, when, at, seconds)
        log(f"wrote the table into {DOC.relative_to(REPO)}")
    ok = all("error" not in r["install"] and r["install"]["kept"]
             and all(r[c.name]["ok"] for c in checks if c.name in r) for r in results.values())
    log("every check passed" if ok else "some checks FAILED (the table says which)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
