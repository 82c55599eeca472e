"""companion.analysis's paired Δτ (issue 24): against a brute-force scipy computation per resample, and
its properties (swapping the measures flips the sign; identical measures give Δ = 0 with interval [0, 0])."""
import math

import numpy as np
import pytest
from scipy import stats

from companion import analysis as A
from companion import analysis


def _data(n=12, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.standard_normal(n)
    x = y + rng.standard_normal(n)
    base = 0.3 * y + rng.standard_normal(n)
    return x, base, y


def test_resample_counts_are_the_resamples_kendall_draws():
    idx = np.random.default_rng(5).integers(0, 9, size=(40, 9))
    counts = A.resample_counts(9, 40, 5)
    assert counts.shape == (40, 9) and (counts.sum(1) == 9).all()
    for row, c in zip(idx, counts):
        assert np.array_equal(np.bincount(row, minlength=9), c)


def test_tau_resamples_equals_scipy_on_every_resample_with_ties():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 4, 10).astype(float)      # ties inside x and inside y
    y = rng.integers(0, 5, 10).astype(float)
    idx = np.random.default_rng(3).integers(0, 10, size=(60, 10))
    counts = A.resample_counts(10, 60, 3)
    got = A.tau_resamples(x, y, counts)
    for k, row in enumerate(idx):
        ref = stats.kendalltau(x[row], y[row], variant="b").statistic
        if np.isnan(ref):
            assert np.isnan(got[k])
        else:
            assert got[k] == pytest.approx(ref, abs=1e-12)
    # and the same bits as tau_rows, which kendall's intervals use
    assert np.array_equal(got, A.tau_rows(x[idx], y[idx]), equal_nan=True)


def test_paired_delta_tau_against_brute_force_per_resample():
    x, base, y = _data()
    n_boot, seed = 200, 11
    d = A.paired_delta_tau(x, base, y, sign=-1, n_boot=n_boot, seed=seed)
    idx = np.random.default_rng(seed).integers(0, x.size, size=(n_boot, x.size))
    boots = []
    for row in idx:
        tx = stats.kendalltau(x[row], y[row]).statistic
        tb = stats.kendalltau(base[row], y[row]).statistic
        if np.isfinite(tx) and np.isfinite(tb):
            boots.append(-(tx - tb))
    lo, hi = np.percentile(boots, [2.5, 97.5])
    assert d.n_boot == len(boots)
    assert (d.lo, d.hi) == pytest.approx((lo, hi), abs=1e-12)
    point = -(stats.kendalltau(x, y).statistic - stats.kendalltau(base, y).statistic)
    assert d.delta == pytest.approx(point, abs=1e-15)
    assert d.tau_x == pytest.approx(stats.kendalltau(x, y).statistic) and d.sign == -1


def test_swapping_the_measures_flips_the_sign_and_the_interval():
    x, base, y = _data(seed=2)
    a = A.paired_delta_tau(x, base, y, sign=1, n_boot=500, seed=4)
    b = A.paired_delta_tau(base, x, y, sign=1, n_boot=500, seed=4)
    c = A.paired_delta_tau(x, base, y, sign=-1, n_boot=500, seed=4)
    assert b.delta == pytest.approx(-a.delta) and c.delta == pytest.approx(-a.delta)
    assert (b.lo, b.hi) == pytest.approx((-a.hi, -a.lo), abs=1e-12)
    assert (c.lo, c.hi) == pytest.approx((-a.hi, -a.lo), abs=1e-12)


def test_identical_measures_give_zero_with_interval_zero():
    x, _, y = _data(seed=3)
    d = A.paired_delta_tau(x, x.copy(), y, sign=1, n_boot=300, seed=0)
    assert (d.delta, d.lo, d.hi) == (0.0, 0.0, 0.0)


def test_paired_delta_tau_refuses_bad_input():
    x, base, y = _data()
    with pytest.raises(ValueError, match="sign must be"):
        A.paired_delta_tau(x, base, y, sign=0, n_boot=10, seed=0)
    with pytest.raises(ValueError, match="same length"):
        A.paired_delta_tau(x, base[:-1], y, sign=1, n_boot=10, seed=0)
    with pytest.raises(ValueError, match="n_boot"):
        A.paired_delta_tau(x, base, y, sign=1, n_boot=0, seed=0)


