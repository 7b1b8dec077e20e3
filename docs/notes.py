"""The project's notes, read one way. A note is defined by its heading: a docstring or comment
line that holds ``[Note: X]`` and nothing else, with the note's text below it. It is cited as
``[Note: X]`` anywhere else, followed by ``in path/to/file.py`` when it is defined in another
file (the name may wrap onto a second line, in a comment after a ``#``). The docs tests check
that each note is defined once, that every citation, in the docs and in the code, names a
defined note, and that a citation's ``in path`` is the file defining it; ``index()`` is the
list on docs/notes.md (``python -m docs.samples --only notes`` rewrites it)."""

from __future__ import annotations

import glob
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SOURCES = ("zero_fx", "passes", "bench", "examples", "tests", "docs")
"""The folders whose Python files define and cite notes."""

CITATION = re.compile(r"\[Note:\s+([^\]\"`\n]+(?:\n[^\]\"`\n]+)?)\]")
"""A citation: its name may wrap onto a second line; ``[Note: "`` in code (a grep) is none."""

DEFINITION = re.compile(r"^\s*(?:#\s*)?(?:[rbuf]?\"\"\"|[rbuf]?''')?\[Note:\s+([^\]]+?)\s*\]\s*$")
"""A note's heading: ``[Note: X]`` alone on its line (after indentation, ``#`` or ``\"\"\"``)."""

CITED_FILE = re.compile(r"\s+in\s+((?:[\w.-]+/)*[\w-]+\.py)\b")
"""What may follow a citation: ``in`` the file that defines the note (its path from the
repository, or from the citing file's package, or its bare name)."""

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


def headings() -> list[tuple[str, str, int]]:
    """``(note name, file, line)`` of every note's heading, in file order."""
    found = []
    for path in code_files():
        for number, line in enumerate(_read(path).split("\n"), 1):
            m = DEFINITION.match(line)
            if m:
                found.append((" ".join(m.group(1).split()), path, number))
    return found


def definitions() -> dict[str, str]:
    """``{note name: the file defining it}`` (the first, if a name is defined twice)."""
    defined: dict[str, str] = {}
    for name, path, _ in headings():
        defined.setdefault(name, path)
    return defined


def cited_files(path: str, text: str | None = None) -> list[tuple[int, str, str]]:
    """``(line, note name, the file named after it)`` of each citation in ``path`` followed
    by ``in some/file.py``."""
    text = _read(path) if text is None else text
    found = []
    for m in CITATION.finditer(text):
        after = CITED_FILE.match(text, m.end())
        if after:
            found.append((text.count("\n", 0, m.start()) + 1, note_name(m.group(1)),
                          after.group(1)))
    return found


def names_file(cited: str, defining: str, citing: str) -> bool:
    """Whether ``cited`` (what follows "in") is ``defining``: its path from the repository,
    from a folder of the citing file's, or its bare name."""
    if cited == defining or defining.endswith("/" + cited) and "/" in cited:
        return True
    if "/" not in cited:
        return os.path.basename(defining) == cited
    return False


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
