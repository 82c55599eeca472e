"""notebooks/vision.ipynb executed by the pipeline (papermill) on a tiny zoo trained here."""
import json
import math

import nbformat
import numpy as np
import pandas as pd
import pytest
from scipy import stats

from companion.experiments import vision_zoo as vz
from companion.pipeline import REPO_ROOT, run_stage

TRAIN = ["n_models=6", "workers=1", "threads=1", "data.n_train=64", "data.n_test=400", "data.spec.image_size=8",
         "data.spec.render=16", "model.width=8", "model.heads=2", "model.embed_dim=8", "model.patch_size=4",
         "model.layers=1", "pretrain.epochs=1", "pretrain.batch_size=32", "ranges.epochs=[1,3]",
         "ranges.batch_size=[16]", "cpu_kernels=null"]
MEASURES = {"adaptive": "m_apgd_l2", "geodesic_invariant": "geodesic_invariant", "geodesic_mixed": "geodesic_mixed"}


def test_notebook_follows_the_contract():
    nb = nbformat.read(REPO_ROOT / "notebooks" / "vision.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    lines = [ln for c in code for ln in c.source.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert len(lines) <= 150
    assert "parameters" in code[0].metadata.get("tags", [])
    calls = [ln for ln in lines if "vision_report.run_report(" in ln]
    assert len(calls) == 1  # one call computes and writes everything; the rest plots
    assert not any(w in ln for ln in lines for w in ("kendalltau", "hs.sharpness", "measure_zoo", "-0.41", "-0.71"))


@pytest.mark.slow
def test_vision_notebook_runs_and_publishes(tmp_path):
    zoo = tmp_path / "zoo"
    vz.train_zoo(zoo, vz.load_settings("cpu", TRAIN), progress=False)
    params = dict(zoo_dir=str(zoo), n_images=16, batch_size=8, n_iters=1, seed=0, data_seed=0, measures=MEASURES,
                  rho={"adaptive": 0.2, "geodesic_invariant": 0.05, "geodesic_mixed": 0.05},
                  exploratory_rho={"adaptive": [0.1, 0.2], "geodesic_invariant": [0.05], "geodesic_mixed": [0.1]},
                  retest=True, max_train_error=0.5, n_boot=50, n_splits=20,
                  power={"alpha": 0.05, "n_sim": 200, "seed": 0}, workers=1, threads=1, device="cpu", cpu_kernels=None,
                  cluster_factors=["shift", "noise_std > 0"], cluster_auc=0.5)   # 0.5: every factor "splits" (the path
                                                                                     # that colours the figure runs)
    reports = tmp_path / "reports"
    res = run_stage("vision", params=params, reports_dir=reports, progress_bar=False)
    figs = {p.name for p in res.figures}
    assert {"fig4_vision.png", "fig4_vision.pdf", "vision_tau_vs_rho.png", "vision_gap_reliability.png"} <= figs
    metrics = json.loads(res.metrics.read_text())
    assert metrics["gap_clusters"] and all(c["splits"] for c in metrics["gap_clusters"])
    assert any("splits into separate clusters by" in line for line in metrics["findings"])
    entry = metrics["table1"][0]
    assert entry["primary"] is True and entry["exploratory"] is False and entry["n_models"] == 6
    assert set(entry["tau"]) == set(MEASURES) and entry["rho"] == params["rho"]

    # recompute the primary taus and the retest from the published data, independently, with scipy
    data = reports / "data" / "vision"
    sharp = pd.read_csv(data / "sharpness.csv", float_precision="round_trip")
    members = pd.read_csv(data / "members.csv", index_col="name")
    prim = sharp[sharp["set"] == "primary"]
    assert len(prim) == 6 * 3 and "seconds" not in sharp.columns and "train_seconds" not in members.columns
    for m, rho in params["rho"].items():
        at = prim[(prim.measure == m) & (prim.rho == rho)].set_index("model").loc[members.index]
        pb = np.array([json.loads(v) for v in at["per_batch"]])
        assert pb.shape == (6, 4)  # two sets of 2 batches
        first, second = pb[:, :2].mean(1), pb[:, 2:].mean(1)
        assert np.array_equal(at["value"].to_numpy(), first)      # the published value is the one τ uses
        assert np.allclose(at["value_set2"].to_numpy(), second)
        assert entry["tau"][m] == pytest.approx(stats.kendalltau(first, members["gap"]).statistic, nan_ok=True)
        assert entry["retest"][m] == pytest.approx(stats.kendalltau(first, second).statistic, nan_ok=True)
        rel, rt = entry["gap_reliability"], entry["retest"][m]
        if np.isfinite(rel) and np.isfinite(rt):  # the closed-form ceiling
            ref = 2 / math.pi * math.asin(math.sqrt(max(math.sin(math.pi * rt / 2), 0) * max(rel, 0)))
            assert entry["tau_ceiling"][m] == pytest.approx(ref)
    # gap reliability on the whole test set, by hand: split halves with Spearman-Brown, from the saved errors
    meta = json.loads((zoo / "zoo.json").read_text())
    errors = vz.test_errors(zoo, meta)
    assert errors.shape == (6, 400)
    gap = errors.mean(1) - members["train_error"].to_numpy()
    assert np.allclose(gap, members["gap"].to_numpy())
    # findings are generated from the numbers
    text = " ".join(metrics["findings"])
    for m in MEASURES:
        assert f"{entry['tau'][m]:+.2f}" in text
    assert set(pd.read_csv(data / "tau_vs_rho.csv")["measure"]) == set(MEASURES)
