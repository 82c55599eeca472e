"""dvc.yaml lists what each stage's numbers depend on: its own code and the library's behaviour.

For each stage: the modules named by its command (``python -m pkg.mod``; for
``python -m companion.pipeline <stage>`` also the code cells of
``notebooks/<stage>.ipynb``), then, with ``ast``, every import of a project
module (``hideseek.*``, ``companion.*``, relative imports included) followed
transitively. Each companion file must be a ``deps:`` entry or lie below one; no
``hideseek/`` file may be one: the stage lists instead the behaviour files
(``reports/behaviour/<path>.json``, :mod:`companion.behaviour`) of the library
names its code refers to (``companion.behaviour.USES``).
"""
from __future__ import annotations

import ast
import functools
import json
import re
import shlex
from pathlib import Path

import pytest

from tests import ROOT
from companion.params import load_yaml

PACKAGES = ("hideseek", "companion")


def module_file(name: str) -> Path | None:
    """The file of project module ``name`` (a package's ``__init__.py``), or None if not ours."""
    if name.split(".")[0] not in PACKAGES:
        return None
    base = ROOT.joinpath(*name.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.AST, current: str | None, is_package: bool) -> set[str]:
    """Absolute names of the modules ``tree`` imports (``from a import b``: ``a`` and ``a.b``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = current.split(".") if is_package else current.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([node.module] if node.module else []))
            else:
                base = node.module
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    out = set()
    for n in names:  # importing a.b.c runs a/__init__ and a/b/__init__ too
        parts = n.split(".")
        out.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return out


@functools.lru_cache(maxsize=None)
def parsed(f: Path) -> ast.AST:
    """``f``'s syntax tree, parsed once for every stage's scan (the trees are only read)."""
    return ast.parse(f.read_text(), filename=str(f))


def closure(seeds: set[str], extra_trees: list[ast.AST] = ()) -> set[Path]:
    files: set[Path] = set()
    todo = set(seeds)
    for tree in extra_trees:
        todo |= imported_modules(tree, None, False)
    while todo:
        f = module_file(todo.pop())
        if f is None or f in files:
            continue
        files.add(f)
        tree = parsed(f)
        todo |= imported_modules(tree, module_name(f), f.name == "__init__.py")
    return files


def library_names(files: set[Path], extra_trees: list[ast.AST] = ()) -> set[str]:
    """The names of :mod:`hideseek` that ``files`` and ``extra_trees`` refer to: names imported from a
    hideseek module, the last part of a hideseek module's name, and ``hs.<name>`` attributes."""
    names: set[str] = set()
    trees = [parsed(f) for f in files if f.parts[len(ROOT.parts)] != "hideseek"]
    for tree in [*trees, *extra_trees]:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "hideseek":
                names.update(a.name for a in node.names)
                names.update(node.module.split(".")[1:])
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "hideseek":
                        names.update(a.name.split(".")[1:])
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "hs":
                names.add(node.attr)
    return names


def notebook_trees(path: Path) -> list[ast.AST]:
    nb = json.loads(path.read_text())
    trees = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        src = "\n".join(line for line in src.splitlines() if not line.lstrip().startswith(("%", "!")))
        trees.append(ast.parse(src, filename=str(path)))
    return trees


STAGES = load_yaml((ROOT / "dvc.yaml").read_text())["stages"]


def stage_sources(stage: dict) -> tuple[set[str], list[Path]]:
    argv = shlex.split(stage["cmd"])
    assert argv[:2] == ["python", "-m"], f"unexpected command {stage['cmd']!r}"
    if argv[2] in ("companion.skipped", "companion.kernels"):   # wrappers (a stage a profile may skip; pinned
        # CPU kernels): the wrapper and the wrapped command
        inner = stage_sources({"cmd": shlex.join(argv[argv.index("--") + 1:])})
        return {argv[2], *inner[0]}, inner[1]
    modules = {argv[2]}
    f = module_file(argv[2])
    if f is not None and f.name == "__init__.py" and (f.parent / "__main__.py").is_file():
        modules.add(f"{argv[2]}.__main__")  # python -m package runs package/__main__.py
    notebooks = []
    if argv[2] == "companion.pipeline":
        notebooks.append(ROOT / "notebooks" / f"{argv[3]}.ipynb")
    return modules, notebooks


def covered(path: Path, deps: list[str]) -> bool:
    rel = path.relative_to(ROOT)
    return any(rel == Path(d) or Path(d) in rel.parents for d in deps)


def stage_scan(stage: dict) -> tuple[set[Path], set[str], list[Path]]:
    """``(project files the stage imports, hideseek names its code refers to, its notebooks)``."""
    modules, notebooks = stage_sources(stage)
    trees = [t for nb in notebooks for t in notebook_trees(nb)]
    files = closure(modules, trees)
    return files, library_names(files, trees), notebooks


BEHAVIOUR_PREFIX = "reports/behaviour/"


