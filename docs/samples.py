"""Output samples in the docs that cannot go stale.

An output sample is a fenced code block right under a marker line naming its producer::

    <!-- sample: traffic -->
    ```text
    ... what the code prints ...
    ```

From the repository root::

    python -m docs.samples                    # rewrite every marked block with what the code prints now
    python -m docs.samples --check            # exit 1 and show the samples whose structure changed
    python -m docs.samples --only explain     # one sample (repeatable)
    python -m docs.samples --list             # the names, and where each is marked
    python -m docs.samples --check FILE.md    # other files than the default ones

The files are README.md, docs/*.md, bench/README.md, the pages of bench/results/ and
passes/README.md. A marker with an unknown name, or not followed by a fence, is an error
naming the file and line (exit 2).
Rewriting keeps the fence lines (and their language tag) and replaces what is between. A
sample whose producer fails is reported with the reason and its blocks are left as they
are (exit 3 when rewriting; under --check it counts as stale). Both modes say on stderr how
long each producer took.

The samples (``SAMPLES``):

- ``explain``, ``traffic``, ``dump-files``: the step of examples/train_gpt.py at its
  default sizes (read from its argparse defaults; vocabulary 256), ``zero_compile(stage=3,
  backend="aot_eager")``, on rank 0 of a fake world of 2 ranks (torch's ``fake`` process
  group: shapes are real, nothing is sent), after one call: ``print(train_step.explain())``,
  ``print(train_step.traffic())``, and the files of its dump folder (one rank and
  compilation: ``<dump_dir>/train_step/rank0/compile0/``), sorted. One compilation serves
  all three (see ``gpt_step_samples``).
- ``plan``: ``python -m zero_fx.plan`` (``PLAN_COMMAND``), its standard output.
- ``plan-moe``: the same for a mixture-of-experts model (``PLAN_MOE_COMMAND``).
- ``plan-muon``: the same with ``--optimizer muon`` (``PLAN_MUON_COMMAND``).
- ``estimate``: ``python -m zero_fx.estimate`` (``ESTIMATE_COMMAND``), its standard output.
- ``verify``: ``torchrun --standalone --nproc_per_node 2 examples/verify_step.py``
  (``VERIFY_COMMAND``), its standard output: ``zero_fx.verify`` on the README's model.
  Each shows the command as the block's first line (``$ python -m ...``).
- ``performance``: a table made from the peer benchmark's results, bench/results/*.json
  (``python -m bench.peers``): per peer, median step time and peak memory per rank for each
  model, with the ratio to FSDP2 eager, then the machine, each model's run, the date each
  result was committed, and the command that produced it.

Structure, not numbers
----------------------
``--check`` and the tests compare a sample's *structure* (``structure()``) with what the
code prints now: both texts are masked, line by line, then compared. Same structure means
the same lines, in the same order, with the same names and the same deterministic integers.
Masked, in every sample (they move with the machine, the clock or the allocator):

- every number with a decimal point or an exponent (times, ratios, GiB, losses, Ψ);
- every number with a unit of bytes or of time (``128 B``, ``48.2 KiB``, ``0.9 s``, ``3 ms``);
- dates and times of day, hexadecimal addresses, memory sparklines (``▃▅█``).

Kept: integers without a unit and without a decimal point. They are counts that the code
decides, the same on every machine: collectives and launches, buckets and the parameters
in each, parameters, elements and shapes, ranks, blocks, compilations, compiled bodies and
the calls of each, lines of a list, the benchmark's steps and cores.

Masked besides, in ``explain`` and ``traffic`` only (``GRAPH_POSITIONS``): positions in the
rewritten graph and its node counts (issued/waited, ready/first use/last use/released
after, ``node 236``, ``nodes 90–249``, ``197 nodes``, ``14 ops``, the tensors alive at the
estimated peak) and the numeric suffixes of node names (``mm_11``): they are deterministic,
but shift whenever a pass or torch's decompositions add a node, which changes nothing a
reader of the sample looks for.

In ``dump-files``, where matplotlib is not installed, ``memory.png`` (which needs it) is
left out of both sides.

Runs of spaces count as one (columns realign when a number's width changes), and trailing
blank lines are ignored.

Not done here: saying in prose which of a sample's numbers vary by machine (the docs do).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DOC_FILES = ("README.md", "docs/*.md", "bench/README.md", "bench/results/README.md",
             "bench/results/*/README.md", "passes/README.md")
"""Where samples are looked for, relative to the repository root (globs)."""

PLAN_COMMAND = ("python", "-m", "zero_fx.plan", "--model", "llama3-8b", "--world", "8",
                "--dtype", "bf16")
"""The ``plan`` sample's command, as shown; ``python`` runs as this interpreter."""

