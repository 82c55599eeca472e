"""No import circle in ``hideseek/`` or ``companion/``: the graph of every import statement —
at module level and inside functions alike, since a function-level import only hides a circle
until the function runs — has no cycle.  Edges go to modules of the two packages only;
``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests import ROOT

PACKAGES = ("hideseek", "companion")


def _modules(root: Path, packages) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(name: str, modules) -> str | None:
    """``name`` or its closest enclosing module among ours (``hideseek.x.f`` → ``hideseek.x``)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(root: Path = ROOT, packages=PACKAGES) -> dict[str, set[str]]:
    """module → the modules of ``packages`` it imports (ast: every import statement)."""
    modules = _modules(root, packages)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for a in node.names:
                    full = f"{base}.{a.name}"
                    targets.append(full if full in modules else base)
            for t in targets:
                target = _resolve(t, modules)
                if target is not None and target != mod:
                    graph[mod].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle ``[a, b, …, a]`` of ``graph``, or ``None`` (depth-first search)."""
    state: dict[str, int] = {}          # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    """A circle closed only by an import inside a function, through ``from . import``, ``from
    ..x import`` and ``import pkg.y`` forms, is found."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("import os\nimport pkg.c\n")
    (pkg / "c.py").write_text("def f():\n    from . import a\n    from .sub.b import g\n    return a\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg.a", "pkg.sub.b"}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    (pkg / "c.py").write_text("def f():\n    return 1\n")
    assert find_cycle(import_graph(tmp_path, ("pkg",))) is None


def test_the_real_graph_holds_the_function_level_imports():
    graph = import_graph()
    assert "hideseek.measures" in graph["hideseek.sharpness"]        # module level, relative
    assert "hideseek.problem" in graph["hideseek.curvature"]         # inside a function (curvature's set-up)


def test_find_cycle_reports_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle(package):
    graph = import_graph()
    sub = {m: {t for t in ts if t.split(".")[0] == package} for m, ts in graph.items() if m.split(".")[0] == package}
    cycle = find_cycle(sub)
    assert cycle is None, "import circle: " + " -> ".join(cycle)
