"""The ``minilm`` stage without its plots: what ``notebooks/minilm.ipynb`` shows (Table 1, primary language row).

:func:`run_report` measures the MiniLM zoo (:mod:`companion.experiments.minilm_zoo`) and writes the stage's metrics
(layout: :mod:`companion.metrics`) and data tables (the layout of the ``language`` stage: ``sharpness.csv``,
``members.csv``, ``primary.csv``):

**Primary (pre-registered, ``reports/pilots/minilm.md`` and ``reports/preregistration/delta_tau.md``).** The
paired Δτ = s·(τ_geodesic − τ_adaptive) of each geodesic measure against adaptive sharpness, with s the sign of
the paper's MNLI τ, over all members, with a paired bootstrap interval (the same resample for both measures) and
its Monte Carlo power at the paper's Δ (:func:`delta_table`). Beside it, per measure (as the ``language``
stage, :func:`companion.experiments.language_report.primary_table`): τ against the dev − train gap with its
interval, the test–retest of the two halves of the batches and the reliability of their mean, the gap's
reliability, the ceiling on |τ| and the power at the paper's τ. The radii, the protocol (pairs, batch size,
iterations), the member count and the fit rule come from the pilot, committed before this zoo was trained.

**Exploratory**: τ on the fitted members only (train error ≤ ``max_train_error``) and against the HANS-like gap.
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd

from companion import analysis, paper
from companion.experiments import language_pilot as lp
from companion.experiments import language_report as lr
from companion.experiments import minilm_pilot as mp
from companion.experiments import minilm_zoo as mz
from companion.experiments.zoo import STANDARD, measure_zoo

STAGE = "minilm"


@dataclass(frozen=True)
class PairedSettings:
    n_boot: int                # paired bootstrap over members (pre-registered: 10 000, seed 24)
    seed: int
    confidence: float
    power_n_sim: int           # Monte Carlo power at the paper's Δ
    power_n_boot: int
    retest_splits: int         # the halves' retest as the mean over random splits (pre-registered rule)


@dataclass(frozen=True)
class MiniLMSettings:
    zoo_dir: str
    device: str
    threads: int | None
    workers: int
    n_points: int | None
    batch_size: int
    data_seed: int
    n_iters: int
    seed: int
    rho: dict[str, float] | None
    eps: float
    max_train_error: float
    n_boot: int
    gap_splits: int
    power_alpha: float
    power_n_sim: int
    paired: PairedSettings


def settings_from(params: Mapping[str, Any]) -> MiniLMSettings:
    """Typed settings from the resolved ``minilm`` parameters."""
    from companion.params import settings

    return settings(MiniLMSettings, STAGE, "cpu", params={STAGE: {"cpu": dict(params)}})


@dataclass
class MiniLMReport:
    settings: MiniLMSettings
    setting: str
    members: pd.DataFrame
    frame: pd.DataFrame
    primary: pd.DataFrame       # per measure (language_report.primary_table)
    delta: pd.DataFrame         # per geodesic measure: the paired Δτ (primary)
    subsets: dict
    metrics: dict
    findings: str


def measure_primary(s: MiniLMSettings, src: mz.MiniLMZoo, names: list[str], *, progress: bool = True) -> pd.DataFrame:
    """The three measures at their pre-registered radii on every member, all ``n_points`` pairs."""
    if s.rho is None:
        raise ValueError("minilm.rho is null: the radii are pre-registered by the pilot "
                         "(python -m companion.experiments.minilm_pilot) before the main zoo is measured")
    missing = set(STANDARD) - set(s.rho)
    if missing:
        raise ValueError(f"minilm.rho has no pre-registered radius for {sorted(missing)}")
    if s.n_points is None:
        raise ValueError("minilm.n_points is null: the protocol is pre-registered by the pilot before the main zoo is "
                         "measured; write it into params.yaml first")
    if s.n_points % (2 * s.batch_size):
        raise ValueError(f"n_points={s.n_points} must be an even number of batches of {s.batch_size} "
                         "(the retest compares the two halves)")
    measures = {k: {"measure": (m.replace(eps=s.eps) if m.geometry == "geodesic" else m)} for k, m in STANDARD.items()}
    batches = src.sharpness_batches(s.n_points, s.batch_size, s.data_seed)
    return measure_zoo(src.loaders(names, s.device), batches, measures, {k: [s.rho[k]] for k in measures},
                       seed=s.seed, n_iters=s.n_iters, progress=progress, workers=s.workers)


def paired_delta(a: np.ndarray, g: np.ndarray, gap: np.ndarray, *, sign: float, n_boot: int, seed: int,
                 confidence: float) -> dict[str, float]:
    """Δ = sign·(τ(g, gap) − τ(a, gap)) with a percentile interval of the paired bootstrap over members: resample
    ``default_rng(seed).integers(0, n, (n_boot, n))``, the same resample for both τ; resamples where a τ is
    undefined are dropped."""
    a, g, gap = (np.asarray(v, dtype=float) for v in (a, g, gap))
    n = gap.size
    if not (a.size == g.size == n) or n < 3:
        raise ValueError(f"paired Δτ needs three aligned vectors of >= 3 members, got {a.size}, {g.size}, {n}")
    delta = sign * (analysis.tau_rows(g, gap)[0] - analysis.tau_rows(a, gap)[0])
    idx = np.random.default_rng(seed).integers(0, n, (n_boot, n))
    boots = sign * (analysis.tau_rows(g[idx], gap[idx]) - analysis.tau_rows(a[idx], gap[idx]))
    boots = boots[np.isfinite(boots)]
    q = (1 - confidence) / 2
    lo, hi = np.quantile(boots, [q, 1 - q]) if boots.size else (math.nan, math.nan)
    return {"delta": float(delta), "ci_low": float(lo), "ci_high": float(hi), "n_boot_kept": int(boots.size)}


def retest_splits(frame: pd.DataFrame, names, *, n_splits: int, seed: int) -> dict[str, float]:
    """Per measure: the Kendall τ between the means over two random halves of the batches, averaged over
    ``n_splits`` random splits (the pre-registered retest of the halves for language rows)."""
    rng = np.random.default_rng(seed)
    out = {}
    for m in STANDARD:
        v = np.array([list(x) for x in frame[frame["measure"] == m].set_index("model").loc[names, "per_batch"]])
        nb = v.shape[1]
        perms = np.array([rng.permutation(nb) for _ in range(n_splits)])
        a = np.stack([v[:, p[: nb // 2]].mean(1) for p in perms])
        b = np.stack([v[:, p[nb // 2: 2 * (nb // 2)]].mean(1) for p in perms])
        out[m] = float(np.nanmean(analysis.tau_rows(a, b)))
    return out


def delta_table(s: MiniLMSettings, frame: pd.DataFrame, members: pd.DataFrame, primary: pd.DataFrame,
                gap_rel: float | None) -> pd.DataFrame:
    """One row per geodesic measure: the paired Δτ, its interval, the paper's Δ, the power at the paper's Δ (Monte
    Carlo, :func:`companion.experiments.minilm_pilot.paired_power`, reliabilities measured on this zoo: the halves'
    retest as the mean over random splits, Spearman–Brown to the mean of both halves) and the decision rule."""
    names = list(members.index)
    tau = paper.table1_tau("language")
    sign = math.copysign(1.0, tau["geodesic_mixed"])
    val = {m: frame[frame["measure"] == m].set_index("model")["value"].loc[names].to_numpy() for m in STANDARD}
    gap = members["gap"].to_numpy(dtype=float)
    p = s.paired
    rt = retest_splits(frame, names, n_splits=p.retest_splits, seed=p.seed)
    rel_tau = {m: lr.full_length_reliability(rt[m]) for m in STANDARD}
    rel = {m: math.sin(math.pi * max(rel_tau[m], 0.0) / 2) if math.isfinite(rel_tau[m]) else 0.0 for m in STANDARD}
    rows = []
    for g in mp.GEODESIC:
        d = paired_delta(val[mp.BASELINE], val[g], gap, sign=sign, n_boot=p.n_boot, seed=p.seed, confidence=p.confidence)
        t_ag = analysis.tau_rows(val[mp.BASELINE], val[g])[0]
        r_ag = math.sin(math.pi * t_ag / 2) / math.sqrt(max(rel[mp.BASELINE] * rel[g], 1e-12)) if math.isfinite(t_ag) else 0.0
        known = gap_rel is not None and math.isfinite(gap_rel) and len(names) >= 4
        power = mp.paired_power(len(names), tau_a=tau[mp.BASELINE], tau_g=tau[g], sign=sign, rel_a=rel[mp.BASELINE],
                                rel_g=rel[g], rel_y=min(max(gap_rel, 0.0), 1.0), corr_ag=r_ag, n_sim=p.power_n_sim,
                                n_boot=p.power_n_boot, confidence=p.confidence, seed=p.seed) if known else math.nan
        paper_delta = sign * (tau[g] - tau[mp.BASELINE])
        verdict = ("supports the paper" if d["ci_low"] > 0 else "contradicts the paper's direction" if d["ci_high"] < 0
                   else "inconclusive")
        if d["ci_high"] < paper_delta and d["ci_low"] <= 0:
            verdict += "; the paper's Δ lies above the interval"
        rows.append(dict(measure=g, delta=d["delta"], ci_low=d["ci_low"], ci_high=d["ci_high"], paper_delta=paper_delta,
                         power=power, n=len(names), n_boot=p.n_boot, retest_splits_baseline=rt[mp.BASELINE],
                         retest_splits=rt[g], corr_measures_tau=float(t_ag), verdict=verdict))
    return pd.DataFrame(rows)


def table1_entries(rep: MiniLMReport) -> list[dict]:
    """The primary Table 1 entry (paired Δτ and per-measure τ) and the exploratory fitted-members line."""
    t = rep.primary.set_index("measure")
    d = rep.delta.set_index("measure")
    n = len(rep.members)
    entry = {"row": "language", "setting": rep.setting,
             "variant": f"{n} seed-only fine-tunes of pre-trained all-MiniLM-L6-v2, all members, ρ and protocol "
                        "pre-registered on pilot members", "primary": True, "exploratory": False, "n_models": n,
             "tau": t["tau"].to_dict(), "ci": {m: [r.ci_low, r.ci_high] for m, r in t.iterrows()},
             "rho": t["rho"].to_dict(), "retest": t["retest"].to_dict(), "reliability": t["reliability"].to_dict(),
             "delta_tau": d["delta"].to_dict(), "delta_tau_ci": {m: [r.ci_low, r.ci_high] for m, r in d.iterrows()},
             "power_delta": d["power"].to_dict(), "paper_delta_tau": d["paper_delta"].to_dict()}
    if t["ceiling"].notna().all():
        entry |= {"gap_reliability": float(t["gap_reliability"].iloc[0]), "tau_ceiling": t["ceiling"].to_dict(),
                  "power": t["power"].to_dict()}
    entries = [entry]
    fit = rep.subsets["fitted"]
    if fit is not None and rep.subsets["fit_rule"]["excluded"]:
        k = next(iter(fit.values()))["n"]
        entries.append({"row": "language", "setting": rep.setting, "variant": f"MiniLM, fitted members only (train "
                        f"error ≤ {rep.subsets['fit_rule']['max_train_error']:g}, rule fixed before training): {k} of {n}",
                        "primary": False, "exploratory": True, "n_models": k,
                        "tau": {m: r["tau"] for m, r in fit.items()},
                        "ci": {m: [r["ci_low"], r["ci_high"]] for m, r in fit.items()},
                        "rho": {m: r["rho"] for m, r in fit.items()}})
    return entries


def findings(rep: MiniLMReport) -> str:
    """The findings in words, generated from the numbers."""
    lines = []
    for r in rep.delta.itertuples():
        lines.append(f"- **Δτ {r.measure.replace('_', ' ')} − adaptive** (primary, paired over {r.n} members, signed by "
                     f"the paper's τ): {r.delta:+.2f} [{r.ci_low:+.2f}, {r.ci_high:+.2f}]; paper {r.paper_delta:+.2f}; "
                     f"power at the paper's Δ {r.power:.2f} — {r.verdict}.")
    lines.append("  Two geodesic measures, two tests; no multiplicity correction.")
    lines.append(lr.findings(rep.primary, rep.subsets))
    return "\n".join(lines)


def save_report_data(rep: MiniLMReport, out_dir: str | Path) -> None:
    """``out_dir/data``: sharpness.csv, members.csv, primary.csv, delta_tau.csv (the ``language`` layout + Δτ)."""
    data = Path(out_dir) / "data"
    data.mkdir(parents=True, exist_ok=True)
    fr = rep.frame
    fr.drop(columns="seconds").assign(per_batch=fr["per_batch"].map(json.dumps),
                                      base_loss=fr["base_loss"].map(json.dumps)).to_csv(data / "sharpness.csv", index=False)
    rep.primary.to_csv(data / "primary.csv", index=False)
    rep.delta.to_csv(data / "delta_tau.csv", index=False)
    members = rep.members.drop(columns=[c for c in ("seconds", "cpu_seconds") if c in rep.members])
    for col in ("test_error_by_template", "hyperparameters"):
        if col in members:
            members[col] = members[col].map(json.dumps)
    members.to_csv(data / "members.csv")


def run_report(params: Mapping[str, Any], out_dir: str | Path, profile: str = "cpu", *,
               progress: bool = True) -> MiniLMReport:
    """Measure, write metrics and data, return what the notebook plots."""
    from companion import metrics as cm
    from hideseek.utils import set_threads

    s = settings_from(params)
    set_threads(s.threads)
    for sub in ("figures", "metrics", "data"):
        (Path(out_dir) / sub).mkdir(parents=True, exist_ok=True)
    src = mz.MiniLMZoo(s.zoo_dir)
    members = src.member_table()
    names = list(members.index)
    t0 = time.perf_counter()
    frame = measure_primary(s, src, names, progress=progress)
    errors = src.eval_errors(names)
    gap_rel = lp.split_half_reliability(errors, members["train_error"].to_numpy(), n_splits=s.gap_splits, seed=s.seed)
    primary = lr.primary_table(s, frame, members, gap_rel)
    delta = delta_table(s, frame, members, primary, gap_rel)
    subsets = lr.explore_subsets(s, frame, members)
    seconds = time.perf_counter() - t0
    rep = MiniLMReport(s, src.meta["setting"], members, frame, primary, delta, subsets, {}, "")
    rep.findings = findings(rep)
    gap = members["gap"]
    rep.metrics = {
        "table1": table1_entries(rep), "table1_row": "MNLI", "profile": profile, "setting": rep.setting,
        "primary_delta_tau": delta.to_dict("records"), "primary": primary.to_dict("records"),
        "paper_tau": paper.table1_tau("language"),
        "exploratory": {"fitted": subsets["fitted"], "tau_gap_hans": subsets["gap_hans"]},
        "fit_rule": subsets["fit_rule"],
        "protocol": {"n_models": len(members), "n_points": s.n_points, "batch_size": s.batch_size,
                     "n_batches": s.n_points // s.batch_size, "n_iters": s.n_iters, "rho": s.rho, "eps": s.eps,
                     "seed": s.seed, "data_seed": s.data_seed, "n_boot": s.n_boot, "paired": vars(s.paired)},
        "zoo": {"n_models": len(members), "gap_min": float(gap.min()), "gap_max": float(gap.max()),
                "gap_median": float(gap.median()), "train_error_max": float(members["train_error"].max()),
                "base": src.meta["base"], "n_parameters_fine_tuned": src.meta["n_parameters"]},
    }
    cm.write_stage_metrics(out_dir, STAGE, rep.metrics)
    save_report_data(rep, out_dir)
    cm.write_stage_timings(out_dir, STAGE, {"seconds": seconds})
    print(f"minilm: {len(members)} members measured in {seconds:.0f} s", file=sys.stderr)
    return rep
