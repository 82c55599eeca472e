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
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from companion import analysis, paper
from companion.experiments import language_report as lr
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
    cpu_kernels: str | None    # CPU kernels pinned to this level (companion.kernels), checked before measuring


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
    n_planned: int | None = None   # members the pre-registration asked for (more than ``members`` if training was cut)


def measure_primary(s: MiniLMSettings, src: mz.MiniLMZoo, names: list[str], *, progress: bool = True) -> pd.DataFrame:
    """The three measures at their pre-registered radii on every member, all ``n_points`` pairs."""
    if s.rho is None:
        raise ValueError("minilm.rho is null: the radii are pre-registered by the pilot "
                         "(python -m companion.pilots.minilm) before the main zoo is measured")
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


def paired_settings(s: MiniLMSettings, data_dir: str | Path):
    """The stage ``paired``'s settings for this row alone (its loader of the ``language`` layout reads ``data_dir``)."""
    from companion.experiments import paired as pr

    p = s.paired
    return pr.PairedSettings(
        rows={STAGE: pr.RowSpec(row="language", layout="language", data=str(data_dir), comparison="primary")},
        baseline=paper.BASELINE,
        geodesic=list(paper.GEODESIC), n_boot=p.n_boot, seed=p.seed, confidence=p.confidence,
        power=pr.PowerSettings(n_sim=p.power_n_sim, n_boot=p.power_n_boot, seed=p.seed), mde=None,
        retest_splits=pr.SplitSettings(n_splits=p.retest_splits, seed=p.seed),
        exploratory=pr.ExploratorySettings(row=STAGE, factors=[], control="train_error"))


def delta_table(s: MiniLMSettings, data_dir: str | Path) -> pd.DataFrame:
    """One row per geodesic measure: the paired Δτ with its interval, the paper's Δ, the power at the paper's Δ and
    the pre-registered verdict — :func:`companion.experiments.paired.delta_table` on this stage's published tables
    (``data_dir``: ``members.csv``, ``sharpness.csv``, ``primary.csv``), so the numbers are the ones the stage
    ``paired`` computes for this row (retest of the halves as the mean over random splits, Spearman–Brown)."""
    from companion.experiments import paired as pr

    ps = paired_settings(s, data_dir)
    rd = pr.load_row(STAGE, ps.rows[STAGE], ps, stage=STAGE)
    if all(rd.reliability[m] > 0 for m in [ps.baseline, *ps.geodesic]):
        return pr.delta_table(rd, ps)
    return delta_table_without_power(rd, ps)


def delta_table_without_power(rd, ps) -> pd.DataFrame:
    """The paired Δτ, its interval, the paper's Δ and the verdict as :func:`companion.experiments.paired.delta_table`
    computes them, for a row where a measure's reliability is 0 (its retest shows no signal): the power's Monte Carlo
    cannot disattenuate the correlation of the two measures then, so the power is NaN (said in ``power_note``)."""
    from companion.experiments import paired as pr

    gap, base = rd.members["gap"].to_numpy(), ps.baseline
    rows = []
    for g in ps.geodesic:
        sign = pr.paper_sign(rd.row, g)
        d = analysis.paired_delta_tau(rd.values[g], rd.values[base], gap, sign=sign, n_boot=ps.n_boot, seed=ps.seed,
                                      confidence=ps.confidence)
        pdelta = pr.paper_delta(rd.row, g, base)
        flat = [m for m in (g, base) if rd.reliability[m] <= 0]
        rows.append(dict(row=rd.name, table1_row=rd.row, stage=rd.stage, comparison=rd.comparison, measure=g,
                         baseline=base, sign=sign,
                         delta=d.delta, ci_low=d.lo, ci_high=d.hi, n=d.n, n_boot=d.n_boot, tau_geodesic=d.tau_x,
                         tau_baseline=d.tau_base, rho_geodesic=rd.rho[g], rho_baseline=rd.rho[base],
                         tau_between=analysis.kendall(rd.values[g], rd.values[base], n_boot=0, seed=0).tau,
                         reliability_geodesic=rd.reliability[g], reliability_baseline=rd.reliability[base],
                         gap_reliability=rd.gap_reliability, paper_delta=pdelta, power=float("nan"),
                         power_note=f"reliability 0 for {', '.join(flat)} (retest of the halves <= 0): no power",
                         verdict=pr.verdict(d.lo, d.hi, pdelta)))
    return pd.DataFrame(rows)


