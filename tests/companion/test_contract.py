"""The companion's shape contract (issue 16): notebooks of at most 150 code lines with exactly one
call into the companion that computes and findings generated, not typed; that one call is the stage module's
entry point, `<module>.run_report(profile, params, out)`, and every stage module's `run_report` has one
signature, `run_report(profile, params, out_dir, *, progress=True)`; no function in the companion longer
than 80 lines; no `.get(key, default)` parameter reads in the experiments.

Parametrized over every notebook listed in NOTEBOOKS, every stage module its computing call names
(STAGE_MODULES), every module of `companion/` (function length) and every module of
`companion/experiments/` (parameter reads)."""
import ast
import importlib
import inspect
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
#: every stage module's entry point, the notebook's one computing call
ENTRY = "run_report"
_P = inspect.Parameter
#: its parameters (name, kind, default): the names the pipeline injects (`profile`, `params`, `out_dir`), then the
#: progress bars' switch. A module that does not use `profile` or `progress` accepts them all the same; further
#: parameters may follow only keyword-only with a default (seams for tests: `sources=`, `metrics_dir=`, ...)
ENTRY_SIGNATURE = [("profile", _P.POSITIONAL_OR_KEYWORD, _P.empty), ("params", _P.POSITIONAL_OR_KEYWORD, _P.empty),
                   ("out_dir", _P.POSITIONAL_OR_KEYWORD, _P.empty), ("progress", _P.KEYWORD_ONLY, True)]
#: how a notebook calls it: the injected `profile` and `params` and `out = Path(out_dir)`, positionally; keywords:
#: only `progress` (the minilm stage reads it from its params, the sam notebook keeps its bars off)
ENTRY_ARGS, ENTRY_KEYWORDS = ["profile", "params", "out"], {"progress"}
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


def _module_calls(code: str) -> list[tuple[str, str, ast.Call]]:
    """``(module, function, call)`` for every call of a function of a `companion` module in the code, through a
    module alias (`from companion.experiments import toy as t`, `import companion.x as y`) or an imported name."""
    tree = ast.parse(code)
    modules, names = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "companion":
            for a in node.names:
                if _is_module(node.module, a.name):
                    modules[a.asname or a.name] = f"{node.module}.{a.name}"
                else:
                    names[a.asname or a.name] = (node.module, a.name)
        elif isinstance(node, ast.Import):
            modules.update({a.asname: a.name for a in node.names if a.name.startswith("companion") and a.asname})
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in names:
                calls.append((*names[f.id], node))
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in modules:
                calls.append((modules[f.value.id], f.attr, node))
    return calls


def _notebook_code(name: str) -> str:
    return "\n".join(c for c in _cells(name, "code") if not c.lstrip().startswith(("%", "!")))


def _entry_call(code: str) -> tuple[str, str, ast.Call]:
    computing = [c for c in _module_calls(code) if c[1] not in PRESENTATION]
    assert len(computing) == 1, f"want one computing call, found {[f'{m}.{f}' for m, f, _ in computing]}"
    return computing[0]


def _call_drift(call: ast.Call, func: str) -> list[str]:
    """How a notebook's computing call differs from `run_report(profile, params, out[, progress=...])`."""
    problems = [] if func == ENTRY else [f"calls {func}, not {ENTRY}"]
    args = [a.id if isinstance(a, ast.Name) else ast.unparse(a) for a in call.args]
    if args != ENTRY_ARGS:
        problems.append(f"positional arguments {args}, want {ENTRY_ARGS}")
    extra = sorted({k.arg or "**" for k in call.keywords} - ENTRY_KEYWORDS)
    if extra:
        problems.append(f"keywords {extra} beyond {sorted(ENTRY_KEYWORDS)}")
    return problems


