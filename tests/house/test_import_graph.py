"""No import circle in the project's packages (flashcp, baselines, experiments), and no
``from m import name`` of a project module m that lacks the name.

The graph is static: every module is parsed (never imported) and every ``import x`` /
``from x import y`` in it is an edge, relative imports resolved against the module's package.
Function-level and conditional imports count as much as module-level ones: an import deferred
into a function still makes one module depend on the other (it only hides the circle from the
interpreter until the function runs), and the circles this test was written against were all
deferred ones. An edge goes to the deepest module the statement names (``from a.b import c`` is
an edge to ``a.b.c`` when that is a module, else to ``a.b``); the packages above it are not
edges, since Python runs their ``__init__`` whatever the importer. Imports of names outside the
three packages are not edges.

Imports by string are edges too (:func:`string_imports`): ``importlib.import_module("a.b")`` with
a literal name, and the loaders by name (``flashcp.compiled``'s kernel modules, the executors'
table): in a module that calls ``importlib.import_module`` with a computed name, every string
constant that is a project module's dotted name (``a.b``: a bare package name is more often a
distribution's), in the module or in a project module it imports (a table kept beside the
loader), is an edge to it. A string import hides a
circle from the interpreter as a deferred import does.

A deferred ``from m import name`` runs only when its function does: one naming what m does not
have (moved or renamed since) passes every test that does not call it and fails the first user
who does. :func:`unresolved_from_imports` reads every such statement and m's top-level names.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("flashcp", "baselines", "experiments")

#: circles tolerated (none now); each entry must
#: still be a circle (a stale entry fails, so it is dropped once its circle is gone)
KNOWN_CYCLES: frozenset[frozenset[str]] = frozenset()


def module_files(root: Path = REPO, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under the packages (``a/b/__init__.py``
    is module ``a.b``)."""
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The deepest module of ``modules`` that the dotted ``name`` is or lies in, or None."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _from_base(node: ast.ImportFrom, package: str) -> str:
    """The dotted module a ``from ... import`` statement in ``package`` imports from (relative
    levels resolved)."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(p for p in [*parts, node.module or ""] if p)


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``module`` (its source at ``path``) imports anywhere in
    its body, functions and conditionals included (see the module docstring)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, package)
            # ``from a import b``: b may be a submodule (an edge to it) or a name in a
            names = [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"] or [base]
        else:
            continue
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != module:
                found.add(target)
    literal, loader = string_imports(tree, modules)
    if loader:
        for source in (module, *found):
            literal |= module_names_in(ast.parse(modules[source].read_text()), modules)
    return found | (literal - {module})


def _is_import_module(node: ast.AST) -> bool:
    """True for a call of ``importlib.import_module`` (or of ``import_module`` by that name)."""
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return (isinstance(f, ast.Attribute) and f.attr == "import_module") or (
        isinstance(f, ast.Name) and f.id == "import_module"
    )


def string_imports(tree: ast.AST, modules: dict[str, Path]) -> tuple[set[str], bool]:
    """The project modules a parsed module imports by a literal ``importlib.import_module``
    argument, and whether it also calls it with a computed name (a loader by name: the module
    docstring)."""
    found: set[str] = set()
    loader = False
    for call in (n for n in ast.walk(tree) if _is_import_module(n)):
        arg = call.args[0] if call.args else None
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            target = _resolve(arg.value, modules)
            if target is not None:
                found.add(target)
        else:
            loader = True
    return found, loader


def module_names_in(tree: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The dotted string constants of a parsed module that are modules of ``modules``."""
    return {
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant)
        and isinstance(n.value, str)
        and "." in n.value
        and n.value in modules
    }


def top_level_names(path: Path) -> set[str] | None:
    """The names a module binds at its top level (definitions, assignments, imports, also inside
    top-level ``if`` / ``try`` / ``with`` blocks), or None when it can bind names the parse does
    not show (a ``from x import *`` or a module ``__getattr__``)."""
    names: set[str] = set()
    todo = list(ast.parse(path.read_text(), filename=str(path)).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name == "__getattr__":
                return None
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign | ast.For):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.If | ast.Try | ast.With):
            todo += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]
    return names


def unresolved_from_imports(root: Path = REPO, packages: Iterable[str] = PACKAGES) -> list[str]:
    """Every ``from m import name`` of a project module m, anywhere in the packages (functions
    included), where ``name`` is neither a submodule of m nor bound at m's top level: an
    ImportError waiting for the one call that runs it. ``file:line: from m import name`` each."""
    modules = module_files(root, packages)
    bound = {m: top_level_names(p) for m, p in modules.items()}
    out = []
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = _from_base(node, package)
            if base not in modules or bound[base] is None:
                continue
            for alias in node.names:
                if f"{base}.{alias.name}" not in modules and alias.name not in bound[base]:
                    rel = path.relative_to(root)
                    out.append(f"{rel}:{node.lineno}: from {base} import {alias.name}")
    return out


