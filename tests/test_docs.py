"""The docs cannot go stale: every output sample marked in them (``<!-- sample: NAME -->``
above a fenced block) has the structure of what the code prints now (docs/samples.py, whose
docstring gives the rule: numbers that vary by machine are masked, names and counts are
not); a sample made stale on purpose fails that check; every ``[Note: ...]`` the docs cite
is defined in the code; every repository file they cite exists; and they carry no words
about how the project's work was organised.

``python -m docs.samples`` rewrites the samples when the code's output changes."""

import glob
import os
import re
import subprocess

import pytest

from docs import notes, samples

REPO = samples.REPO

DOCS = samples.DOC_FILES
"""The user-facing docs every check here reads: README.md, docs/*.md, bench/README.md, the
pages of bench/results/, passes/README.md."""


REQUIRED = ("explain", "traffic", "plan")
"""Samples the docs must show somewhere."""

try:
    MARKERS = samples.all_markers()
    MARKER_ERROR = None
except samples.SampleError as e:  # reported by test_every_marker_names_a_sample_and_a_block
    MARKERS, MARKER_ERROR = [], str(e)


def doc_files() -> list[str]:
    return [path for pattern in DOCS for path in sorted(glob.glob(os.path.join(REPO, pattern)))]


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def rel(path: str) -> str:
    return os.path.relpath(path, REPO)


@pytest.fixture(scope="module")
def produced():
    """Name -> text, or the SampleFailed its producer gave, for every cheap sample the docs
    mark and for traffic (the stale-sample tests'), produced once: one compiled step serves
    explain, traffic and dump-files; the CLIs' processes run while it compiles."""
    names = {m.name for m in MARKERS if samples.SAMPLES[m.name].cheap} | {"traffic"}
    return samples.produce_many(sorted(names))


def text_of(produced, name: str) -> str:
    if isinstance(produced[name], samples.SampleFailed):
        pytest.fail(str(produced[name]))
    return produced[name]


# --------------------------------------------------------------------------- samples

def test_every_marker_names_a_sample_and_a_block():
    assert MARKER_ERROR is None, MARKER_ERROR


@pytest.mark.parametrize("name", REQUIRED)
def test_the_docs_show_the_main_samples(name):
    where = [f"{rel(m.path)}:{m.line}" for m in MARKERS if m.name == name]
    assert where, (f"no <!-- sample: {name} --> in {', '.join(DOCS)}: the docs should show "
                   f"{samples.SAMPLES[name].what}")


@pytest.mark.parametrize("marker", MARKERS, ids=[f"{rel(m.path)}:{m.line}:{m.name}" for m in MARKERS])
def test_sample_has_the_structure_of_what_the_code_prints(marker, produced):
    if not samples.SAMPLES[marker.name].cheap:
        pytest.skip(f"{marker.name} is too slow to regenerate here (python -m docs.samples --check)")
    current = text_of(produced, marker.name)
    diff = samples.differences(marker.name, marker.body, current)
    assert not diff, (f"{rel(marker.path)}:{marker.line}: sample {marker.name!r} is stale; "
                      f"python -m docs.samples --only {marker.name} rewrites it:\n"
                      + "\n".join(diff))


def test_a_stale_sample_fails_the_check(produced):
    current = text_of(produced, "traffic")
    lines = current.split("\n")
    assert samples.differences("traffic", current, current) == []
    renamed = current.replace("wpe.weight", "wpe.bias", 1)
    assert renamed != current
    assert samples.differences("traffic", renamed, current), "a renamed parameter passed"
    dropped = "\n".join(lines[:2] + lines[3:])
    assert samples.differences("traffic", dropped, current), "a missing line passed"
    # a count the code decides: the launches
    recounted = re.sub(r"\b(\d+) launches", lambda m: f"{int(m.group(1)) + 1} launches", current)
    assert recounted != current
    assert samples.differences("traffic", recounted, current), "a wrong count passed"