PLAN_MOE_COMMAND = ("python", "-m", "zero_fx.plan", "--model", "mixtral-8x7b", "--world", "8",
                    "--dtype", "bf16")
"""The ``plan-moe`` sample's command: the experts line and states of a mixture of experts."""

PLAN_MUON_COMMAND = ("python", "-m", "zero_fx.plan", "--model", "llama3-8b", "--world", "8",
                     "--dtype", "bf16", "--optimizer", "muon")
"""The ``plan-muon`` sample's command: Muon's owners priced ([Note: planning whole-tensor
updates])."""

VERIFY_COMMAND = ("torchrun", "--standalone", "--nproc_per_node", "2", "examples/verify_step.py")
"""The ``verify`` sample's command: ``zero_fx.verify`` on the README's model at 2 ranks."""

ESTIMATE_COMMAND = ("python", "-m", "zero_fx.estimate", "--model", "llama3-8b", "--world", "8")
"""The ``estimate`` sample's command, as shown; ``python`` runs as this interpreter."""

PEER_RESULTS = "bench/results/*.json"
"""The run of every peer (DDP, FSDP2, DeepSpeed, zero_fx's stages): the ``performance`` sample."""
LATEST_RESULTS = "bench/results/recompute-2026-11-25/*.json"
"""The latest run of zero_fx-3 against FSDP2: the ``performance-latest`` sample, the README's
table. Point it at a newer run's folder when one lands."""
"""The peer benchmark's results the ``performance`` table is made from (files with
``summaries``; others, e.g. the schedule benchmark's, are passed over)."""