def test_every_from_import_of_a_project_module_names_something_it_has():
    missing = unresolved_from_imports()
    assert not missing, "names their modules do not have:\n" + "\n".join(missing)


def test_the_name_check_finds_a_deferred_import_of_a_missing_name(tmp_path):
    _write(tmp_path, {
        "p/__init__.py": "",
        "p/a.py": "X = 1\nif True:\n    Y = 2\ndef f():\n    pass\n",
        "p/b.py": "from p.a import X, Y, f\ndef g():\n    from p.a import Z\n    from . import a\n",
        "p/c.py": "def __getattr__(name):\n    return name\n",
        "p/d.py": "from p.c import anything\n",
    })  # fmt: skip
    assert unresolved_from_imports(tmp_path, ["p"]) == ["p/b.py:3: from p.a import Z"]


def import_graph(root: Path = REPO, packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the project modules it imports (see :func:`imports_of`)."""
    modules = module_files(root, packages)
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (each sorted),
    by Tarjan's algorithm (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


def a_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One circle through the first module of ``component`` (a strongly connected component),
    shortest first: ``[a, b, ..., a]``."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in previous:
                    previous[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"{component} is not strongly connected")


def describe(graph: dict[str, set[str]], components: list[list[str]]) -> list[str]:
    """One line per component: its modules and one circle through them."""
    return [f"{', '.join(c)}: e.g. {' -> '.join(a_cycle(graph, c))}" for c in components]


def test_no_import_cycle():
    graph = import_graph()
    assert {"flashcp", "baselines", "experiments"} <= set(graph)  # the packages were found
    components = strongly_connected(graph)
    unexpected = [c for c in components if frozenset(c) not in KNOWN_CYCLES]
    assert not unexpected, "import cycles:\n" + "\n".join(describe(graph, unexpected))
    stale = [sorted(k) for k in KNOWN_CYCLES if list(sorted(k)) not in components]
    assert not stale, f"no longer a cycle, drop it from KNOWN_CYCLES: {stale}"


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize(
    ("files", "want"),
    [
        # a deferred (function-level) import closes the circle: the form of the circles found
        (
            {
                "p/__init__.py": "",
                "p/a.py": "import p.b\n",
                "p/b.py": "def f():\n    from p import a\n",
            },
            [["p.a", "p.b"]],
        ),
        # relative imports, a longer circle, and a ``from x import name`` that is not a module
        (
            {
                "p/__init__.py": "",
                "p/a.py": "from .b import thing\n",
                "p/b.py": "if True:\n    from .sub.c import g\nthing = 1\n",
                "p/sub/__init__.py": "",
                "p/sub/c.py": "from ..a import x\n",
            },
            [["p.a", "p.b", "p.sub.c"]],
        ),
        # a literal ``importlib.import_module`` closes the circle
        (
            {
                "p/__init__.py": "",
                "p/a.py": "import importlib\ndef f():\n    return importlib.import_module('p.b')\n",
                "p/b.py": "from p.a import f\n",
            },
            [["p.a", "p.b"]],
        ),
        # a loader by name (a table of module names, imported by a computed name) closes it
        (
            {
                "p/__init__.py": "",
                "p/load.py": (
                    "import importlib\nMODS = {'k': 'p.kern'}\n"
                    "def load(n):\n    return importlib.import_module(MODS[n])\n"
                ),
                "p/kern.py": "from p.load import load\n",
                "p/other.py": "import importlib\nX = 'p.kern'\n",  # no loader: not an edge
            },
            [["p.kern", "p.load"]],
        ),
        # ... also with its table in a module beside it, which the kernels import
        (
            {
                "p/__init__.py": "",
                "p/table.py": "MODS = {'k': 'p.kern'}\ndef deco(f):\n    return f\n",
                "p/load.py": (
                    "import importlib\nfrom p.table import MODS\n"
                    "def load(n):\n    return importlib.import_module(MODS[n])\n"
                ),
                "p/kern.py": "from p.table import deco\nimport p.load\n",
            },
            [["p.kern", "p.load"]],
        ),
        # no circle: imports one way only, a package above the importer is not an edge
        (
            {
                "p/__init__.py": "from p.a import f\n",
                "p/a.py": "import os\nfrom p.b import g\n",
                "p/b.py": "import p.sub.c\n",
                "p/sub/__init__.py": "",
                "p/sub/c.py": "",
            },
            [],
        ),
    ],
)
def test_the_walk_finds_circles(tmp_path, files, want):
    _write(tmp_path, files)
    graph = import_graph(tmp_path, ["p"])
    components = strongly_connected(graph)
    assert components == want
    for c in components:
        cycle = a_cycle(graph, c)
        assert cycle[0] == cycle[-1] and set(cycle) == set(c)
        assert all(b in graph[a] for a, b in itertools.pairwise(cycle))
