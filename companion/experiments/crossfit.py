"""Two-fold cross-fitting of the radius: every model evaluated once, at a radius chosen without it.

The split-half protocol (:func:`companion.experiments.zoo.split_half_taus`) chooses each
measure's ρ on one half of the zoo and reports τ on the other half, so half of the models
never serve as evaluation. Cross-fitting uses both directions: ρ_A chosen on half A (largest
|τ|, or the signed criterion) is evaluated on half B, ρ_B chosen on B is evaluated on A, and
the reported τ is the mean of the two held-out τ. Values at different radii are never pooled
into one ranking (sharpness grows with ρ, so that would mix scales).

The interval is a percentile bootstrap that resamples the models within each half
independently, with both radii held at their chosen values (as the split-half interval holds
its radius), so it does not include the variability of the choice itself.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd
from companion.analysis import kendall, tau_rows, value_table


def _tau(x: np.ndarray, y: np.ndarray) -> float:
    return kendall(x, y, n_boot=0, seed=0).tau


def _choose(table: pd.DataFrame, gaps: pd.Series, models: list[str], criterion: str) -> float | None:
    best, best_score = None, -np.inf
    for rho in sorted(table.columns):
        t = _tau(table.loc[models, rho].to_numpy(), gaps.loc[models].to_numpy())
        if not np.isfinite(t):
            continue
        score = {"abs": abs(t), "max": t, "min": -t}[criterion]
        if score > best_score:
            best, best_score = float(rho), score
    return best   # None: tau undefined at every radius on this half (e.g. a constant gap)


def crossfit_taus(frame: pd.DataFrame, gaps: pd.Series | Mapping[str, float], halves: Mapping[str, list[str]], *,
                  n_boot: int, seed: int, criterion: str = "abs") -> pd.DataFrame:
    """Per measure of ``frame`` (columns ``model, measure, rho, value``): the radius chosen on each
    half, the τ of the other half at it, their mean and its bootstrap 95 % interval.

    ``halves``: ``{"select": [...], "eval": [...]}`` as returned by ``split_half_taus`` (the same
    halves, so ``tau_b`` equals the split-half table's held-out τ). Columns: ``measure, rho_a,
    rho_b, tau_a, tau_b, tau, ci_low, ci_high, n`` (``tau_a``: half A's τ at the ρ chosen on B).
    """
    if criterion not in ("abs", "max", "min"):
        raise ValueError(f"criterion must be 'abs', 'max' or 'min', got {criterion!r}")
    gaps = pd.Series(gaps, dtype=float)
    a, b = list(halves["select"]), list(halves["eval"])
    if set(a) & set(b):
        raise ValueError("the two halves share models")
    rng = np.random.default_rng(seed)
    rows = []
    for measure in dict.fromkeys(frame["measure"]):
        table = value_table(frame, measure)
        rho_a, rho_b = _choose(table, gaps, a, criterion), _choose(table, gaps, b, criterion)
        if rho_a is None or rho_b is None:   # no radius can be chosen on a half: no cross-fit (NaN, not a guess)
            rows.append(dict(measure=measure, rho_a=rho_a, rho_b=rho_b, tau_a=np.nan, tau_b=np.nan, tau=np.nan,
                             ci_low=np.nan, ci_high=np.nan, n=len(a) + len(b)))
            continue
        xa, ya = table.loc[a, rho_b].to_numpy(), gaps.loc[a].to_numpy()   # half A at the radius chosen on B
        xb, yb = table.loc[b, rho_a].to_numpy(), gaps.loc[b].to_numpy()
        tau_a, tau_b = _tau(xa, ya), _tau(xb, yb)
        draws = [(rng.integers(0, len(a), len(a)), rng.integers(0, len(b), len(b))) for _ in range(n_boot)]
        ia = np.array([d[0] for d in draws], dtype=int).reshape(n_boot, len(a))
        ib = np.array([d[1] for d in draws], dtype=int).reshape(n_boot, len(b))
        boots = 0.5 * (tau_rows(xa[ia], ya[ia]) + tau_rows(xb[ib], yb[ib]))
        boots = boots[np.isfinite(boots)]
        lo, hi = (np.percentile(boots, [2.5, 97.5]) if boots.size else (np.nan, np.nan))
        rows.append(dict(measure=measure, rho_a=rho_a, rho_b=rho_b, tau_a=tau_a, tau_b=tau_b,
                         tau=0.5 * (tau_a + tau_b), ci_low=float(lo), ci_high=float(hi), n=len(a) + len(b)))
    return pd.DataFrame(rows)


def table1_entry(row: str, crossfit: pd.DataFrame, n_models: int) -> dict:
    """The Table 1 line of a cross-fit table (τ the mean of both held-out halves)."""
    t = crossfit.set_index("measure")
    radii = "; ".join(f"{m} {r['rho_a']:g}/{r['rho_b']:g}" for m, r in t.iterrows()
                      if r["rho_a"] is not None and r["rho_b"] is not None and np.isfinite(r["tau"]))
    return {"row": row, "variant": f"2-fold cross-fit: mean τ of both held-out halves (ρ chosen on A/B: {radii})",
            "tau": {m: float(r["tau"]) for m, r in t.iterrows()},
            "ci": {m: [float(r["ci_low"]), float(r["ci_high"])] for m, r in t.iterrows()},
            "n_models": int(n_models)}
