"""The ``language`` stage without its plots: what ``notebooks/language.ipynb`` shows.

:func:`run_report` is the notebook's one computing call. It measures the language zoo and
writes the stage's metrics (layout: :mod:`companion.metrics`) and data tables:

**Primary comparison (pre-registered).** The paper's three measures
(:data:`companion.experiments.zoo.STANDARD`) at the radii ``rho`` written into ``params.yaml``
before the main zoo was measured (chosen on pilot members by test–retest,
:mod:`companion.pilots.language`), on **all** members, ``n_points`` training
pairs in batches of ``batch_size``, ``n_iters`` Auto-PGD iterations; Kendall τ against the
in-distribution gap (dev − train error) with a bootstrap interval. Beside each τ: the
measure's test–retest (τ between its values on the first and the second half of the
batches, disjoint pairs) and the reliability of the value τ uses — the mean of both halves —
by Spearman–Brown (:func:`full_length_reliability`), the gap's reliability across members
(split halves of the shared dev set, from per-example errors), the ceiling on |τ| they imply
and the power at the paper's τ (both from the value's reliability). No radius is chosen on the gap.

**Exploratory** (labelled so in the metrics): τ against ρ over a grid, the Appendix G
ablations, the ε sweep (at ``exploratory.n_points`` × ``exploratory.n_iters``, a cheaper
protocol), τ on fitted members only (train error ≤ ``max_train_error``, a rule fixed before
the main zoo was trained), τ against the HANS-like gap, relative flatness and the orbit
figure.
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

from companion import analysis
from companion.experiments import language_zoo as lz
from companion.experiments.correlation import kendall_tau
from companion.experiments.zoo import STANDARD, measure_zoo, per_batch_halves, tau_vs_rho
from hideseek.measures import Measure


@dataclass(frozen=True)
class OrbitSettings:
    model: str | None          # member name; None: the first
    scales: list[float]
    action_seeds: list[int]
    n_iters: int
    dtype: str                 # "float32" or "float64"
    rho: dict[str, float]


@dataclass(frozen=True)
class ExploratorySettings:
    n_points: int              # pairs of the exploratory measurements (from the first of the primary batches)
    n_iters: int
    rho_grid: dict[str, list[float]]            # τ against ρ, the three measures
    ablation_rho_grid: dict[str, list[float]]   # per measure of lz.ABLATIONS
    eps_grid: list[float]      # each metric at its pre-registered ρ
    relative_flatness_layer: str | None         # None: no relative flatness
    orbit: OrbitSettings | None


@dataclass(frozen=True)
class LanguageSettings:
    zoo_dir: str
    device: str
    threads: int | None
    workers: int
    n_points: int              # training pairs, both halves of the retest
    batch_size: int
    data_seed: int
    n_iters: int
    seed: int
    rho: dict[str, float] | None   # pre-registered, per measure of zoo.STANDARD (None: not yet; the stage refuses)
    eps: float
    max_train_error: float     # fit rule (exploratory line)
    n_boot: int
    gap_splits: int
    power_alpha: float
    power_n_sim: int
    exploratory: ExploratorySettings


def settings_from(params: Mapping[str, Any]) -> LanguageSettings:
    """Typed settings from the resolved ``language`` parameters (what the pipeline hands the notebook)."""
    from companion.params import settings

    return settings(LanguageSettings, "language", "cpu", params={"language": {"cpu": dict(params)}})


@dataclass
class LanguageReport:
    """What ``notebooks/language.ipynb`` shows, measured and saved by :func:`run_report`."""

    settings: LanguageSettings
    setting: str               # the zoo (ZooSource.description): generated here or McCoy et al.'s
    members: pd.DataFrame      # one row per member (errors, gaps, seed)
    frame: pd.DataFrame        # primary measurement: measure_zoo rows (per-batch values)
    primary: pd.DataFrame      # one row per measure: tau, interval, retest, gap reliability, ceiling, power
    explore: dict              # exploratory frames and tables (None where skipped)
    metrics: dict              # the metrics JSON written to out_dir/metrics/language.json
    findings: str              # generated from the numbers


# --------------------------------------------------------------------------- measuring


def _measure(s: LanguageSettings, names: list[str], measures: Mapping[str, Measure],
             grid: Mapping[str, list[float]], n_points: int, n_iters: int, progress: bool) -> pd.DataFrame:
    src = lz.source(s.zoo_dir)
    batches = src.sharpness_batches(s.n_points, s.batch_size, s.data_seed)[: n_points // s.batch_size]
    loaders = src.loaders(names, s.device)
    return measure_zoo(loaders, batches, {k: {"measure": m} for k, m in measures.items()}, grid, seed=s.seed,
                       n_iters=n_iters, progress=progress, workers=s.workers)


def _with_eps(m: Measure, eps: float) -> Measure:
    return m.replace(eps=eps) if m.geometry == "geodesic" else m


def measure_primary(s: LanguageSettings, names: list[str], *, progress: bool = True) -> pd.DataFrame:
    """The three measures at their pre-registered radii on every member, all ``n_points`` pairs."""
    if s.rho is None:
        raise ValueError("language.rho is null: the radii are pre-registered from the pilot "
                         "(python -m companion.pilots.language) before the main zoo is measured; "
                         "write them into params.yaml first")
    missing = set(STANDARD) - set(s.rho)
    if missing:
        raise ValueError(f"language.rho has no pre-registered radius for {sorted(missing)}")
    if s.n_points % (2 * s.batch_size):
        raise ValueError(f"n_points={s.n_points} must be an even number of batches of {s.batch_size} "
                         "(the retest compares the two halves)")
    measures = {k: _with_eps(m, s.eps) for k, m in STANDARD.items()}
    return _measure(s, names, measures, {k: [s.rho[k]] for k in measures}, s.n_points, s.n_iters, progress)


def full_length_reliability(half_retest_tau: float, k: int = 2) -> float:
    """Reliability, on the Kendall-τ scale of a retest, of the mean of ``k`` parallel halves whose
    test–retest τ is ``half_retest_tau`` (:func:`companion.analysis.spearman_brown`). The primary value
    is the mean over both halves (``k = 2``), so its ceiling and power use this, not the retest of one
    half. A retest ≤ 0 (no signal) gives 0; ``k`` < 1 or a non-finite retest NaN."""
    return analysis.spearman_brown(half_retest_tau, k) if k >= 1 else math.nan


def primary_table(s: LanguageSettings, frame: pd.DataFrame, members: pd.DataFrame,
                  gap_rel: float | None) -> pd.DataFrame:
    """One row per measure: τ with the gap over all members, retest of the halves, the reliability of
    their mean (:func:`full_length_reliability`, the value τ is computed from), ceiling, power."""
    first, second = per_batch_halves(frame)
    rows = []
    for name in STANDARD:
        v = frame[frame["measure"] == name].set_index("model")["value"].loc[members.index]
        t = kendall_tau(v.to_numpy(), members["gap"].to_numpy(), n_boot=s.n_boot, seed=s.seed)
        a = first[first["measure"] == name].set_index("model")["value"].loc[members.index]
        b = second[second["measure"] == name].set_index("model")["value"].loc[members.index]
        rt = kendall_tau(a.to_numpy(), b.to_numpy(), n_boot=s.n_boot, seed=s.seed)
        known = gap_rel is not None and math.isfinite(gap_rel) and math.isfinite(rt.tau)
        rel = full_length_reliability(rt.tau)   # the value is the mean of the two halves
        rows.append(dict(
            measure=name, label=STANDARD[name].label, rho=s.rho[name], tau=t.tau, ci_low=t.ci_low,
            ci_high=t.ci_high, pvalue=t.pvalue, n=t.n, paper=lz.PAPER_TAU[name], retest=rt.tau,
            retest_ci_low=rt.ci_low, retest_ci_high=rt.ci_high, reliability=rel, gap_reliability=gap_rel,
            ceiling=analysis.ceiling(rel, gap_rel) if known else math.nan,
            power=analysis.power(t.n, lz.PAPER_TAU[name], rel, max(gap_rel, 0.0), alpha=s.power_alpha,
                                 n_sim=s.power_n_sim, seed=s.seed) if known else math.nan))
    return pd.DataFrame(rows)


def gap_reliability(s: LanguageSettings, members: pd.DataFrame) -> float | None:
    """Split-half reliability of the gap across members (None for a zoo without per-example errors)."""
    errors = lz.source(s.zoo_dir).eval_errors(list(members.index))
    if errors is None:
        return None
    return split_half(errors, members["train_error"].to_numpy(), s)


def split_half(errors: np.ndarray, train_error: np.ndarray, s) -> float:
    """The gap's split-half reliability across members (:func:`companion.analysis.gap_reliability`: ``s.gap_splits``
    random halves of the evaluation pairs from ``s.seed``, each stepped up by Spearman–Brown, their mean)."""
    return analysis.gap_reliability(errors, train_error, seed=s.seed, n_splits=s.gap_splits).split_half


# --------------------------------------------------------------------------- exploratory


def explore_curves(s: LanguageSettings, members: pd.DataFrame, progress: bool) -> dict:
    """τ against ρ for the three measures and the ablations, at the exploratory protocol."""
    e = s.exploratory
    out: dict[str, Any] = {"curves": None, "ablation_curves": None, "frame": None, "ablation_frame": None}
    names = list(members.index)
    if e.rho_grid:
        measures = {k: _with_eps(STANDARD[k], s.eps) for k in e.rho_grid}
        out["frame"] = _measure(s, names, measures, e.rho_grid, e.n_points, e.n_iters, progress)
        out["curves"] = tau_vs_rho(out["frame"], members["gap"], n_boot=s.n_boot, seed=s.seed)
    if e.ablation_rho_grid:
        unknown = set(e.ablation_rho_grid) - set(lz.ABLATIONS)
        if unknown:
            raise ValueError(f"unknown ablation measures {sorted(unknown)}; known: {sorted(lz.ABLATIONS)}")
        measures = {k: _with_eps(lz.ABLATIONS[k], s.eps) for k in e.ablation_rho_grid}
        out["ablation_frame"] = _measure(s, names, measures, e.ablation_rho_grid, e.n_points, e.n_iters, progress)
        out["ablation_curves"] = tau_vs_rho(out["ablation_frame"], members["gap"], n_boot=s.n_boot, seed=s.seed)
    return out


def explore_eps(s: LanguageSettings, members: pd.DataFrame, progress: bool) -> pd.DataFrame | None:
    """τ against ε for each metric at its pre-registered ρ (exploratory protocol)."""
    e = s.exploratory
    if not e.eps_grid:
        return None
    measures = {f"{k}@eps={eps:g}": STANDARD[k].replace(eps=eps)
                for k in ("geodesic_invariant", "geodesic_mixed") for eps in e.eps_grid}
    grid = {k: [s.rho[k.split("@")[0]]] for k in measures}
    frame = _measure(s, list(members.index), measures, grid, e.n_points, e.n_iters, progress)
    table = tau_vs_rho(frame, members["gap"], n_boot=s.n_boot, seed=s.seed)
    table["metric"] = table["measure"].str.split("@").str[0].str.removeprefix("geodesic_")
    table["eps"] = [float(m.split("=")[1]) for m in table["measure"]]
    return table


def explore_subsets(s: LanguageSettings, frame: pd.DataFrame, members: pd.DataFrame) -> dict:
    """Primary values against other gaps or members: fitted members only, the HANS-like gap."""
    fitted = members[members["train_error"] <= s.max_train_error]
    out = {"fit_rule": {"max_train_error": s.max_train_error,
                        "excluded": {str(n): float(e) for n, e in members["train_error"].items()
                                     if e > s.max_train_error}}}
    hans = members["gap_hans"] if "gap_hans" in members else None
    for key, gaps in (("fitted", fitted["gap"]), ("gap_hans", hans)):
        if gaps is None or len(gaps) < 3:
            out[key] = None
            continue
        rows = {}
        for name in STANDARD:
            v = frame[frame["measure"] == name].set_index("model")["value"].loc[gaps.index]
            t = kendall_tau(v.to_numpy(), gaps.to_numpy(dtype=float), n_boot=s.n_boot, seed=s.seed)
            rows[name] = {"rho": s.rho[name], "tau": t.tau, "ci_low": t.ci_low, "ci_high": t.ci_high, "n": t.n}
        out[key] = rows
    return out


def explore_relative_orbit(s: LanguageSettings, members: pd.DataFrame) -> dict:
    """Relative flatness of every member (same batches) and the orbit of one member."""
    from companion.experiments import orbit, relative

    e = s.exploratory
    batches = lz.source(s.zoo_dir).sharpness_batches(s.n_points, s.batch_size, s.data_seed)
    out: dict[str, Any] = {"relative": None, "relative_taus": None, "orbit": None}
    if e.relative_flatness_layer is not None:
        out["relative"], out["relative_taus"] = relative.run_relative(
            s.zoo_dir, list(members.index), batches, members, layer=e.relative_flatness_layer,
            device=s.device, n_boot=s.n_boot, seed=s.seed)
    if e.orbit is not None:
        o = e.orbit
        out["orbit"] = orbit.run_orbit(s.zoo_dir, o.model or members.index[0], batches[0], scales=o.scales,
                                       rho=o.rho, n_iters=o.n_iters, seed=s.seed, action_seeds=o.action_seeds,
                                       dtype=o.dtype, device=s.device)
    return out


# --------------------------------------------------------------------------- metrics, findings, files


def table1_entries(primary: pd.DataFrame, subsets: dict, n_members: int) -> list[dict]:
    """The primary Table 1 entry (all members, pre-registered ρ) and the exploratory fitted-members line."""
    t = primary.set_index("measure")
    entry = {"row": "language", "variant": f"{n_members} seed-only BERT fine-tunes, all members, ρ pre-registered "
             "on pilot members (test–retest)", "primary": True, "exploratory": False, "n_models": n_members,
             "tau": t["tau"].to_dict(), "ci": {m: [r.ci_low, r.ci_high] for m, r in t.iterrows()},
             "rho": t["rho"].to_dict(), "retest": t["retest"].to_dict(), "reliability": t["reliability"].to_dict()}
    if t["ceiling"].notna().all():
        entry |= {"gap_reliability": float(t["gap_reliability"].iloc[0]), "tau_ceiling": t["ceiling"].to_dict(),
                  "power": t["power"].to_dict()}
    entries = [entry]
    fit = subsets["fitted"]
    if fit is not None and subsets["fit_rule"]["excluded"]:
        n = next(iter(fit.values()))["n"]
        entries.append({"row": "language", "variant": f"fitted members only (train error ≤ "
                        f"{subsets['fit_rule']['max_train_error']:g}, rule fixed before training): {n} of {n_members}",
                        "primary": False, "exploratory": True, "n_models": n,
                        "tau": {m: r["tau"] for m, r in fit.items()},
                        "ci": {m: [r["ci_low"], r["ci_high"]] for m, r in fit.items()},
                        "rho": {m: r["rho"] for m, r in fit.items()}})
    return entries


def report_metrics(rep: LanguageReport, profile: str) -> dict:
    """The ``language`` stage's metrics (layout: :mod:`companion.metrics`)."""
    s, members, ex = rep.settings, rep.members, rep.explore
    gap = members["gap"]
    records = lambda fr: None if fr is None else fr.to_dict("records")  # noqa: E731
    return {
        "table1": table1_entries(rep.primary, ex["subsets"], len(members)),
        "table1_row": "MNLI",
        "profile": profile,
        "setting": rep.setting,
        "primary": rep.primary.to_dict("records"),
        "tau": {r["measure"]: {k: r[k] for k in ("tau", "ci_low", "ci_high", "pvalue", "n", "rho", "retest",
                                                     "reliability")}
                for r in rep.primary.to_dict("records")},
        "paper_tau": lz.PAPER_TAU,
        "exploratory": {"tau_vs_rho": records(ex["curves"]), "ablations": records(ex["ablation_curves"]),
                        "paper_ablation_tau": lz.PAPER_ABLATION_TAU, "eps_sweep": records(ex["eps"]),
                        "fitted": ex["subsets"]["fitted"], "tau_gap_hans": ex["subsets"]["gap_hans"],
                        "relative_flatness": records(ex["relative_taus"])},
        "fit_rule": ex["subsets"]["fit_rule"],
        "protocol": {"n_models": len(members), "n_points": s.n_points, "batch_size": s.batch_size,
                     "n_batches": s.n_points // s.batch_size, "n_iters": s.n_iters, "rho": s.rho, "eps": s.eps,
                     "seed": s.seed, "data_seed": s.data_seed, "n_boot": s.n_boot,
                     "exploratory_n_points": s.exploratory.n_points, "exploratory_n_iters": s.exploratory.n_iters},
        "zoo": {"n_models": len(members), "gap_min": float(gap.min()), "gap_max": float(gap.max()),
                "gap_median": float(gap.median()), "train_error_max": float(members["train_error"].max())},
    }