def test_numbers_that_vary_do_not_make_a_sample_stale(produced):
    """Floats, byte sizes, times and graph positions are masked; columns may realign."""
    current = text_of(produced, "traffic")
    moved = re.sub(r"\d+\.\d+", "9.99", current)                 # ratios
    moved = re.sub(r"\b[\d,]+ B\b", "1,234,567 B", moved)         # byte sizes
    moved = re.sub(r"(forward|backward)(\s+)\d+(\s+)\d+", r"\1\2 1234\3 5678", moved)  # positions
    assert moved != current
    assert samples.differences("traffic", moved, current) == []
    assert samples.structure("step 311.65 ms in 0.9 s, 21.9 GiB, 128 B at 0x7f3a, 2026-11-21") == \
        samples.structure("step 2.5 ms in 12.25 s, 1.0 GiB, 4096 B at 0x1, 2027-01-02")
    assert samples.structure("35 buckets, 291 tensors") != samples.structure("34 buckets, 291 tensors")


def test_check_and_rewrite_from_the_command_line(tmp_path, produced, capsys):
    """--check exits 1 and names the stale block's file and line; a rewrite keeps the fence
    and its language tag, and --check then passes."""
    doc = tmp_path / "page.md"
    stale = text_of(produced, "traffic").split("\n")
    del stale[3]
    doc.write_text("# A page\n\n<!-- sample: traffic -->\n```text\n" + "\n".join(stale)
                   + "\n```\n\nAfter.\n")
    assert samples.main(["--check", "--only", "traffic", str(doc)]) == 1
    assert f"{doc}:3: sample 'traffic' is stale" in capsys.readouterr().out
    assert samples.main(["--only", "traffic", str(doc)]) == 0
    text = doc.read_text()
    assert "<!-- sample: traffic -->\n```text\n" + produced["traffic"] + "\n```\n\nAfter.\n" in text
    assert samples.main(["--check", str(doc)]) == 0


def test_a_marker_shown_in_a_code_block_is_no_marker(tmp_path):
    doc = tmp_path / "page.md"
    doc.write_text("How to mark a sample:\n\n````markdown\n<!-- sample: NAME -->\n```\n...\n```\n"
                   "````\n\n<!-- sample: plan -->\n```text\nx\n```\n")
    assert [(m.line, m.name, m.body) for m in samples.markers(str(doc))] == [(10, "plan", "x")]


def test_a_producer_that_fails_is_reported_by_name(tmp_path, monkeypatch, capsys):
    def broken():
        raise RuntimeError("the CLI exited 1")

    monkeypatch.setitem(samples.SAMPLES, "broken", samples.Sample("broken", broken, "a test's"))
    monkeypatch.setattr(samples, "_PRODUCED", dict(samples._PRODUCED))  # forget it afterwards
    doc = tmp_path / "page.md"
    doc.write_text("<!-- sample: broken -->\n```\nold\n```\n")
    assert samples.main([str(doc)]) == 3
    assert "page.md:1: sample 'broken' could not be produced: RuntimeError: the CLI exited 1" \
        in capsys.readouterr().err
    assert doc.read_text() == "<!-- sample: broken -->\n```\nold\n```\n"
    assert samples.main(["--check", str(doc)]) == 1


@pytest.mark.parametrize("page, error", [
    ("<!-- sample: no-such-sample -->\n```\nx\n```\n", ":2: unknown sample 'no-such-sample'"),
    ("<!-- sample: traffic -->\n\nsome prose\n", ":2: the sample 'traffic' must be followed by"),
    ("<!-- sample: traffic -->\n```text\nx\n", ":2: the code block of sample 'traffic' is never closed"),
])
def test_a_bad_marker_is_an_error_naming_file_and_line(tmp_path, capsys, page, error):
    doc = tmp_path / "page.md"
    doc.write_text("# A page\n" + page)
    assert samples.main(["--check", str(doc)]) == 2
    assert f"{doc}{error}" in capsys.readouterr().err


# --------------------------------------------------------------------------- notes

def note_definitions() -> set[str]:
    return set(notes.definitions())


