"""Rank correlation between a sharpness measure and generalisation.

Kendall's tau-b with its bootstrap interval is :func:`companion.analysis.kendall`
(re-exported here as ``kendall_tau``).

:func:`tau_split_half` guards against choosing the perturbation radius on the
same models it is reported on: it splits the population in two halves at
random, picks the radius with the largest ``|tau|`` on one half and reports
tau (with its interval) on the other half.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from companion.analysis import TauCI, kendall


# One tau implementation: ``kendall_tau`` is :func:`companion.analysis.kendall` and its result
# :class:`companion.analysis.TauCI` (``ci_low``/``ci_high`` name its ``lo``/``hi``).
TauResult = TauCI
kendall_tau = kendall


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
    seed: int,
    n_boot: int,
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
        t = kendall(x[sel], y[sel], n_boot=0, seed=seed).tau
        if not np.isfinite(t):
            continue
        score = {"abs": abs(t), "max": t, "min": -t}[criterion]
        if score > best_score:
            best_key, best_score, best_tau = key, score, t
    if best_key is None:
        raise ValueError("tau is undefined for every candidate on the selection half")
    x = np.asarray(measures[best_key], dtype=float).ravel()
    held = kendall(x[ev], y[ev], n_boot=n_boot, seed=seed + 1)
    return SplitHalfResult(float(best_key), float(best_tau), held, sel, ev)
