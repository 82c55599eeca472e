"""The pipeline depends on the library's behaviour, not its source (companion/behaviour.py, dvc.yaml).

In a copy of the checkout: a comment appended to every library module leaves every behaviour file
byte-identical and ``dvc status`` unchanged; an edit that moves one value (relative flatness scaled)
changes exactly that path's file, and ``dvc status`` newly lists exactly the stages that depend on it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import ROOT
from companion.params import load_yaml

pytestmark = pytest.mark.slow


def _run(args, cwd, **kw):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONHASHSEED": "0",
           "PYTHONPATH": str(cwd)}
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, **kw)
    assert out.returncode == 0, f"{args}: {out.stderr[-2000:]}"
    return out.stdout


def _dvc() -> str:
    dvc = shutil.which("dvc") or str(Path(sys.executable).parent / "dvc")
    if not Path(dvc).exists():
        pytest.skip("dvc not installed")
    return dvc


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    """The checkout's tracked and untracked-not-ignored files, as a git repository of its own."""
    dst = tmp_path_factory.mktemp("checkout")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)
    for args in (["git", "init", "-q"], ["git", "add", "-A"],
                 ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "copy"]):
        subprocess.run(args, cwd=dst, check=True, capture_output=True)
    return dst


def _status(copy: Path) -> set[tuple[str, str, str]]:
    """``dvc status`` as (stage, kind of change, path) entries; the behaviour stage (always run, its
    files are what the other stages compare) left out."""
    raw = json.loads(_run([_dvc(), "status", "--json"], copy))
    entries = set()
    for stage, changes in raw.items():
        if stage == "behaviour":
            continue
        for ch in changes:
            if isinstance(ch, dict):
                for kind, paths in ch.items():
                    for path, how in (paths.items() if isinstance(paths, dict) else []):
                        entries.add((stage, f"{kind}:{how}", path))
    return entries


def _write_behaviour(copy: Path) -> dict[str, bytes]:
    _run([sys.executable, "-m", "companion.behaviour", "write", "--out", "reports/behaviour", "--quiet"], copy)
    return {p.name: p.read_bytes() for p in sorted((copy / "reports/behaviour").glob("*.json"))}


@pytest.fixture(scope="module")
def fresh(copy) -> dict[str, bytes]:
    """The behaviour files the unchanged copy writes (written once for both tests: each write is a
    process that imports torch and computes every path, several seconds)."""
    return _write_behaviour(copy)


def test_the_committed_behaviour_files_are_the_librarys_current_numbers(fresh):
    """What dvc.lock recorded for the behaviour files is what the library gives now: a value change
    that was not followed by `dvc repro` would show here."""
    before = {p.name: p.read_bytes() for p in sorted((ROOT / "reports/behaviour").glob("*.json"))}
    assert before, "reports/behaviour/ is empty: run `dvc repro behaviour`"
    changed = sorted(k for k in fresh if fresh[k] != before.get(k))
    assert not changed, f"the library's behaviour moved on {changed}: run `dvc repro` (never re-lock by hand)"


def test_a_comment_changes_no_stage_and_a_value_change_exactly_its_stages(copy, fresh):
    files0 = fresh   # what the unchanged copy writes (the fixture ran before anything below changed it)
    assert {p.name: p.read_bytes() for p in sorted((copy / "reports/behaviour").glob("*.json"))} == files0
    status0 = _status(copy)

    modules = sorted((copy / "hideseek").rglob("*.py"))
    assert len(modules) > 20
    for m in modules:
        with m.open("a") as fh:
            fh.write("\n# a comment: moves no value\n")
    assert _write_behaviour(copy) == files0
    assert _status(copy) == status0

    with (copy / "hideseek/relative_flatness.py").open("a") as fh:
        fh.write("\n_measured = relative_flatness\n\n\ndef relative_flatness(*args, **kwargs):\n"
                 "    import dataclasses\n    res = _measured(*args, **kwargs)\n"
                 "    return dataclasses.replace(res, value=1.5 * res.value)\n")
    files1 = _write_behaviour(copy)
    assert sorted(k for k in files1 if files1[k] != files0[k]) == ["relative_flatness.json"]
    status1 = _status(copy)
    new = status1 - status0
    dep = "reports/behaviour/relative_flatness.json"
    stages = load_yaml((copy / "dvc.yaml").read_text())["stages"]
    users = {s for s, st in stages.items() if dep in st.get("deps", [])}
    assert users and users != set(stages) - {"behaviour"}
    assert {s for s, _, _ in new} <= users and {p for _, _, p in new} <= {dep}
    # every user whose lock was current before now lists the file as modified
    already = {s for s, _, p in status0 if p == dep}
    assert {s for s, _, _ in new} == users - already
