"""The ``paired`` stage without its plots: the paper's question asked directly (issue 24 items 1 and 3).

Pre-registered in ``reports/preregistration/delta_tau.md`` (settings: ``params.yaml`` section ``paired``),
committed before this code computed any value. For each transformer row named in ``rows`` and each
geodesic measure *g*:

    Δ_g = s · (τ_g − τ_adaptive),   s = sign of the paper's τ for the row (:mod:`companion.paper`)

over the row's members, each measure at its pre-registered radius, with the interval of a paired
bootstrap over members (:func:`companion.analysis.paired_delta_tau`), the paper's own Δ, the Δ one
would expect to observe if the paper's τ were the truth (attenuated by the row's reliabilities,
:func:`companion.analysis.attenuated`), the Monte Carlo power at the paper's τ
(:func:`companion.analysis.delta_power`), the pre-registered verdict (:func:`verdict`) and beside it the minimum Δ
the row detects with 80 % power (:func:`companion.analysis.delta_mde`: the same power function solved for Δ by
bisection; declared in ``reports/preregistration/ablations.md``; settings ``mde``).

Nothing is measured again: every number comes from the per-member tables the zoo stages published
(``reports/data/<stage>/``), read by one loader per table layout (:data:`LAYOUTS`); each loader checks
that the per-measure τ it recomputes is the τ the stage published, so the values are the ones the row's
primary τ uses.

Exploratory, vision only (declared in the same document): τ and Δ within the levels of each drawn binary
factor (:func:`factor_table`) and Kendall's partial τ controlling for train error (:func:`partial_table`).
For the language layout the retest of the halves is also reported as the mean over random splits of the
batches (:func:`companion.analysis.random_split_retest`, the pre-registered split rule), which sets the
reliability the power uses.

**A row whose stage the profile does not run** (:mod:`companion.skipped`: its data folder holds only
:data:`SKIPPED_FILE`, e.g. the 144 k-parameter BERT row in the cpu profile) is not compared: it is listed with its
role and the reason under ``"not_run"`` in the metrics file and in one findings line after the primary ones
(:func:`not_run_record`); no Δ, no Table 1 entry. The exploratory row must have run.

``run_report(profile, params, out_dir)`` writes ``metrics/paired.json``, ``data/delta_tau.csv``,
``data/reliability.csv``, ``data/factors.csv`` and ``data/partial.csv``; ``notebooks/paired.ipynb`` plots.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from companion import analysis, paper
from companion.params import from_mapping

STAGE = "paired"
#: the record companion.skipped leaves in the data folder of a stage its profile does not run
SKIPPED_FILE = "skipped.json"
LABELS = {"adaptive": "adaptive", "geodesic_invariant": "geodesic, invariant",
          "geodesic_mixed": "geodesic, mixed"}


@dataclass(frozen=True)
class RowSpec:
    row: str        # Table 1 row (vision / language): the paper's τ and sign come from it
    layout: str     # which loader reads the stage's tables (:data:`LAYOUTS`)
    data: str       # the stage's published folder, reports/data/<stage>
    comparison: str  # the row's role: "primary", or "secondary (<why>)" for a row another row supersedes


@dataclass(frozen=True)
class PowerSettings:
    n_sim: int
    n_boot: int
    seed: int


@dataclass(frozen=True)
class MdeSettings:
    target: float      # the power the minimum detectable Δ reaches (0.8)
    n_sim: int
    n_boot: int
    seed: int
    tol: float         # bisection to this width on Δ


@dataclass(frozen=True)
class SplitSettings:
    n_splits: int
    seed: int


@dataclass(frozen=True)
class ExploratorySettings:
    row: str               # the row (key of ``rows``) whose members carry the factors
    factors: list[str]     # a column with two values, or "<column> > 0" (an on/off draw)
    control: str           # the column the partial τ controls for


@dataclass(frozen=True)
class PairedSettings:
    rows: dict[str, RowSpec]
    baseline: str
    geodesic: list[str]
    n_boot: int
    seed: int
    confidence: float
    power: PowerSettings
    mde: MdeSettings | None    # None: no minimum detectable Δ (a stage that reports the Δ without it)
    retest_splits: SplitSettings
    exploratory: ExploratorySettings


def load_settings(params: dict) -> PairedSettings:
    """Typed settings from the stage's resolved ``params`` (every key required)."""
    s = from_mapping(PairedSettings, params, "params.yaml paired")
    unknown = [m for m in [s.baseline, *s.geodesic] if m not in paper.TABLE1_MEASURES]
    if unknown:
        raise ValueError(f"paired: measures {unknown} are not Table 1's ({', '.join(paper.TABLE1_MEASURES)})")
    for name, spec in s.rows.items():
        if spec.row not in paper.TABLE1_TAU:
            raise ValueError(f"paired.rows.{name}.row = {spec.row!r}: not a Table 1 row ({', '.join(paper.TABLE1_TAU)})")
        if spec.layout not in LAYOUTS:
            raise ValueError(f"paired.rows.{name}.layout = {spec.layout!r}: choose one of {', '.join(LAYOUTS)}")
        if not (spec.comparison == "primary" or spec.comparison.startswith("secondary")):
            raise ValueError(f"paired.rows.{name}.comparison = {spec.comparison!r}: write 'primary' or "
                             "'secondary (<why>)'")
    if s.exploratory.row not in s.rows:
        raise ValueError(f"paired.exploratory.row = {s.exploratory.row!r} is not one of rows ({', '.join(s.rows)})")
    return s


