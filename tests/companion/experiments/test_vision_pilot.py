"""companion.experiments.vision_pilot: the pre-registration rules on synthetic pilot data (no training)."""
import numpy as np
import pandas as pd
import pytest
from scipy import stats

from companion.experiments import vision_pilot as vp
from companion.params import settings


def test_choose_rho_takes_the_best_retest_and_ties_go_to_the_smaller_radius():
    assert vp.choose_rho({0.1: 0.5, 0.2: 0.9, 0.4: 0.7}) == 0.2
    assert vp.choose_rho({0.4: 0.8, 0.1: 0.8, 0.2: 0.3}) == 0.1


def _synthetic(p, n_models=12, seed=0):
    """Members with a known gap spread, per-example errors, and sharpness whose retest falls with rho."""
    rng = np.random.default_rng(seed)
    true_err = rng.uniform(0.2, 0.4, n_models)
    errors = (rng.random((n_models, p.n_test)) < true_err[:, None]).astype(np.uint8)
    train = true_err - rng.uniform(0.0, 0.1, n_models)
    meta = {"members": [dict(name=f"model_{i:03d}", train_error=float(train[i]),
                             test_error=float(errors[i].mean()), gap=float(errors[i].mean() - train[i]),
                             hparams={"lr": 1e-3}) for i in range(n_models)]}
    latent = rng.standard_normal(n_models)
    nb = p.n_images // p.batch_size
    rows = []
    for m in p.measures:
        for j, rho in enumerate(p.rho_grid[m.name]):
            noise = 0.2 + 0.6 * j  # larger radii: noisier
            for i in range(n_models):
                pb = list(latent[i] + noise * rng.standard_normal(2 * nb))
                rows.append(dict(model=f"model_{i:03d}", measure=m.name, rho=rho, value=float(np.mean(pb)),
                                 per_batch=pb, base_loss=[0.5] * (2 * nb), seconds=0.1))
    return meta, errors, pd.DataFrame(rows)


def test_summarise_applies_the_rules_checked_with_scipy():
    p = settings(vp.VisionPilot, "vision_pilot", "cpu", ["n_test=2000", "test_sizes=[200,500,2000]",
                                                         "n_images=512", "power.n_sim=200"])
    meta, errors, frame = _synthetic(p)
    r = vp.summarise(p, meta, errors, frame, dict(training=1.0, sharpness=2.0, per_call_mean=0.1, n_calls=len(frame)))
    nb = p.n_images // p.batch_size
    for m in p.measures:  # retest and the chosen radius, recomputed from the frame with scipy
        taus = {}
        for rho, g in frame[frame.measure == m.name].groupby("rho"):
            pb = np.array(list(g["per_batch"]))
            taus[rho] = stats.kendalltau(pb[:, :nb].mean(1), pb[:, nb:].mean(1)).statistic
        best = max(taus.values())
        assert r["chosen"][m.name]["rho"] == min(k for k, v in taus.items() if v >= best - 1e-9)
        assert r["chosen"][m.name]["retest"] == pytest.approx(best)
        assert 0 <= r["chosen"][m.name]["power"] <= 1
    sizes = [c["n_test"] for c in r["reliability"]]
    assert sizes == [200, 500, 2000]
    ok = [c["n_test"] for c in r["reliability"] if c["split_half"] >= p.target_reliability]
    assert r["chosen_n_test"] == (min(ok) if ok else 2000)
    # the larger test set gives the more reliable gap
    assert r["reliability"][-1]["split_half"] > r["reliability"][0]["split_half"]
    md = vp.render_markdown(r)
    for c in r["chosen"].values():
        assert f"{c['retest']:.3f}" in md and f"{c['power']:.3f}" in md
    assert f"**{r['chosen_n_test']}**" in md
