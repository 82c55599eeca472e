"""`dvc plots show` renders every plot dvc.yaml declares from the committed report data."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import ROOT
from companion.params import load_yaml

DVC = Path(sys.executable).parent / "dvc"


def declared() -> dict:
    plots = load_yaml((ROOT / "dvc.yaml").read_text()).get("plots") or []
    return {k: v for p in plots for k, v in p.items()}


def not_run(spec: dict) -> bool:
    """Whether the plot's data folder is one of a stage the committed profile does not run (it holds only the
    record companion.skipped writes, e.g. the 144 k-parameter BERT zoo's in the cpu profile)."""
    from companion.skipped import MARKER

    paths = [p for axis in ("x", "y") if isinstance(spec[axis], dict) for p in spec[axis]]
    skipped = [(ROOT / p).parent.joinpath(MARKER).is_file() for p in paths]
    assert len(set(skipped)) <= 1, f"a plot reads a skipped and a run stage: {paths}"
    return bool(skipped) and skipped[0]


def test_every_declared_plot_reads_a_committed_file_with_its_columns():
    import pandas as pd

    assert declared(), "dvc.yaml declares no plots"
    assert any(not not_run(spec) for spec in declared().values())
    for name, spec in declared().items():
        if not_run(spec):
            continue
        for axis in ("x", "y"):
            refs = spec[axis] if isinstance(spec[axis], dict) else {}
            for path, cols in refs.items():
                frame = pd.read_csv(ROOT / path)
                cols = cols if isinstance(cols, list) else [cols]
                assert set(cols) <= set(frame.columns) and len(frame), (name, path, cols)
        if isinstance(spec["x"], str):
            assert all(spec["x"] in pd.read_csv(ROOT / p).columns for p in spec["y"]), name


@pytest.mark.slow
def test_dvc_plots_show_renders_them(tmp_path):
    dvc = str(DVC) if DVC.exists() else shutil.which("dvc")
    if dvc is None:
        pytest.skip("dvc is not installed")
    res = subprocess.run([dvc, "plots", "show", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)["data"]
    for name, spec in declared().items():
        if not_run(spec):
            continue
        values = [v for part in data[name] for v in part["content"]["data"]["values"]]
        assert values, f"dvc plots show rendered no points for {name}"
