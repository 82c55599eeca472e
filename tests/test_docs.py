"""The documentation stays true to the code.

* Every ``hideseek.…`` / ``companion.…`` dotted name written in backticks in ``docs/*.md``
  (inline code or fenced blocks; ``hs.`` counts as ``hideseek.``) resolves by import and
  attribute access.
* Every ``tests/…py::test_name`` that ``docs/*.md`` cites exists (a ``::test_name`` right
  after a cited file refers to that file).
* Every ``docs/maths.md §k`` cited anywhere in the code names a section that exists.
"""
from __future__ import annotations

import dataclasses
import importlib
import re

import pytest

from tests import ROOT

DOCS = sorted((ROOT / "docs").glob("*.md"))
CODE_DIRS = ("hideseek", "companion", "tests", "benchmarks", "notebooks")

_FENCE = re.compile(r"```.*?```", re.S)
_INLINE = re.compile(r"`([^`\n]+)`")
_DOTTED = re.compile(r"(?<![\w.])(hideseek|companion|hs)((?:\.[A-Za-z_]\w*)+)")
_TEST_REF = re.compile(r"(tests/[\w/]+\.py)?::(test_\w+)")
_MATHS_REF = re.compile(r"docs/maths\.md`*,?\s*§\s*(\d+(?:\.\d+)?)(?:\s*[–-]\s*(\d+(?:\.\d+)?))?")
_HEADING = re.compile(r"^#{2,3}\s+(\d+(?:\.\d+)?)\.?\s", re.M)


def _code_spans(text: str) -> list[str]:
    spans = _FENCE.findall(text)
    spans += _INLINE.findall(_FENCE.sub("", text))
    return spans


def dotted_names(text: str) -> set[str]:
    names = set()
    for span in _code_spans(text):
        for root, rest in _DOTTED.findall(span):
            names.add(("hideseek" if root == "hs" else root) + rest)
    return names


def resolve(name: str) -> None:
    """Import the longest importable module prefix of ``name``, then getattr the rest.
    A dataclass field without a default counts as an attribute of its class."""
    parts = name.split(".")
    obj, i = None, len(parts)
    while i > 0:
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ModuleNotFoundError as err:
            if err.name is None or not ".".join(parts[:i]).startswith(err.name):
                raise
            i -= 1
    if obj is None:
        raise AssertionError(f"{name}: no importable module prefix")
    for attr in parts[i:]:
        if hasattr(obj, attr):
            obj = getattr(obj, attr)
        elif dataclasses.is_dataclass(obj) and attr in {f.name for f in dataclasses.fields(obj)}:
            return
        else:
            raise AssertionError(f"{name}: {obj!r} has no attribute {attr!r}")


def test_resolver_rejects_what_does_not_exist():
    resolve("hideseek.geometry.gl.PairGeometry.project")
    resolve("hideseek.SharpnessResult.per_batch")       # dataclass field
    for bad in ("hideseek.geometry.adaptive_nonexistent", "hideseek.PairGeometry.nope",
                "companion.experiments.nothing_here"):
        with pytest.raises((AssertionError, ModuleNotFoundError)):
            resolve(bad)
    assert dotted_names("see `hs.sharpness(...)` and\n```python\nhideseek.find_symmetries(m)\n```") \
        == {"hideseek.sharpness", "hideseek.find_symmetries"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_dotted_names_in_docs_resolve(doc):
    bad = []
    for name in sorted(dotted_names(doc.read_text(encoding="utf-8"))):
        try:
            resolve(name)
        except (AssertionError, ImportError) as err:
            bad.append(f"{name} ({err})")
    assert not bad, f"{doc.name} names things that do not exist:\n  " + "\n  ".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_cited_tests_exist(doc):
    bad, current = [], None
    for path, test in _TEST_REF.findall(doc.read_text(encoding="utf-8")):
        current = path or current
        if current is None:
            bad.append(f"::{test} (no file before it)")
            continue
        file = ROOT / current
        if not file.is_file():
            bad.append(f"{current} (no such file)")
        elif not re.search(rf"^\s*def {test}\(", file.read_text(encoding="utf-8"), re.M):
            bad.append(f"{current}::{test}")
    assert not bad, f"{doc.name} cites tests that do not exist:\n  " + "\n  ".join(bad)


def test_maths_citations_in_code_name_existing_sections():
    maths = ROOT / "docs" / "maths.md"
    sections = set(_HEADING.findall(maths.read_text(encoding="utf-8")))
    assert {"1", "13"} <= sections
    bad = []
    for d in CODE_DIRS:
        for f in sorted((ROOT / d).rglob("*")):
            if f.suffix not in (".py", ".ipynb", ".md") or not f.is_file():
                continue
            for m in _MATHS_REF.finditer(f.read_text(encoding="utf-8", errors="replace")):
                for sec in filter(None, m.groups()):
                    if sec not in sections:
                        bad.append(f"{f.relative_to(ROOT)}: §{sec}")
    assert not bad, "citations of missing docs/maths.md sections:\n  " + "\n  ".join(bad)


def test_architecture_lists_every_module():
    """docs/architecture.md's module map names every module of both packages."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = [str(f.relative_to(ROOT)) for pkg in ("hideseek", "companion")
               for f in sorted((ROOT / pkg).rglob("*.py"))
               if f"`{f.relative_to(ROOT).as_posix()}`" not in text]
    assert not missing, "docs/architecture.md does not list these modules:\n  " + "\n  ".join(missing)


def test_architecture_diffs_apply():
    """The ```diff blocks of docs/architecture.md ("What an addition touches") still apply to this
    checkout (``git apply --check``: nothing is written)."""
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout")
    blocks = re.findall(r"```diff\n(.*?)```", (ROOT / "docs" / "architecture.md").read_text(), re.S)
    assert len(blocks) >= 2
    for i, block in enumerate(blocks):
        with tempfile.NamedTemporaryFile("w", suffix=".diff", delete=False) as f:
            f.write(block)
        try:
            res = subprocess.run(["git", "apply", "--check", f.name], cwd=ROOT, capture_output=True, text=True)
        finally:
            Path(f.name).unlink()
        assert res.returncode == 0, f"diff {i} of docs/architecture.md no longer applies: {res.stderr}"
