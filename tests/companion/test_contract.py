"""The companion's shape contract (issue 16): notebooks of at most 150 code lines with exactly one
call into the companion that computes and findings generated, not typed; no function in the
companion longer than 80 lines; no `.get(key, default)` parameter reads in the experiments.

Parametrized over every notebook listed in NOTEBOOKS, every module of `companion/` (function length) and
every module of `companion/experiments/` (parameter reads)."""
import ast
import json
import re
from pathlib import Path

import pytest

from tests import ROOT

#: notebooks/<name>.ipynb under the notebook contract: every notebook of the pipeline
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
#: companion modules whose functions are held to 80 lines: every module of the package
MODULES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "companion").rglob("*.py"))
#: experiment modules that read their parameters through typed settings only: all of them
EXPERIMENTS = sorted(p.stem for p in (ROOT / "companion" / "experiments").glob("*.py") if p.stem != "__init__")
#: companion functions a notebook may call besides its one computing call: they only format numbers
PRESENTATION = {"findings"}
MAX_CODE_LINES, MAX_FUNCTION_LINES = 150, 80
PARAM_NAMES = {"params", "p", "prm", "cfg", "config", "settings", "protocol", "proto"}


def _cells(name: str, kind: str) -> list[str]:
    nb = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == kind]


def _companion_calls(code: str) -> list[str]:
    """Names of the functions of `companion` the code calls (through `import companion...` aliases
    or names imported from companion modules)."""
    tree = ast.parse(code)
    aliases, names = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "companion":
            for a in node.names:
                (aliases if a.name[:1].islower() and "." not in a.name and _is_module(node.module, a.name)
                 else names).add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            aliases |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("companion")}
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in names:
                calls.append(f.id)
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in aliases:
                calls.append(f.attr)
    return calls


def _is_module(package: str, name: str) -> bool:
    return (ROOT / Path(*package.split("."), f"{name}.py")).is_file() or (
        ROOT / Path(*package.split("."), name, "__init__.py")).is_file()


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_contract(name):
    code = _cells(name, "code")
    n_lines = sum(1 for c in code for ln in c.splitlines() if ln.strip() and not ln.strip().startswith("#"))
    assert n_lines <= MAX_CODE_LINES, f"notebooks/{name}.ipynb has {n_lines} code lines (at most {MAX_CODE_LINES})"
    calls = _companion_calls("\n".join(c for c in code if not c.lstrip().startswith(("%", "!"))))
    computing = [c for c in calls if c not in PRESENTATION]
    assert len(computing) == 1, f"notebooks/{name}.ipynb calls the companion to compute {computing}; want one call"
    assert any(c in PRESENTATION for c in calls), f"notebooks/{name}.ipynb does not generate its findings"
    text = [re.sub(r"§\s*\d+(\.\d+)*|Appendi(x|ces) [A-Z](\.\d+)*", "", md) for md in _cells(name, "markdown")]
    typed = [m.group(0) for md in text for m in re.finditer(r"[-+−]?\d+\.\d+", md)]
    assert not typed, f"notebooks/{name}.ipynb types numbers in its text {typed[:5]}; generate them"


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(
                body[0].value.value, str)
            start = (body[1].lineno if len(body) > 1 else node.end_lineno) if doc else body[0].lineno
            yield node.name, node.end_lineno - start + 1


@pytest.mark.parametrize("module", MODULES)
def test_no_function_longer_than_80_lines(module):
    long = [(n, k) for n, k in _functions(ROOT / module) if k > MAX_FUNCTION_LINES]
    assert not long, f"{module}: functions longer than {MAX_FUNCTION_LINES} lines (docstring excluded): {long}"


def _receiver(node: ast.AST) -> str:
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        if isinstance(node, ast.Attribute) and node.attr in PARAM_NAMES:
            return node.attr
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_no_get_parameter_reads(name):
    path = ROOT / "companion" / "experiments" / f"{name}.py"
    reads = [node.lineno for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
             and _receiver(node.func.value) in PARAM_NAMES]
    assert not reads, f"{path.relative_to(ROOT)} reads parameters with .get(...) on lines {reads}; use typed settings"


def test_the_checks_catch_violations(tmp_path):
    """The detectors themselves: a second computing call, a long function, a .get parameter read."""
    code = "from companion.experiments import toy\nres = toy.run(p)\nres2 = toy.run_report(p, o)\ntoy.findings(m)\n"
    assert [c for c in _companion_calls(code) if c not in PRESENTATION] == ["run", "run_report"]
    f = tmp_path / "m.py"
    f.write_text("def f():\n    '''doc'''\n" + "    x = 1\n" * 81 + "\ndef g(params):\n    return params.get('a', 1)\n")
    assert dict(_functions(f))["f"] == 81
    call = next(n for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.Call))
    assert _receiver(call.func.value) == "params"
