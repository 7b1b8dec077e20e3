"""The project's notes, read one way: a note is defined by a docstring or comment line that
starts with ``[Note: X]`` and cited as ``[Note: X]`` anywhere else (the name may wrap onto a
second line, in a comment after a ``#``). The docs tests check that every citation, in the
docs and in the code, names a defined note; ``index()`` is the list on docs/notes.md
(``python -m docs.samples --only notes`` rewrites it)."""

from __future__ import annotations

import glob
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SOURCES = ("zero_fx", "passes", "bench", "examples", "tests", "docs")
"""The folders whose Python files define and cite notes."""

CITATION = re.compile(r"\[Note:\s+([^\]\"`\n]+(?:\n[^\]\"`\n]+)?)\]")
"""A citation: its name may wrap onto a second line; ``[Note: "`` in code (a grep) is none."""

DEFINITION = re.compile(r"^\s*(?:#\s*)?(?:[rbuf]?\"\"\"|[rbuf]?''')?\[Note:\s+([^\]]+?)\s*\]")
"""``[Note: X]`` at the start of a line (after indentation, ``#`` or ``\"\"\"``)."""

EXAMPLES = (os.path.join("tests", "test_docs.py"), os.path.join("docs", "notes.py"))
"""Files whose notes in brackets show the form (this one, the tests of the form), not a note."""


def note_name(citation: str) -> str:
    """A citation's name on one line: a wrap (in a comment, ``#`` begins the next line) is a
    space."""
    return " ".join(re.sub(r"(^|\n)\s*#", "\n", citation).split())


def code_files() -> list[str]:
    """Every Python file where a note may be defined or cited, relative to the repository."""
    return [os.path.relpath(path, REPO) for folder in SOURCES
            for path in sorted(glob.glob(os.path.join(REPO, folder, "**", "*.py"), recursive=True))
            if os.path.relpath(path, REPO) not in EXAMPLES]


def _read(path: str) -> str:
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return f.read()


def definitions() -> dict[str, str]:
    """``{note name: the file defining it}`` (the first, if a name is defined twice)."""
    defined: dict[str, str] = {}
    for path in code_files():
        for line in _read(path).split("\n"):
            m = DEFINITION.match(line)
            if m:
                defined.setdefault(" ".join(m.group(1).split()), path)
    return defined


def citations(path: str, text: str | None = None) -> list[tuple[int, str]]:
    """``(line, note name)`` of each citation in ``path`` (``text``: its text, if not the file's)."""
    text = _read(path) if text is None else text
    return [(text.count("\n", 0, m.start()) + 1, note_name(m.group(1)))
            for m in CITATION.finditer(text)]


def index() -> str:
    """Every note and the file that defines it, by file, for docs/notes.md."""
    by_file: dict[str, list[str]] = {}
    for name, path in definitions().items():
        by_file.setdefault(path, []).append(name)
    lines = []
    for path in sorted(by_file):
        lines.append(path)
        lines += [f"    [Note: {name}]" for name in sorted(by_file[path], key=str.lower)]
    return "\n".join(lines)