def table1_entries(rep: MiniLMReport) -> list[dict]:
    """The primary Table 1 entry (paired Δτ and per-measure τ) and the exploratory fitted-members line."""
    t = rep.primary.set_index("measure")
    d = rep.delta.set_index("measure")
    n = len(rep.members)
    planned = rep.n_planned if rep.n_planned is not None else n
    cut = "" if planned == n else (f"; only {n} of the {planned} pre-registered members finished training in the "
                                   "session's time (the first {n} seeds)").format(n=n)
    count = f" (the {n} pre-registered)" if rep.n_planned is not None and planned == n else ""
    entry = {"row": "language", "setting": rep.setting,
             "variant": f"{n} seed-only fine-tunes of pre-trained all-MiniLM-L6-v2, all members{count}, ρ and protocol "
                        f"pre-registered on pilot members{cut}", "primary": True, "exploratory": False, "n_models": n,
             "tau": t["tau"].to_dict(), "ci": {m: [r.ci_low, r.ci_high] for m, r in t.iterrows()},
             "rho": t["rho"].to_dict(), "retest": t["retest"].to_dict(), "reliability": t["reliability"].to_dict(),
             "delta_tau": d["delta"].to_dict(), "delta_tau_ci": {m: [r.ci_low, r.ci_high] for m, r in d.iterrows()},
             "power_delta": d["power"].to_dict(), "paper_delta_tau": d["paper_delta"].to_dict(),
             "verdict_delta": d["verdict"].to_dict()}
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
    if rep.n_planned is not None and rep.n_planned != len(rep.members):
        lines.append(f"- **Zoo cut short**: {len(rep.members)} of the {rep.n_planned} pre-registered members finished "
                     "training in the session's time; every number below is over those (the first seeds), with the "
                     "pre-registered radii and protocol.")
    for r in rep.delta.itertuples():
        lines.append(f"- **Δτ {r.measure.replace('_', ' ')} − adaptive** (primary, paired over {r.n} members, signed by "
                     f"the paper's τ): {r.delta:+.2f} [{r.ci_low:+.2f}, {r.ci_high:+.2f}]; paper {r.paper_delta:+.2f}; "
                     + (f"power at the paper's Δ {r.power:.2f}" if r.power == r.power else
                        f"power not computable ({getattr(r, 'power_note', 'a reliability is 0')})")
                     + f" — {r.verdict}.")
    lines.append("  Two geodesic measures, two tests; no multiplicity correction.")
    lines.append(lr.findings(rep.primary, rep.subsets))
    return "\n".join(lines)


def save_report_data(rep: MiniLMReport, out_dir: str | Path) -> None:
    """``out_dir/data``: sharpness.csv, members.csv, primary.csv (the ``language`` layout)."""
    data = Path(out_dir) / "data"
    data.mkdir(parents=True, exist_ok=True)
    fr = rep.frame
    fr.drop(columns="seconds").assign(per_batch=fr["per_batch"].map(json.dumps),
                                      base_loss=fr["base_loss"].map(json.dumps)).to_csv(data / "sharpness.csv", index=False)
    rep.primary.to_csv(data / "primary.csv", index=False)
    members = rep.members.drop(columns=[c for c in ("seconds", "cpu_seconds") if c in rep.members])
    for col in ("test_error_by_template", "hyperparameters"):
        if col in members:
            members[col] = members[col].map(json.dumps)
    members.to_csv(data / "members.csv")


def run_report(profile: str, params: Mapping[str, Any], out_dir: str | Path, *,
               progress: bool = True) -> MiniLMReport:
    """Measure, write metrics and data, return what the notebook plots."""
    from companion import kernels
    from companion import metrics as cm
    from hideseek.utils import set_threads

    s = settings_from(params)
    kernels.check(s.cpu_kernels, "minilm")   # the stage's command pins them (python -m companion.kernels minilm -- ...)
    set_threads(s.threads)
    for sub in ("figures", "metrics", "data"):
        (Path(out_dir) / sub).mkdir(parents=True, exist_ok=True)
    src = mz.MiniLMZoo(s.zoo_dir)
    members = src.member_table()
    names = list(members.index)
    t0 = time.perf_counter()
    frame = measure_primary(s, src, names, progress=progress)
    errors = src.eval_errors(names)
    gap_rel = lr.split_half(errors, members["train_error"].to_numpy(), s)
    primary = lr.primary_table(s, frame, members, gap_rel)
    subsets = lr.explore_subsets(s, frame, members)
    rep = MiniLMReport(s, src.meta["setting"], members, frame, primary, pd.DataFrame(), subsets, {}, "",
                       src.meta.get("n_planned"))
    save_report_data(rep, out_dir)
    rep.delta = delta_table(s, Path(out_dir) / "data")
    rep.delta.to_csv(Path(out_dir) / "data" / "delta_tau.csv", index=False)
    seconds = time.perf_counter() - t0
    rep.findings = findings(rep)
    gap = members["gap"]
    delta = rep.delta
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
                "n_planned": rep.n_planned, "complete": src.meta.get("complete", True),
                "base": src.meta["base"], "n_parameters_fine_tuned": src.meta["n_parameters"]},
    }
    cm.write_stage_metrics(out_dir, STAGE, rep.metrics)
    cm.write_stage_timings(out_dir, STAGE, {"seconds": seconds})
    print(f"minilm: {len(members)} members measured in {seconds:.0f} s", file=sys.stderr)
    return rep
