"""Imports run one way (docs/architecture.md, "The layers").

Every import in zero_fx/ and passes/ (the package ``zero_fx.passes``) is read from the
source with ``ast``, including those made inside functions: a module-level cycle is a
failure even when Python tolerates it at import time, and so is a folder that imports a
folder above it in ``LAYERS``. Each failure names the import lines to change.

Imports under ``if TYPE_CHECKING:`` count for cycles (a cycle of names is one of meanings,
whether or not it runs) but not for the layers: they never run, and only name a type from
above for an annotation (inspection/explain.py's ``Compilation``).
"""

from __future__ import annotations

import ast
import collections
import pathlib
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"zero_fx": ROOT / "zero_fx", "zero_fx.passes": ROOT / "passes"}

LAYERS: list[tuple[str, ...]] = [
    # lowest first; a part is a folder of zero_fx/ or one of its top-level modules
    ("errors", "models", "base"),  # leaves: the public errors, the shipped models, base/ (compat, logs, ...)
    ("passes",),  # graph rewrites, and (common/) the tensor code they splice in
    ("capture",),  # the step as one FX graph
    ("plan",),  # the layout: where each element of each parameter lives
    ("analysis",),  # what a graph costs: bytes, memory, time
    ("inspection",),  # graphs and reports as text, HTML, plots
    ("config",),  # the user's options: their groups, their checks, old names
    ("materialize",),  # values for a meta-device model, pretrained weights
    ("runtime",),  # sharded state, process groups, the step around the compiled graph
    ("checkpoint",),  # sharded save and load of the runtime's state
    ("compiler",),  # the dynamo backend: capture, passes, lowering, per compilation
    ("planner",),  # the offline "will it fit" planner (python -m zero_fx.plan)
    ("evaluation",),  # evaluation steps beside the training step
    ("compiled_step", "step_inspection", "step_state"),  # CompiledStep, what the user calls
    ("api",),  # zero_compile
    ("verification", "export", "estimate"),  # built on the api; command lines
    ("__init__",),  # the front door: what ``import zero_fx`` exports
]

ALLOWED_UPWARD: dict[tuple[str, str], str] = {
    # (importing module, imported module): why it may import a higher layer
}


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    where: str
    """path:line of the import statement, for the reader who fixes it"""


def module_files() -> dict[str, tuple[pathlib.Path, bool]]:
    """Every module's dotted name -> (its file, whether it is a package's __init__)."""
    modules = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            if parts and parts[-1] == "__main__":
                continue  # an entry point: nothing imports it
            modules[".".join([package] + parts)] = (path, is_package)
    return modules


def _known(name: str, modules: dict) -> str | None:
    """The module that importing ``name`` runs: itself, or its nearest enclosing module."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported_names(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        source = f"{base}.{node.module}" if node.module else base
    else:
        source = node.module or ""
    # ``from x import name``: the submodule x.name where there is one, else x
    return [f"{source}.{alias.name}" for alias in node.names]


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _nodes_that_run(tree: ast.AST):
    """Every node, inside functions too, except the body of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(tree):
        yield child
        if _is_type_checking(child):
            for node in child.orelse:
                yield node
                yield from _nodes_that_run(node)
        else:
            yield from _nodes_that_run(child)


def all_imports(annotations: bool = False) -> list[Import]:
    """Every import of one zero_fx module by another; ``annotations``: those under ``if
    TYPE_CHECKING:`` too."""
    modules = module_files()
    found = []
    for module, (path, is_package) in sorted(modules.items()):
        tree = ast.parse(path.read_text(), str(path))
        nodes = (n for n in ast.walk(tree) if n is not tree) if annotations else _nodes_that_run(tree)
        for node in nodes:
            for name in _imported_names(node, module, is_package):
                imported = _known(name, modules)
                if imported is not None and imported != module:
                    found.append(Import(module, imported,
                                        f"{path.relative_to(ROOT)}:{node.lineno}"))
    return found


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one module: each is a cycle (or several)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return components


