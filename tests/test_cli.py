"""The command lines agree: python -m zero_fx.plan and python -m zero_fx.estimate take the
same model names, shipped in the package (not examples/), and either dtype spelling; the
install hints name packages a user can install from a clone or from an install."""

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zero_fx.compat import SUPPORTED_TRANSFORMERS_TEXT
from zero_fx.planner import cli as plan_cli
from zero_fx.planner.arguments import DTYPES, parse_dtype
from zero_fx.planner.models import ALIASES, NAMED, model_source, on_meta

REPO = Path(__file__).resolve().parent.parent
estimate_cli = importlib.import_module("zero_fx.estimate")  # zero_fx.estimate is also a function

# Run in a fresh interpreter, isolated (-I: no PYTHONPATH, no current folder on sys.path)
# and in a folder outside the checkout: what a user of the installed package has.
OUTSIDE = r"""
import contextlib, importlib.util, io, json, re, runpy, sys
assert importlib.util.find_spec("examples") is None, "examples/ is importable here"
out = {}

def run(key, module, argv, hide_transformers=False):
    if hide_transformers:
        assert "transformers" not in sys.modules
        sys.modules["transformers"] = None  # import transformers raises ImportError
    sys.argv = [module, *argv]
    with contextlib.redirect_stdout(io.StringIO()) as stdout:
        runpy.run_module(module, run_name="__main__", alter_sys=True)  # as python -m does
    if hide_transformers:
        del sys.modules["transformers"]
    out[key] = re.sub(r"in [0-9.]+ s", "in _ s", stdout.getvalue())  # times vary

quick = ["--world", "8", "--layers", "2", "--seq", "64"]
run("estimate bf16", "zero_fx.estimate", ["--model", "llama3-8b", *quick, "--dtype", "bf16"])
run("estimate bfloat16", "zero_fx.estimate", ["--model", "llama3-8b", *quick, "--dtype", "bfloat16"])
run("estimate llama-8b", "zero_fx.estimate", ["--model", "llama-8b", *quick, "--dtype", "bf16"])
run("plan torch", "zero_fx.plan", ["--model", "llama3-8b", "--world", "8", "--dtype", "float16"],
    hide_transformers=True)
run("plan fp16", "zero_fx.plan", ["--model", "llama3-8b", "--world", "8", "--dtype", "fp16"],
    hide_transformers=True)
out["examples imported"] = sorted(m for m in sys.modules if m.split(".")[0] == "examples")
print(json.dumps(out))
"""


