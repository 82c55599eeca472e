"""Kendall tau-b with bootstrap intervals, and the split-half radius choice."""
import itertools

import numpy as np
import pytest

from companion.experiments.correlation import kendall_tau, tau_split_half


def brute_tau_b(x, y):
    """Kendall tau-b from its definition: (C - D) / sqrt((n0 - n1)(n0 - n2))."""
    c = d = tx = ty = 0
    n = len(x)
    for i, j in itertools.combinations(range(n), 2):
        sx, sy = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
        if sx == 0 and sy == 0:
            continue
        if sx == 0:
            tx += 1
        elif sy == 0:
            ty += 1
        elif sx == sy:
            c += 1
        else:
            d += 1
    return (c - d) / np.sqrt((c + d + tx) * (c + d + ty))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tau_matches_definition_with_ties(seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 6, size=30).astype(float)  # many ties
    y = x + rng.integers(-3, 4, size=30)
    res = kendall_tau(x, y, n_boot=0, seed=0)
    assert res.tau == pytest.approx(brute_tau_b(x, y), abs=1e-12)
    assert np.isnan(res.ci_low) and np.isnan(res.ci_high)


def test_bootstrap_interval_deterministic_and_brackets_tau():
    rng = np.random.default_rng(3)
    x = rng.normal(size=50)
    y = -x + 0.7 * rng.normal(size=50)
    a = kendall_tau(x, y, n_boot=500, seed=7)
    b = kendall_tau(x, y, n_boot=500, seed=7)
    c = kendall_tau(x, y, n_boot=500, seed=8)
    assert a == b
    assert (a.ci_low, a.ci_high) != (c.ci_low, c.ci_high)
    assert a.ci_low < a.tau < a.ci_high
    assert a.tau < -0.3 and a.ci_high < 0


def test_interval_shrinks_with_more_models():
    rng = np.random.default_rng(4)
    widths = []
    for n in (20, 80, 320):
        x = rng.normal(size=n)
        y = x + rng.normal(size=n)
        r = kendall_tau(x, y, n_boot=400, seed=0)
        widths.append(r.ci_high - r.ci_low)
    assert widths[0] > widths[1] > widths[2]
    # width ~ 1/sqrt(n): quadrupling n roughly halves it
    assert 0.35 < widths[2] / widths[1] < 0.7


def test_perfect_rank_agreement():
    x = np.arange(10.0)
    r = kendall_tau(x, x**3, n_boot=200, seed=0)
    assert r.tau == pytest.approx(1.0)
    assert r.ci_low == pytest.approx(1.0) and r.ci_high == pytest.approx(1.0)


def test_bad_input():
    with pytest.raises(ValueError, match="same length"):
        kendall_tau([1, 2, 3], [1, 2], n_boot=0, seed=0)
    with pytest.raises(ValueError, match="finite"):
        kendall_tau([1, 2, np.nan, 4], [1, 2, 3, 4], n_boot=0, seed=0)
    with pytest.raises(ValueError, match="at least 3"):
        kendall_tau([1, 2], [1, 2], n_boot=0, seed=0)


def test_split_half_picks_informative_radius_and_reports_held_out():
    rng = np.random.default_rng(5)
    n = 60
    gen = rng.lognormal(size=n)
    measures = {
        0.01: rng.normal(size=n),                      # noise
        0.1: -np.log(gen) + 0.3 * rng.normal(size=n),  # strongly anti-correlated
        1.0: rng.normal(size=n),                       # noise
    }
    res = tau_split_half(measures, gen, seed=0, n_boot=300)
    assert res.chosen == 0.1
    assert res.tau_select < -0.5
    assert res.held_out.tau < -0.5 and res.held_out.n == n - n // 2
    # halves are disjoint and cover the population
    both = np.concatenate([res.select_idx, res.eval_idx])
    assert np.array_equal(np.sort(both), np.arange(n))
    # the held-out tau is computed on the held-out models only
    direct = kendall_tau(measures[0.1][res.eval_idx], gen[res.eval_idx], n_boot=0, seed=0).tau
    assert res.held_out.tau == pytest.approx(direct)
    # signed criterion: asking for the largest tau picks a noise radius instead
    assert tau_split_half(measures, gen, seed=0, n_boot=0, criterion="max").chosen != 0.1