def test_every_note_cited_in_code_is_defined():
    """A misspelt ``[Note: ...]`` in a docstring or comment points at nothing: each is defined
    somewhere (issue 88, the notes)."""
    defined = note_definitions()
    missing = [f"{path}:{line}: [Note: {name}]" for path in notes.code_files()
               for line, name in notes.citations(path) if name not in defined]
    assert not missing, "notes cited in code and defined nowhere:\n" + "\n".join(missing)


def test_a_misspelt_citation_in_code_is_found():
    defined = note_definitions()
    assert "whole-tensor updates on owner ranks" in defined
    assert notes.note_name("whole-tensor updates on\n    # owner ranks") in defined
    assert notes.note_name("whole-tensor update on owner ranks") not in defined
    assert notes.citations("x.py", "a\n# [Note: whole-tensor update on\n#  owner ranks]") == [
        (2, "whole-tensor update on owner ranks")]


def test_each_note_is_defined_once():
    """A note's heading is ``[Note: X]`` alone on its line: written once. A citation that
    starts a line is no heading (it has words after it), and two headings of one name would
    leave the reader two texts to choose from."""
    seen: dict[str, str] = {}
    twice = []
    for name, path, line in notes.headings():
        if name in seen:
            twice.append(f"{path}:{line}: [Note: {name}], defined first in {seen[name]}")
        seen.setdefault(name, f"{path}:{line}")
    assert not twice, "notes with two headings:\n" + "\n".join(twice)
    assert notes.headings.__doc__ and notes.DEFINITION.match("    [Note: a heading]")
    assert not notes.DEFINITION.match("    [Note: a citation] in passes/x.py, as here")


def test_a_citation_names_the_file_that_defines_its_note():
    """``[Note: X] in path/file.py`` sends the reader to that file: it must be the one whose
    heading defines X (one pointed at the file its note had moved out of)."""
    defined = note_definitions()
    by_name = notes.definitions()
    wrong = [f"{rel(path)}:{line}: [Note: {name}] in {cited}, defined in {by_name[name]}"
             for path in [*(os.path.join(notes.REPO, p) for p in notes.code_files()),
                          *doc_files()]
             for line, name, cited in notes.cited_files(path, read(path))
             if name in defined and not notes.names_file(cited, by_name[name], rel(path))]
    assert not wrong, "citations naming the wrong file:\n" + "\n".join(wrong)
    assert notes.names_file("plan/layout.py", "zero_fx/plan/layout.py", "x.py")
    assert notes.names_file("layout.py", "zero_fx/plan/layout.py", "x.py")
    assert not notes.names_file("zero_fx/plan/owners.py", "zero_fx/plan/layout.py", "x.py")


def test_every_cited_note_is_defined_in_the_code():
    defined = note_definitions()
    assert len(defined) > 20, defined  # the convention is still the one read here
    missing = [f"{rel(path)}:{line}: [Note: {name}]" for path in doc_files()
               for line, name in notes.citations(path, read(path)) if name not in defined]
    assert not missing, ("notes cited in the docs and defined nowhere in "
                         f"{', '.join(notes.SOURCES)}/:\n" + "\n".join(missing))


# --------------------------------------------------------------------------- paths

