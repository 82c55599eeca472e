"""companion.experiments.crossfit: two-fold cross-fitting of rho, checked by hand with scipy."""
import numpy as np
import pandas as pd
import pytest
from scipy import stats

from companion.experiments.crossfit import crossfit_taus, table1_entry


def _frame(seed=0, n=16):
    rng = np.random.default_rng(seed)
    names = [f"m{i:02d}" for i in range(n)]
    gap = pd.Series(rng.normal(size=n), index=names)
    rows = []
    for i, name in enumerate(names):
        rows.append(dict(model=name, measure="s", rho=0.1, value=gap.iloc[i] + rng.normal()))        # weak
        rows.append(dict(model=name, measure="s", rho=0.2, value=gap.iloc[i] + 0.2 * rng.normal()))  # strong
        rows.append(dict(model=name, measure="s", rho=0.4, value=rng.normal()))                      # noise
    return pd.DataFrame(rows), gap, names


def test_crossfit_by_hand():
    frame, gap, names = _frame()
    halves = {"select": names[::2], "eval": names[1::2]}
    cf = crossfit_taus(frame, gap, halves, n_boot=200, seed=1)
    r = cf.iloc[0]

    def tau(models, rho):
        v = frame[(frame.rho == rho)].set_index("model")["value"]
        return stats.kendalltau(v.loc[models], gap.loc[models]).statistic

    rho_a = max((0.1, 0.2, 0.4), key=lambda x: abs(tau(halves["select"], x)))
    rho_b = max((0.1, 0.2, 0.4), key=lambda x: abs(tau(halves["eval"], x)))
    assert (r.rho_a, r.rho_b) == (rho_a, rho_b)
    assert r.tau_b == pytest.approx(tau(halves["eval"], rho_a)) and r.tau_a == pytest.approx(tau(halves["select"], rho_b))
    assert r.tau == pytest.approx((r.tau_a + r.tau_b) / 2) and r.n == 16
    assert r.ci_low <= r.tau <= r.ci_high
    entry = table1_entry("vision", cf, 16)
    assert entry["tau"] == {"s": r.tau} and entry["ci"]["s"] == [r.ci_low, r.ci_high] and entry["n_models"] == 16


def test_crossfit_refuses_overlapping_halves_and_bad_criterion():
    frame, gap, names = _frame()
    with pytest.raises(ValueError, match="share models"):
        crossfit_taus(frame, gap, {"select": names[:9], "eval": names[8:]}, n_boot=0, seed=0)
    with pytest.raises(ValueError, match="criterion"):
        crossfit_taus(frame, gap, {"select": names[:8], "eval": names[8:]}, n_boot=0, seed=0, criterion="best")


def test_crossfit_is_nan_where_a_half_cannot_choose():
    frame, gap, names = _frame()
    gap.loc[names[8:]] = 1.0   # constant gap on half B: tau undefined at every radius there
    cf = crossfit_taus(frame, gap, {"select": names[:8], "eval": names[8:]}, n_boot=10, seed=0)
    assert cf["rho_b"].isna().all() and cf["tau"].isna().all() and cf["ci_low"].isna().all()