@dataclass
class RowData:
    """One row's members as its primary τ uses them."""

    name: str                  # key of ``rows``
    row: str                   # Table 1 row
    stage: str                 # the stage whose tables these are (the data folder's name)
    members: pd.DataFrame      # one row per member (index: name), with ``gap`` and the factors
    values: dict[str, np.ndarray]      # measure -> value per member, in ``members``' order
    rho: dict[str, float]
    reliability: dict[str, float]      # measure -> reliability (τ scale) of the value τ uses
    gap_reliability: float
    published_tau: dict[str, float]    # the stage's own primary τ (checked against ours)
    retest_splits: pd.DataFrame | None = None   # language layout: retest of the halves, both rules
    comparison: str = "primary"        # the row's role (RowSpec.comparison)


def _read(path: Path, **kw) -> pd.DataFrame:
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run (or dvc pull) the stage that publishes it")
    return pd.read_csv(path, float_precision="round_trip", **kw)


def load_vision(name: str, spec: RowSpec, s: PairedSettings) -> RowData:
    """``reports/data/vision``: values on the first sharpness set (``members.csv``'s ``sharpness_<m>``, the
    value the primary τ uses), the gap, each measure's test–retest between its two sets (the value is one
    set's, so its reliability is the retest) and the gap's reliability (``primary.csv``)."""
    d = Path(spec.data)
    members = _read(d / "members.csv", index_col="name")
    prim = _read(d / "primary.csv").set_index("measure")
    measures = [s.baseline, *s.geodesic]
    missing = [f"sharpness_{m}" for m in measures if f"sharpness_{m}" not in members]
    if missing:
        raise ValueError(f"{d / 'members.csv'} lacks columns {missing}: not a vision-layout members table")
    return RowData(name, spec.row, d.name, members, {m: members[f"sharpness_{m}"].to_numpy() for m in measures},
                   {m: float(prim.loc[m, "rho"]) for m in measures},
                   {m: float(prim.loc[m, "retest"]) for m in measures}, float(prim["gap_reliability"].iloc[0]),
                   {m: float(prim.loc[m, "tau"]) for m in measures})


