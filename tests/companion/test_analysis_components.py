"""The variance-component statistics of companion.analysis (the pilots' protocol choices), each against an
independent reference: a simulation with known truth or Kendall's τ computed split by split with SciPy."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from companion import analysis


def test_variance_components_recover_the_simulated_ones():
    rng = np.random.default_rng(1)
    member = rng.normal(0.0, 0.5, (400, 1))       # s_m = 0.25
    batch = rng.normal(0.0, 3.0, (1, 30))         # shared batch effects: must not count as noise
    v = np.exp(member + batch + rng.normal(0.0, 1.0, (400, 30)))   # s_e = 1
    s_m, s_e = analysis.variance_components(v)
    assert s_m == pytest.approx(member.var(ddof=1), abs=0.03)   # the realised member variance
    assert s_e == pytest.approx(1.0, rel=0.05)


def test_component_retest_predicts_the_tau_of_two_disjoint_means():
    # Spearman–Brown reliability of a k-batch mean, as Kendall tau, against tau measured on a large simulation
    rng = np.random.default_rng(2)
    s_m, s_e, k = 0.2, 1.0, 4
    member = rng.normal(0.0, math.sqrt(s_m), (20000, 1))
    a = (member + rng.normal(0.0, math.sqrt(s_e), (20000, k))).mean(1)
    b = (member + rng.normal(0.0, math.sqrt(s_e), (20000, k))).mean(1)
    assert analysis.component_retest(s_m, s_e, k) == pytest.approx(stats.kendalltau(a, b).statistic, abs=0.015)
    k_star = analysis.batches_for(s_m, s_e, 0.8)
    assert analysis.component_retest(s_m, s_e, math.ceil(k_star)) >= 0.8 > analysis.component_retest(s_m, s_e, math.floor(k_star))
    assert analysis.component_retest(0.0, 1.0, 8) == 0.0 and analysis.batches_for(0.0, 1.0, 0.8) == math.inf


def test_gap_reliability_matches_the_binomial_truth():
    rng = np.random.default_rng(3)
    n_members, n_pairs = 300, 2000
    p = rng.uniform(0.05, 0.15, n_members)
    truth = p.var() / (p.var() + np.mean(p * (1 - p)) / n_pairs)
    errors = (rng.random((n_members, n_pairs)) < p[:, None]).astype(float)
    train = rng.uniform(0.0, 0.05, n_members) * 0  # a constant train error leaves the gap's reliability unchanged
    assert analysis.gap_reliability(errors, train, n_splits=20, seed=0).split_half == pytest.approx(truth, abs=0.03)


@pytest.mark.slow
def test_power_is_the_level_without_effect_and_grows_with_members():
    assert analysis.power(30, 0.0, 0.9, 0.9, alpha=0.05, n_sim=2000, seed=0) == pytest.approx(0.05, abs=0.015)
    small = analysis.power(20, 0.3, 0.9, 0.9, alpha=0.05, n_sim=500, seed=0)
    large = analysis.power(80, 0.3, 0.9, 0.9, alpha=0.05, n_sim=500, seed=0)
    noisy = analysis.power(80, 0.3, 0.2, 0.9, alpha=0.05, n_sim=500, seed=0)
    assert small < large and noisy < large


def test_all_splits_retest_averages_every_disjoint_split():
    rng = np.random.default_rng(7)
    v = rng.normal(size=(9, 4))
    pairs = [((0,), (1,)), ((0,), (2,)), ((0,), (3,)), ((1,), (2,)), ((1,), (3,)), ((2,), (3,))]
    ref = np.mean([stats.kendalltau(v[:, a[0]], v[:, b[0]]).statistic for a, b in pairs])
    assert analysis.all_splits_retest(v, 1) == pytest.approx(ref)
    halves = [stats.kendalltau(v[:, [0, 1]].mean(1), v[:, [2, 3]].mean(1)).statistic,
              stats.kendalltau(v[:, [0, 2]].mean(1), v[:, [1, 3]].mean(1)).statistic,
              stats.kendalltau(v[:, [0, 3]].mean(1), v[:, [1, 2]].mean(1)).statistic]
    assert analysis.all_splits_retest(v, 2) == pytest.approx(np.mean(halves))


def test_batch_retest_reads_the_two_halves_and_matches_its_parts():
    rng = np.random.default_rng(8)
    v = np.exp(rng.normal(0.0, 1.0, (12, 1)) + rng.normal(0.0, 0.5, (12, 6)))
    r = analysis.batch_retest(v, 2, target=0.8)
    assert r["retest"] == pytest.approx(stats.kendalltau(v[:, :2].mean(1), v[:, 3:5].mean(1)).statistic)
    s_m, s_e = analysis.variance_components(v)
    assert (r["s_member"], r["s_resid"]) == (s_m, s_e) and r["noise_ratio"] == pytest.approx(s_e / s_m)
    assert r["retest_vc"] == analysis.component_retest(s_m, s_e, 2)
    assert r["batches_for_target"] == analysis.batches_for(s_m, s_e, 0.8)
    with pytest.raises(ValueError, match="batches per half"):
        analysis.batch_retest(v, 4, target=0.8)


def test_step_up_by_hand_and_as_the_retest_scale():
    assert analysis.step_up(0.5, 3) == pytest.approx(0.75) and analysis.step_up(0.0, 4) == 0.0
    assert analysis.step_up(0.6245, 1) == pytest.approx(0.6245)
    assert analysis.component_reliability(1.0, 1.0, 1) == pytest.approx(0.5)
    assert analysis.component_reliability(1.0, 1.0, 4) == pytest.approx(0.8)   # = step_up(0.5, 4)
    assert analysis.component_reliability(1.0, 1.0, 4) == pytest.approx(analysis.step_up(0.5, 4))
    tau = 0.4   # spearman_brown is step_up on the Pearson scale sin(πτ/2)
    assert analysis.spearman_brown(tau, 3) == pytest.approx(
        2 / math.pi * math.asin(analysis.step_up(math.sin(math.pi * tau / 2), 3)))