def _signature_drift(fn) -> list[str]:
    """How `fn`'s signature differs from :data:`ENTRY_SIGNATURE` (extra parameters: keyword-only, defaulted)."""
    params = list(inspect.signature(fn).parameters.values())
    head = [(p.name, p.kind, p.default) for p in params[:len(ENTRY_SIGNATURE)]]

    def shown(ps):
        return ", ".join(("*, " if k is _P.KEYWORD_ONLY else "") + n + ("" if d is _P.empty else f"={d!r}")
                         for n, k, d in ps)
    problems = [] if head == ENTRY_SIGNATURE else [f"({shown(head)}), want ({shown(ENTRY_SIGNATURE)})"]
    problems += [f"extra parameter {p.name} is not keyword-only with a default" for p in params[len(ENTRY_SIGNATURE):]
                 if p.kind is not _P.KEYWORD_ONLY or p.default is _P.empty]
    return problems


#: the stage modules: the ones the notebooks' computing calls name (one each: test_notebook_calls_the_stage_entry)
STAGE_MODULES = sorted({m for n in NOTEBOOKS for m, f, _ in _module_calls(_notebook_code(n)) if f not in PRESENTATION})


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_calls_the_stage_entry(name):
    """The one computing call is `<module>.run_report(profile, params, out)` on the injected names."""
    code = _notebook_code(name)
    module, func, call = _entry_call(code)
    problems = _call_drift(call, func)
    assert not problems, f"notebooks/{name}.ipynb: {module}.{func}(...): {'; '.join(problems)}"
    (params_cell,) = [c for c in json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())["cells"]
                      if "parameters" in c.get("metadata", {}).get("tags", [])]
    injected = {t.id for node in ast.walk(ast.parse("".join(params_cell["source"]))) if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    assert injected == {"profile", "params", "out_dir"}, f"notebooks/{name}.ipynb's parameters cell sets {injected}"
    outs = [ast.unparse(n.value) for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Assign)
            and [ast.unparse(t) for t in n.targets] == ["out"]]
    assert outs == ["Path(out_dir)"], f"notebooks/{name}.ipynb: out = {outs}, want Path(out_dir)"


@pytest.mark.parametrize("module", STAGE_MODULES)
def test_stage_modules_share_one_entry_signature(module):
    problems = _signature_drift(getattr(importlib.import_module(module), ENTRY))
    assert not problems, f"{module}.{ENTRY}: {'; '.join(problems)}"


def test_every_stage_notebook_has_its_own_module():
    assert len(NOTEBOOKS) == len(STAGE_MODULES) >= 9, STAGE_MODULES


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
    """The detectors themselves: a second computing call, a long function, a .get parameter read, a drifted
    entry call or signature."""
    code = "from companion.experiments import toy\nres = toy.run(p)\nres2 = toy.run_report(p, o)\ntoy.findings(m)\n"
    assert [c for c in _companion_calls(code) if c not in PRESENTATION] == ["run", "run_report"]
    f = tmp_path / "m.py"
    f.write_text("def f():\n    '''doc'''\n" + "    x = 1\n" * 81 + "\ndef g(params):\n    return params.get('a', 1)\n")
    assert dict(_functions(f))["f"] == 81
    call = next(n for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.Call))
    assert _receiver(call.func.value) == "params"
    # a drifted entry call (old argument order, a keyword, another function) and drifted signatures
    code = "from companion.experiments import toy as t\nres = t.run_report(params, out, profile=profile)\n"
    module, func, call = _entry_call(code)
    assert module == "companion.experiments.toy" and len(_call_drift(call, func)) == 2
    assert _call_drift(ast.parse("m.run(profile, params, out)").body[0].value, "run") == [f"calls run, not {ENTRY}"]

    def ok(profile, params, out_dir, *, progress=True, sources=None): ...
    def old(params, out_dir, profile="cpu", *, progress=True): ...
    def no_progress(profile, params, out_dir): ...
    def seam(profile, params, out_dir, *, progress=True, sources): ...
    def off(profile, params, out_dir, *, progress=False): ...
    assert _signature_drift(ok) == []
    assert all(len(_signature_drift(fn)) == 1 for fn in (old, no_progress, seam, off))