def load_language(name: str, spec: RowSpec, s: PairedSettings) -> RowData:
    """``reports/data/language`` (and any row with its layout): the value is the mean over all batches
    (``sharpness.csv``'s ``value``), the gap from ``members.csv``; the retest of the halves is the mean over
    ``retest_splits.n_splits`` random splits of the batches (pre-registered), beside the first/last split
    the stage reported, and the value's reliability is its Spearman–Brown step-up to both halves
    (:func:`companion.analysis.spearman_brown`, k = 2); the gap's reliability from ``primary.csv``."""
    d = Path(spec.data)
    members = _read(d / "members.csv", index_col="name")
    sharp = _read(d / "sharpness.csv")
    prim = _read(d / "primary.csv").set_index("measure")
    values, rel, rho, rows = {}, {}, {}, []
    for m in [s.baseline, *s.geodesic]:
        at = sharp[sharp["measure"] == m].set_index("model")
        if at.index.duplicated().any() or set(at.index) != set(members.index):
            raise ValueError(f"{d / 'sharpness.csv'}: {m} must have exactly one value per member of members.csv")
        at = at.loc[members.index]
        values[m] = at["value"].to_numpy()
        rho[m] = float(prim.loc[m, "rho"])
        per_batch = np.array([json.loads(p) for p in at["per_batch"]], dtype=float)
        mean, sd = analysis.random_split_retest(per_batch, n_splits=s.retest_splits.n_splits,
                                                seed=s.retest_splits.seed)
        rel[m] = analysis.spearman_brown(mean, 2)
        rows.append(dict(row=name, measure=m, batches=per_batch.shape[1], retest_first_last=float(prim.loc[m, "retest"]),
                         reliability_first_last=float(prim.loc[m, "reliability"]), retest_random_splits=mean,
                         retest_random_splits_sd=sd, n_splits=s.retest_splits.n_splits, reliability=rel[m]))
    return RowData(name, spec.row, d.name, members, values, rho, rel, float(prim["gap_reliability"].iloc[0]),
                   {m: float(prim.loc[m, "tau"]) for m in values}, pd.DataFrame(rows))


#: table layout -> loader (a new row whose stage publishes one of these layouts needs no code)
LAYOUTS: dict[str, Callable[[str, RowSpec, PairedSettings], RowData]] = {"vision": load_vision,
                                                                         "language": load_language}


def not_run_record(name: str, spec: RowSpec) -> dict | None:
    """``{"name", "row", "stage", "comparison", "profile", "reason"}`` when the row's stage was not run in its profile
    (its data folder holds :data:`SKIPPED_FILE`, written by :mod:`companion.skipped`), else None."""
    path = Path(spec.data) / SKIPPED_FILE
    if not path.is_file():
        return None
    rec = json.loads(path.read_text())
    return dict(name=name, row=spec.row, stage=rec.get("stage", Path(spec.data).name), comparison=spec.comparison,
                profile=rec.get("profile", ""), reason=rec["skipped"])


def load_row(name: str, spec: RowSpec, s: PairedSettings, stage: str | None = None) -> RowData:
    """The row's members, refusing tables whose τ is not the one the stage published. ``stage``: the stage that
    published the tables (default: the data folder's name, as in ``reports/data/<stage>``; a stage reading its own
    tables from a staging folder names itself)."""
    rd = LAYOUTS[spec.layout](name, spec, s)
    rd.comparison = spec.comparison
    if stage is not None:
        rd.stage = stage
    gap = rd.members["gap"].to_numpy()
    for m, v in rd.values.items():
        tau = analysis.kendall(v, gap, n_boot=0, seed=0).tau
        both_undefined = math.isnan(tau) and math.isnan(rd.published_tau[m])    # e.g. a gap with no spread
        if not both_undefined and not math.isclose(tau, rd.published_tau[m], abs_tol=1e-12):
            raise ValueError(f"{spec.data}: τ({m}, gap) recomputed from the tables is {tau:+.6f}, the stage published "
                             f"{rd.published_tau[m]:+.6f}: the tables are not the ones its primary τ used")
    return rd


def paper_sign(row: str, geodesic: str) -> int:
    """The sign s of the pre-registration: the sign of the paper's τ for the row (of its geodesic τ where the
    paper's two τ differ in sign)."""
    t = paper.table1_tau(row)[geodesic]
    if t == 0:
        raise ValueError(f"the paper's τ for {row}/{geodesic} is 0: no direction to test")
    return 1 if t > 0 else -1


def paper_delta(row: str, geodesic: str, baseline: str) -> float:
    """The paper's Δ by the pre-registered formula, from :data:`companion.paper.TABLE1_TAU`."""
    t = paper.table1_tau(row)
    return paper_sign(row, geodesic) * (t[geodesic] - t[baseline])