MARKER = re.compile(r"^\s*<!--\s*sample:\s*(?P<name>[^\s>]*)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


# --------------------------------------------------------------------------- producers

EXAMPLE = "examples/train_gpt.py"
"""The example whose step the ``explain``, ``traffic`` and ``dump-files`` samples show."""


def example_defaults() -> dict:
    """The example's default model and batch (its argparse defaults, read from its source so
    that the samples follow it): layers, width, heads, seq, batch_size (global), lr."""
    import ast
    with open(os.path.join(REPO, EXAMPLE), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    defaults = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"
                and node.args and isinstance(node.args[0], ast.Constant)):
            for keyword in node.keywords:
                if keyword.arg == "default" and isinstance(keyword.value, ast.Constant):
                    defaults[node.args[0].value.lstrip("-").replace("-", "_")] = keyword.value.value
    wanted = ("layers", "width", "heads", "seq", "batch_size", "lr")
    missing = [w for w in wanted if not isinstance(defaults.get(w), (int, float))]
    if missing:
        raise RuntimeError(f"{EXAMPLE} has no numeric default for --{', --'.join(missing)}; "
                           "docs/samples.py builds the example's model from them")
    return {w: defaults[w] for w in wanted}


_GPT_STEP: list = []


def gpt_step_samples() -> dict[str, str]:
    """``explain``, ``traffic`` and ``dump-files`` from one compiled step (kept, or its
    failure kept: one compile, whichever of them asks first)."""
    if not _GPT_STEP:
        try:
            _GPT_STEP.append(dict(_gpt_step_samples()))
        except Exception as e:  # noqa: BLE001 - raised again for each of the three
            _GPT_STEP.append(e)
    if isinstance(_GPT_STEP[0], Exception):
        raise _GPT_STEP[0]
    return _GPT_STEP[0]


def _gpt_step_samples() -> tuple[tuple[str, str], ...]:
    """The example's step (examples/train_gpt.py at its defaults, --backend aot_eager) on
    rank 0 of a fake world of 2, after one call."""
    if REPO not in sys.path:  # examples.gpt lives in the checkout, not the package
        sys.path.insert(0, REPO)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import zero_fx
    from examples.gpt import GPT, GPTConfig

    if dist.is_initialized():
        raise RuntimeError("the GPT samples start a fake world of 2 ranks of their own; a "
                           "process group is already initialized in this process")
    world = 2
    example = example_defaults()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with tempfile.TemporaryDirectory(prefix="zero_fx-samples-") as dump_dir:
            torch.manual_seed(0)
            model = GPT(GPTConfig(vocab_size=256, block_size=example["seq"],
                                  n_layer=example["layers"], n_head=example["heads"],
                                  n_embd=example["width"]))
            opt = torch.optim.AdamW(model.parameters(), lr=example["lr"], weight_decay=0.1)
            @zero_fx.zero_compile(stage=3, backend="aot_eager",
                                  debug=zero_fx.DebugOptions(dump_dir=dump_dir))
            def train_step(model, opt, x, y):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
                return loss

            x = torch.randint(0, 256, (example["batch_size"] // world, example["seq"] + 1),
                              generator=torch.Generator().manual_seed(0))
            train_step(model, opt, x[:, :-1], x[:, 1:])
            files = [os.path.join(root, f) for root, _, names in os.walk(dump_dir) for f in names]
            folder = os.path.commonpath([os.path.dirname(f) for f in files]) if files else dump_dir
            listing = sorted(os.path.relpath(f, folder).replace(os.sep, "/") for f in files)
            return (("explain", str(train_step.explain())),
                    ("traffic", str(train_step.traffic())),
                    ("dump-files", "\n".join(listing)))
    finally:
        dist.destroy_process_group()


def _command_output(command: tuple[str, ...]) -> str:
    """``$ command`` and what it prints on stdout, run from the repository root."""
    argv = ([sys.executable, *command[1:]] if command[0] == "python" else
            [sys.executable, "-m", "torch.distributed.run", *command[1:]]
            if command[0] == "torchrun" else list(command))
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n"
                           f"{done.stderr.strip()[-2000:]}")
    return f"$ {' '.join(command)}\n{done.stdout.rstrip()}"


def plan_sample() -> str:
    return _command_output(PLAN_COMMAND)


def plan_moe_sample() -> str:
    return _command_output(PLAN_MOE_COMMAND)


def plan_muon_sample() -> str:
    return _command_output(PLAN_MUON_COMMAND)


def estimate_sample() -> str:
    return _command_output(ESTIMATE_COMMAND)


def verify_sample() -> str:
    return _command_output(VERIFY_COMMAND)


def notes_index() -> str:
    from docs import notes

    return notes.index()


def optimizer_rules_sample() -> str:
    """``explain()``'s table of update rules for the recipe of docs/optimizers.md (Muon over
    the hidden matrices, AdamW over the rest) on a 2-block example GPT at stage 3 over 4
    ranks, as the first call plans it (the plan and the owners only: nothing trains)."""
    import torch

    from examples.gpt import GPT, GPTConfig
    from zero_fx.config import ZeroConfig
    from zero_fx.inspection.explain import rules_section
    from zero_fx.plan import PlanOptions, PlanRanks, plan_for_module
    from zero_fx.runtime.optimizer import parameter_updates
    from zero_fx.runtime.update.optimizer_set import OptimizerSet
    from zero_fx.runtime.sharding import with_owners

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128,
                          bias=False))
    named = list(model.named_parameters())
    hidden = [p for n, p in named if p.ndim == 2 and "wte" not in n and "wpe" not in n]
    rest = [p for n, p in named if not any(p is h for h in hidden)]
    optimizers = [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=3e-4)]
    plan = plan_for_module(model, PlanRanks(4), PlanOptions(stage=3))
    plan = with_owners(plan, model, OptimizerSet(optimizers), ZeroConfig(stage=3))
    return rules_section(parameter_updates(optimizers, named, plan, None), 4, plan)


def _committed_date(path: str) -> str:
    """The date the file was last committed (YYYY-MM-DD); its modification date outside git."""
    try:
        done = subprocess.run(["git", "log", "-1", "--format=%cs", "--", path], cwd=REPO,
                              capture_output=True, text=True, timeout=30)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return time.strftime("%Y-%m-%d", time.gmtime(os.path.getmtime(path)))


