"""`dvc plots show` renders every plot dvc.yaml declares from the committed report data."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests import ROOT

DVC = Path(sys.executable).parent / "dvc"


def declared() -> dict:
    plots = yaml.safe_load((ROOT / "dvc.yaml").read_text()).get("plots") or []
    return {k: v for p in plots for k, v in p.items()}


def test_every_declared_plot_reads_a_committed_file_with_its_columns():
    import pandas as pd

    assert declared(), "dvc.yaml declares no plots"
    for name, spec in declared().items():
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
    for name in declared():
        values = [v for part in data[name] for v in part["content"]["data"]["values"]]
        assert values, f"dvc plots show rendered no points for {name}"