def verdict(lo: float, hi: float, paper_d: float) -> str:
    """The pre-registered decision (reports/preregistration/delta_tau.md), in words."""
    if lo > 0:
        return "supports the paper"
    if hi < 0:
        return "contradicts the paper's direction"
    if paper_d > hi:
        return "contradicts the paper's size"
    return "inconclusive"


def delta_table(rd: RowData, s: PairedSettings) -> pd.DataFrame:
    """One line per geodesic measure: Δ with its paired interval, both τ, the paper's Δ, the expected
    observed Δ at the paper's τ, the power there and the verdict."""
    gap, base, ptau = rd.members["gap"].to_numpy(), s.baseline, paper.table1_tau(rd.row)
    rows = []
    for g in s.geodesic:
        sign = paper_sign(rd.row, g)
        d = analysis.paired_delta_tau(rd.values[g], rd.values[base], gap, sign=sign, n_boot=s.n_boot, seed=s.seed,
                                      confidence=s.confidence)
        between = analysis.kendall(rd.values[g], rd.values[base], n_boot=0, seed=0).tau
        pdelta = paper_delta(rd.row, g, base)
        expected = sign * (analysis.attenuated(ptau[g], rd.reliability[g], rd.gap_reliability)
                           - analysis.attenuated(ptau[base], rd.reliability[base], rd.gap_reliability))
        pw = analysis.delta_power(len(gap), ptau[g], ptau[base], retest_x=rd.reliability[g],
                                  retest_base=rd.reliability[base], rel_y=rd.gap_reliability, tau_between=between,
                                  sign=sign, n_sim=s.power.n_sim, n_boot=s.power.n_boot, seed=s.power.seed,
                                  confidence=s.confidence)
        mde = None if s.mde is None else analysis.delta_mde(
            len(gap), ptau[base], retest_x=rd.reliability[g], retest_base=rd.reliability[base], rel_y=rd.gap_reliability,
            tau_between=between, sign=sign, n_sim=s.mde.n_sim, n_boot=s.mde.n_boot, seed=s.mde.seed,
            confidence=s.confidence, target=s.mde.target, tol=s.mde.tol)
        nan = float("nan")
        rows.append(dict(row=rd.name, table1_row=rd.row, stage=rd.stage, comparison=rd.comparison, measure=g,
                         baseline=base, sign=sign, delta=d.delta, ci_low=d.lo, ci_high=d.hi, n=d.n, n_boot=d.n_boot,
                         tau_geodesic=d.tau_x, tau_baseline=d.tau_base, rho_geodesic=rd.rho[g], rho_baseline=rd.rho[base],
                         tau_between=between, reliability_geodesic=rd.reliability[g],
                         reliability_baseline=rd.reliability[base], gap_reliability=rd.gap_reliability,
                         paper_delta=pdelta, expected_at_paper=expected, power=pw,
                         expected_above_interval=bool(expected > d.hi), verdict=verdict(d.lo, d.hi, pdelta),
                         **(dict(mde=nan, mde_power=nan, mde_target=nan, mde_delta_max=nan, mde_power_max=nan,
                                 mde_above_paper=False) if mde is None else
                            dict(mde=mde.delta, mde_power=mde.power, mde_target=mde.target, mde_delta_max=mde.delta_max,
                                 mde_power_max=mde.power_max, mde_above_paper=bool(not mde.reached or mde.delta > pdelta)))))
    return pd.DataFrame(rows)


def factor_levels(members: pd.DataFrame, factor: str) -> pd.Series:
    """The level of every member for a declared factor, as text: ``"<column> = <value>"`` for a column with
    exactly two values, ``"<column> = 0"`` / ``"<column> > 0"`` for an on/off draw declared as
    ``"<column> > 0"``; anything else is refused."""
    if factor.endswith("> 0"):
        col = factor[:-3].strip()
        if col not in members:
            raise ValueError(f"factor {factor!r}: members table has no column {col!r}")
        return (members[col] > 0).map({False: f"{col} = 0", True: f"{col} > 0"})
    if factor not in members:
        raise ValueError(f"factor {factor!r}: members table has no column {factor!r}")
    if members[factor].nunique() != 2:
        raise ValueError(f"factor {factor!r} has {members[factor].nunique()} levels; declare binary factors only "
                         "(or an on/off draw as '<column> > 0')")
    return members[factor].map(lambda v: f"{factor} = {v}")