@pytest.mark.parametrize("name", sorted(STAGES))
def test_stage_lists_every_imported_project_file(name):
    from companion.behaviour import PATHS, USES, paths_for

    stage = STAGES[name]
    deps = [str(d) for d in stage.get("deps", [])]
    if name == "behaviour":
        assert stage.get("always_changed") is True and not [d for d in deps if d.startswith("hideseek")], stage
        return
    files, names, notebooks = stage_scan(stage)
    for nb in notebooks:
        assert covered(nb, deps), f"stage {name}: dvc.yaml deps lack {nb.relative_to(ROOT)}"
    assert files, f"stage {name}: found no project module in {stage['cmd']!r}"
    source = [d for d in deps if d.split("/")[0] == "hideseek"]
    assert not source, (f"stage {name}: depends on library source {source}; depend on its behaviour "
                        f"(reports/behaviour/<path>.json) instead")
    missing = sorted(str(f.relative_to(ROOT)) for f in files
                     if f.relative_to(ROOT).parts[0] != "hideseek" and not covered(f, deps))
    assert not missing, f"stage {name}: dvc.yaml deps lack {missing}"
    need = {f"{BEHAVIOUR_PREFIX}{p}.json" for p in paths_for(names)}
    assert not need - set(deps), f"stage {name}: dvc.yaml deps lack the behaviour files {sorted(need - set(deps))}"
    listed = {d for d in deps if d.startswith(BEHAVIOUR_PREFIX)}
    unknown = sorted(d for d in listed if d[len(BEHAVIOUR_PREFIX):-len(".json")] not in PATHS)
    assert not unknown, f"stage {name}: behaviour files no path writes: {unknown}"
    assert listed == need, f"stage {name}: behaviour files its code does not use: {sorted(listed - need)}"


def test_every_library_name_a_stage_uses_has_a_behaviour_path():
    """A hideseek name a stage's code calls must map to the paths that fingerprint it (or come from a
    module that does, e.g. ``open_clip_finetune``'s constants); a new one fails here, naming it."""
    from companion.behaviour import USES

    for name, stage in STAGES.items():
        if name == "behaviour":
            continue
        files, names, notebooks = stage_scan(stage)
        modules = {"curvature", "geometry", "gl", "metrics", "measures", "problem", "solvers", "apgd", "symmetries",
                   "utils", "relative_flatness", "open_clip_finetune", "optim", "sharpness", "zoo"}
        clip = {"CheckpointError", "ClipClassifier", "NUM_CLASSES", "VIT_B32", "build_clip_classifier",
                "infer_vision_config", "load_clip_finetune", "split_state_dict"}
        unmapped = sorted(n for n in names - set(USES) - modules if not (n in clip and "open_clip_finetune" in names))
        assert not unmapped, (f"stage {name}: hideseek names {unmapped} have no behaviour path; add them to "
                              f"companion.behaviour.USES (and a path that computes their numbers)")


def test_the_scanner_follows_relative_and_package_imports():
    assert "companion.assets.__main__" in stage_sources({"cmd": "python -m companion.assets check"})[0]
    wrapped = stage_sources({"cmd": "python -m companion.skipped language -- python -m companion.pipeline language"})
    assert wrapped == ({"companion.skipped", "companion.pipeline"}, [ROOT / "notebooks" / "language.ipynb"])
    # companion.assets.__main__ imports .manifest relatively; hideseek's __init__ pulls in its subpackages
    files = {str(f.relative_to(ROOT)) for f in closure({"companion.assets.__main__"})}
    assert "companion/assets/manifest.py" in files and "companion/assets/__init__.py" in files
    assert "companion/__init__.py" in files
    nb = [ast.parse("from hideseek.utils import set_threads\nimport companion.experiments.zoo as z")]
    got = {str(f.relative_to(ROOT)) for f in closure(set(), nb)}
    assert {"hideseek/utils.py", "hideseek/__init__.py", "companion/experiments/zoo.py"} <= got
    assert not covered(ROOT / "hideseek/utils.py", ["hideseek/geometry", "hideseek/util"])
    assert covered(ROOT / "hideseek/geometry/gl.py", ["hideseek/geometry"])


def test_dvc_metrics_show_fits_a_100_column_terminal():
    """Only the small headlines are DVC metrics, so the table stays readable."""
    import shutil
    import subprocess
    import sys

    dvc = shutil.which("dvc") or str(Path(sys.executable).parent / "dvc")
    if not Path(dvc).exists():
        pytest.skip("dvc not installed")
    declared = [next(iter(m)) if isinstance(m, dict) else m
                for st in STAGES.values() for m in st.get("metrics", [])]
    assert declared and all(m.startswith("reports/headline/") for m in declared), declared
    out = subprocess.run([dvc, "metrics", "show"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 1 + len(declared), out.stdout  # header + one row per headline file
    assert max(map(len, lines)) <= 100, out.stdout
