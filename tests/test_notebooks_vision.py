"""notebooks/vision.ipynb executed by the pipeline (papermill) on a tiny zoo trained here."""
import json

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from companion.experiments import vision_zoo as vz
from companion.pipeline import run_stage

TRAIN = dict(
    seed=0, split_seed=0, n_test=497, n_sharpness=16, n_models=6, threads=1,
    model=dict(width=8, layers=1, heads=2, patch_size=4, mlp_ratio=2.0, embed_dim=8, logit_scale=5.0),
    pretrain=dict(objective="contrastive", epochs=1, lr=3e-3, weight_decay=0.01, batch_size=256),
    ranges=dict(lr=[1e-3, 1e-2], weight_decay=[1e-3, 0.1], epochs=[1, 2], batch_size=[256], label_smoothing=[0.0, 0.1],
                shift=[0, 1], noise_std=[0.0, 0.2], mixup_alpha=[0.1, 0.4], p_mixup=0.5),
    stability=dict(seeds=[1, 2], n_models=4),
)


@pytest.mark.slow
def test_vision_notebook_runs_and_publishes(tmp_path):
    zoo = tmp_path / "zoo"
    vz.train_zoo(zoo, TRAIN, progress=False)
    vz.train_stability(zoo, TRAIN, progress=False)
    params = dict(zoo_dir=str(zoo), n_images=16, batch_size=8, n_iters=1, threads=1,
                  rho_grid=dict(adaptive=[0.1, 0.3], geodesic_invariant=[0.05, 0.1], geodesic_mixed=[0.05]),
                  seed=0, split_seed=0, n_boot=50)
    reports = tmp_path / "reports"
    res = run_stage("vision", params=params, reports_dir=reports, progress_bar=False)
    figs = {p.name for p in res.figures}
    assert {"fig4_vision.png", "fig4_vision.pdf", "vision_tau_vs_rho.png", "vision_zoo.png"} <= figs
    metrics = json.loads(res.metrics.read_text())
    for r in metrics["crossfit"]:   # the split-half's own halves: half B's tau is the table's held-out tau
        assert r["tau_b"] == pytest.approx(metrics["tau"][r["measure"]]["tau"], nan_ok=True)
    # test-retest on the two halves of the sharpness batches, recomputed from the published per-batch values
    rt = {r["measure"]: r for r in metrics["retest"]["taus"]}
    assert set(rt) == set(metrics["tau"])
    sharp = pd.read_csv(reports / "data" / "vision" / "sharpness.csv")
    for m, r in rt.items():
        at = sharp[(sharp.measure == m) & (sharp.rho == metrics["tau"][m]["rho"])]
        pb = np.array([json.loads(v) for v in at["per_batch"]])
        h = pb.shape[1] // 2
        ref = stats.kendalltau(pb[:, :h].mean(1), pb[:, h:].mean(1)).statistic
        assert r["tau"] == pytest.approx(ref, nan_ok=True)
    assert metrics["profile"] == "cpu" and metrics["table1_row"] == "ImageNet"
    assert set(metrics["tau"]) == {"adaptive", "geodesic_invariant", "geodesic_mixed"}
    assert metrics["paper_tau"] == {"adaptive": -0.41, "geodesic_invariant": -0.71, "geodesic_mixed": -0.70}
    assert metrics["zoo"]["n_models"] == 6

    # recompute the reported taus from the published data, independently, with scipy
    data = reports / "data" / "vision"
    sharp = pd.read_csv(data / "sharpness.csv")
    members = pd.read_csv(data / "members.csv", index_col="name")
    assert len(sharp) == 6 * 5
    for measure, t in metrics["tau"].items():
        assert t["rho"] in params["rho_grid"][measure]
        v = sharp[(sharp.measure == measure) & (sharp.rho == t["rho"])].set_index("model")["value"]
        all_tau = stats.kendalltau(v.loc[members.index], members["gap"]).statistic
        assert t["tau_all"] == pytest.approx(all_tau, nan_ok=True) and t["n_all"] == 6 and t["n_eval"] == 3
        per_batch = sharp[sharp.measure == measure]["per_batch"].map(json.loads)
        assert np.allclose(sharp[sharp.measure == measure]["value"], [np.mean(p) for p in per_batch])
    # stability: tau per zoo seed at the chosen rho, recomputed from the published sharpness
    stab = pd.read_csv(data / "stability.csv")
    smem = pd.read_csv(data / "stability_members.csv")
    assert sorted(stab["seed"].unique()) == [1, 2] and len(smem) == 8
    for _, r in stab.iterrows():
        assert r["rho"] == metrics["tau"][r["measure"]]["rho"]  # no selection on the stability zoos
        z = smem[smem.zoo == r["zoo"]]
        assert r["tau"] == pytest.approx(stats.kendalltau(z[f"sharpness_{r['measure']}"], z["gap"]).statistic,
                                         nan_ok=True) and r["n"] == 4
    spread = metrics["table1"][1]["spread"]
    for m in metrics["tau"]:
        t = stab[stab.measure == m]["tau"]
        assert spread[m]["n_zoos"] == 2 and spread[m]["taus"] == pytest.approx(t.tolist(), nan_ok=True)
        if t.notna().all():
            assert spread[m]["mean"] == pytest.approx(t.mean())
    assert set(metrics["stability"]["population"]) == {"zoo_1", "zoo_2"}
    nb = json.loads(res.notebook.read_text())
    assert any("parameters" in c.get("metadata", {}).get("tags", []) for c in nb["cells"])
    # the DVC headline, derived by the pipeline: the held-out entry's tau and model count
    head = json.loads((reports / "headline" / "vision.json").read_text())
    assert head["n"] == 3 and head["tau"] == {m: t["tau"] for m, t in metrics["tau"].items()}
    assert [e["n_models"] for e in head["table1"]] == [3, 6, 6] and "spread" in head["table1"][1]
    # the notebook computes no sharpness itself: it calls the companion once
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert "vision_report.run_report(" in code and "sharpness(" not in code and "measure_vision_zoo" not in code