def factor_table(rd: RowData, s: PairedSettings) -> pd.DataFrame:
    """Exploratory: within each level of each factor, every measure's τ with the gap (bootstrap interval,
    :func:`companion.analysis.kendall`) and each geodesic measure's signed Δ (paired interval)."""
    rows = []
    for f in s.exploratory.factors:
        levels = factor_levels(rd.members, f)
        raw = rd.members[f[:-3].strip()] > 0 if f.endswith("> 0") else rd.members[f]
        for level in [lab for _, lab in sorted(set(zip(raw, levels)))]:   # in the order of the values
            keep = (levels == level).to_numpy()
            gap = rd.members["gap"].to_numpy()[keep]
            for m in [s.baseline, *s.geodesic]:
                t = analysis.kendall(rd.values[m][keep], gap, n_boot=s.n_boot, seed=s.seed, confidence=s.confidence)
                rows.append(dict(factor=f, level=str(level), n=int(keep.sum()), quantity="tau", measure=m,
                                 value=t.tau, ci_low=t.lo, ci_high=t.hi))
            for g in s.geodesic:
                d = analysis.paired_delta_tau(rd.values[g][keep], rd.values[s.baseline][keep], gap,
                                              sign=paper_sign(rd.row, g), n_boot=s.n_boot, seed=s.seed,
                                              confidence=s.confidence)
                rows.append(dict(factor=f, level=str(level), n=int(keep.sum()), quantity="delta", measure=g,
                                 value=d.delta, ci_low=d.lo, ci_high=d.hi))
    return pd.DataFrame(rows)


def partial_table(rd: RowData, s: PairedSettings) -> pd.DataFrame:
    """Exploratory: τ(gap, control) itself; each measure's Kendall partial τ with the gap controlling for
    ``control`` (:func:`companion.analysis.partial_kendall`); each geodesic measure's signed partial Δ
    (:func:`companion.analysis.paired_delta_partial`)."""
    c = s.exploratory.control
    if c not in rd.members:
        raise ValueError(f"paired.exploratory.control = {c!r}: members table has no such column")
    gap, z = rd.members["gap"].to_numpy(), rd.members[c].to_numpy()
    t = analysis.kendall(gap, z, n_boot=s.n_boot, seed=s.seed, confidence=s.confidence)
    rows = [dict(quantity=f"tau_gap_{c}", measure="", value=t.tau, ci_low=t.lo, ci_high=t.hi)]
    for m in [s.baseline, *s.geodesic]:
        p = analysis.partial_kendall(rd.values[m], gap, z, n_boot=s.n_boot, seed=s.seed, confidence=s.confidence)
        rows.append(dict(quantity="partial_tau", measure=m, value=p.tau, ci_low=p.lo, ci_high=p.hi))
    for g in s.geodesic:
        d = analysis.paired_delta_partial(rd.values[g], rd.values[s.baseline], gap, z, sign=paper_sign(rd.row, g),
                                          n_boot=s.n_boot, seed=s.seed, confidence=s.confidence)
        rows.append(dict(quantity="partial_delta", measure=g, value=d.delta, ci_low=d.lo, ci_high=d.hi))
    return pd.DataFrame(rows).assign(control=c, n=len(gap))


def mde_text(r) -> str:
    """The minimum detectable Δ of a line in words (``r``: a row of :func:`delta_table`)."""
    if not math.isfinite(r.mde_target):
        return "minimum detectable Δ not computed"
    if not math.isfinite(r.mde):
        return (f"no Δ up to {r.mde_delta_max:+.2f} reaches {r.mde_target:.0%} power here (power there "
                f"{r.mde_power_max:.2f}): inconclusive by design")
    out = f"smallest Δ detectable with {r.mde_target:.0%} power {r.mde:+.2f}"
    return out + (" — above the paper's Δ: inconclusive by design" if r.mde > r.paper_delta else "")