def findings(primary: pd.DataFrame, subsets: dict) -> str:
    """The findings in words, from the numbers."""
    lines = []
    for r in primary.itertuples():
        sig = "excludes 0" if r.ci_low > 0 or r.ci_high < 0 else "includes 0"
        line = (f"- **{r.label}** (ρ = {r.rho:g}, pre-registered): τ = {r.tau:+.2f} [{r.ci_low:+.2f}, {r.ci_high:+.2f}] "
                f"over {r.n} members (interval {sig}; paper {r.paper:+.2f}); test–retest of the two halves "
                f"{r.retest:.2f}, reliability of their mean (Spearman–Brown, τ scale) {r.reliability:.2f}")
        if not pd.isna(r.ceiling):
            line += (f", gap reliability {r.gap_reliability:.2f}, ceiling on |τ| {r.ceiling:.2f}, power at the "
                     f"paper's τ {r.power:.2f}")
            if r.ceiling < abs(r.paper):
                line += " — the ceiling is below the paper's |τ|: this row cannot show the paper's effect"
        lines.append(line + ".")
    excluded = subsets["fit_rule"]["excluded"]
    lines.append(f"- {len(excluded)} member(s) above the fit rule's train error "
                 f"{subsets['fit_rule']['max_train_error']:g}" + (f": {', '.join(excluded)}." if excluded else "."))
    return "\n".join(lines)