_NOT_COMMAND_LINE = {"name", "worker_of", "result_file", "store_prefix", "device"}


def _peers_command(args: dict) -> str:
    """The ``python -m bench.peers`` command line that gave ``args`` (flags at defaults left out)."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from bench.peers.cli import parse_args
    defaults = vars(parse_args([]))
    words = ["python", "-m", "bench.peers", "--model", str(args["model"]),
             "--world", str(args["world"])]
    for key, value in args.items():
        if key in _NOT_COMMAND_LINE | {"model", "world"} or key not in defaults:
            continue
        if value == defaults[key] or (key == "peers" and sorted(value) == sorted(defaults[key])):
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            words.append(flag)
        elif isinstance(value, list):
            words += [flag, *map(str, value)]
        elif value not in (False, None):
            words += [flag, str(value)]
    return " ".join(words)


def performance_sample(results: str = PEER_RESULTS) -> str:
    """Step time and peak memory per rank, per peer and model, from the peer benchmark's
    JSON files matching ``results``."""
    runs = []
    for path in sorted(glob.glob(os.path.join(REPO, results))):
        with open(path) as f:
            result = json.load(f)
        if result.get("summaries"):
            runs.append((path, result))
    if not runs:
        raise RuntimeError(f"no peer results in {results}")
    # file names order the models by name: order them by size instead
    runs.sort(key=lambda run: run[1]["summaries"][0]["psi"])
    peers: list[str] = []
    for _, result in runs:
        peers += [s["peer"] for s in result["summaries"] if s["peer"] not in peers]
    head = ["peer"]
    for _, result in runs:
        model = result["args"]["model"]
        head += [f"{model} step ms", f"{model} peak MiB/rank"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for peer in peers:
        cells = [peer]
        for _, result in runs:
            by_peer = {s["peer"]: s for s in result["summaries"]}
            ref = by_peer.get("fsdp2")
            s = by_peer.get(peer)
            if s is None:
                cells += ["—", "—"]
                continue
            for key in ("median_step_ms", "peak_mib"):
                cell = f"{s[key]:.1f}"
                if s.get("whole_batch") and key == "median_step_ms":
                    cell += " †"
                elif ref and ref[key]:
                    cell += f" ({s[key] / ref[key]:.2f}×)"
                cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    whole_batch = any(s.get("whole_batch") for _, result in runs for s in result["summaries"])
    lines.append("Ratios in brackets: against FSDP2 eager (fsdp2)."
                 + (" † one process on the whole global batch (no data parallelism)."
                    if whole_batch else ""))
    machines = sorted({result["machine"] for _, result in runs})
    lines.append(f"Machine: {'; '.join(machines)}.")
    for path, result in runs:
        args = result["args"]
        description = result["description"]
        # the description repeats the machine; keep what says what was run
        what = description.split("; ", 1)[1] if description.startswith(result["machine"]) else description
        lines.append("")
        lines.append(f"{args['model']}, {_committed_date(path)}: {what}")
        lines.append(f"  {_peers_command(args)}")
        lines.append(f"  ({os.path.relpath(path, REPO).replace(os.sep, '/')})")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Sample:
    name: str
    produce: Callable[[], str]
    what: str
    cheap: bool = True
    """Whether the docs tests regenerate it (seconds, on a 2-core CPU)."""
    graph_positions: bool = False
    """Whether node indices and node counts of the rewritten graph are masked too."""
    optional_lines: Callable[[], frozenset] = lambda: frozenset()
    """Lines that this machine may not print though another does (see dump-files)."""


def _missing_without_matplotlib() -> frozenset:
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # the memory plot is written only with matplotlib
        return frozenset({"memory.png"})
    return frozenset()


SAMPLES = {s.name: s for s in (
    Sample("explain", lambda: gpt_step_samples()["explain"],
           "print(train_step.explain()) of examples/train_gpt.py's step at stage 3, 2 fake ranks",
           graph_positions=True),
    Sample("traffic", lambda: gpt_step_samples()["traffic"],
           "print(train_step.traffic()) of the same step", graph_positions=True),
    Sample("dump-files", lambda: gpt_step_samples()["dump-files"],
           "the files of the same step's dump folder after one call",
           optional_lines=_missing_without_matplotlib),
    Sample("optimizer-rules", optimizer_rules_sample,
           "explain()'s update rules for Muon and AdamW on a 2-block GPT, stage 3, 4 ranks"),
    Sample("notes", lambda: notes_index(),
           "every note of the code and the file that defines it (docs/notes.py)"),
    Sample("plan", plan_sample, " ".join(PLAN_COMMAND)),
    Sample("plan-moe", plan_moe_sample, " ".join(PLAN_MOE_COMMAND)),
    Sample("plan-muon", plan_muon_sample, " ".join(PLAN_MUON_COMMAND)),
    Sample("estimate", estimate_sample, " ".join(ESTIMATE_COMMAND)),
    Sample("verify", verify_sample, " ".join(VERIFY_COMMAND)),
    Sample("performance", performance_sample,
           f"step time and peak memory per rank from {PEER_RESULTS}"),
    Sample("performance-latest", lambda: performance_sample(LATEST_RESULTS),
           f"step time and peak memory per rank from {LATEST_RESULTS}"),
)}


class SampleFailed(Exception):
    """A sample's producer raised: the message says which and why."""