PATH = re.compile(r"(?<![\w./~:-])((?:\.ci|[A-Za-z_][\w.-]*)/[\w./-]*)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
BARE = re.compile(r"`([\w-]+\.(?:py|sh))`")
FENCED = re.compile(r"^\s*(```|~~~).*?^\s*\1\s*$", re.S | re.M)
BARE_NAMES_IN = ("bench/README.md", "passes/README.md")
"""Docs in a code folder, where a bare file name (`wire.py`) means a file beside them."""


def ignored(paths: list[str]) -> set[str]:
    """The paths git ignores (outputs such as bench/out/), relative to the repository. Each is
    asked about as a folder too: a pattern ending in "/" matches only a folder, and one not
    made yet (bench/out/ before a benchmark ran) is not known to be one."""
    if not paths:
        return set()
    try:
        done = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=REPO,
                              input="\n".join(p + end for p in paths for end in ("", "/")),
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return set()
    return {p.rstrip("/") for p in done.stdout.split()}


def cited_paths(path: str, text: str = None) -> list[tuple[int, str]]:
    """(line, path relative to the repository) for each repository file the doc at ``path``
    cites (``text``: its text, if not the file's)."""
    text = read(path) if text is None else text
    here = os.path.dirname(path)
    top = {entry for entry in os.listdir(REPO) if not entry.startswith(".")} | {".ci"}
    cited = []

    def add(offset, target):
        cited.append((text.count("\n", 0, offset) + 1,
                      os.path.normpath(os.path.relpath(target, REPO))))

    for m in PATH.finditer(text):
        token = m.group(1).rstrip(".,;:")
        first = token.split("/", 1)[0]
        if first in top:
            add(m.start(), os.path.join(REPO, token))
        elif here != REPO and os.path.exists(os.path.join(here, first)):
            add(m.start(), os.path.join(here, token))  # bench/README's results/...
    for m in LINK.finditer(text):
        target = m.group(1).split("#", 1)[0]
        if target and not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # not a URL or mailto
            add(m.start(), os.path.join(here, target))
    if rel(path) in BARE_NAMES_IN:
        prose = FENCED.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        for m in BARE.finditer(prose):
            add(m.start(), os.path.join(here, m.group(1)))
    return cited


def test_every_cited_repository_file_exists():
    missing = []
    for path in doc_files():
        cited = cited_paths(path)
        outputs = ignored(sorted({p for _, p in cited if not os.path.exists(os.path.join(REPO, p))}))
        for line, target in cited:
            if not os.path.exists(os.path.join(REPO, target)) and target not in outputs:
                missing.append(f"{rel(path)}:{line}: {target}")
    assert not missing, "files the docs cite that the repository lacks:\n" + "\n".join(missing)


def test_the_path_check_sees_what_it_should():
    """The path check's own test: a cited file that is gone is found, outputs are not."""
    assert ("examples/train_gpt.py" in {p for _, p in cited_paths(os.path.join(REPO, "README.md"))}
            or not os.path.exists(os.path.join(REPO, "README.md")))
    page = os.path.join(REPO, "docs", "a-page.md")
    cited = {p: line for line, p in cited_paths(page, (
        "# A page\n"
        "See `zero_fx/no_such_file.py` and [the stages](stages_gone.md),\n"
        "https://example.com/docs/x.md, bench/out/x.json, meta-llama/Llama-3-8B.\n"))}
    assert cited == {"zero_fx/no_such_file.py": 2, "docs/stages_gone.md": 2, "bench/out/x.json": 3}
    assert ignored(["bench/out/x.json", "zero_fx/no_such_file.py"]) == {"bench/out/x.json"}


# --------------------------------------------------------------------------- wording

ORGANISATION = re.compile(r"\bissues? #?\d+|\bparts? \d+ of\b|\bpart \d+\)|, part \d+\b"
                          r"|\bthe issue'?s\b", re.I)
"""An issue by number, a part of one, or "the issue's targets"."""


def test_no_words_about_how_the_work_is_organised():
    found = []
    for path in doc_files():
        text = read(path)
        for m in ORGANISATION.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"{rel(path)}:{line}: {m.group(0)!r}")
    assert not found, ("the docs speak of the project's issues or their parts; say what the "
                       "code does instead:\n" + "\n".join(found))


@pytest.mark.parametrize("text, found", [
    ("as in issue 20, part 3", ["issue 20", ", part 3"]),
    ("part 2 of the plan", ["part 2 of"]),
    ("the issue's targets", ["the issue's"]),
    ("in issue order; issued and waited; an issue with gloo", []),
])
def test_the_wording_check_sees_what_it_should(text, found):
    assert [m.group(0) for m in ORGANISATION.finditer(text)] == found


README_MAX_LINES = 250
"""The README is the front page: what zero_fx is, the two commands, a complete script, the
everyday options and where the rest lives. Detail goes to docs/, which it links."""


def test_the_readme_stays_a_front_page():
    with open(os.path.join(REPO, "README.md")) as f:
        lines = f.read().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, over {README_MAX_LINES}: move detail to a page of "
        "docs/ and link it")