def save_report_data(rep: LanguageReport, out_dir: str | Path) -> None:
    """``out_dir/data``: sharpness.csv (primary), members.csv, primary.csv and the exploratory tables."""
    data = Path(out_dir) / "data"
    data.mkdir(parents=True, exist_ok=True)
    ex = rep.explore
    frames = {"sharpness": rep.frame, "tau_vs_rho_values": ex["frame"], "ablations": ex["ablation_frame"]}
    for fname, fr in frames.items():
        if fr is not None:
            fr.drop(columns="seconds").assign(per_batch=fr["per_batch"].map(json.dumps),
                                              base_loss=fr["base_loss"].map(json.dumps)).to_csv(
                data / f"{fname}.csv", index=False)
    tables = {"primary": rep.primary, "tau_vs_rho": ex["curves"], "ablation_tau_vs_rho": ex["ablation_curves"],
              "eps_sweep": ex["eps"], "orbit": ex["orbit"],
              "relative_flatness": None if ex["relative"] is None else ex["relative"].drop(columns=["per_batch",
                                                                                                   "seconds"])}
    for fname, fr in tables.items():
        if fr is not None:
            fr.drop(columns=[c for c in ("seconds",) if c in fr]).to_csv(data / f"{fname}.csv", index=False)
    members = rep.members.drop(columns=[c for c in ("seconds", "cpu_seconds") if c in rep.members])
    for col in ("test_error_by_template", "hyperparameters"):
        if col in members:
            members[col] = members[col].map(json.dumps)
    members.to_csv(data / "members.csv")
    if ex["curves"] is not None:   # dvc.yaml plots: τ against ρ (exploratory), primary values against the gap
        from companion.metrics import write_plot_data

        values = rep.frame.pivot_table(index="model", columns="measure", values="value", sort=False)
        write_plot_data(data, ex["curves"], rep.members[["gap"]].join(values[list(STANDARD)]))


