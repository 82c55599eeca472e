"""vision_report.gap_clusters: the pre-registered check whether a drawn binary factor splits the gap into clusters."""
import numpy as np
import pandas as pd
import pytest
from scipy import stats

from companion.experiments import vision_report as vr


def _members(seed=0, n=40, shift_effect=0.0):
    rng = np.random.default_rng(seed)
    shift = rng.integers(0, 2, n)
    noise = np.where(rng.uniform(size=n) < 0.5, 0.0, rng.uniform(0.01, 0.2, n))
    gap = rng.normal(0.05, 0.01, n) + shift_effect * shift
    return pd.DataFrame({"gap": gap, "shift": shift, "noise_std": noise, "batch_size": np.full(n, 64)},
                        index=[f"m{i}" for i in range(n)])


def test_auc_is_the_mann_whitney_statistic_and_the_rule_is_symmetric():
    m = _members(shift_effect=0.0)
    m.loc[m.index[:3], "gap"] = m["gap"].iloc[3]           # ties count one half
    got = {c["factor"]: c for c in vr.gap_clusters(m, ["shift", "noise_std > 0", "batch_size"], 0.9)}
    assert set(got) == {"shift", "noise_std > 0"}           # a constant column is not a factor
    for f, col in (("shift", m["shift"] == 1), ("noise_std > 0", m["noise_std"] > 0)):
        hi, lo = m["gap"][col].to_numpy(), m["gap"][~col].to_numpy()
        u = stats.mannwhitneyu(hi, lo, alternative="two-sided").statistic   # independent reference
        assert got[f]["auc"] == pytest.approx(u / (len(hi) * len(lo)), abs=1e-12)
        assert got[f]["n_low"] + got[f]["n_high"] == len(m)
    assert not any(c["splits"] for c in got.values())
    assert "No drawn binary factor splits" in vr.cluster_line(list(got.values()), 0.9)


def test_a_factor_that_separates_the_gap_is_named_either_way_round():
    up = vr.gap_clusters(_members(shift_effect=0.2), ["shift"], 0.9)[0]
    down = vr.gap_clusters(_members(shift_effect=-0.2), ["shift"], 0.9)[0]
    assert up["splits"] and up["auc"] >= 0.9 and down["splits"] and down["auc"] <= 0.1
    assert (up["low"], up["high"]) == ("shift = 0", "shift = 1")
    assert "splits into separate clusters by shift" in vr.cluster_line([up], 0.9)
    assert vr.gap_clusters(_members().drop(columns="shift"), ["shift"], 0.9) == []   # paper zoo: no such column