def test_partial_tau_closed_form_and_independent_z():
    # Kendall's formula by hand on three numbers
    assert A.partial_tau(0.5, 0.2, 0.4) == pytest.approx((0.5 - 0.08) / math.sqrt(0.96 * 0.84))
    # z a constant-free permutation unrelated to x and y by construction: partial ≈ plain τ in expectation;
    # with τ_xz = 0 exactly the partial τ is τ_xy / sqrt(1 - τ_yz²)
    assert A.partial_tau(0.3, 0.0, 0.5) == pytest.approx(0.3 / math.sqrt(0.75))
    assert np.isnan(A.partial_tau(0.3, 1.0, 0.2))


def test_partial_kendall_against_brute_force():
    rng = np.random.default_rng(7)
    z = rng.standard_normal(11)
    x, y = z + rng.standard_normal(11), z + rng.standard_normal(11)
    r = A.partial_kendall(x, y, z, n_boot=150, seed=2)
    t = lambda a, b: stats.kendalltau(a, b).statistic  # noqa: E731
    assert r.tau == pytest.approx((t(x, y) - t(x, z) * t(y, z)) / math.sqrt((1 - t(x, z) ** 2) * (1 - t(y, z) ** 2)))
    idx = np.random.default_rng(2).integers(0, 11, size=(150, 11))
    vals = []
    for row in idx:
        a, b, c = t(x[row], y[row]), t(x[row], z[row]), t(y[row], z[row])
        v = (a - b * c) / math.sqrt((1 - b * b) * (1 - c * c)) if abs(b) < 1 and abs(c) < 1 else float("nan")
        if np.isfinite(v):
            vals.append(v)
    assert (r.lo, r.hi) == pytest.approx(tuple(np.percentile(vals, [2.5, 97.5])), abs=1e-12)
    d = A.paired_delta_partial(x, x, y, z, sign=1, n_boot=100, seed=0)
    assert (d.delta, d.lo, d.hi) == (0.0, 0.0, 0.0)


def test_latent_between_is_positive_definite_and_leaves_admissible_values():
    r = A.latent_between(0.3, 1.0, 1.0, 0.2, 0.1)
    assert r == pytest.approx(math.sin(math.pi * 0.3 / 2))     # reliabilities 1: no disattenuation, admissible
    for tau_obs in (-0.95, 0.0, 0.95):
        r = A.latent_between(tau_obs, 0.6, 0.7, -0.9, 0.8)
        c = np.array([[1, r, -0.9], [r, 1, 0.8], [-0.9, 0.8, 1]])
        assert np.linalg.eigvalsh(c).min() > 0


def test_delta_power_size_and_growth():
    kw = dict(retest_x=0.95, retest_base=0.95, rel_y=0.95, tau_between=0.3, sign=1, n_boot=200, seed=0)
    # no difference: the one-sided "lower edge > 0" rejects about 2.5 % of the time
    null = A.delta_power(40, 0.3, 0.3, n_sim=400, **kw)
    assert null < 0.08
    small = A.delta_power(20, 0.6, 0.1, n_sim=150, **kw)
    large = A.delta_power(80, 0.6, 0.1, n_sim=150, **kw)
    assert small < large and large > 0.9
    # the wrong sign has (almost) no power
    assert A.delta_power(80, 0.6, 0.1, n_sim=150, **{**kw, "sign": -1}) < 0.05


def test_random_split_retest_against_a_loop():
    rng = np.random.default_rng(0)
    v = rng.standard_normal((9, 1)) + 0.5 * rng.standard_normal((9, 6))
    mean, sd = A.random_split_retest(v, n_splits=25, seed=3)
    r = np.random.default_rng(3)
    taus = []
    for _ in range(25):
        p = r.permutation(6)
        taus.append(stats.kendalltau(v[:, p[:3]].mean(1), v[:, p[3:]].mean(1)).statistic)
    assert (mean, sd) == pytest.approx((np.mean(taus), np.std(taus)), abs=1e-12)
    with pytest.raises(ValueError, match="even number"):
        A.random_split_retest(v[:, :5], n_splits=2, seed=0)