def run_report(profile: str, params: Mapping[str, Any], out_dir: str | Path, *,
               progress: bool = True) -> LanguageReport:
    """The ``language`` stage without its plots: measure, write metrics and data, return what to plot."""
    from companion import metrics as cm
    from hideseek.utils import set_threads

    s = settings_from(params)
    set_threads(s.threads)
    for sub in ("figures", "metrics", "data"):
        (Path(out_dir) / sub).mkdir(parents=True, exist_ok=True)
    src = lz.source(s.zoo_dir)
    members = src.member_table()
    t0 = time.perf_counter()
    frame = measure_primary(s, list(members.index), progress=progress)
    primary = primary_table(s, frame, members, gap_reliability(s, members))
    explore = {**explore_curves(s, members, progress), "eps": explore_eps(s, members, progress),
               "subsets": explore_subsets(s, frame, members), **explore_relative_orbit(s, members)}
    seconds = time.perf_counter() - t0
    rep = LanguageReport(s, src.description(), members, frame, primary, explore, {}, findings(primary, explore["subsets"]))
    rep.metrics = report_metrics(rep, profile)
    cm.write_stage_metrics(out_dir, "language", rep.metrics)
    save_report_data(rep, out_dir)
    cm.write_stage_timings(out_dir, "language", {"seconds": seconds})   # published to reports/timings/, git only
    print(f"language: {len(members)} members measured in {seconds:.0f} s", file=sys.stderr)   # the log, not the report
    return rep
