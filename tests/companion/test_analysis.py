"""companion.analysis against independent references: scipy's Kendall τ-b, members simulated with a
reliability known by construction, the attenuation formula by simulation, power by brute force."""
import numpy as np
import pytest
from scipy import stats

from companion import analysis as an


def _tied(rng, n):
    x = rng.integers(0, 5, n).astype(float)
    return x, x + rng.integers(-2, 3, n)


@pytest.mark.parametrize("seed", [0, 1])
def test_tau_rows_equal_scipy_tau_b_with_ties_and_constant_rows(seed):
    rng = np.random.default_rng(seed)
    xs, ys = zip(*[_tied(rng, 25) for _ in range(30)])
    x, y = np.array(xs), np.array(ys)
    x[3] = 2.0                                   # a constant row: τ undefined
    got = an.tau_rows(x, y)
    ref = np.array([stats.kendalltau(a, b, variant="b").statistic if np.ptp(a) else np.nan for a, b in zip(x, y)])
    assert np.isnan(got[3]) and np.array_equal(np.delete(got, 3), np.delete(ref, 3))   # bit for bit


def test_kendall_point_and_bootstrap_match_scipy_resample_by_resample():
    rng = np.random.default_rng(2)
    x, y = _tied(rng, 30)
    res = an.kendall(x, y, n_boot=300, seed=11)
    ref = stats.kendalltau(x, y, variant="b")
    assert res.tau == pytest.approx(ref.statistic, abs=1e-12) and res.pvalue == pytest.approx(ref.pvalue)
    idx = np.random.default_rng(11).integers(0, 30, (300, 30))
    boots = np.array([stats.kendalltau(x[i], y[i]).statistic for i in idx])
    boots = boots[np.isfinite(boots)]
    assert (res.lo, res.hi) == tuple(np.quantile(boots, [0.025, 0.975]))     # bit for bit: plots rely on lo <= tau
    assert res.n == 30 and res.n_boot == boots.size and res.ci_low == res.lo and res.ci_high == res.hi
    assert an.kendall(x, y, n_boot=300, seed=11) == res and an.kendall(x, y, n_boot=300, seed=12) != res
    assert an.retest(x, y, n_boot=300, seed=11) == res
    assert set(res.as_dict()) == {"tau", "ci_low", "ci_high", "pvalue", "n", "n_boot"}


def test_kendall_refuses_bad_input():
    with pytest.raises(ValueError, match="same length"):
        an.kendall([1, 2, 3], [1, 2], n_boot=0, seed=0)
    with pytest.raises(ValueError, match="finite"):
        an.kendall([1, 2, np.inf, 4], [1, 2, 3, 4], n_boot=0, seed=0)
    with pytest.raises(ValueError, match="n_boot"):
        an.kendall([1, 2, 3, 4], [1, 2, 3, 4], n_boot=-1, seed=0)


def _members(rng, p, n_examples, train=None):
    """0/1 errors of members with true error rates ``p`` on a shared set of ``n_examples``."""
    return (rng.random((p.size, n_examples)) < p[:, None]).astype(float)


@pytest.mark.parametrize("target", [0.3, 0.6, 0.9])
def test_gap_reliability_recovers_a_reliability_known_by_construction(target):
    rng = np.random.default_rng(int(target * 10))
    m, n = 300, 2000
    train = rng.uniform(0.0, 0.05, m)
    # true gaps g = p - train with variance chosen so that var(g) / (var(g) + noise) = target
    base = 0.2
    noise = base * (1 - base) / n
    sd = np.sqrt(target / (1 - target) * noise)
    p = np.clip(base + train + sd * rng.standard_normal(m), 0.01, 0.99)
    g_true = p - train
    noise_true = np.mean(p * (1 - p)) / n
    known = np.var(g_true, ddof=1) / (np.var(g_true, ddof=1) + noise_true)
    rel = an.gap_reliability(_members(rng, p, n), train, seed=0, n_splits=40)
    assert rel.split_half == pytest.approx(known, abs=0.06)
    assert rel.disagreement == pytest.approx(known, abs=0.06)
    assert rel.value == rel.split_half and (rel.n_members, rel.n_examples) == (m, n)


def test_gap_reliability_ignores_examples_every_member_gets_wrong_and_refuses_bad_shapes():
    rng = np.random.default_rng(5)
    p = rng.uniform(0.1, 0.3, 40)
    e = _members(rng, p, 600)
    hard = np.hstack([e, np.ones((40, 600))])      # shared hard examples: a common shift of every gap
    a, b = an.gap_reliability(e, seed=1), an.gap_reliability(hard, seed=1)
    # both estimators only see differences between members; the noise per pair halves with 2n examples
    # while the spread quarters, so the reliability is unchanged in expectation (not exactly)
    assert a.disagreement == pytest.approx(b.disagreement, abs=0.05)
    with pytest.raises(ValueError, match="members"):
        an.gap_reliability(e[:2], seed=0)
    with pytest.raises(ValueError, match="train_err"):
        an.gap_reliability(e, np.zeros(3), seed=0)


def _noisy(rng, z, rel):
    return np.sqrt(rel) * z + np.sqrt(1 - rel) * rng.standard_normal(z.size)


@pytest.mark.parametrize("tau_true", [1.0, -0.7, 0.4])
def test_attenuation_and_ceiling_by_simulation(tau_true):
    rng = np.random.default_rng(7)
    n, r_xx, r_yy = 6000, 0.7, 0.5
    r = np.sin(np.pi * tau_true / 2)
    x = rng.standard_normal(n)
    y = r * x + np.sqrt(max(1 - r * r, 0.0)) * rng.standard_normal(n)
    x1, x2, yo = _noisy(rng, x, r_xx), _noisy(rng, x, r_xx), _noisy(rng, y, r_yy)
    retest_tau = stats.kendalltau(x1, x2).statistic             # measured, as a stage would
    observed = stats.kendalltau(x1, yo).statistic
    assert observed == pytest.approx(an.attenuated(tau_true, retest_tau, r_yy), abs=0.025)
    if tau_true == 1.0:
        assert observed == pytest.approx(an.ceiling(retest_tau, r_yy), abs=0.025)