def part_of(module: str) -> str:
    """The part of zero_fx a module belongs to: its folder, or itself at the top level."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def layer_of(part: str) -> int:
    for i, layer in enumerate(LAYERS):
        if part in layer:
            return i
    raise AssertionError(f"{part!r} is in no layer: add it to LAYERS in {__file__}, and to "
                         "the layers in docs/architecture.md")


def test_no_module_imports_one_that_imports_it_back():
    imports = all_imports(annotations=True)
    edges = collections.defaultdict(set)
    for i in imports:
        edges[i.importer].add(i.imported)
    components = strongly_connected(edges)
    lines = []
    for component in components:
        inside = set(component)
        lines.append("cycle among " + ", ".join(component) + ":")
        first_line = {}  # one import line per edge of the cycle
        for i in imports:
            if i.importer in inside and i.imported in inside:
                first_line.setdefault((i.importer, i.imported), i.where)
        lines += [f"    {a} -> {b}  ({where})" for (a, b), where in first_line.items()]
    assert not components, ("import cycles (counting imports inside functions and under "
                            "TYPE_CHECKING):\n"
                            + "\n".join(lines))


def test_every_part_imports_only_its_layer_or_lower():
    wrong = {}
    for i in all_imports():
        mine, theirs = part_of(i.importer), part_of(i.imported)
        if layer_of(theirs) > layer_of(mine) and (i.importer, i.imported) not in ALLOWED_UPWARD:
            wrong.setdefault((i.importer, i.imported),
                             f"    {mine} -> {theirs}: {i.importer} -> {i.imported}  ({i.where})")
    assert not wrong, ("imports of a higher layer (see LAYERS):\n"
                       + "\n".join(sorted(wrong.values())))


def test_every_allowed_exception_is_still_needed():
    imports = {(i.importer, i.imported) for i in all_imports()}
    stale = [pair for pair in ALLOWED_UPWARD if pair not in imports]
    assert not stale, f"ALLOWED_UPWARD lists imports that no longer exist: {stale}"


def test_imports_inside_functions_count():
    # a cycle once ran through an import made inside a function (materialize.pretrained
    # importing the api): the graph must see such imports to catch the next one
    source = "def load():\n    from ..api import CompiledStep\n"
    names = [name for node in _nodes_that_run(ast.parse(source))
             for name in _imported_names(node, "zero_fx.materialize.pretrained", False)]
    assert names == ["zero_fx.api.CompiledStep"]


def test_imports_for_annotations_only_do_not_count():
    source = ("if TYPE_CHECKING:\n    from ..api import CompiledStep\n"
              "else:\n    import zero_fx.plan\n")
    names = [name for node in _nodes_that_run(ast.parse(source))
             for name in _imported_names(node, "zero_fx.materialize.pretrained", False)]
    assert names == ["zero_fx.plan"]


def private_imports(module: str, tree: ast.AST, is_package: bool, modules: dict) -> list[str]:
    """The names ``from <another zero_fx module> import _name`` takes in ``tree``: a leading
    underscore means private to its module, so a name another module needs is public."""
    found = []
    for node in ast.walk(tree):  # under TYPE_CHECKING too: a private type is private still
        if not isinstance(node, ast.ImportFrom):
            continue
        source = _imported_names(node, module, is_package)[0].rpartition(".")[0]
        if source not in modules or source == module:
            continue
        found += [f"{source}.{alias.name}" for alias in node.names
                  if alias.name.startswith("_") and not alias.name.startswith("__")
                  and f"{source}.{alias.name}" not in modules]  # a private submodule is a module
    return found


def test_no_module_imports_another_modules_private_name():
    modules = module_files()
    wrong = []
    for module, (path, is_package) in sorted(modules.items()):
        tree = ast.parse(path.read_text(), str(path))
        wrong += [f"    {path.relative_to(ROOT)}: {name}"
                  for name in private_imports(module, tree, is_package, modules)]
    assert not wrong, ("private names imported from another module (make each public where it "
                       "is defined, or move the code that needs it there):\n" + "\n".join(wrong))


def test_the_private_import_check_sees_one():
    modules = module_files()
    source = ("from .report_sections import memory_section, _hidden\n"
              "from . import explain\nfrom .explain import __doc__\n")
    assert private_imports("zero_fx.inspection.explain", ast.parse(source), False,
                           modules) == ["zero_fx.inspection.report_sections._hidden"]
    own = "from zero_fx.inspection.explain import _own\n"
    assert private_imports("zero_fx.inspection.explain", ast.parse(own), False, modules) == []


FOREIGN_PRIVATE_MEMBERS = {
    "_init_weights": "HuggingFace's PreTrainedModel._init_weights (materialize/hf.py calls "
                     "the model's own), which zero_fx.models' GPT happens to name alike",
}
"""Private members read across modules that belong to another library's objects, by name."""


def private_members_defined(trees: dict) -> dict[str, set[str]]:
    """``{_member: the modules whose classes define it}`` (``self._x = ...``, ``def _x``)."""
    defined = collections.defaultdict(set)
    for module, tree in trees.items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                name = (node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                        else node.attr if isinstance(node, ast.Attribute)
                        and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
                        and node.value.id == "self" else None)
                if name and name.startswith("_") and not name.startswith("__"):
                    defined[name].add(module)
    return defined


def private_member_reads(trees: dict) -> list[str]:
    """Each ``obj._x`` in a module whose ``_x`` is a private member of a zero_fx class defined
    in another module (``self._x`` and ``cls._x`` are the object's own)."""
    defined = private_members_defined(trees)
    found = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in defined
                    and module not in defined[node.attr]
                    and node.attr not in FOREIGN_PRIVATE_MEMBERS
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.append(f"{module}:{node.lineno}: .{node.attr} (a member of "
                             f"{', '.join(sorted(defined[node.attr]))})")
    return found


def test_no_module_reaches_into_another_modules_objects():
    """Private means private to its module for members too (issue 88): an object made in
    one module is used by others through public members."""
    trees = {module: ast.parse(path.read_text(), str(path))
             for module, (path, _) in module_files().items()}
    wrong = private_member_reads(trees)
    assert not wrong, ("private members of another module's objects (give the class a public "
                       "member for what is needed):\n" + "\n".join(wrong))


def test_the_private_member_check_sees_one():
    trees = {"zero_fx.a": ast.parse("class A:\n    def __init__(self):\n        self._x = 1\n"),
             "zero_fx.b": ast.parse("def f(a):\n    return a._x + a._y\n")}
    assert private_member_reads(trees) == ["zero_fx.b:2: ._x (a member of zero_fx.a)"]
