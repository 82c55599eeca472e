"""notebooks/minilm.ipynb executed by the pipeline (papermill) on a tiny zoo fine-tuned here from a stand-in BERT
saved in the layout of the MiniLM wheel."""
import json

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from companion.experiments import minilm_zoo as mz
from companion.pipeline import run_stage
from tests.companion.minilm_standin import standin_zoo

RHO = {"adaptive": 0.1, "geodesic_invariant": 0.05, "geodesic_mixed": 0.02}


@pytest.mark.slow
def test_minilm_notebook_runs_and_publishes(tmp_path, monkeypatch):
    zoo = standin_zoo(tmp_path, monkeypatch)
    params = dict(zoo_dir=str(zoo), device="cpu", threads=1, workers=1, n_points=16, batch_size=4, data_seed=0,
                  n_iters=1, seed=0, rho=RHO, eps=0.0, max_train_error=0.3, n_boot=50, gap_splits=10,
                  power_alpha=0.05, power_n_sim=20,
                  paired=dict(n_boot=200, seed=24, confidence=0.95, power_n_sim=10, power_n_boot=50, retest_splits=10),
                  cpu_kernels=None)
    reports = tmp_path / "reports"
    res = run_stage("minilm", params=params, reports_dir=reports, progress_bar=False)
    assert {p.name for p in res.figures} >= {"minilm_zoo.png", "minilm_gap_vs_sharpness.png", "minilm_delta_tau.png"}
    metrics = json.loads(res.metrics.read_text())
    entry = metrics["table1"][0]
    assert entry["row"] == "language" and entry["primary"] is True and entry["n_models"] == 6
    assert entry["setting"] == mz.SETTING.format(n_top=2) and entry["rho"] == RHO
    assert set(entry["delta_tau"]) == {"geodesic_invariant", "geodesic_mixed"} == set(entry["power_delta"])

    # recompute τ and the paired Δτ from the published tables, independently, with scipy
    data = reports / "data" / "minilm"
    sharp = pd.read_csv(data / "sharpness.csv")
    members = pd.read_csv(data / "members.csv", index_col="name")
    assert np.allclose(members["gap"], members["dev_error"] - members["train_error"])
    val = {m: sharp[sharp.measure == m].set_index("model").loc[members.index, "value"].to_numpy() for m in RHO}
    gap = members["gap"].to_numpy()
    tau = {m: stats.kendalltau(v, gap).statistic for m, v in val.items()}
    for m in RHO:
        assert entry["tau"][m] == pytest.approx(tau[m], nan_ok=True)
    sign = np.sign(0.38)   # the paper's MNLI τ are positive
    idx = np.random.default_rng(24).integers(0, 6, (200, 6))
    for g in ("geodesic_invariant", "geodesic_mixed"):
        assert entry["delta_tau"][g] == pytest.approx(sign * (tau[g] - tau["adaptive"]), nan_ok=True)
        boots = np.array([sign * (stats.kendalltau(val[g][i], gap[i]).statistic
                                  - stats.kendalltau(val["adaptive"][i], gap[i]).statistic) for i in idx])
        boots = boots[np.isfinite(boots)]
        assert entry["delta_tau_ci"][g] == pytest.approx(list(np.quantile(boots, [0.025, 0.975])))
    delta = pd.read_csv(data / "delta_tau.csv")
    assert list(delta["measure"]) == ["geodesic_invariant", "geodesic_mixed"]
    assert set(delta["stage"]) == {"minilm"} and set(delta["comparison"]) == {"primary"}   # not the staging folder
    # the line's text comes from zoo.json: a complete zoo holds the pre-registered count, nothing was cut
    assert "all members (the 6 pre-registered)" in entry["variant"] and "finished training" not in entry["variant"]
    assert "seconds" not in sharp and "seconds" not in members