_PRODUCED: dict = {}
TIMES: dict = {}
"""Seconds each sample's producer took in this process (the GPT samples share one compile,
counted for the first of them produced)."""


def produce(name: str) -> str:
    """What the code prints now for the sample ``name`` (kept for the process); SampleFailed
    if its producer raised."""
    if name not in _PRODUCED:
        start = time.perf_counter()
        try:
            _PRODUCED[name] = SAMPLES[name].produce().rstrip("\n")
        except Exception as e:  # noqa: BLE001 - reported with the sample's name
            _PRODUCED[name] = SampleFailed(f"sample {name!r} could not be produced: "
                                           f"{type(e).__name__}: {e}")
        TIMES[name] = time.perf_counter() - start
    result = _PRODUCED[name]
    if isinstance(result, SampleFailed):
        raise result
    return result


def produce_many(names) -> dict:
    """Several samples at once (the commands' processes run while this one compiles): name
    -> its text, or the SampleFailed its producer gave."""
    from concurrent.futures import ThreadPoolExecutor

    def attempt(name):
        try:
            return produce(name)
        except SampleFailed as e:
            return e

    names = list(dict.fromkeys(names))
    commands = [n for n in names if SAMPLES[n].produce in (plan_sample, plan_moe_sample,
                                                                  plan_muon_sample, estimate_sample,
                                                                  verify_sample)]
    with ThreadPoolExecutor(max_workers=max(len(commands), 1)) as pool:
        running = {n: pool.submit(attempt, n) for n in commands}
        here = {n: attempt(n) for n in names if n not in running}
        return {n: running[n].result() if n in running else here[n] for n in names}


# --------------------------------------------------------------------------- structure

_SPARK = re.compile(r"[▁▂▃▄▅▆▇█]+")
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]+\b")
_DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?Z?)?\b")
_CLOCK = re.compile(r"\b\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?\b")
_NUMBER = r"\d[\d,]*(?:\.\d+)?(?:[eE][+-]?\d+)?"
_UNIT = r"(?:[KMGTP]i?B|B|bytes|[mµun]s|s|sec|min)"
_QUANTITY = re.compile(rf"(?<![\w.]){_NUMBER}\s?{_UNIT}(?![\w])")
_FLOAT = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+(?:[eE][+-]?\d+)?|[eE][+-]?\d+)(?![\d])")
_SPACES = re.compile(r"[ \t]+")

