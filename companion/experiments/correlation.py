"""Rank correlation between a sharpness measure and generalisation.

Kendall's tau-b (``scipy.stats.kendalltau``, ties handled) with a
nonparametric bootstrap 95 % interval: models are resampled with replacement,
tau-b is recomputed on each resample, and the interval is the 2.5 / 97.5 %
percentiles. Everything is deterministic given ``seed``.

:func:`tau_split_half` guards against choosing the perturbation radius on the
same models it is reported on: it splits the population in two halves at
random, picks the radius with the largest ``|tau|`` on one half and reports
tau (with its interval) on the other half.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

import numpy as np
from scipy import stats


@dataclass(frozen=True)
class TauResult:
    """Kendall tau-b with a bootstrap percentile interval."""

    tau: float
    ci_low: float
    ci_high: float
    pvalue: float
    n: int
    n_boot: int

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.tau:+.3f} [{self.ci_low:+.3f}, {self.ci_high:+.3f}] (n={self.n})"


def _as_pair(x: Sequence[float], y: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(x, dtype=float).ravel()
    y = np.asarray(y, dtype=float).ravel()
    if x.shape != y.shape:
        raise ValueError(f"x and y must have the same length, got {x.size} and {y.size}")
    if x.size < 3:
        raise ValueError(f"need at least 3 models for a rank correlation, got {x.size}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError("x and y must be finite (a NaN sharpness usually means a diverged solver)")
    return x, y


def kendall_tau(
    x: Sequence[float],
    y: Sequence[float],
    *,
    n_boot: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> TauResult:
    """Kendall tau-b between ``x`` and ``y`` with a bootstrap interval.

    Resamples in which one variable is constant (tau undefined) are dropped.
    ``n_boot=0`` skips the bootstrap (the interval is then ``(nan, nan)``).
    """
    x, y = _as_pair(x, y)
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    if n_boot < 0:
        raise ValueError("n_boot must be >= 0")
    res = stats.kendalltau(x, y, variant="b")
    tau, pvalue = float(res.statistic), float(res.pvalue)
    if n_boot == 0:
        return TauResult(tau, float("nan"), float("nan"), pvalue, x.size, 0)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_boot, x.size))
    taus = np.empty(n_boot)
    for b in range(n_boot):
        taus[b] = stats.kendalltau(x[idx[b]], y[idx[b]], variant="b").statistic
    taus = taus[np.isfinite(taus)]
    if taus.size == 0:
        lo = hi = float("nan")
    else:
        alpha = (1.0 - confidence) / 2.0
        lo, hi = (float(v) for v in np.quantile(taus, [alpha, 1.0 - alpha]))
    return TauResult(tau, lo, hi, pvalue, x.size, int(taus.size))


@dataclass(frozen=True)
class SplitHalfResult:
    """Radius chosen on one half, tau reported on the other."""

    chosen: float
    tau_select: float
    held_out: TauResult
    select_idx: np.ndarray
    eval_idx: np.ndarray

    def as_dict(self) -> dict:
        return {
            "chosen": self.chosen,
            "tau_select": self.tau_select,
            "held_out": self.held_out.as_dict(),
            "n_select": int(self.select_idx.size),
            "n_eval": int(self.eval_idx.size),
        }


def tau_split_half(
    measures: Mapping[float, Sequence[float]],
    y: Sequence[float],
    *,
    seed: int = 0,
    n_boot: int = 2000,
    criterion: str = "abs",
) -> SplitHalfResult:
    """Choose the radius on a random half of the models, report tau on the rest.

    ``measures`` maps a radius (or any hyperparameter) to the measure's values
    on all models, ``y`` is the generalisation measure. ``criterion="abs"``
    picks the largest ``|tau|`` on the selection half; ``"max"`` and ``"min"``
    pick the largest / smallest signed tau (when the expected sign is fixed in
    advance).
    """
    if not measures:
        raise ValueError("measures is empty")
    if criterion not in ("abs", "max", "min"):
        raise ValueError(f"criterion must be 'abs', 'max' or 'min', got {criterion!r}")
    y = np.asarray(y, dtype=float).ravel()
    n = y.size
    if n < 6:
        raise ValueError(f"need at least 6 models to split in halves, got {n}")
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    sel, ev = np.sort(perm[: n // 2]), np.sort(perm[n // 2 :])
    best_key, best_score, best_tau = None, -np.inf, float("nan")
    for key in sorted(measures):
        x = np.asarray(measures[key], dtype=float).ravel()
        if x.size != n:
            raise ValueError(f"measure for {key!r} has {x.size} values, y has {n}")
        t = kendall_tau(x[sel], y[sel], n_boot=0).tau
        if not np.isfinite(t):
            continue
        score = {"abs": abs(t), "max": t, "min": -t}[criterion]
        if score > best_score:
            best_key, best_score, best_tau = key, score, t
    if best_key is None:
        raise ValueError("tau is undefined for every candidate on the selection half")
    x = np.asarray(measures[best_key], dtype=float).ravel()
    held = kendall_tau(x[ev], y[ev], n_boot=n_boot, seed=seed + 1)
    return SplitHalfResult(float(best_key), float(best_tau), held, sel, ev)