def test_the_clis_run_from_the_installed_package_outside_the_checkout(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    child = subprocess.run([sys.executable, "-I", "-c", OUTSIDE], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    out = json.loads(child.stdout.strip().splitlines()[-1])
    assert out["examples imported"] == []
    assert "note: --model llama-8b is the old name of llama3-8b" in child.stderr
    # both spellings, and the old name, plan the same step
    assert out["estimate bf16"] == out["estimate bfloat16"] == out["estimate llama-8b"]
    assert "estimated on 8xH100" in out["estimate bf16"] and "bf16" in out["estimate bf16"]
    # the planner builds the same named model from the package without transformers
    assert out["plan torch"] == out["plan fp16"]
    assert "float16 compute, fp32 masters" in out["plan torch"]
    assert "| 3 ← |" in out["plan torch"]


@pytest.mark.parametrize("short,long", [("fp32", "float32"), ("bf16", "bfloat16"),
                                        ("fp16", "float16")])
def test_every_cli_takes_both_dtype_spellings(short, long):
    assert parse_dtype(short) is parse_dtype(long) is parse_dtype(long.upper()) is getattr(torch, long)
    for cli, required in ((estimate_cli, []), (plan_cli, ["--model", "gpt2", "--world", "8"])):
        parser = cli.make_parser()
        assert parser.parse_args([*required, "--dtype", short]).dtype is getattr(torch, long)
        assert parser.parse_args([*required, "--dtype", long]).dtype is getattr(torch, long)
        assert "fp32|float32, bf16|bfloat16, fp16|float16" in parser.format_help()
    assert set(DTYPES) == {"fp32", "float32", "bf16", "bfloat16", "fp16", "float16"}


def test_a_bad_dtype_says_what_is_accepted(capsys):
    with pytest.raises(SystemExit):
        estimate_cli.make_parser().parse_args(["--dtype", "float8"])
    assert "'float8' is not one of fp32|float32, bf16|bfloat16, fp16|float16" in capsys.readouterr().err


def test_plan_and_estimate_take_the_same_names_and_build_the_same_shapes(named_model_on_meta):
    """Every name (and old name) builds in both CLIs; the planner's model (HuggingFace's when
    transformers is installed) has the estimate's parameter count, and both --help list it.
    The estimate's model is built once (named_model_on_meta: estimate.load_model_builder on
    meta, shared with test_planner) and its vocabulary read from that same build."""
    for spec in [*NAMED, *ALIASES]:
        source = model_source(spec)
        planned = on_meta(lambda: source.build(None))
        estimated = named_model_on_meta(spec)
        assert sum(p.numel() for p in planned.parameters()) == \
            sum(p.numel() for p in estimated.parameters()), spec
        assert source.vocab_size == estimate_cli.vocab_size_of(lambda: estimated), spec
    helps = [" ".join(cli.make_parser().format_help().split()) for cli in (estimate_cli, plan_cli)]
    for name in [*NAMED, *ALIASES]:
        assert all(name in text for text in helps), name


def test_an_unknown_name_lists_the_same_names_in_both_clis():
    messages = []
    for load in (estimate_cli.load_model_builder, model_source):
        with pytest.raises(SystemExit) as err:
            load("llama-9000")
        messages.append(str(err.value))
    names = [re.search(r"one of (.*?\))", m).group(1) for m in messages]
    assert names[0] == names[1] and "llama3-8b" in names[0] and "llama-8b = llama3-8b" in names[0]


def test_the_model_code_ships_in_the_package():
    """Nothing under zero_fx/ imports the repository's examples/ (not packaged)."""
    offenders = [str(path.relative_to(REPO)) for path in (REPO / "zero_fx").rglob("*.py")
                 if re.search(r"^\s*(from|import) examples\b|['\"]examples\.",
                              path.read_text(), re.M)]
    assert offenders == []


def test_install_hints_name_packages_not_extras_or_a_checkout():
    """A hint works from a clone and from an install: ``pip install matplotlib``, not
    ``zero_fx[viz]`` (a package index with zero_fx) or ``-e ".[hf]"`` (a checkout)."""
    hints = []
    for folder in ("zero_fx", "passes"):
        for path in (REPO / folder).rglob("*.py"):
            hints += re.findall(r"pip install[^\n\"'`)(]*", path.read_text())
    assert hints
    for hint in hints:
        assert "[" not in hint and " -e" not in hint and " ." not in hint, hint
    from zero_fx.inspection.memory_plot import MATPLOTLIB_MISSING
    assert "pip install matplotlib " in MATPLOTLIB_MISSING
    tomllib = pytest.importorskip("tomllib")  # Python 3.11
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert SUPPORTED_TRANSFORMERS_TEXT in extras["hf"]  # the hint's range is the [hf] extra's


def test_the_estimate_passes_the_options_by_their_current_names(capsys):
    """--prefetch-buckets and --reduce-overlap-buckets are zero_compile's options; the old
    --prefetch still sets both (with a note)."""
    import warnings

    from zero_fx import ZeroConfig

    parser = estimate_cli.make_parser()
    options = estimate_cli.overlap_options(parser.parse_args([]))
    assert options == {"prefetch_buckets": 1, "reduce_overlap_buckets": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no FutureWarning of a renamed option
        ZeroConfig(stage=3, backend="eager", **options)
    old = parser.parse_args(["--prefetch", "0", "--reduce-overlap-buckets", "2"])
    assert estimate_cli.overlap_options(old) == {"prefetch_buckets": 0, "reduce_overlap_buckets": 2}
    assert "--prefetch is now --prefetch-buckets" in capsys.readouterr().err


def test_importing_the_estimate_command_line_leaves_the_estimate_function_alone():
    """``zero_fx.estimate`` is both the cost model's function and the command line's module:
    importing the module (as this file does above) must not replace the function."""
    import zero_fx
    import zero_fx.estimate  # noqa: F401
    from zero_fx.analysis.cost_model import estimate

    assert estimate_cli is sys.modules["zero_fx.estimate"]
    assert zero_fx.estimate is estimate