def _ci(lo: float, hi: float) -> str:
    return f"[{lo:+.2f}, {hi:+.2f}]"


def finding_lines(deltas: pd.DataFrame, factors: pd.DataFrame, partial: pd.DataFrame, s: PairedSettings,
                  not_run: list[dict] = ()) -> list[str]:
    """The findings (also in the metrics file and the README), every number from the tables; a row whose stage was
    not run (``not_run``, :func:`not_run_record`) gets one line after the primary ones, saying so and why."""
    out = [f"Primary test of the paper's claim (pre-registered, reports/preregistration/delta_tau.md): Δ = s·(τ_geodesic − "
           f"τ_adaptive), s the sign of the paper's τ, positive when the geodesic measure tracks the gap more strongly "
           f"in the paper's direction; paired bootstrap over members ({s.n_boot} resamples), {s.confidence:.0%} "
           "intervals; two tests per row, no multiplicity correction; a row marked secondary is one another row "
           "supersedes, kept for comparison."]
    for r in deltas.itertuples():
        role = "" if r.comparison == "primary" else f"; {r.comparison}"
        out.append(f"{r.row} ({r.n} members{role}), {LABELS[r.measure]} − adaptive: Δ = {r.delta:+.2f} {_ci(r.ci_low, r.ci_high)}"
                   f" (τ {r.tau_geodesic:+.2f} vs {r.tau_baseline:+.2f}); the paper's Δ {r.paper_delta:+.2f}, expected "
                   f"here if the paper's τ held {r.expected_at_paper:+.2f}, power {r.power:.2f}: {r.verdict}; "
                   + mde_text(r) + ".")
    for r in not_run:
        out.append(f"{r['name']} ({r['comparison']}): not compared — stage {r['stage']}, {r['reason']}.")
    if len(factors):
        out.append("Exploratory (declared before the values; vision members split by each drawn binary factor):")
        for (f, level), g in factors.groupby(["factor", "level"], sort=False):
            taus = " / ".join(f"{v:+.2f}" for v in g[g.quantity == "tau"]["value"])
            ds = "; ".join(f"Δ {LABELS[r.measure].removeprefix('geodesic, ')} {r.value:+.2f} {_ci(r.ci_low, r.ci_high)}"
                           for r in g[g.quantity == "delta"].itertuples())
            out.append(f"{level} ({int(g.n.iloc[0])} members): τ adaptive / invariant / mixed {taus}; {ds}.")
    if len(partial):
        head = partial[partial.quantity.str.startswith("tau_gap_")].iloc[0]
        pt = partial[partial.quantity == "partial_tau"]
        pdl = partial[partial.quantity == "partial_delta"]
        out.append(f"Exploratory: τ(gap, {head.control}) = {head.value:+.2f} {_ci(head.ci_low, head.ci_high)}; Kendall's "
                   f"partial τ with the gap controlling for {head.control}: "
                   + ", ".join(f"{LABELS[r.measure]} {r.value:+.2f} {_ci(r.ci_low, r.ci_high)}" for r in pt.itertuples())
                   + "; partial Δ: " + ", ".join(f"{LABELS[r.measure].removeprefix('geodesic, ')} {r.value:+.2f} "
                                                 f"{_ci(r.ci_low, r.ci_high)}" for r in pdl.itertuples()) + ".")
    return out


