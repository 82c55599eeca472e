"""The MiniLM stage's paired Δτ and retest (companion.experiments.minilm_report), against scipy."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from companion.experiments import minilm_report as mr


def test_paired_delta_matches_a_scipy_bootstrap():
    rng = np.random.default_rng(1)
    gap = rng.normal(size=15)
    a = 0.2 * gap + rng.normal(size=15)
    g = 0.8 * gap + rng.normal(size=15)
    out = mr.paired_delta(a, g, gap, sign=-1.0, n_boot=300, seed=5, confidence=0.9)
    tau = lambda x, y: stats.kendalltau(x, y).statistic  # noqa: E731
    assert out["delta"] == pytest.approx(-(tau(g, gap) - tau(a, gap)))
    idx = np.random.default_rng(5).integers(0, 15, (300, 15))
    boots = np.array([-(tau(g[i], gap[i]) - tau(a[i], gap[i])) for i in idx])
    boots = boots[np.isfinite(boots)]
    assert out["n_boot_kept"] == boots.size
    assert [out["ci_low"], out["ci_high"]] == pytest.approx(list(np.quantile(boots, [0.05, 0.95])))
    with pytest.raises(ValueError, match="aligned"):
        mr.paired_delta(a[:3], g, gap, sign=1.0, n_boot=10, seed=0, confidence=0.95)


def test_retest_splits_is_the_mean_over_random_halves():
    rng = np.random.default_rng(2)
    vals = rng.random((6, 4))
    frame = pd.DataFrame([dict(model=f"m{i}", measure=m, per_batch=list(vals[i] + k)) for k, m in
                          enumerate(("adaptive", "geodesic_invariant", "geodesic_mixed")) for i in range(6)])
    names = [f"m{i}" for i in range(6)]
    out = mr.retest_splits(frame, names, n_splits=7, seed=3)
    rng = np.random.default_rng(3)
    perms = [rng.permutation(4) for _ in range(7)]
    ref = np.mean([stats.kendalltau(vals[:, p[:2]].mean(1), vals[:, p[2:]].mean(1)).statistic for p in perms])
    assert out["adaptive"] == pytest.approx(ref)
    assert json.dumps(out)   # plain floats