GRAPH_POSITIONS = (
    # (a collective's row: issued and waited, the two integers after its phase: _issued_waited)
    # a gathered parameter's row: ready, first use, last use, released after (after its bytes)
    (re.compile(r"(?<=<q>)((?:\s+\d+)+)"), lambda m: re.sub(r"\d+", "<n>", m.group(0))),
    (re.compile(r"\bnodes?\s+\d+(?:\s*[–-]\s*\d+)?"), lambda m: re.sub(r"\d+", "<n>", m.group(0))),
    (re.compile(r"\b\d+(\s+(?:other\s+)?)(nodes?|ops?)\b"), r"<n>\1\2"),
    # how many tensors the memory estimate finds alive at its peak
    (re.compile(r"\b\d+ tensors(?=, <q>)"), "<n> tensors"),
    (re.compile(r"\bfor \d+ in the graph\b"), "for <n> in the graph"),
    (re.compile(r"\b\d+ … \d+\b"), "<n> … <n>"),
    (re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*?)_\d+\b"), r"\1_<n>"),
)


def _issued_waited(line: str) -> str:
    """The collective tables' issued/waited columns: a row starts with its index and kind."""
    m = re.match(r"^(\s*\d+\s+(?:all_gather|reduce_scatter|all_reduce|all_to_all|broadcast)\w*"
                 r"(?:\s+\S+)*?\s+(?:forward|backward|optimizer|update|step)\s+)(\d+)(\s+)(\d+)\b",
                 line)
    if not m:
        return line
    return m.group(1) + "<n>" + m.group(3) + "<n>" + line[m.end():]


def mask_line(line: str, graph_positions: bool = False) -> str:
    """One line with what varies replaced by placeholders (the rules: the module's docstring)."""
    line = _SPARK.sub("<spark>", line)
    line = _ADDRESS.sub("<addr>", line)
    line = _DATE.sub("<date>", line)
    line = _CLOCK.sub("<time>", line)
    line = _QUANTITY.sub("<q>", line)
    line = _FLOAT.sub("<x>", line)
    if graph_positions:
        line = _issued_waited(line)
        for pattern, replacement in GRAPH_POSITIONS:
            line = pattern.sub(replacement, line)
    return _SPACES.sub(" ", line).strip()


def structure(text: str, name: Optional[str] = None) -> list[str]:
    """The lines of ``text`` as ``--check`` compares them (``name``: the sample's own rules)."""
    sample = SAMPLES.get(name) if name else None
    graph_positions = bool(sample and sample.graph_positions)
    optional = sample.optional_lines() if sample else frozenset()
    lines = text.rstrip().split("\n") if text.strip() else []
    return [mask_line(line, graph_positions) for line in lines
            if not any(line.strip().endswith(o) for o in optional)]


def differences(name: str, documented: str, current: str) -> list[str]:
    """A unified diff of the two structures; empty when the sample is up to date."""
    return list(difflib.unified_diff(structure(documented, name), structure(current, name),
                                     "in the docs", "printed now", n=1, lineterm=""))


# --------------------------------------------------------------------------- markers

@dataclasses.dataclass
class Marker:
    path: str
    line: int          # 1-based line of the marker
    name: str
    body: str          # the block's current text
    start: int         # 0-based index of the first body line
    end: int           # 0-based index of the closing fence


class SampleError(Exception):
    """A marker that names no sample, or that is not followed by a fenced block."""


def default_files() -> list[str]:
    files = []
    for pattern in DOC_FILES:
        files += sorted(glob.glob(os.path.join(REPO, pattern)))
    return files


def _display(path: str) -> str:
    rel = os.path.relpath(path, REPO)
    return path if rel.startswith("..") else rel


def _closing(lines: list[str], opening: int, fence: str) -> Optional[int]:
    """The index of the line closing the fence opened at ``opening`` (None: never closed)."""
    close = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
    return next((j for j in range(opening + 1, len(lines)) if close.match(lines[j])), None)


def markers(path: str, lines: Optional[list[str]] = None) -> list[Marker]:
    """The marked blocks of a file; SampleError on an unknown name or a marker with no fence."""
    if lines is None:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    found = []
    i = 0
    while i < len(lines):
        m = MARKER.match(lines[i])
        if not m:
            other = FENCE.match(lines[i])
            if other:  # a code block of the docs' own: a marker shown in it is no marker
                i = _closing(lines, i, other.group("fence"))
                i = len(lines) if i is None else i
            i += 1
            continue
        where = f"{_display(path)}:{i + 1}"
        name = m.group("name")
        if name not in SAMPLES:
            raise SampleError(f"{where}: unknown sample {name!r} (known: {', '.join(SAMPLES)})")
        opening = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if not opening:
            raise SampleError(f"{where}: the sample {name!r} must be followed by a fenced code "
                              "block on the next line")
        end = _closing(lines, i + 1, opening.group("fence"))
        if end is None:
            raise SampleError(f"{where}: the code block of sample {name!r} is never closed")
        found.append(Marker(path, i + 1, name, "\n".join(lines[i + 2:end]), i + 2, end))
        i = end + 1
    return found


