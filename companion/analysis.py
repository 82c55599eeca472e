"""The one analysis module: Kendall τ with bootstrap intervals, reliability, ceiling, power, curves.

Every stage computes its rank correlations here, so a τ, its interval and the numbers that say
how large a τ the data could show are computed one way.

* :func:`kendall` — Kendall τ-b (ties handled, as ``scipy.stats.kendalltau``) with a percentile
  bootstrap interval over members (models resampled with replacement; resamples on which τ is
  undefined, one variable constant, are dropped).
* :func:`retest` — test–retest reliability of a measure: τ between two measurements of the same
  members on disjoint data.
* :func:`gap_reliability` — reliability of a generalisation gap across members measured on one
  shared evaluation set (signal variance / total variance), by split halves with the
  Spearman–Brown step-up and by pairwise disagreement.
* :func:`ceiling` / :func:`attenuated` — the largest |τ| (or the τ) one can observe between a
  measure of test–retest τ ``retest_tau`` and a gap of reliability ``rel_y``, under a latent
  bivariate normal model: Pearson ``r = sin(πτ/2)`` (Greiner's relation), a measurement's
  reliability is the correlation of two parallel measurements, and the observed correlation is
  the true one times ``√(r_xx · r_yy)`` (Spearman's attenuation).
* :func:`power` — Monte Carlo power of the two-sided test of τ = 0 at ``n`` members.
* :func:`paired_delta_tau`, :func:`delta_power`, :func:`delta_mde` — the paired Δτ of two measures with one gap, its
  Monte Carlo power, and the minimum Δ it detects with a given power (bisection on :func:`delta_power`).
* :func:`spearman_brown` / :func:`spearman_brown_factor` — the retest of a mean of ``k`` parallel
  measurements (on the Pearson scale ``r = sin(πτ/2)``), and the ``k`` a target retest needs;
  :func:`retest_by_subsets` — the measured retest against the number of batches averaged;
  :func:`step_up` — the same step on the Pearson scale (a reliability, not a retest τ).
* :func:`variance_components`, :func:`component_reliability`, :func:`component_retest`, :func:`batches_for`,
  :func:`all_splits_retest`, :func:`batch_retest` — a measure's per-batch values over members as a two-way
  (members × batches) table: the member and residual variance components, the reliability and retest they
  predict for a mean over ``k`` batches, the batches a target retest needs, and the measured retest (one
  split and every split) beside them. The pilots choose their protocols with these.
* :func:`tau_curve`, :func:`retest_table` — τ against the radius ρ for every measure of a long
  frame (columns ``model, measure, rho, value``), and the test–retest table of two such frames.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
from scipy import stats


@dataclass(frozen=True)
class TauCI:
    """Kendall τ-b over ``n`` members with its bootstrap interval ``[lo, hi]``.

    ``pvalue``: scipy's two-sided p-value of τ = 0; ``n_boot``: resamples on which τ was defined
    (0 when the bootstrap was skipped, ``lo``/``hi`` then NaN).
    """

    tau: float
    lo: float
    hi: float
    n: int
    pvalue: float = float("nan")
    n_boot: int = 0

    @property
    def ci_low(self) -> float:
        return self.lo

    @property
    def ci_high(self) -> float:
        return self.hi

    def as_dict(self) -> dict:
        """The metrics-file record: ``tau, ci_low, ci_high, pvalue, n, n_boot``."""
        d = asdict(self)
        return {"tau": d["tau"], "ci_low": d["lo"], "ci_high": d["hi"], "pvalue": d["pvalue"],
                "n": d["n"], "n_boot": d["n_boot"]}

    def __str__(self) -> str:
        return f"{self.tau:+.3f} [{self.lo:+.3f}, {self.hi:+.3f}] (n={self.n})"


def _as_pair(x: Sequence[float], y: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(x, dtype=float).ravel()
    y = np.asarray(y, dtype=float).ravel()
    if x.shape != y.shape:
        raise ValueError(f"x and y must have the same length, got {x.size} and {y.size}")
    if x.size < 3:
        raise ValueError(f"need at least 3 members for a rank correlation, got {x.size}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError("x and y must be finite (a NaN sharpness usually means a diverged solver)")
    return x, y


def _signs(v: np.ndarray) -> np.ndarray:
    """``sign(v[..., i] - v[..., j])`` for every pair, as int8 (``[..., n, n]``)."""
    a, b = v[..., :, None], v[..., None, :]
    return (a > b).astype(np.int8) - (a < b).astype(np.int8)


def tau_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Kendall τ-b of every row pair: ``x``, ``y`` of shape ``[k, n]`` → ``[k]`` (NaN where a row is
    constant). τ-b = Σ sx·sy / √(Σ sx² · Σ sy²) over pairs, which is (C − D)/√((n0 − n1)(n0 − n2))."""
    x, y = np.atleast_2d(x), np.atleast_2d(y)
    k, n = x.shape
    out = np.empty(k)
    step = max(1, 4_000_000 // max(n * n, 1))
    for s in range(0, k, step):
        sx, sy = _signs(x[s:s + step]), _signs(y[s:s + step])
        # over the full matrix every pair counts twice; halved, these are scipy's integers
        # (C - D, n0 - n1, n0 - n2), combined in scipy's order so that the values are bit-identical
        num = np.einsum("kij,kij->k", sx, sy, dtype=np.int64) // 2
        nx = np.einsum("kij,kij->k", sx, sx, dtype=np.int64) // 2
        ny = np.einsum("kij,kij->k", sy, sy, dtype=np.int64) // 2
        ok = (nx > 0) & (ny > 0)
        with np.errstate(invalid="ignore", divide="ignore"):
            out[s:s + step] = np.where(ok, num / np.sqrt(np.where(ok, nx, 1)) / np.sqrt(np.where(ok, ny, 1)), np.nan)
    return out


def _interval(boots: np.ndarray, confidence: float) -> tuple[float, float, int]:
    boots = boots[np.isfinite(boots)]
    if boots.size == 0:
        return float("nan"), float("nan"), 0
    a = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(boots, [a, 1.0 - a])
    return float(lo), float(hi), int(boots.size)


def kendall(x: Sequence[float], y: Sequence[float], *, n_boot: int, seed: int,
            confidence: float = 0.95) -> TauCI:
    """Kendall τ-b between ``x`` and ``y`` with a percentile bootstrap interval over members.

    ``n_boot=0`` skips the bootstrap (interval NaN). Deterministic given ``seed``: the resample
    indices are ``default_rng(seed).integers(0, n, (n_boot, n))``.
    """
    x, y = _as_pair(x, y)
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    if n_boot < 0:
        raise ValueError(f"n_boot must be >= 0, got {n_boot}")
    res = stats.kendalltau(x, y, variant="b")
    tau, pvalue = float(res.statistic), float(res.pvalue)
    if n_boot == 0:
        return TauCI(tau, float("nan"), float("nan"), x.size, pvalue, 0)
    idx = np.random.default_rng(seed).integers(0, x.size, size=(n_boot, x.size))
    lo, hi, kept = _interval(tau_rows(x[idx], y[idx]), confidence)
    return TauCI(tau, lo, hi, x.size, pvalue, kept)


def retest(x1: Sequence[float], x2: Sequence[float], *, n_boot: int, seed: int) -> TauCI:
    """Test–retest reliability: τ between two measurements of the same members on disjoint data
    (entries aligned by member). Near 1: the ranking is a property of the members."""
    return kendall(x1, x2, n_boot=n_boot, seed=seed)


# --------------------------------------------------------------------------- reliability


@dataclass(frozen=True)
class Reliability:
    """Reliability of a gap across members (signal variance / total variance).

    ``split_half``: Spearman–Brown stepped-up Pearson correlation of the gaps measured on two random
    halves of the evaluation set, averaged over ``n_splits`` splits; ``disagreement``: 1 − mean
    pairwise noise / mean pairwise spread (see :func:`gap_reliability`); ``value``: the one Table 1
    reports (``split_half``).
    """

    split_half: float
    disagreement: float
    value: float
    n_members: int
    n_examples: int
    n_splits: int

    def as_dict(self) -> dict:
        return asdict(self)


def _pairs_mean(mat: np.ndarray) -> float:
    iu = np.triu_indices(mat.shape[0], k=1)
    return float(mat[iu].mean())


def gap_reliability(test_err, train_err=None, *, seed: int, n_splits: int = 100) -> Reliability:
    """Reliability of the generalisation gap across members measured on one shared evaluation set.

    ``test_err``: ``[members, examples]`` per-example errors (0/1, or losses) on the SHARED set;
    ``train_err``: each member's train error (``[members]``, taken as exact) or None (the gap is
    then the test error). The noise is the evaluation set's: with a finite set the measured error
    of member i is its expected error plus sampling noise, and only differences between members
    matter for a ranking.

    * split halves: the examples are split at random into two halves, the gaps recomputed on each,
      their Pearson correlation r over members stepped up to the full set (2r / (1 + r)); the mean
      over ``n_splits`` splits (drawn from ``seed``).
    * disagreement: Var(ê_i − ê_j) = (d_ij − (e_i − e_j)²)/(n − 1) (the unbiased variance of the
      mean of the per-example differences; ``d_ij`` their mean square, the disagreement rate for 0/1
      errors), and the reliability is 1 − mean_{i<j} Var(ê_i − ê_j) / mean_{i<j} (ĝ_i − ĝ_j)².
    """
    e = np.asarray(test_err, dtype=float)
    if e.ndim != 2 or e.shape[0] < 3 or e.shape[1] < 4:
        raise ValueError(f"test_err must be [members >= 3, examples >= 4], got shape {e.shape}")
    if not np.all(np.isfinite(e)):
        raise ValueError("test_err must be finite")
    m, n = e.shape
    t = np.zeros(m) if train_err is None else np.asarray(train_err, dtype=float).ravel()
    if t.shape != (m,) or not np.all(np.isfinite(t)):
        raise ValueError(f"train_err must be {m} finite values (one per member), got shape {t.shape}")
    if n_splits < 1:
        raise ValueError(f"n_splits must be >= 1, got {n_splits}")
    rng = np.random.default_rng(seed)
    rs = []
    for _ in range(n_splits):
        half = rng.permutation(n) < n // 2
        ga, gb = e[:, half].mean(1) - t, e[:, ~half].mean(1) - t
        if np.std(ga) > 0 and np.std(gb) > 0:
            r = float(np.corrcoef(ga, gb)[0, 1])
            rs.append(2 * r / (1 + r) if r > -1 else float("nan"))
    split = float(np.nanmean(rs)) if rs else float("nan")
    mean = e.mean(1)
    sq = (e * e).mean(1)
    d = sq[:, None] + sq[None, :] - 2.0 * (e @ e.T) / n
    noise = (d - (mean[:, None] - mean[None, :]) ** 2) / (n - 1)
    g = mean - t
    spread = _pairs_mean((g[:, None] - g[None, :]) ** 2)
    disagreement = 1.0 - _pairs_mean(noise) / spread if spread > 0 else float("nan")
    return Reliability(split, float(disagreement), split, m, n, n_splits)


# --------------------------------------------------------------------------- ceiling and power


def _check_unit(name: str, v: float) -> float:
    v = float(v)
    if not np.isfinite(v) or not -1.0 <= v <= 1.0:
        raise ValueError(f"{name} must be a finite number in [-1, 1], got {v}")
    return v


def _pearson_reliability(retest_tau: float, rel_y: float) -> tuple[float, float]:
    """Reliabilities as variance ratios in [0, 1]: the measure's from its retest τ (r = sin(πτ/2)),
    the gap's as given. Estimates below 0 (sampling error around no signal) count as 0."""
    r_xx = np.sin(np.pi * _check_unit("retest_tau", retest_tau) / 2.0)
    r_yy = float(rel_y)
    if not np.isfinite(r_yy) or r_yy > 1.0:
        raise ValueError(f"rel_y must be a finite reliability <= 1, got {rel_y}")
    return max(float(r_xx), 0.0), max(r_yy, 0.0)


def attenuated(tau: float, retest_tau: float, rel_y: float) -> float:
    """The τ one expects to observe when the error-free τ is ``tau``:
    (2/π)·arcsin(sin(πτ/2)·√(r_xx·r_yy)), r_xx = sin(π·retest_tau/2), r_yy = ``rel_y``."""
    r_xx, r_yy = _pearson_reliability(retest_tau, rel_y)
    r = np.sin(np.pi * _check_unit("tau", tau) / 2.0) * np.sqrt(r_xx * r_yy)
    return float(2.0 / np.pi * np.arcsin(r))


def ceiling(retest_tau: float, rel_y: float) -> float:
    """The largest |τ| observable between a measure with test–retest τ ``retest_tau`` and a gap of
    reliability ``rel_y``: (2/π)·arcsin √(sin(π·retest_tau/2) · rel_y) (0 when either is ≤ 0)."""
    return attenuated(1.0, retest_tau, rel_y)


def spearman_brown(retest_tau: float, k: float) -> float:
    """Test–retest τ of the mean of ``k`` parallel measurements whose retest is ``retest_tau``
    (Spearman–Brown on the Pearson scale: r = sin(πτ/2), R = k·r / (1 + (k − 1)·r), back to
    τ = (2/π)·arcsin R; ``k`` may be fractional, below 1 for fewer). A retest ≤ 0 (no signal) gives
    0; a non-finite retest or ``k`` ≤ 0 gives NaN."""
    if not math.isfinite(retest_tau) or not k > 0:
        return float("nan")
    return float(2 / math.pi * math.asin(step_up(math.sin(math.pi * retest_tau / 2), k)))


def step_up(r: float, k: float) -> float:
    """Spearman–Brown on the Pearson scale: the reliability of a mean over ``k`` times as many parallel units as
    the one of reliability ``r``, k·r / (1 + (k − 1)·r) (``k`` may be fractional); a reliability ≤ 0 (no signal)
    gives 0."""
    if r <= 0:
        return 0.0
    return k * r / (1 + (k - 1) * r)


def spearman_brown_factor(retest_tau: float, target_tau: float) -> float:
    """The ``k`` with ``spearman_brown(retest_tau, k) == target_tau``: how many times more data the
    measurement needs for its retest to reach ``target_tau`` (inf without signal, ``retest_tau`` ≤ 0)."""
    target = _check_unit("target_tau", target_tau)
    if not 0.0 < target < 1.0:
        raise ValueError(f"target_tau must lie strictly between 0 and 1, got {target_tau}")
    r, big_r = float(np.sin(np.pi * _check_unit("retest_tau", retest_tau) / 2.0)), float(np.sin(np.pi * target / 2.0))
    if r <= 0:
        return float("inf")
    return big_r * (1.0 - r) / (r * (1.0 - big_r))


def retest_by_subsets(first: np.ndarray, second: np.ndarray, sizes: Sequence[int], *, n_draws: int,
                      seed: int) -> pd.DataFrame:
    """Test–retest τ against the number of batches averaged: ``first`` and ``second`` hold each
    member's value per batch on two disjoint sets of batches (``[members, batches]``). For each
    ``k`` of ``sizes``, τ-b between the members' means over ``k`` batches of ``first`` and over ``k``
    of ``second``: the mean (and standard deviation) over ``n_draws`` random choices of the batches
    (without replacement within a set; ``default_rng(seed)``), or the one value when ``k`` is both
    sets' size. Columns ``k, tau, tau_sd, n_draws``."""
    first, second = np.asarray(first, dtype=float), np.asarray(second, dtype=float)
    if first.ndim != 2 or second.ndim != 2 or first.shape[0] != second.shape[0] or first.shape[0] < 3:
        raise ValueError(f"first and second must be [members, batches] arrays of the same >= 3 members, "
                         f"got shapes {first.shape} and {second.shape}")
    if n_draws < 1:
        raise ValueError(f"n_draws must be >= 1, got {n_draws}")
    rng, rows = np.random.default_rng(seed), []
    for k in sizes:
        if not 1 <= k <= min(first.shape[1], second.shape[1]):
            raise ValueError(f"k = {k} batches: each set has {first.shape[1]} and {second.shape[1]}; choose 1..min")
        whole = k == first.shape[1] == second.shape[1]
        draws = 1 if whole else n_draws
        pick = [np.stack([np.arange(v.shape[1]) if whole else rng.choice(v.shape[1], k, replace=False)
                          for _ in range(draws)]) for v in (first, second)]
        a = first[:, pick[0]].mean(axis=2).T    # [draws, members]
        b = second[:, pick[1]].mean(axis=2).T
        taus = tau_rows(a, b)
        rows.append(dict(k=int(k), tau=float(np.mean(taus)), tau_sd=float(np.std(taus)), n_draws=draws))
    return pd.DataFrame(rows)


def variance_components(v: np.ndarray) -> tuple[float, float]:
    """``(s_m, s_e)`` of the two-way (members × batches) table ``log v``: the member variance and the residual
    (member × batch interaction plus solver noise) variance, by the method of moments (``s_m`` clipped at 0)."""
    x = np.log(np.maximum(np.asarray(v, dtype=float), np.finfo(float).tiny))
    if x.ndim != 2 or x.shape[0] < 2 or x.shape[1] < 2:
        raise ValueError(f"v must be a [members >= 2, batches >= 2] array, got shape {x.shape}")
    n_m, n_b = x.shape
    resid = x - x.mean(1, keepdims=True) - x.mean(0, keepdims=True) + x.mean()
    ms_e = float((resid ** 2).sum() / ((n_m - 1) * (n_b - 1)))
    ms_m = float(n_b * x.mean(1).var(ddof=1))
    return max(0.0, (ms_m - ms_e) / n_b), ms_e


def component_reliability(s_m: float, s_e: float, k: float) -> float:
    """Pearson reliability of a member's mean over ``k`` batches from the variance components: s_m / (s_m + s_e/k)
    (0 without member variance)."""
    return s_m / (s_m + s_e / k) if s_m > 0 else 0.0


def component_retest(s_m: float, s_e: float, k: float) -> float:
    """The Kendall τ two disjoint means over ``k`` batches each reach (bivariate normal, Greiner's relation:
    (2/π)·arcsin of :func:`component_reliability`)."""
    return float(2 / math.pi * math.asin(component_reliability(s_m, s_e, k)))


def batches_for(s_m: float, s_e: float, target: float) -> float:
    """Batches per half whose :func:`component_retest` reaches the retest τ ``target`` (Spearman–Brown; inf
    without member variance)."""
    if s_m <= 0:
        return math.inf
    r = math.sin(math.pi * target / 2)
    return r / (1 - r) * s_e / s_m


def all_splits_retest(v: np.ndarray, k: int) -> float:
    """Mean Kendall τ-b between the members' means over two disjoint sets of ``k`` batches of ``v`` (``[members,
    batches]``), over every such pair of sets (the measured retest without the luck of one split)."""
    import itertools

    v = np.asarray(v, dtype=float)
    n = v.shape[1]
    if not 1 <= k <= n // 2:
        raise ValueError(f"k = {k}: two disjoint sets of k batches need 1 <= k <= {n // 2} ({n} batches)")
    taus = []
    for a in itertools.combinations(range(n), k):
        rest = [i for i in range(n) if i not in a]
        for b in itertools.combinations(rest, k):
            if b[0] > a[0]:
                taus.append(stats.kendalltau(v[:, list(a)].mean(1), v[:, list(b)].mean(1)).statistic)
    return float(np.mean(taus))


def batch_retest(v: np.ndarray, k: int, *, target: float) -> dict:
    """The retest of a mean over ``k`` batches of ``v`` (``[members, 2h]``: half A the first ``h`` batches, half B
    the rest), measured and predicted: ``retest`` (τ-b between the means over the first ``k`` batches of each
    half), ``retest_splits`` (:func:`all_splits_retest`), ``retest_vc`` (:func:`component_retest`), the variance
    components ``s_member``, ``s_resid``, their ratio ``noise_ratio`` and ``batches_for_target``
    (:func:`batches_for` ``target``)."""
    v = np.asarray(v, dtype=float)
    h = v.shape[1] // 2
    if not 1 <= k <= h:
        raise ValueError(f"k = {k} batches per half: the halves hold {h}; choose 1..{h}")
    s_m, s_e = variance_components(v)
    return dict(retest=float(stats.kendalltau(v[:, :k].mean(1), v[:, h:h + k].mean(1)).statistic),
                retest_splits=all_splits_retest(v, k), retest_vc=component_retest(s_m, s_e, k),
                s_member=s_m, s_resid=s_e, noise_ratio=s_e / s_m if s_m > 0 else math.inf,
                batches_for_target=batches_for(s_m, s_e, target))


def _null_z(tau: np.ndarray, n: int) -> np.ndarray:
    """Kendall's normal approximation under τ = 0 (no ties): z = 3τ√(n(n−1)) / √(2(2n+5))."""
    return 3.0 * tau * np.sqrt(n * (n - 1.0)) / np.sqrt(2.0 * (2.0 * n + 5.0))


def power(n: int, tau: float, retest_tau: float, rel_y: float, *, alpha: float, n_sim: int, seed: int) -> float:
    """Monte Carlo power of the two-sided level-``alpha`` test of τ = 0 over ``n`` members.

    Each simulation draws a latent bivariate normal with Kendall τ = ``tau`` (Pearson sin(πτ/2)),
    adds independent noise to each variable so that its reliability is sin(π·retest_tau/2) (the
    measure) and ``rel_y`` (the gap), and computes the observed τ-b; the test rejects when
    |z| > z_{1−α/2} with Kendall's normal approximation (:func:`_null_z`). Returns the fraction of
    rejections (at ``tau = 0`` that is the test's size, close to ``alpha``).
    """
    if n < 4:
        raise ValueError(f"n must be >= 4 members, got {n}")
    if not 0.0 < alpha < 1.0 or n_sim < 1:
        raise ValueError(f"alpha must lie in (0, 1) and n_sim >= 1, got {alpha}, {n_sim}")
    r_xx, r_yy = _pearson_reliability(retest_tau, rel_y)
    r = np.sin(np.pi * _check_unit("tau", tau) / 2.0)
    rng = np.random.default_rng(seed)
    z1, z2, ex, ey = rng.standard_normal((4, n_sim, n))
    x = np.sqrt(r_xx) * z1 + np.sqrt(1.0 - r_xx) * ex
    y = np.sqrt(r_yy) * (r * z1 + np.sqrt(1.0 - r * r) * z2) + np.sqrt(1.0 - r_yy) * ey
    z = _null_z(tau_rows(x, y), n)
    return float(np.mean(np.abs(z) > stats.norm.ppf(1.0 - alpha / 2.0)))


# --------------------------------------------------------------------------- long frames and curves


def value_table(frame: pd.DataFrame, measure: str) -> pd.DataFrame:
    """``model x rho`` table of one measure's values (rows in the frame's model order)."""
    sub = frame[frame["measure"] == measure]
    if sub.empty:
        raise ValueError(f"measure {measure!r} not in frame (has {sorted(frame['measure'].unique())})")
    models = list(dict.fromkeys(frame["model"]))
    table = sub.pivot(index="model", columns="rho", values="value").reindex(models)
    if table.isna().any().any():
        raise ValueError(f"measure {measure!r} lacks values for some (model, rho)")
    return table


def gap_vector(frame: pd.DataFrame, gaps) -> tuple[list[str], np.ndarray]:
    """The frame's model names in order and their gaps (``gaps``: a mapping/Series ``model -> gap``
    or an array already in that order)."""
    names = list(dict.fromkeys(frame["model"]))
    if isinstance(gaps, (Mapping, pd.Series)):
        missing = [m for m in names if m not in gaps]
        if missing:
            raise ValueError(f"no gap for models {missing[:5]}")
        return names, np.array([float(gaps[m]) for m in names])
    g = np.asarray(gaps, dtype=float).ravel()
    if g.size != len(names):
        raise ValueError(f"{g.size} gaps for {len(names)} models")
    return names, g


def tau_curve(frame: pd.DataFrame, gaps, *, n_boot: int, seed: int, models=None) -> pd.DataFrame:
    """Kendall τ (with bootstrap interval) between the gap and each measure at every ρ.

    ``models``: optional subset of model names (e.g. one half of the zoo). Columns:
    ``measure, rho, tau, ci_low, ci_high, pvalue, n``.
    """
    names, g = gap_vector(frame, gaps)
    keep = list(range(len(names))) if models is None else [names.index(m) for m in models]
    rows = []
    for measure in dict.fromkeys(frame["measure"]):
        table = value_table(frame, measure)
        for rho in table.columns:
            res = kendall(table[rho].to_numpy()[keep], g[keep], n_boot=n_boot, seed=seed)
            rows.append(dict(measure=measure, rho=float(rho), tau=res.tau, ci_low=res.lo,
                             ci_high=res.hi, pvalue=res.pvalue, n=res.n))
    return pd.DataFrame(rows)


def retest_table(first: pd.DataFrame, second: pd.DataFrame, *, n_boot: int, seed: int) -> pd.DataFrame:
    """Test–retest τ over the models for every (measure, ρ) present in both long frames (values
    of the same models on two disjoint data sets, aligned by model name). Columns:
    ``measure, rho, tau, ci_low, ci_high, pvalue, n``."""
    a = first.set_index(["measure", "rho", "model"])["value"]
    b = second.set_index(["measure", "rho", "model"])["value"]
    rows = []
    for (measure, rho), va in a.groupby(level=[0, 1], sort=False):
        try:
            vb = b.loc[(measure, rho)]
        except KeyError:
            continue
        va = va.droplevel([0, 1])
        common = [m for m in va.index if m in vb.index]
        if len(common) < 3:
            raise ValueError(f"{measure} at rho={rho}: {len(common)} models measured twice; need >= 3")
        t = retest(va.loc[common].to_numpy(), vb.loc[common].to_numpy(), n_boot=n_boot, seed=seed)
        rows.append(dict(measure=measure, rho=float(rho), tau=t.tau, ci_low=t.lo, ci_high=t.hi,
                         pvalue=t.pvalue, n=t.n))
    if not rows:
        raise ValueError("no (measure, rho) is in both frames")
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- paired Δτ (issue 24)


def resample_counts(n: int, n_boot: int, seed: int) -> np.ndarray:
    """How often each of ``n`` members occurs in each of ``n_boot`` bootstrap resamples (``[n_boot, n]``,
    int64): the resamples :func:`kendall` draws, ``default_rng(seed).integers(0, n, (n_boot, n))``, as counts."""
    if n < 1 or n_boot < 1:
        raise ValueError(f"need n >= 1 members and n_boot >= 1 resamples, got {n} and {n_boot}")
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    flat = idx + n * np.arange(n_boot)[:, None]
    return np.bincount(flat.ravel(), minlength=n_boot * n).reshape(n_boot, n)


def tau_resamples(x: Sequence[float], y: Sequence[float], counts: np.ndarray) -> np.ndarray:
    """Kendall τ-b of ``x`` and ``y`` on every resample given by ``counts`` (``[k, n]``: how often each
    member occurs), NaN where a resample leaves a variable constant.

    The same integers as :func:`tau_rows` on the resampled arrays — over the resample's pairs of positions
    Σ s_x·s_y = wᵀ (S_x ∘ S_y) w with ``w`` the counts (a member paired with its own copy has sign 0) —
    computed as one matrix product, so 10 000 resamples of 72 members take milliseconds; the values are
    bit-identical to :func:`tau_rows` (exact integers, combined in the same order)."""
    x, y = _as_pair(x, y)
    w = np.asarray(counts, dtype=float)
    if w.ndim != 2 or w.shape[1] != x.size:
        raise ValueError(f"counts must be [resamples, {x.size}], got shape {w.shape}")
    sx, sy = _signs(x).astype(float), _signs(y).astype(float)

    def form(m: np.ndarray) -> np.ndarray:   # wᵀ M w per row: exact integers below 2**53 in float64
        return np.einsum("ki,ki->k", w @ m, w)

    num, nx, ny = form(sx * sy) / 2, form(sx * sx) / 2, form(sy * sy) / 2
    ok = (nx > 0) & (ny > 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(ok, num / np.sqrt(np.where(ok, nx, 1)) / np.sqrt(np.where(ok, ny, 1)), np.nan)


def partial_tau(t_xy, t_xz, t_yz):
    """Kendall's partial τ of x and y controlling for z (elementwise on arrays):
    (τ_xy − τ_xz·τ_yz) / √((1 − τ_xz²)(1 − τ_yz²)); NaN where z ranks like x or y exactly (|τ| = 1)."""
    t_xy, t_xz, t_yz = (np.asarray(t, dtype=float) for t in (t_xy, t_xz, t_yz))
    den = np.sqrt((1.0 - t_xz ** 2) * (1.0 - t_yz ** 2))
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(den > 0, (t_xy - t_xz * t_yz) / np.where(den > 0, den, 1.0), np.nan)
    return float(out) if out.ndim == 0 else out


@dataclass(frozen=True)
class DeltaTau:
    """Signed paired difference of two Kendall τ with the same variable ``y`` over the same members:
    ``delta = sign · (tau_x − tau_base)`` with its paired-bootstrap interval ``[lo, hi]``.

    ``tau_x``, ``tau_base``: the two τ themselves (unsigned); ``n_boot``: resamples on which both were
    defined."""

    delta: float
    lo: float
    hi: float
    tau_x: float
    tau_base: float
    sign: int
    n: int
    n_boot: int

    @property
    def ci_low(self) -> float:
        return self.lo

    @property
    def ci_high(self) -> float:
        return self.hi

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.delta:+.3f} [{self.lo:+.3f}, {self.hi:+.3f}] (n={self.n})"


def _sign(sign: int) -> int:
    if sign not in (1, -1):
        raise ValueError(f"sign must be +1 or -1 (the sign of the paper's τ), got {sign!r}")
    return int(sign)


def _check_boot(n_boot: int, confidence: float) -> None:
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1 for a paired interval, got {n_boot}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")


def paired_delta_tau(x: Sequence[float], base: Sequence[float], y: Sequence[float], *, sign: int, n_boot: int,
                     seed: int, confidence: float = 0.95) -> DeltaTau:
    """Paired Δτ = ``sign`` · (τ(x, y) − τ(base, y)) over the same members, with a percentile interval from a
    paired bootstrap: every resample (the resamples of :func:`kendall` with this ``seed``,
    :func:`resample_counts`) gives both τ, so their correlation through the shared members is kept.

    Issue 24's primary test: ``x`` a geodesic measure, ``base`` adaptive sharpness, ``y`` the gap, ``sign``
    the sign of the paper's τ for the row, so a positive Δ means ``x`` tracks ``y`` more strongly in the
    paper's direction (reports/preregistration/delta_tau.md). Point values: scipy's τ-b, as :func:`kendall`."""
    x, y = _as_pair(x, y)
    base, _ = _as_pair(base, y)
    s = _sign(sign)
    _check_boot(n_boot, confidence)
    tx = float(stats.kendalltau(x, y, variant="b").statistic)
    tb = float(stats.kendalltau(base, y, variant="b").statistic)
    counts = resample_counts(x.size, n_boot, seed)
    boots = s * (tau_resamples(x, y, counts) - tau_resamples(base, y, counts))
    lo, hi, kept = _interval(boots, confidence)
    return DeltaTau(s * (tx - tb), lo, hi, tx, tb, s, x.size, kept)


def partial_kendall(x: Sequence[float], y: Sequence[float], z: Sequence[float], *, n_boot: int, seed: int,
                    confidence: float = 0.95) -> TauCI:
    """Kendall's partial τ of ``x`` and ``y`` controlling for ``z`` (:func:`partial_tau` of the three τ-b), with a
    percentile bootstrap interval (the three τ recomputed on every resample of :func:`resample_counts`).
    ``pvalue`` is not defined for it (NaN)."""
    x, y = _as_pair(x, y)
    z, _ = _as_pair(z, y)
    _check_boot(n_boot, confidence)
    t = lambda a, b: float(stats.kendalltau(a, b, variant="b").statistic)  # noqa: E731
    point = partial_tau(t(x, y), t(x, z), t(y, z))
    c = resample_counts(x.size, n_boot, seed)
    lo, hi, kept = _interval(partial_tau(tau_resamples(x, y, c), tau_resamples(x, z, c), tau_resamples(y, z, c)),
                             confidence)
    return TauCI(point, lo, hi, x.size, float("nan"), kept)


def paired_delta_partial(x: Sequence[float], base: Sequence[float], y: Sequence[float], z: Sequence[float], *,
                         sign: int, n_boot: int, seed: int, confidence: float = 0.95) -> DeltaTau:
    """:func:`paired_delta_tau` of Kendall's partial τ controlling for ``z``: ``sign`` · (τ_{xy·z} − τ_{base,y·z}),
    both partial τ recomputed on the same resamples."""
    x, y = _as_pair(x, y)
    base, _ = _as_pair(base, y)
    z, _ = _as_pair(z, y)
    s = _sign(sign)
    _check_boot(n_boot, confidence)
    t = lambda a, b: float(stats.kendalltau(a, b, variant="b").statistic)  # noqa: E731
    tyz = t(y, z)
    px, pb = partial_tau(t(x, y), t(x, z), tyz), partial_tau(t(base, y), t(base, z), tyz)
    c = resample_counts(x.size, n_boot, seed)
    byz = tau_resamples(y, z, c)
    boots = s * (partial_tau(tau_resamples(x, y, c), tau_resamples(x, z, c), byz)
                 - partial_tau(tau_resamples(base, y, c), tau_resamples(base, z, c), byz))
    lo, hi, kept = _interval(boots, confidence)
    return DeltaTau(s * (px - pb), lo, hi, px, pb, s, x.size, kept)


def latent_between(tau_observed: float, retest_x: float, retest_base: float, r_xy: float, r_by: float) -> float:
    """The error-free Pearson correlation of two measures that :func:`delta_power` assumes
    (reports/preregistration/delta_tau.md): their observed Kendall τ to Pearson (sin(πτ/2)), divided by
    √(r_xx·r_bb) (reliabilities from the retests, as :func:`attenuated`), clipped to [−0.99, 0.99], then
    moved toward ``r_xy·r_by`` by the smallest step that makes the 3 × 3 correlation matrix with the gap
    positive definite: its determinant 1 − r² − r_xy² − r_by² + 2·r·r_xy·r_by is a concave quadratic in r,
    positive strictly between r_xy·r_by ± √((1 − r_xy²)(1 − r_by²)); r is kept within 99.9 % of that
    half-width."""
    r_xx, r_bb = _pearson_reliability(retest_x, 1.0)[0], _pearson_reliability(retest_base, 1.0)[0]
    if r_xx <= 0 or r_bb <= 0:
        raise ValueError(f"both retests must show signal (> 0) to disattenuate, got {retest_x} and {retest_base}")
    r = float(np.clip(np.sin(np.pi * _check_unit("tau_observed", tau_observed) / 2.0) / np.sqrt(r_xx * r_bb),
                      -0.99, 0.99))
    centre = r_xy * r_by
    half = 0.999 * math.sqrt(max((1.0 - r_xy ** 2) * (1.0 - r_by ** 2), 0.0))
    return float(np.clip(r, centre - half, centre + half))


def delta_power(n: int, tau_x: float, tau_base: float, *, retest_x: float, retest_base: float, rel_y: float,
                tau_between: float, sign: int, n_sim: int, n_boot: int, seed: int, confidence: float = 0.95) -> float:
    """Monte Carlo power of the paired Δτ test (lower edge of the paired bootstrap interval > 0) at ``n``
    members if the error-free τ with the gap were ``tau_x`` and ``tau_base`` (the paper's).

    Each of ``n_sim`` simulated zoos draws a latent trivariate normal (X, B, Y) with corr(X, Y) =
    sin(π·tau_x/2), corr(B, Y) = sin(π·tau_base/2) and corr(X, B) = :func:`latent_between` of the measures'
    observed τ ``tau_between``; each variable gets independent noise so that its reliability is
    sin(π·retest/2) (the measures) or ``rel_y`` (the gap), as :func:`power`; the zoo is analysed as the real
    one, :func:`paired_delta_tau`'s interval with ``n_boot`` resamples. Returns the fraction of zoos whose
    interval's lower edge is > 0 (pre-registered: reports/preregistration/delta_tau.md)."""
    if n < 4:
        raise ValueError(f"n must be >= 4 members, got {n}")
    if n_sim < 1:
        raise ValueError(f"n_sim must be >= 1, got {n_sim}")
    s = _sign(sign)
    _check_boot(n_boot, confidence)
    r_xx, r_yy = _pearson_reliability(retest_x, rel_y)
    r_bb = _pearson_reliability(retest_base, rel_y)[0]
    r_xy = float(np.sin(np.pi * _check_unit("tau_x", tau_x) / 2.0))
    r_by = float(np.sin(np.pi * _check_unit("tau_base", tau_base) / 2.0))
    r_xb = latent_between(tau_between, retest_x, retest_base, r_xy, r_by)
    chol = np.linalg.cholesky(np.array([[1.0, r_xb, r_xy], [r_xb, 1.0, r_by], [r_xy, r_by, 1.0]]))
    rel = np.sqrt(np.array([r_xx, r_bb, r_yy]))
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(n_sim):
        latent = rng.standard_normal((n, 3)) @ chol.T
        obs = rel * latent + np.sqrt(1.0 - rel ** 2) * rng.standard_normal((n, 3))
        counts = resample_counts(n, n_boot, int(rng.integers(2 ** 63)))
        boots = s * (tau_resamples(obs[:, 0], obs[:, 2], counts) - tau_resamples(obs[:, 1], obs[:, 2], counts))
        lo = _interval(boots, confidence)[0]
        hits += bool(lo > 0)
    return hits / n_sim


def random_split_retest(per_batch: np.ndarray, *, n_splits: int, seed: int) -> tuple[float, float]:
    """Test–retest of a measure measured on ``2h`` batches per member (``per_batch``: ``[members, 2h]``) as the
    mean (and standard deviation) over ``n_splits`` random splits of the batches into two halves of ``h``:
    per split (an independent permutation from ``default_rng(seed)``), Kendall τ-b between the members'
    means over the two halves. Split rule pre-registered in reports/preregistration/delta_tau.md."""
    v = np.asarray(per_batch, dtype=float)
    if v.ndim != 2 or v.shape[0] < 3 or v.shape[1] < 2 or v.shape[1] % 2:
        raise ValueError(f"per_batch must be [members >= 3, an even number of batches], got shape {v.shape}")
    if n_splits < 1:
        raise ValueError(f"n_splits must be >= 1, got {n_splits}")
    rng, h = np.random.default_rng(seed), v.shape[1] // 2
    perms = np.stack([rng.permutation(v.shape[1]) for _ in range(n_splits)])    # [splits, 2h]
    a = v[:, perms[:, :h]].mean(axis=2).T     # [splits, members]
    b = v[:, perms[:, h:]].mean(axis=2).T
    taus = tau_rows(a, b)
    return float(np.mean(taus)), float(np.std(taus))


@dataclass(frozen=True)
class MinimumDetectable:
    """The smallest error-free Δ a paired Δτ test detects with power ``target`` (:func:`delta_mde`): ``delta`` (NaN
    when not reached below ``delta_max``), the power there, ``power_max`` at ``delta_max`` (the largest Δ the τ scale
    allows) and the number of power evaluations."""

    delta: float
    power: float
    delta_max: float
    power_max: float
    target: float
    evaluations: int

    @property
    def reached(self) -> bool:
        return math.isfinite(self.delta)

    def as_dict(self) -> dict:
        return asdict(self) | {"reached": self.reached}


def delta_mde(n: int, tau_base: float, *, retest_x: float, retest_base: float, rel_y: float, tau_between: float,
              sign: int, n_sim: int, n_boot: int, seed: int, confidence: float = 0.95, target: float = 0.8,
              tol: float = 0.005, max_abs_tau: float = 0.99) -> MinimumDetectable:
    """Minimum detectable Δ of the paired Δτ test: the smallest error-free Δ ≥ 0 at which :func:`delta_power` (the
    test's pre-registered power: ``n`` members, the reliabilities, the measures' observed τ ``tau_between``) reaches
    ``target``, with the baseline's error-free τ held at ``tau_base`` and the other measure's at
    ``tau_base + sign·Δ`` (so Δ is on the scale of the paper's Δ = sign·(τ_g − τ_adaptive)).

    Bisection on Δ between 0 and ``delta_max`` = ``max_abs_tau − sign·tau_base`` (|τ| ≤ ``max_abs_tau``) until the
    bracket is narrower than ``tol``; every evaluation uses the same ``seed`` (common random numbers, so the power is
    a deterministic, nearly monotone function of Δ and the bracket is well defined). Returns the bracket's upper end,
    whose power is ≥ ``target``; NaN when even ``delta_max`` falls short."""
    _sign(sign)
    if not 0.0 < target < 1.0 or not tol > 0:
        raise ValueError(f"target must lie in (0, 1) and tol be > 0, got {target}, {tol}")
    tau_base = _check_unit("tau_base", tau_base)
    delta_max = max_abs_tau - sign * tau_base
    if not delta_max > 0:
        raise ValueError(f"tau_base = {tau_base} leaves no room for a positive Δ below |τ| = {max_abs_tau}")
    count = [0]

    def pw(d: float) -> float:
        count[0] += 1
        return delta_power(n, tau_base + sign * d, tau_base, retest_x=retest_x, retest_base=retest_base, rel_y=rel_y,
                           tau_between=tau_between, sign=sign, n_sim=n_sim, n_boot=n_boot, seed=seed,
                           confidence=confidence)

    p_max = pw(delta_max)
    if p_max < target:
        return MinimumDetectable(float("nan"), float("nan"), delta_max, p_max, target, count[0])
    lo, hi, p_hi = 0.0, delta_max, p_max
    while hi - lo > tol:
        mid = (lo + hi) / 2
        p = pw(mid)
        if p >= target:
            hi, p_hi = mid, p
        else:
            lo = mid
    return MinimumDetectable(hi, p_hi, delta_max, p_max, target, count[0])