# --------------------------------------------------------------------------- minimum detectable Δ


def _independent_delta_hat(n, tau_x, tau_b, rel_x, rel_b, rel_y, r_xb, n_sim, seed):
    """Observed Δτ = τ(X, Y) − τ(B, Y) of simulated zoos, written out independently: a latent trivariate normal with
    Pearson correlations sin(πτ/2) (and r_xb between the measures), each variable seen through independent noise of
    reliability ``rel`` (variance share), τ-b by scipy."""
    rng = np.random.default_rng(seed)
    rxy, rby = np.sin(np.pi * tau_x / 2), np.sin(np.pi * tau_b / 2)
    cov = np.array([[1, r_xb, rxy], [r_xb, 1, rby], [rxy, rby, 1]])
    rel = np.sqrt([rel_x, rel_b, rel_y])
    out = []
    for _ in range(n_sim):
        lat = rng.multivariate_normal(np.zeros(3), cov, size=n)
        obs = rel * lat + np.sqrt(1 - rel ** 2) * rng.standard_normal((n, 3))
        out.append(stats.kendalltau(obs[:, 0], obs[:, 2]).statistic - stats.kendalltau(obs[:, 1], obs[:, 2]).statistic)
    return np.array(out)


@pytest.mark.slow
def test_minimum_detectable_delta_against_a_normal_approximation_of_an_independent_simulation():
    n, tau_b, retest = 40, 0.06, 0.7
    rel = math.sin(math.pi * retest / 2)                 # the reliability (variance share) delta_power gives a retest
    tau_between = 0.3                                    # disattenuated: sin(0.15π)/rel, no clipping at these τ
    r_xb = math.sin(math.pi * tau_between / 2) / rel
    kw = dict(retest_x=retest, retest_base=retest, rel_y=0.9, tau_between=tau_between, sign=1, n_sim=300, n_boot=300,
              seed=5)
    m = analysis.delta_mde(n, tau_b, tol=0.01, **kw)
    assert m.reached and 0 < m.delta < m.delta_max and m.power >= 0.8 and m.evaluations > 3
    # the bisection's bracket: just below the MDE the same Monte Carlo (same seed) falls short of 0.8
    assert analysis.delta_power(n, tau_b + m.delta - 0.01, tau_b, **kw) < 0.8
    # independent reference: at the MDE the observed Δ's mean is about (z_0.975 + z_0.8) standard errors above 0, i.e.
    # a normal approximation of the test gives power 0.8 there
    d = _independent_delta_hat(n, tau_b + m.delta, tau_b, rel, rel, 0.9, r_xb, 1500, seed=11)
    ratio = d.mean() / d.std(ddof=1)
    z = stats.norm.ppf(0.975) + stats.norm.ppf(0.8)
    assert ratio == pytest.approx(z, abs=0.35)
    assert stats.norm.cdf(ratio - stats.norm.ppf(0.975)) == pytest.approx(0.8, abs=0.1)


@pytest.mark.slow
def test_minimum_detectable_delta_grows_as_members_fall_and_is_not_reached_by_a_tiny_noisy_zoo():
    kw = dict(retest_x=0.8, retest_base=0.8, rel_y=0.9, tau_between=0.4, n_sim=200, n_boot=200, seed=3, tol=0.02)
    big, small = analysis.delta_mde(80, -0.41, sign=-1, **kw), analysis.delta_mde(30, -0.41, sign=-1, **kw)
    assert big.reached and small.reached and big.delta < small.delta
    assert big.delta_max == pytest.approx(0.99 - 0.41)    # τ_g = τ_base − Δ may reach −0.99
    tiny = analysis.delta_mde(5, 0.06, retest_x=0.2, retest_base=0.2, rel_y=0.3, tau_between=0.1, sign=1, n_sim=100,
                              n_boot=100, seed=3)
    assert not tiny.reached and math.isnan(tiny.delta) and tiny.power_max < 0.8 and tiny.evaluations == 1
    with pytest.raises(ValueError, match="no room"):
        analysis.delta_mde(30, 0.99, sign=1, **kw)
