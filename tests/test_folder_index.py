"""Every folder indexes its modules: the ``__init__`` docstring of each package in zero_fx/
and passes/ names each of its modules and subpackages (as ``name``, ``name.py`` or ``name/``), so a
reader finds where a thing lives from the folder, without opening its files one by one."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("zero_fx", "passes")


def packages() -> list[pathlib.Path]:
    """Every folder with an ``__init__.py`` under the project's packages."""
    return sorted(init.parent for top in PACKAGES for init in (ROOT / top).rglob("__init__.py"))


def unnamed(folder: pathlib.Path) -> list[str]:
    """The modules and subpackages of ``folder`` its ``__init__`` docstring does not name."""
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    parts = [p.stem for p in folder.glob("*.py") if p.name != "__init__.py"]
    parts += [p.name for p in folder.iterdir() if (p / "__init__.py").is_file()]
    return sorted(part for part in parts
                  if not any(f"``{part}{end}``" in doc for end in ("", ".py", "/")))


def test_every_folder_names_each_of_its_modules():
    missing = {str(folder.relative_to(ROOT)): names for folder in packages()
               if (names := unnamed(folder))}
    assert not missing, (
        "modules their folder's __init__ docstring does not name (add each, by its role):\n"
        + "\n".join(f"{folder}/__init__.py: {', '.join(names)}"
                    for folder, names in missing.items()))


MOST_MODULES = 15
"""A folder of zero_fx/ holds at most this many modules; past it, it gets rooms (issue 88)."""
MOST_AT_ROOT = 12
"""zero_fx/ itself holds at most this many: the front door and the leaves, at one height."""


def test_no_folder_holds_more_modules_than_a_reader_scans():
    counts = {str(folder.relative_to(ROOT)): len([p for p in folder.glob("*.py")
                                                  if p.name != "__init__.py"])
              for folder in packages() if folder.parts[len(ROOT.parts)] == "zero_fx"}
    assert counts["zero_fx"] <= MOST_AT_ROOT, counts["zero_fx"]
    crowded = {f: n for f, n in counts.items() if n > MOST_MODULES}
    assert not crowded, f"folders over {MOST_MODULES} modules (give them rooms): {crowded}"


def test_the_index_check_finds_a_module_left_out(tmp_path):
    (tmp_path / "__init__.py").write_text('"""Holds ``named`` and ``sub``."""\n')
    for module in ("named.py", "forgotten.py"):
        (tmp_path / module).write_text("")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "__init__.py").write_text("")
    (tmp_path / "data").mkdir()  # not a package: no index needed
    assert unnamed(tmp_path) == ["forgotten"]
    assert len(packages()) >= 12


def test_passes_readme_names_where_each_pass_is_tested():
    """passes/README.md's table gives each pass of the pipeline the test files that test it
    (issue 88, tests/), and each file it names exists."""
    import re

    from zero_fx.passes import PASS_ORDER

    rows = {m.group(1): m.group(2) for m in re.finditer(
        r"^\| `(\w+)` \|.*\| ([^|]*) \|$", (ROOT / "passes" / "README.md").read_text(), re.M)}
    problems = []
    for name, _ in PASS_ORDER:
        files = re.findall(r"`(tests/test_\w+\.py)`", rows.get(name, ""))
        if not files:
            problems.append(f"{name}: no test file named")
        problems += [f"{name}: {f} does not exist" for f in files if not (ROOT / f).is_file()]
    assert not problems, "\n".join(problems)
