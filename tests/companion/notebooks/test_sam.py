"""notebooks/sam.ipynb executed by the pipeline (papermill) with tiny parameters; the published
numbers re-derived from the published tables."""
import json

import numpy as np
import pandas as pd
import pytest

from companion.experiments.sam import results_markdown
from companion.pipeline import run_stage

#: a tiny glyph stand-in (overrides of the cpu profile's vision_train settings)
VISION = ["data.n_train=192", "data.n_test=200", "data.spec.image_size=8", "data.spec.render=16", "model.width=8",
          "model.heads=2", "model.embed_dim=8", "model.patch_size=4", "model.layers=1", "pretrain.epochs=1",
          "pretrain.batch_size=64"]
TINY = dict(
    seed=0, vision_profile=None, vision_overrides=VISION, n_val=64, threads=1,
    steps=3, batch_size=32, lr=2e-3, weight_decay=0.01, seeds=[0, 1],
    rho_grid=dict(sam=[0.01, 0.1], asam=[0.5], geodesic_invariant=[0.1], geodesic_mixed=[0.05, 0.1]),
    selection="min_mean_val_error",
    sharpness=dict(measures=dict(geodesic_invariant=0.1, geodesic_mixed=0.1), n_images=16, n_iters=1),
    n_boot=100, cpu_kernels=None)   # the processor's own kernels (the pinned path: tests/companion/test_kernels.py)


@pytest.mark.slow
def test_sam_notebook_runs_and_publishes(tmp_path):
    reports = tmp_path / "reports"
    res = run_stage("sam", params=TINY, reports_dir=reports, progress_bar=False)
    assert {p.name for p in res.figures} == {"sam.png", "sam.pdf"}
    metrics = json.loads(res.metrics.read_text())
    data = reports / "data" / "sam"
    runs = pd.read_csv(data / "runs.csv")
    chosen = pd.read_csv(data / "chosen_runs.csv")
    assert len(runs) == 2 * (1 + 2 + 1 + 1 + 2)
    # the selection rule, re-applied by hand: lowest mean validation error, ties to the smaller rho
    for method, grid in dict(adamw=[0.0], **TINY["rho_grid"]).items():
        means = {r: runs[(runs.method == method) & (runs.rho == r)].val_error.mean() for r in grid}
        best = min(means.values())
        assert metrics["chosen_rho"][method] == min(r for r, v in means.items() if v == best)
        m = metrics["methods"][method]
        at = chosen[chosen.method == method]
        assert list(at.rho.unique()) == [metrics["chosen_rho"][method]] and len(at) == 2
        assert m["test_error"] == pytest.approx(at.test_error.mean())
        assert m["test_ci"][0] <= m["test_error"] + 1e-9 and m["test_error"] - 1e-9 <= m["test_ci"][1]
        assert m["diff_vs_adamw"] == pytest.approx(metrics["methods"]["adamw"]["test_error"] - m["test_error"])
        assert m["sharpness"]["geodesic_invariant"] == pytest.approx(at.geodesic_invariant.mean())
    assert metrics["methods"]["adamw"]["diff_ci"] == [0.0, 0.0]
    timings = json.loads((reports / "timings" / "sam.json").read_text())   # git only: no DVC output holds a time
    assert set(timings["step_vs_sam"]) == set(metrics["methods"]) and timings["step_vs_sam"]["sam"] == 1.0
    assert np.isfinite(list(timings["per_step"].values())).all() and "seconds" not in metrics
    assert "AdamW alone reaches a test error of" in metrics["findings"]
    assert metrics["protocol"]["n_train"] + metrics["protocol"]["n_val"] == 192
    assert metrics["protocol"]["n_test"] == 200 and metrics["protocol"]["vision_train"]["model"]["width"] == 8
    assert "seconds_per_step" not in runs and "step_vs_sam" not in pd.read_csv(data / "summary.csv")
    table = results_markdown(metrics, timings).splitlines()
    assert len(table) == 2 + 5 and table[3].startswith("| SAM | ")
