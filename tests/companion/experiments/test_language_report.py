"""The language row's reliability of the mean of two halves (Spearman–Brown on the Kendall scale),
checked against a simulation of parallel measurements with known reliability."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from companion.experiments.language_report import full_length_reliability


@pytest.mark.parametrize("r_half", [0.3, 0.6, 0.85])
def test_spearman_brown_matches_a_simulation(r_half):
    rng = np.random.default_rng(0)
    n = 40_000
    true = rng.standard_normal(n)
    noise_sd = math.sqrt(1 / r_half - 1)
    halves = true[:, None] + noise_sd * rng.standard_normal((n, 4))   # four parallel halves
    half_tau = stats.kendalltau(halves[:, 0], halves[:, 1]).statistic
    # the retest of the mean of two halves: two independent means, each over two halves
    full_tau = stats.kendalltau(halves[:, :2].mean(1), halves[:, 2:].mean(1)).statistic
    assert full_length_reliability(half_tau) == pytest.approx(full_tau, abs=0.01)
    assert full_length_reliability(half_tau, k=1) == pytest.approx(half_tau)


def test_no_signal_and_bad_input():
    assert full_length_reliability(-0.2) == 0.0 and full_length_reliability(0.0) == 0.0
    assert math.isnan(full_length_reliability(math.nan))
    assert full_length_reliability(1.0) == pytest.approx(1.0)