def all_markers(files: Optional[list[str]] = None) -> list[Marker]:
    return [m for path in (default_files() if files is None else files) for m in markers(path)]


def rewrite(path: str, only: Optional[set] = None) -> tuple[list[str], list[str]]:
    """Put what the code prints now in the file's marked blocks: the names rewritten, and
    reports of the samples that could not be produced (their blocks are left as they are)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    lines = text.split("\n")
    found = [m for m in markers(path, lines) if not only or m.name in only]
    produced = produce_many(m.name for m in found)
    changed, failed = [], []
    for m in reversed(found):
        current = produced[m.name]
        if isinstance(current, SampleFailed):
            failed.append(f"{_display(m.path)}:{m.line}: {current}")
        elif current != m.body:
            indent = FENCE.match(lines[m.start - 1]).group("indent")
            lines[m.start:m.end] = [indent + line if line else line
                                    for line in current.split("\n")]
            changed.append(m.name)
    if changed:
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(lines))
    return changed[::-1], failed[::-1]


def check(files: Optional[list[str]] = None, only: Optional[set] = None) -> list[str]:
    """Reports of the marked blocks whose structure differs from what the code prints now,
    or whose sample could not be produced."""
    stale = []
    found = [m for m in all_markers(files) if not only or m.name in only]
    produced = produce_many(m.name for m in found)
    for m in found:
        current = produced[m.name]
        if isinstance(current, SampleFailed):
            stale.append(f"{_display(m.path)}:{m.line}: {current}")
            continue
        diff = differences(m.name, m.body, current)
        if diff:
            stale.append(f"{_display(m.path)}:{m.line}: sample {m.name!r} is stale "
                         f"(python -m docs.samples --only {m.name} rewrites it):\n  "
                         + "\n  ".join(diff))
    return stale


def _times() -> str:
    return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in TIMES.items())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m docs.samples",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="Markdown files (default: README.md, "
                        "docs/*.md, bench/README.md, bench/results/**/README.md, "
                        "passes/README.md)")
    parser.add_argument("--check", action="store_true",
                        help="rewrite nothing; exit 1 listing the samples whose structure differs")
    parser.add_argument("--only", action="append", metavar="NAME",
                        help=f"only this sample (repeatable): {', '.join(SAMPLES)}")
    parser.add_argument("--list", action="store_true", help="the samples and where each is marked")
    args = parser.parse_args(argv)
    only = set(args.only or ())
    unknown = only - set(SAMPLES)
    if unknown:
        parser.error(f"unknown sample(s) {', '.join(sorted(unknown))} (known: {', '.join(SAMPLES)})")
    files = [os.path.abspath(f) for f in args.files] or default_files()
    try:
        found = all_markers(files)
    except SampleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.list:
        for name, sample in SAMPLES.items():
            where = [f"{_display(m.path)}:{m.line}" for m in found if m.name == name]
            print(f"{name:12} {sample.what}\n{'':12} marked at: {', '.join(where) or 'nowhere'}")
        return 0
    if args.check:
        stale = check(files, only)
        for report in stale:
            print(report)
        checked = sum(1 for m in found if not only or m.name in only)
        print(f"{checked} sample(s) checked, {len(stale)} stale or failed (produced in: "
              f"{_times() or 'none'})", file=sys.stderr)
        return 1 if stale else 0
    failed = []
    for path in files:
        changed, failures = rewrite(path, only)
        failed += failures
        for name in changed:
            print(f"{_display(path)}: rewrote {name}")
    for report in failed:
        print(f"error: {report}", file=sys.stderr)
    print(f"produced in: {_times() or 'none'}", file=sys.stderr)
    return 3 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
