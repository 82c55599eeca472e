"""The library is thin: it never imports the paper companion, and its declared hard
dependencies are torch and numpy only."""
import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests import ROOT


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def test_library_source_never_imports_the_companion():
    offenders = {str(p.relative_to(ROOT)): sorted(m for m in _imported_modules(p)
                                                   if m.split(".")[0] in {"companion", "benchmarks", "tests"})
                 for p in (ROOT / "hideseek").rglob("*.py")}
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"the library imports paper-companion code: {offenders}"


@pytest.mark.slow
def test_importing_the_library_loads_no_companion_or_heavy_optional_module():
    code = ("import sys, hideseek, hideseek.cli; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('companion', 'transformers', 'open_clip', 'dvc', 'papermill', 'yaml', 'pandas', 'matplotlib')); "
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import hideseek pulled in {out.stdout.strip()}"


def test_library_hard_dependencies_are_torch_and_numpy_with_ranges():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = meta["dependencies"]
    names = sorted(d.split(">")[0].split("<")[0].split("=")[0].strip() for d in deps)
    assert names == ["numpy", "torch"], deps
    assert not any("==" in d for d in deps), f"the library pins exact versions: {deps}"
    assert {"hf", "open_clip"} <= set(meta["optional-dependencies"])
    assert meta["name"] == "hideseek"


def test_companion_is_its_own_distribution():
    meta = tomllib.loads((ROOT / "companion" / "pyproject.toml").read_text())["project"]
    assert meta["name"] != "hideseek" and "hideseek" in meta["dependencies"]


def test_version_is_declared_once_consistently():
    import hideseek
    assert hideseek.__version__ == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
