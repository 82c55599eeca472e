"""notebooks/language.ipynb executed by the pipeline (papermill) on a tiny zoo trained here."""
import json

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from companion.experiments import language_zoo as lz
from companion.pipeline import run_stage

TRAIN = {
    "corpus": {"seed": 2, "n_train": 64, "n_dev": 15, "n_test": 30, "hard_rate": 0.1},
    "model": {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32},
    "pretrain": {"steps": 3, "batch_size": 16},
    "finetune": {"n_models": 6, "epochs": 1.0, "batch_size": 16, "lr": 3e-3},
}


@pytest.mark.slow
def test_language_notebook_runs_and_publishes(tmp_path):
    zoo = tmp_path / "zoo"
    lz.train_zoo(lz.ZooSpec.from_dict(TRAIN), zoo, progress=False)
    grid = [0.05, 0.2]
    params = dict(zoo_dir=str(zoo), n_points=16, batch_size=8, data_seed=0, n_iters=1, seed=0, threads=1,
                  rho_grid={m: grid for m in ("adaptive", "geodesic_invariant", "geodesic_mixed")},
                  ablation_rho_grid={m: [0.1] for m in lz.ABLATION_MEASURES},
                  eps=0.0, eps_grid=[0.0, 0.01], split_seed=0, n_boot=50, criterion="abs",
                  workers=2)  # models measured in 2 spawned processes from inside the papermill kernel
    reports = tmp_path / "reports"
    res = run_stage("language", params=params, reports_dir=reports, progress_bar=False)
    figs = {p.name for p in res.figures}
    assert {"fig5_language.png", "fig5_language.pdf", "language_tau_vs_rho.png", "language_zoo.png",
            "fig7_fig8_ablations.png", "fig9_eps.png", "fig7_tau_vs_rho_invariant.png",
            "fig8_tau_vs_rho_mixed.png"} <= figs
    metrics = json.loads(res.metrics.read_text())
    assert metrics["profile"] == "cpu" and metrics["table1_row"] == "MNLI"
    held_out, whole, crossfit = metrics["table1"][:3]   # held-out half first (the DVC headline), all models, cross-fit
    assert crossfit["variant"].startswith("2-fold cross-fit") and crossfit["n_models"] == 6
    assert held_out["row"] == whole["row"] == "language"
    assert held_out["tau"] == {m: t["tau"] for m, t in metrics["tau"].items()}
    assert whole["tau"] == {m: t["tau_all"] for m, t in metrics["tau"].items()}
    assert (held_out["n_models"], whole["n_models"]) == (3, 6)
    assert set(metrics["tau"]) == {"adaptive", "geodesic_invariant", "geodesic_mixed"}
    assert metrics["paper_tau"] == {"adaptive": 0.06, "geodesic_invariant": 0.28, "geodesic_mixed": 0.38}
    assert set(metrics["ablations"]) == {"geodesic_invariant", "geodesic_mixed", *lz.ABLATION_MEASURES}
    assert metrics["zoo"]["n_models"] == 6
    # cross-fitting: on the split-half's own halves, so half B's tau is the held-out tau of the table
    for r in metrics["crossfit"]:
        assert r["tau_b"] == pytest.approx(metrics["tau"][r["measure"]]["tau"], nan_ok=True)
        assert r["rho_a"] == metrics["tau"][r["measure"]]["rho"]
    assert set(metrics["tau_gap_hans"]) == set(metrics["tau"])
    # test-retest on other pairs: one row per measure, at its chosen rho, over all 6 models
    assert {r["measure"]: (r["rho"], r["n"]) for r in metrics["retest"]} == {
        m: (t["rho"], 6) for m, t in metrics["tau"].items()}
    assert {(r["metric"], r["eps"]) for r in metrics["eps_sweep"]} == {
        (m, e) for m in ("invariant", "mixed") for e in (0.0, 0.01)}

    # recompute the reported taus from the published data, independently, with scipy
    data = reports / "data" / "language"
    sharp = pd.read_csv(data / "sharpness.csv")
    members = pd.read_csv(data / "members.csv", index_col="name")
    assert np.allclose(members["gap"], members["test_error"] - members["train_error"])
    assert len(sharp) == 6 * 3 * len(grid)
    for measure, t in metrics["tau"].items():
        assert t["rho"] in grid
        v = sharp[(sharp.measure == measure) & (sharp.rho == t["rho"])].set_index("model")["value"]
        all_tau = stats.kendalltau(v.loc[members.index], members["gap"]).statistic
        assert t["tau_all"] == pytest.approx(all_tau, nan_ok=True) and t["n_all"] == 6 and t["n_eval"] == 3
        per_batch = sharp[sharp.measure == measure]["per_batch"].map(json.loads)
        assert all(len(p) == 2 for p in per_batch)
        assert np.allclose(sharp[sharp.measure == measure]["value"], [np.mean(p) for p in per_batch])
    # the eps sweep at eps = 0 reuses the main measurement at the chosen rho
    eps = pd.read_csv(data / "eps_sweep.csv")
    for metric in ("invariant", "mixed"):
        rho = metrics["tau"][f"geodesic_{metric}"]["rho"]
        a = eps[(eps.metric == metric) & (eps.eps == 0.0)].set_index("model")["value"]
        b = sharp[(sharp.measure == f"geodesic_{metric}") & (sharp.rho == rho)].set_index("model")["value"]
        assert np.allclose(a.loc[b.index], b)
    nb = json.loads(res.notebook.read_text())
    assert any("parameters" in c.get("metadata", {}).get("tags", []) for c in nb["cells"])
    # the DVC headline, derived by the pipeline
    head = json.loads((reports / "headline" / "language.json").read_text())
    assert head["n"] == 3 and head["tau"] == {m: t["tau"] for m, t in metrics["tau"].items()}
    # the solver check ran in the companion, once per (Christoffel-only measure, rho)
    assert len(metrics["solver_check_christoffel_only"]) == 2
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert "language_report.run_report(" in code and "sharpness(" not in code and "measure_language_zoo" not in code
