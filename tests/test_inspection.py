"""Inspection: explain(), graph dumps (text, HTML in a real browser, memory plot), logging,
and the recompilation record. Composition with user passes is in test_composition.py."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from support import models
from support.ranks import run_ranks
from support.training import SMALL_BUCKETS
from zero_fx import explain, set_logs, zero_compile
from zero_fx.passes import PASS_ORDER
from zero_fx.passes.common.predicates import is_all_gather, is_collective, is_reduce_scatter

WORLD = 2


def explained_rank(rank: int, world_size: int, stage: int, dump_dir: str):
    """Two steps of the test GPT, then one with half the batch (a recompilation)."""
    model = models.build("gpt")
    opt = models.make_optimizer(model)

    train_step = zero_compile(models.training_step("gpt"), stage=stage, backend="aot_eager",
                              dump_dir=dump_dir, **dict(SMALL_BUCKETS))

    per_rank = 8 // world_size
    for step, size in enumerate((per_rank, per_rank, per_rank // 2)):
        x, y = models.global_batch("gpt", step)
        train_step(model, opt, x[rank * size:(rank + 1) * size], y[rank * size:(rank + 1) * size])
    explanation = train_step.explain()
    return {"text": str(explanation), "explanation": explanation, "traffic": train_step.traffic(),
            "same_as_function": str(explain(train_step)) == str(explanation),
            "graph_nodes": len(train_step.graphs[-1].graph.nodes),
            "graph_collectives": [(i, n.name, _kind(n))
                                  for i, n in enumerate(train_step.graphs[-1].graph.nodes)
                                  if is_collective(n)]}


def _kind(node) -> str:
    return "all_gather" if is_all_gather(node) else "reduce_scatter" if is_reduce_scatter(node) \
        else "other"


@pytest.fixture(scope="module")
def stage3(tmp_path_factory):
    dump_dir = tmp_path_factory.mktemp("dumps")
    return run_ranks(WORLD, explained_rank, 3, str(dump_dir)), dump_dir


def test_explain_lists_every_collective_where_the_graph_has_it(stage3):
    results, _ = stage3
    for r in results:
        timings = r["explanation"].timings
        # read off the graph here, not off the traffic report explain() is built from
        assert [(t.collective.issued_at, t.collective.node, t.collective.kind)
                for t in timings] == r["graph_collectives"]
        for t in timings:
            c = t.collective
            assert c.issued_at < c.waited_at
            assert t.finish > t.start and t.exposed <= t.finish - t.start + 1e-12
        # with prefetch, some all-gather has compute to hide behind
        assert any(t.ops_between > 0 for t in timings if t.collective.kind == "all_gather")
        rows = re.findall(r"^\s+\d+\s+(all_gather|reduce_scatter)\s", r["text"], re.M)
        assert len(rows) == len(timings)
        assert r["same_as_function"]


def test_explain_gathered_lifetimes_are_ordered_and_cover_both_phases(stage3):
    explanation = stage3[0][0]["explanation"]
    lifetimes = explanation.lifetimes
    phases = {(l.param, l.phase) for l in lifetimes}
    weight = "blocks.0.attn.qkv.weight"
    assert {(weight, "forward"), (weight, "backward")} <= phases
    for l in lifetimes:
        assert l.ready_at <= l.first_use <= l.last_use <= l.released_after
    backward_start = explanation.memory.phases.index("backward")
    for l in lifetimes:  # no forward-gathered weight survives into the backward but those kept
        if l.phase == "forward" and not l.kept:
            assert l.released_after < backward_start, l
    kept = {l.param: l.kept for l in lifetimes if l.kept}
    assert kept == {"wte.weight": "through the loss",  # the head: [Note: a weight kept through the loss]
                    **{n: "resident" for n in explanation.plan.resident}}
    head = next(l for l in lifetimes if l.param == "wte.weight")
    assert head.first_use < backward_start < head.last_use
    assert f"{head.released_after} ({head.released_node})  kept through the loss" in str(explanation)


def test_explain_memory_peak_and_what_is_alive_there(stage3):
    explanation = stage3[0][0]["explanation"]
    memory = explanation.memory
    assert len(memory.total) == stage3[0][0]["graph_nodes"]
    assert memory.peak_bytes == max(memory.total)
    live = memory.live_at(memory.peak_index)
    assert sum(t.bytes for t in live) == memory.transient[memory.peak_index]
    text = stage3[0][0]["text"]
    assert f"peak {_mib_or_kib(memory.peak_bytes)}" in text
    assert live[0].node in text


def test_explain_records_each_compilation_and_why(stage3):
    explanation = stage3[0][0]["explanation"]
    reasons = [c.reason for c in explanation.compilations]
    assert reasons[0].startswith("first call"), reasons  # (a kept compilation says so after)
    assert len(reasons) == 2 and "size mismatch" in reasons[1], reasons
    assert "Compilations: 2" in stage3[0][0]["text"]


def _mib_or_kib(n: int) -> str:
    from zero_fx.formatting import format_bytes

    return format_bytes(n)


def stage_rank(rank: int, world_size: int, stage: int):
    model = models.build("mlp")
    opt = models.make_optimizer(model)

    train_step = zero_compile(models.training_step("mlp"), stage=stage, backend="aot_eager")

    x, y = models.global_batch("mlp", 0)
    train_step(model, opt, x[rank::world_size], y[rank::world_size])
    return str(train_step.explain()), train_step.traffic().launches_by_kind()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_explain_at_stages_below_3(stage):
    text, launches = run_ranks(WORLD, stage_rank, stage)[0]
    assert f"stage {stage} over 2 rank(s)" in text
    assert "none in the graph" in text  # no parameter is gathered inside the graph
    kind = "all_reduce" if stage == 0 else "reduce_scatter"
    assert len(re.findall(rf"^\s+\d+\s+{kind}\s", text, re.M)) == launches[kind]
    if stage:  # the after-step gathers are listed too
        assert len(re.findall(r"after step", text)) == launches["all_gather"] > 0


# -- dumps -------------------------------------------------------------------------------

def _folder(dump_dir: Path, rank: int, compilation: int = 0) -> Path:
    return dump_dir / "train_step" / f"rank{rank}" / f"compile{compilation}"


def test_dumps_every_pass_as_text_and_html_for_every_compilation(stage3):
    _, dump_dir = stage3
    expected = ["captured"] + [name for name, _ in PASS_ORDER]
    for rank in range(WORLD):
        for compilation in (0, 1):
            folder = _folder(dump_dir, rank, compilation)
            for i, name in enumerate(expected):
                assert (folder / f"{i:02d}-{name}.txt").is_file(), (folder, name)
                assert (folder / f"{i:02d}-{name}.html").is_file(), (folder, name)
            assert (folder / "explain.txt").read_text().startswith("zero_fx explain")
            assert (folder / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            assert "memory.png" in (folder / "index.html").read_text()


def test_text_dump_names_parameters_and_marks_collectives(stage3):
    results, dump_dir = stage3
    folder = _folder(dump_dir, 0)
    captured = (folder / "00-captured.txt").read_text()
    final = (folder / f"{len(PASS_ORDER):02d}-check_invariants.txt").read_text()
    for name in ("blocks.0.attn.qkv.weight", "wte.weight"):
        assert f"parameter {name}" in captured
        assert f"shard of {name}" in final
        assert re.search(rf"^\s+\d+ fwd\s+{name.replace('.', '_')}: f32\[", final, re.M)
    assert not re.search(r"\barg\d+_\d+\b", final), "placeholders keep anonymous names"
    launches = results[0]["traffic"].launches_by_kind()
    assert final.count("# ALL-GATHER") == launches["all_gather"]
    assert final.count("# REDUCE-SCATTER") == launches["reduce_scatter"]
    assert "ALL-GATHER" not in captured


def test_dump_folder_is_named_in_the_log(tmp_path, caplog):
    model = models.build("mlp")
    opt = models.make_optimizer(model)

    train_step = zero_compile(models.training_step("mlp"), stage=3, backend="aot_eager",
                              dump_dir=str(tmp_path))

    with caplog.at_level(logging.WARNING, logger="zero_fx"):
        train_step(model, opt, *models.global_batch("mlp", 0))
    folder = _folder(tmp_path, 0)
    assert any(str(folder) in record.getMessage() for record in caplog.records)


def test_dumps_turned_on_by_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ZERO_FX_DUMP", str(tmp_path))
    model = models.build("mlp")
    opt = models.make_optimizer(model)

    train_step = zero_compile(models.training_step("mlp"), stage=2, backend="aot_eager")

    train_step(model, opt, *models.global_batch("mlp", 0))
    assert (_folder(tmp_path, 0) / "index.html").is_file()


# -- the HTML view in a real browser --------------------------------------------------------

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if os.environ.get("CI"):
        pytest.fail("CI must have Chromium (.ci/run installs Debian's chromium)")
    pytest.skip("no Chromium here: apt-get install chromium (CI installs it)")


def test_html_view_loads_in_chromium_and_shows_the_collectives(stage3, tmp_path):
    results, dump_dir = stage3
    page = _folder(dump_dir, 0) / f"{len(PASS_ORDER):02d}-check_invariants.html"
    browser = [_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*browser, "--dump-dom", page.as_uri()], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert re.search(r"<body[^>]*data-ready=\"1\"", dom), "the page's script did not finish"
    assert "data-errors" not in dom, re.search(r"<pre id=\"errors\">(.*?)</pre>", dom, re.S)
    collectives = len(results[0]["traffic"].collectives)
    assert f'<span id="shown-collectives">{collectives}</span>' in dom
    assert len(re.findall(r'<tr id="n\d+" class="(all_gather|reduce_scatter)', dom)) == collectives
    shot = tmp_path / "view.png"
    subprocess.run([*browser, "--window-size=1400,1000", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


# -- logging -------------------------------------------------------------------------------

def _one_step():
    model = models.build("mlp")
    opt = models.make_optimizer(model)

    train_step = zero_compile(models.training_step("mlp"), stage=3, backend="aot_eager")

    train_step(model, opt, *models.global_batch("mlp", 0))


def test_quiet_by_default(capfd):
    _one_step()
    assert "zero_fx" not in capfd.readouterr().err


def test_one_switch_shows_the_pass_pipeline(capfd):
    from zero_fx.compiler import reuse

    reuse.forget_all()  # the passes run, not a kept compilation of an earlier test's step
    set_logs("info", passes=True)
    try:
        _one_step()
    finally:
        set_logs(None)
    err = capfd.readouterr().err
    assert "zero_fx pipeline: annotate_phases -> scale_loss -> recompute_activations -> recompute_param_views" in err
    for name, _ in PASS_ORDER:
        assert re.search(rf"zero_fx pass {name}: [\d.]+ ms, \d+ nodes, op count changes", err), name
    assert re.search(r"zero_fx pass gather_params: .* changes .*\+\d+", err)
    set_logs("info")
    try:
        _one_step()
    finally:
        set_logs(None)
    err = capfd.readouterr().err
    assert "compiled train_step with aot_eager" in err and "op count changes" not in err


def test_torchs_no_cuda_runtime_line_is_not_printed_on_a_machine_without_cuda():
    """Inductor imports ``torch.utils.cpp_extension``, which on a machine with a CUDA toolkit
    but no runtime prints "No CUDA runtime is found" once per rank (issue 88, the newcomer's
    first run): after ``import zero_fx`` that line is dropped, and only it."""
    import sys
    from zero_fx.logs import NO_CUDA_RUNTIME

    def stderr_of(code: str) -> str:
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        return run.stderr

    if torch.cuda.is_available() or NO_CUDA_RUNTIME not in stderr_of(
            "import torch.utils.cpp_extension"):
        pytest.skip("this machine's torch does not print the line")
    assert NO_CUDA_RUNTIME not in stderr_of("import zero_fx, torch.utils.cpp_extension")
    others = stderr_of("import zero_fx, logging\n"
                       "logging.getLogger('torch.utils.cpp_extension').warning('other line')")
    assert "other line" in others


def test_bad_log_level_says_what_is_allowed():
    with pytest.raises(ValueError, match="one of"):
        set_logs("loud")


def test_explain_before_the_first_call_says_what_to_do():
    step = zero_compile(lambda model, opt, x, y: None, backend="aot_eager")
    with pytest.raises(RuntimeError, match="call it once first"):
        step.explain()
    with pytest.raises(TypeError, match="decorated with @zero_compile"):
        explain(torch.nn.Linear(2, 2))


def _tiny_mixtral_rank(rank: int, world_size: int) -> dict:
    from examples import hf_models

    torch.manual_seed(0)
    model = hf_models.tiny_mixtral(models.VOCAB, models.SEQ)
    step = zero_compile(models.language_model_step, stage=3, backend="aot_eager")
    step(model, torch.optim.SGD(model.parameters(), lr=0.01), models.global_batch("hf_llama", 0)[0])
    return {"text": str(step.explain()), "estimate": step.estimate(),
            "grouped": [str(n.target) for n in step.graphs[-1].graph.nodes
                        if "grouped_mm" in str(n.target)]}


def test_explain_lists_the_mixture_of_experts_blocks():
    """One line per distinct shape of block; the grouped expert matmuls are priced."""
    pytest.importorskip("transformers")
    out = run_ranks(1, _tiny_mixtral_rank)[0]
    lines = [l for l in out["text"].splitlines() if "mixture of experts" in l]
    assert lines == [
        "  mixture of experts: 2 blocks (model.layers.0.block_sparse_moe, "
        "model.layers.1.block_sparse_moe): 8 experts, top-2, routed by softmax, top-2, "
        "renormalised; 49,152 expert parameters each, resident (gathered once per step); "
        "each token's rows run through its top-2 experts only, in fixed shapes"]
    assert "zero_fx.grouped_mm_weight_grad.default" in out["grouped"]
    assert out["estimate"].compute_seconds > 0
