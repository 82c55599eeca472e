"""notebooks/ablations.ipynb executed by the pipeline (papermill) on a tiny MiniLM zoo fine-tuned here from a stand-in
BERT saved in the layout of the MiniLM wheel, after the minilm stage published its tables for that zoo: the stage reads
them, measures the ablations on the chosen batches, draws Figures 5, 7, 8, 9 and the camera-ready language figures,
and its values are recomputed here independently."""
import json

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats

import hideseek as hs
from companion.experiments import minilm_zoo as mz
from companion.pipeline import run_stage
from tests.companion.minilm_standin import standin_zoo

RHO = {"adaptive": 0.1, "geodesic_invariant": 0.05, "geodesic_mixed": 0.02}


@pytest.mark.slow
def test_ablations_notebook_runs_and_publishes(tmp_path, monkeypatch):
    zoo = standin_zoo(tmp_path, monkeypatch)
    reports = tmp_path / "reports"
    run_stage("minilm", reports_dir=reports, progress_bar=False, params=dict(
        zoo_dir=str(zoo), device="cpu", threads=1, workers=1, n_points=16, batch_size=4, data_seed=0, n_iters=1, seed=0,
        rho=RHO, eps=0.0, max_train_error=0.3, n_boot=50, gap_splits=10, power_alpha=0.05, power_n_sim=20,
        paired=dict(n_boot=100, seed=24, confidence=0.95, power_n_sim=5, power_n_boot=20, retest_splits=10),
        cpu_kernels=None))
    params = {"rows": {"minilm": {"row": "language", "stage": "minilm", "zoo": str(zoo), "batches": [0, 2],
                                  "variants": ["no_christoffel", "christoffel_only"], "eps_grid": [0.1], "reason": ""},
                       "vision": {"row": "vision", "stage": "vision", "zoo": None, "batches": [0, 1],
                                  "variants": ["no_christoffel"], "eps_grid": [], "reason": "not computed: no zoo here"}},
              "metrics": ["invariant", "mixed"], "eps_metric": "invariant",
              "language": {"stage": "minilm", "zoo": str(zoo), "relative_flatness_layer": "classifier.weight",
                           "orbit": {"model": None, "batch": 0, "scales": [0.1, 10.0], "action_seed": 0,
                                     "dtype": "float64"}, "reason": ""},
              "n_boot": 100, "seed": 24, "confidence": 0.95, "retest_splits": {"n_splits": 10, "seed": 24},
              "check_rtol": 1e-5, "metrics_dir": str(reports / "metrics"), "data_dir": str(reports / "data"),
              "workers": 1, "threads": 1, "budget_minutes": 20,
              "cpu_kernels": None}
    res = run_stage("ablations", params=params, reports_dir=reports, progress_bar=False)
    assert {p.name for p in res.figures} >= {"fig7_minilm.png", "fig8_minilm.png", "fig9_eps.png", "fig5_language.png",
                                             "relative_flatness.png", "orbit_invariance.png"}
    metrics = json.loads(res.metrics.read_text())
    assert metrics["published_check_max_rel_diff"]["minilm"] <= 1e-5
    lines = [e for e in metrics["table1_lines"] if e["name"] == "minilm"]
    assert [e["status"] for e in lines] == ["computed"] * 3
    # recompute one ablation value and its τ / Δ against the full measure, independently
    members = pd.read_csv(reports / "data" / "ablations" / "minilm" / "members.csv", index_col=0)
    src = mz.MiniLMZoo(zoo)
    b = src.sharpness_batches(16, 4, 0)
    torch.manual_seed(0)
    ref = hs.sharpness(mz.load_member(zoo, "model_001"), [b[0], b[2]], hs.Measure(metric="mixed", ball="adaptive"),
                       rho=RHO["adaptive"], n_iters=1, seed=0, progress=False).value
    assert members.loc["model_001", "christoffel_only_mixed"] == pytest.approx(ref, rel=1e-6)
    pub = pd.read_csv(reports / "data" / "minilm" / "sharpness.csv")
    full = pub[pub.measure == "geodesic_mixed"].set_index("model").loc[members.index, "per_batch"]
    full = np.array([np.mean(np.array(json.loads(p))[[0, 2]]) for p in full])
    assert np.allclose(members["geodesic_mixed"], full, rtol=1e-12)
    gap = members["gap"].to_numpy()
    noc = next(e for e in lines if "no Christoffel" in e["variant"])
    d = stats.kendalltau(members["no_christoffel_mixed"], gap).statistic - stats.kendalltau(full, gap).statistic
    assert noc["delta_tau"]["geodesic_mixed"] == pytest.approx(d, nan_ok=True)
    assert any(f.startswith("vision: not computed: no zoo here") for f in metrics["findings"])
    orbit = pd.read_csv(reports / "data" / "ablations" / "language" / "orbit.csv")
    geo = orbit[orbit.measure.str.startswith("geodesic")]
    assert np.allclose(geo.ratio, 1, rtol=1e-6) and "seconds" not in orbit
