"""Every override the docs document works as typed: each `dvc exp run` line of docs/profiles.md's
"Changing a parameter" block is run with --dry in a throw-away git copy of the working tree."""
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import ROOT

DVC = str(Path(sys.executable).parent / "dvc") if (Path(sys.executable).parent / "dvc").exists() else shutil.which("dvc") or "dvc"
#: stages that need a zoo `make repro` trains and caches (absent from a fresh copy)
NEEDS_ZOO = {"vision", "language", "language_stability", "ablations"}


def documented_commands() -> list[str]:
    text = (ROOT / "docs" / "profiles.md").read_text()
    section = text.split("### Changing a parameter", 1)[1]
    block = re.search(r"```\n(.*?)```", section, re.S).group(1)
    cmds = [ln.strip() for ln in block.splitlines() if ln.strip().startswith("dvc exp run")]
    assert cmds, "docs/profiles.md documents no override"
    return cmds


@pytest.fixture(scope="module")
def repo_copy(tmp_path_factory):
    if shutil.which(DVC) is None:
        pytest.skip("dvc is not installed")
    dst = tmp_path_factory.mktemp("repo")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dst / f)
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(git + ["init", "-q"], cwd=dst, check=True)
    subprocess.run(git + ["add", "-A"], cwd=dst, check=True)
    subprocess.run(git + ["commit", "-qm", "copy"], cwd=dst, check=True)
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("cmd", documented_commands())
def test_documented_override_runs_dry(cmd, repo_copy):
    args = shlex.split(cmd)
    stage = args[-1]
    res = subprocess.run([DVC, *args[1:3], "--dry", *args[3:]], cwd=repo_copy, capture_output=True, text=True,
                         timeout=600)
    out = res.stdout + res.stderr
    assert "Could not override" not in out and "Invalid `--set-param`" not in out, out
    if stage in NEEDS_ZOO and res.returncode != 0:
        assert "data/zoos/" in out, out       # the override applied; only the untrained zoo is missing
    else:
        assert res.returncode == 0, out
        assert f"Running stage '{stage}'" in out, out


@pytest.mark.slow
def test_plain_override_of_an_unstated_profile_key_is_refused_by_dvc(repo_copy):
    """Why docs/profiles.md documents `++`: DVC cannot override a key an empty profile section lacks."""
    res = subprocess.run([DVC, "exp", "run", "--dry", "-S", "toy.cpu.n_grid=100", "toy"], cwd=repo_copy,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode != 0 and "Could not override" in res.stdout + res.stderr