def table1_entries(deltas: pd.DataFrame) -> list[dict]:
    """What Table 1 attaches to the primary line of each row's stage (:mod:`companion.experiments.table1`), with the
    row's role (``comparison``: Table 1 relabels a superseded stage's primary line with it)."""
    out = []
    for (name, stage), g in deltas.groupby(["row", "stage"], sort=False):
        g = g.set_index("measure")
        col = lambda c: {m: float(g.loc[m, c]) for m in g.index}  # noqa: E731
        out.append(dict(name=name, row=str(g["table1_row"].iloc[0]), stage=stage, comparison=str(g["comparison"].iloc[0]),
                        n_models=int(g["n"].iloc[0]),
                        delta=col("delta"), ci={m: [float(g.loc[m, "ci_low"]), float(g.loc[m, "ci_high"])] for m in g.index},
                        power=col("power"), paper_delta=col("paper_delta"), expected_at_paper=col("expected_at_paper"),
                        **({} if not np.isfinite(g["mde_target"]).all() else dict(
                            mde={m: (float(g.loc[m, "mde"]) if math.isfinite(g.loc[m, "mde"]) else None) for m in g.index},
                            mde_power_max=col("mde_power_max"))),
                        verdict={m: str(g.loc[m, "verdict"]) for m in g.index}))
    return out


@dataclass
class PairedReport:
    deltas: pd.DataFrame
    reliability: pd.DataFrame
    factors: pd.DataFrame
    partial: pd.DataFrame
    rows: dict[str, RowData]
    findings: list[str]
    metrics: dict
    not_run: list[dict] = dataclasses.field(default_factory=list)   # rows whose stage was not run (not_run_record)


def findings(rep: PairedReport) -> str:
    """The findings as a markdown list (the notebook displays it)."""
    return "\n".join("- " + line for line in rep.findings)


def run_report(profile: str, params: dict, out_dir: str | Path, *, progress: bool = True) -> PairedReport:
    """Compute and write every output of the stage (see the module docstring). ``profile`` and ``progress`` are
    accepted and unused (the entry signature every stage module shares, ``tests/companion/test_contract.py``):
    ``params`` is the resolved profile already, and the stage reads tables, nothing to report progress on."""
    from companion import metrics as cm

    s = load_settings(params)
    not_run = [r for name, spec in s.rows.items() if (r := not_run_record(name, spec)) is not None]
    skipped = {r["name"] for r in not_run}
    if s.exploratory.row in skipped or len(skipped) == len(s.rows):
        raise ValueError(f"paired: no data for {'every row' if len(skipped) == len(s.rows) else 'the exploratory row'}"
                         f" ({', '.join(sorted(skipped))}: stage not run in this profile); run its stage in a "
                         "profile that runs it, or drop the row from params.yaml paired.rows")
    rows = {name: load_row(name, spec, s) for name, spec in s.rows.items() if name not in skipped}
    deltas = pd.concat([delta_table(rd, s) for rd in rows.values()], ignore_index=True)
    rel = [rd.retest_splits for rd in rows.values() if rd.retest_splits is not None]
    reliability = pd.concat(rel, ignore_index=True) if rel else pd.DataFrame()
    ex = rows[s.exploratory.row]
    factors, partial = factor_table(ex, s), partial_table(ex, s)
    lines = finding_lines(deltas, factors, partial, s, not_run)
    n_primary = 1 + len(deltas)    # the head sentence and one per (row, geodesic measure); not the not-run lines
    metrics = {"delta_tau": table1_entries(deltas), "primary": deltas.to_dict("records"), "findings": lines,
               "findings_primary": lines[:n_primary],
               "not_run": not_run, "retest_random_splits": reliability.to_dict("records"),
               "exploratory": {"what": "vision confounds, declared in reports/preregistration/delta_tau.md before the "
                                       "values: τ and Δ within the levels of each drawn binary factor; Kendall's partial "
                                       "τ controlling for " + s.exploratory.control,
                               "row": s.exploratory.row, "factors": factors.to_dict("records"),
                               "partial": partial.to_dict("records")},
               "preregistration": "reports/preregistration/delta_tau.md"}
    out = Path(out_dir)
    for sub in ("metrics", "data", "figures"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    cm.write_stage_metrics(out, STAGE, metrics)
    deltas.to_csv(out / "data" / "delta_tau.csv", index=False)
    reliability.to_csv(out / "data" / "reliability.csv", index=False)
    factors.to_csv(out / "data" / "factors.csv", index=False)
    partial.to_csv(out / "data" / "partial.csv", index=False)
    return PairedReport(deltas, reliability, factors, partial, rows, lines, metrics, not_run)