def test_ceiling_closed_form_edges():
    assert an.ceiling(1.0, 1.0) == pytest.approx(1.0)
    assert an.ceiling(-0.2, 0.9) == 0.0 and an.ceiling(0.9, -0.1) == 0.0
    assert an.ceiling(0.5, 0.5) == pytest.approx(2 / np.pi * np.arcsin(np.sqrt(np.sin(np.pi / 4) * 0.5)))
    with pytest.raises(ValueError, match="retest_tau"):
        an.ceiling(1.5, 0.5)
    with pytest.raises(ValueError, match="rel_y"):
        an.ceiling(0.5, float("nan"))


def test_power_is_alpha_at_zero_and_one_at_large_n():
    assert an.power(40, 0.0, 0.9, 0.9, alpha=0.05, n_sim=4000, seed=0) == pytest.approx(0.05, abs=0.012)
    assert an.power(300, 0.4, 0.9, 0.9, alpha=0.05, n_sim=200, seed=0) == 1.0
    assert an.power(20, 0.3, 0.2, 0.2, alpha=0.05, n_sim=2000, seed=0) < 0.15


def test_power_matches_brute_force_with_scipy_pvalues():
    n, tau, rt, ry = 20, 0.45, 0.8, 0.7
    rng = np.random.default_rng(123)
    r, r_xx = np.sin(np.pi * tau / 2), np.sin(np.pi * rt / 2)
    hits = 0
    for _ in range(1500):
        x = rng.standard_normal(n)
        y = r * x + np.sqrt(1 - r * r) * rng.standard_normal(n)
        hits += stats.kendalltau(_noisy(rng, x, r_xx), _noisy(rng, y, ry)).pvalue < 0.05
    got = an.power(n, tau, rt, ry, alpha=0.05, n_sim=3000, seed=1)
    assert got == pytest.approx(hits / 1500, abs=0.045)


# --------------------------------------------------------------------------- Spearman–Brown, retest by batches


def test_spearman_brown_closed_form_and_inverse():
    # r = 0.5 (τ = 1/3) stepped up to R = 0.8 needs k = R(1 − r) / (r(1 − R)) = 4 times the data
    tau_r, tau_big = 2 / np.pi * np.arcsin(0.5), 2 / np.pi * np.arcsin(0.8)
    assert an.spearman_brown(tau_r, 4) == pytest.approx(tau_big, abs=1e-12)
    assert an.spearman_brown_factor(tau_r, tau_big) == pytest.approx(4.0, abs=1e-12)
    assert an.spearman_brown(tau_r, 1) == pytest.approx(tau_r, abs=1e-12)
    assert an.spearman_brown(-0.2, 3) == 0.0 and np.isnan(an.spearman_brown(np.nan, 2))
    assert an.spearman_brown_factor(0.0, 0.8) == np.inf
    with pytest.raises(ValueError, match="strictly between"):
        an.spearman_brown_factor(0.5, 1.0)


def test_spearman_brown_predicts_simulated_parallel_batches():
    """Members with a true value and independent noise per batch: the retest of means over m batches
    is what Spearman–Brown predicts from the retest at h batches (large n: sampling error ~0.005)."""
    rng = np.random.default_rng(0)
    n, h = 20000, 8
    true = rng.standard_normal(n)[:, None]
    first, second = true + 2.0 * rng.standard_normal((n, h)), true + 2.0 * rng.standard_normal((n, h))
    tau_h = stats.kendalltau(first.mean(1), second.mean(1)).statistic
    for m in (1, 2, 4):
        tau_m = stats.kendalltau(first[:, :m].mean(1), second[:, :m].mean(1)).statistic
        assert an.spearman_brown(tau_h, m / h) == pytest.approx(tau_m, abs=0.015)


def test_retest_by_subsets_against_every_choice_of_batches():
    """Random draws average to the mean over all C(4,2)² choices (enumerated with scipy); the whole
    sets give the one τ of their means."""
    import itertools

    rng = np.random.default_rng(1)
    true = rng.standard_normal(12)[:, None]
    first, second = true + rng.standard_normal((12, 4)), true + rng.standard_normal((12, 4))
    got = an.retest_by_subsets(first, second, [2, 4], n_draws=4000, seed=3)
    every = [stats.kendalltau(first[:, list(a)].mean(1), second[:, list(b)].mean(1)).statistic
             for a in itertools.combinations(range(4), 2) for b in itertools.combinations(range(4), 2)]
    assert got.loc[0, "tau"] == pytest.approx(np.mean(every), abs=0.01) and got.loc[0, "n_draws"] == 4000
    assert got.loc[0, "tau_sd"] == pytest.approx(np.std(every), abs=0.01)
    assert got.loc[1, "tau"] == stats.kendalltau(first.mean(1), second.mean(1)).statistic
    assert got.loc[1, "n_draws"] == 1 and got.loc[1, "tau_sd"] == 0.0
    again = an.retest_by_subsets(first, second, [2, 4], n_draws=4000, seed=3)
    assert again.equals(got)                                     # seeded
    with pytest.raises(ValueError, match="choose 1..min"):
        an.retest_by_subsets(first, second, [5], n_draws=10, seed=0)
    with pytest.raises(ValueError, match="same >= 3 members"):
        an.retest_by_subsets(first, second[:5], [2], n_draws=10, seed=0)
