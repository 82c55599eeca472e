"""The ``ablations`` stage without its plots: the paper's ablations (its Appendix G, Figures 7 and 8; the ε sweep of
Appendix H.2, Figure 9) on the MiniLM and vision zoos, and the language figures of the cpu profile (Figure 5, relative
flatness against the gap, orbit invariance) on the MiniLM zoo.

Pre-registered in ``reports/preregistration/ablations.md`` (settings: ``params.yaml`` section ``ablations``), committed
before any of these values was computed. **Every line here is exploratory**; the rows' primary tests are unchanged.

Per row (a zoo whose stage published its members, per-batch values and protocol: ``vision``, ``minilm``) and metric
*m* ∈ {invariant, mixed}, on a declared subset of the row's primary sharpness batches, with the row's iterations and
seed:

* **no Christoffel term** — ``Measure(metric=m, step="straight")`` (the metric's ball, straight step) at the full
  measure's radius;
* **no metric norm** — ``Measure(metric=m, ball="adaptive")`` (second-order step in adaptive sharpness's ball) at
  the row's adaptive radius;
* **ε sweep** (invariant metric) — ``Measure(metric="invariant", eps=ε)`` at the invariant radius.

The full measure and adaptive sharpness on the same members and batches are the row's **published** per-batch
values (checked first: the full measure re-run on one member must reproduce them, :func:`check_published`).
Statistics (:func:`line_stats`, all from :mod:`companion.analysis`): τ with the gap and its bootstrap interval, the
paired Δτ against the full measure and against adaptive sharpness (signed by the paper's τ for the row), the retest
between the two batches and the Spearman–Brown reliability of their mean.

Language figures (:func:`language_figures`): Figure 5 from the MiniLM row's published values; relative flatness
(:func:`hideseek.relative_flatness`) of every member's classifier on the row's primary batches, τ and Δτ; the orbit
A = a·N per head (:mod:`companion.experiments.orbit`) of one member in float64, with the classifier's relative
flatness beside the three sharpness measures.

``run_report(profile, params, out_dir)`` writes ``metrics/ablations.json`` (key ``table1_lines``: what
:mod:`companion.experiments.table1` adds to Table 1), ``data/<row>/members.csv``, ``data/<row>/lines.csv``,
``data/language/*.csv`` and the timings; the notebook plots.
"""
from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd
import torch

from companion import analysis, paper
from companion.experiments import geometry_lines as gl
from companion.experiments import table1
from companion.experiments.paired import SplitSettings
from companion.params import from_mapping
from companion.pool import run_pool

STAGE = "ablations"
METRIC_COLUMN = gl.METRIC_COLUMN
#: the ablation switches of the paper's Appendix G, as changes of the full measure ``Measure(metric=m)``
VARIANTS: dict[str, dict[str, str]] = {"no_christoffel": {"step": "straight"}, "christoffel_only": {"ball": "adaptive"}}
TITLES = {"full": "full (metric norm, second-order step)",
          "no_christoffel": "no Christoffel term (metric norm, straight step)",
          "christoffel_only": "no metric norm (Christoffel only: second-order step in the adaptive ball)",
          "eps": "ε relaxation"}
#: the panels of the paper's Figures 7 (invariant metric) and 8 (mixed metric), left to right
PANELS = ("christoffel_only", "no_christoffel", "full")
FIGURE = {"invariant": 7, "mixed": 8}
#: a row's lines before the stage has run (Table 1 shows them so: :func:`companion.experiments.table1.pending_ablations`)
PENDING = table1.ABLATIONS_PENDING


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class RowSpec:
    row: str                 # Table 1 row (vision / language)
    stage: str               # the stage whose tables and protocol the lines reuse
    zoo: str | None          # None: not computed (``reason``)
    batches: list[int]       # indices into the row's primary (first-set) sharpness batches
    variants: list[str]      # of VARIANTS
    eps_grid: list[float]    # ε > 0 of the sweep (ε = 0 is the full measure)
    reason: str


@dataclass(frozen=True)
class OrbitSpec:
    model: str | None        # None: the zoo's first member
    batch: int               # index into the row's primary sharpness batches
    scales: list[float]      # a of A = a·N
    action_seed: int         # the draw of N
    dtype: str               # float64 or float32


@dataclass(frozen=True)
class LanguageSpec:
    stage: str               # the MiniLM row's stage (tables, protocol)
    zoo: str | None          # None: not computed (``reason``)
    relative_flatness_layer: str
    orbit: OrbitSpec | None
    reason: str


@dataclass(frozen=True)
class Settings:
    rows: dict[str, RowSpec]
    metrics: list[str]
    eps_metric: str
    language: LanguageSpec | None
    n_boot: int
    seed: int
    confidence: float
    retest_splits: SplitSettings
    check_rtol: float
    metrics_dir: str
    data_dir: str
    workers: int
    threads: int | None
    budget_minutes: float
    cpu_kernels: str | None        # CPU kernels pinned to this level (companion.kernels), checked before measuring


def load_settings(params: Mapping[str, Any]) -> Settings:
    """Typed settings from the stage's resolved ``params`` (every key required), checked."""
    s = from_mapping(Settings, params, "params.yaml ablations")
    bad = [m for m in [*s.metrics, s.eps_metric] if m not in METRIC_COLUMN]
    if bad:
        raise ValueError(f"ablations: metrics {bad} are not Table 1's geodesic metrics ({', '.join(METRIC_COLUMN)})")
    for name, r in s.rows.items():
        if r.row not in paper.TABLE1_TAU:
            raise ValueError(f"ablations.rows.{name}.row = {r.row!r}: not a Table 1 row")
        if set(r.variants) - set(VARIANTS):
            raise ValueError(f"ablations.rows.{name}.variants = {r.variants}: choose from {', '.join(VARIANTS)}")
        if any(not (e > 0 and math.isfinite(e)) for e in r.eps_grid):
            raise ValueError(f"ablations.rows.{name}.eps_grid = {r.eps_grid}: every ε must be > 0 (ε = 0 is the full "
                             "measure, always shown)")
        if len(r.batches) < 2 or len(r.batches) % 2:
            raise ValueError(f"ablations.rows.{name}.batches = {r.batches}: an even number >= 2 (the retest splits them)")
        if r.zoo is None and not r.reason:
            raise ValueError(f"ablations.rows.{name}: zoo is null, so `reason` must say why")
    if s.language is not None and s.language.zoo is None and not s.language.reason:
        raise ValueError("ablations.language: zoo is null, so `reason` must say why")
    return s


# --------------------------------------------------------------------------- the lines of a row


@dataclass(frozen=True)
class Line:
    key: str                 # e.g. "no_christoffel_invariant", "eps_0.001_invariant"
    variant: str             # "no_christoffel" / "christoffel_only" / "eps"
    metric: str
    eps: float
    rho_of: str              # the Table 1 measure whose pre-registered radius the line uses

    @property
    def full(self) -> str:
        """The Table 1 measure this line ablates (its Δ is against it)."""
        return METRIC_COLUMN[self.metric]

    def measure(self, row_eps: float):
        from hideseek.measures import Measure

        if self.variant == "eps":
            return Measure(metric=self.metric, eps=self.eps)
        return Measure(metric=self.metric, eps=row_eps, **VARIANTS[self.variant])

    @property
    def label(self) -> str:
        return (f"{self.metric}, ε = {self.eps:g}" if self.variant == "eps"
                else f"{self.metric}, {TITLES[self.variant]}")


def lines_of(spec: RowSpec, s: Settings) -> list[Line]:
    """The row's lines: each variant for each metric, then the ε sweep (pre-registration's order)."""
    out = [Line(f"{v}_{m}", v, m, 0.0, "adaptive" if v == "christoffel_only" else METRIC_COLUMN[m])
           for v in spec.variants for m in s.metrics]
    return out + [Line(f"eps_{e:g}_{s.eps_metric}", "eps", s.eps_metric, float(e), METRIC_COLUMN[s.eps_metric])
                  for e in spec.eps_grid]


def measure_member(name: str, model, *, batches: Sequence, lines: Sequence[tuple[str, Any, float]], n_iters: int,
                   seed: int) -> dict:
    """Every line's value of one member (``model``: an ``nn.Module`` or a zero-argument loader): per
    ``(key, measure, rho)``, :func:`hideseek.sharpness` on ``batches`` after ``torch.manual_seed(seed)`` (as
    :func:`companion.experiments.zoo.measure_zoo`); a ``ValueError`` of the library (its one-line refusal, e.g. a
    singular Gram matrix) gives NaN with ``refused`` True and the message."""
    import hideseek as hs

    if not isinstance(model, torch.nn.Module):
        model = model()
    model = model.eval()
    out: dict[str, Any] = {"model": name}
    t0 = time.perf_counter()
    for key, measure, rho in lines:
        torch.manual_seed(seed)
        rec = {"value": float("nan"), "per_batch": [float("nan")] * len(batches), "refused": False, "message": ""}
        try:
            res = hs.sharpness(model, list(batches), measure, rho=rho, n_iters=n_iters, seed=seed, progress=False)
            rec.update(value=float(res.value), per_batch=[float(v) for v in res.per_batch])
        except ValueError as exc:
            rec.update(refused=True, message=str(exc).splitlines()[0][:300])
        out[key] = rec
    out["elapsed"] = time.perf_counter() - t0
    return out


def check_published(model, batches: Sequence, idx: Sequence[int], published: np.ndarray, *, rho: float, n_iters: int,
                    seed: int, eps: float, rtol: float, where: str) -> float:
    """The full invariant measure of one member re-run on the chosen batches must give the row's published per-batch
    values at those batches (``published``): the comparison "same members and batches" holds. Returns the largest
    relative difference; raises ``ValueError`` above ``rtol``."""
    from hideseek.measures import Measure

    rec = measure_member("check", model, batches=batches, lines=[("full", Measure(metric="invariant", eps=eps), rho)],
                         n_iters=n_iters, seed=seed)["full"]
    got, want = np.asarray(rec["per_batch"], float), np.asarray(published, float)
    diff = float(np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-300)))
    if not diff <= rtol:
        raise ValueError(f"{where}: the full invariant measure re-run on batches {list(idx)} gives {got.tolist()}, the "
                         f"published per-batch values are {want.tolist()} (relative difference {diff:.2g} > {rtol:g}): "
                         "these are not the batches the row's primary τ used")
    return diff


# --------------------------------------------------------------------------- statistics


def retest_of(per_batch: np.ndarray, s: Settings) -> tuple[float, float]:
    """``(retest, reliability)`` between the two halves of the batches (with two batches: batch against batch), the
    reliability of their mean by Spearman–Brown (k = 2); NaN with fewer than 3 members."""
    pb = np.asarray(per_batch, dtype=float)
    if pb.shape[0] < 3:
        return float("nan"), float("nan")
    rt, _ = analysis.random_split_retest(pb, n_splits=s.retest_splits.n_splits, seed=s.retest_splits.seed)
    return rt, analysis.spearman_brown(rt, 2)


def line_stats(values: np.ndarray, per_batch: np.ndarray, full: np.ndarray, adaptive: np.ndarray, gap: np.ndarray, *,
               sign: int, s: Settings) -> dict:
    """τ(values, gap) with its interval, the paired Δ = sign·(τ − τ_full) and sign·(τ − τ_adaptive) over the members
    with a value (refused ones left out of both τ of each Δ), the retest and reliability."""
    values, full, adaptive, gap = (np.asarray(a, dtype=float) for a in (values, full, adaptive, gap))
    ok = np.isfinite(values)
    n = int(ok.sum())
    nan = float("nan")
    out: dict[str, Any] = {"n": n, "n_refused": int((~ok).sum()), "sign": sign}
    keys = ("tau", "ci_low", "ci_high", "tau_full", "delta_full", "delta_full_ci_low", "delta_full_ci_high",
            "tau_adaptive", "delta_adaptive", "delta_adaptive_ci_low", "delta_adaptive_ci_high", "retest", "reliability")
    if n < 4:
        return out | dict.fromkeys(keys, nan)
    kw = dict(n_boot=s.n_boot, seed=s.seed, confidence=s.confidence)
    t = analysis.kendall(values[ok], gap[ok], **kw)
    df = analysis.paired_delta_tau(values[ok], full[ok], gap[ok], sign=sign, **kw)
    da = analysis.paired_delta_tau(values[ok], adaptive[ok], gap[ok], sign=sign, **kw)
    rt, rel = retest_of(np.asarray(per_batch, float)[ok], s)
    return out | {"tau": t.tau, "ci_low": t.lo, "ci_high": t.hi, "tau_full": df.tau_base, "delta_full": df.delta,
                  "delta_full_ci_low": df.lo, "delta_full_ci_high": df.hi, "tau_adaptive": da.tau_base,
                  "delta_adaptive": da.delta, "delta_adaptive_ci_low": da.lo, "delta_adaptive_ci_high": da.hi,
                  "retest": rt, "reliability": rel}


def paper_tau(row: str, name: str) -> float | None:
    """The paper's τ for a measure name on a row where its text gives one (:mod:`companion.paper`): the language
    row's Figure 8 values and Table 1's full measures; None elsewhere ("not given")."""
    if row == "language" and name in paper.LANGUAGE_ABLATION_TAU:
        return float(paper.LANGUAGE_ABLATION_TAU[name])
    if name in paper.TABLE1_MEASURES:
        return float(paper.table1_tau(row)[name])
    return None


# --------------------------------------------------------------------------- a row


@dataclass
class RowResult:
    name: str
    spec: RowSpec
    protocol: Any            # geometry_lines.Protocol
    members: pd.DataFrame    # per member: gap, adaptive, full measures and every line (same batches)
    lines: pd.DataFrame      # per line (the full measures and adaptive included): statistics
    check_diff: float
    raw: list[dict]


def measure_row(name: str, spec: RowSpec, s: Settings, *, progress: bool = True, source=None,
                names: Sequence[str] | None = None) -> RowResult:
    """Check the published values, measure every member of a row on the chosen batches and compute its lines
    (``source`` / ``names``: a zoo source and member names instead of the row's zoo, for tests)."""
    if s.threads:
        torch.set_num_threads(s.threads)      # the check below runs here, with the workers' thread count
    prot = gl.read_protocol(spec.stage, s.metrics_dir)
    pub = gl.read_published(spec.stage, prot.n_points // prot.batch_size, s.data_dir)
    src = gl.zoo_source(spec.stage, spec.zoo) if source is None else source
    names = list(pub.members.index) if names is None else list(names)
    zoo_names = [n for n, _ in src.loaders()]
    if sorted(set(names) - set(zoo_names)) or len(zoo_names) != len(pub.members):
        raise ValueError(f"{spec.zoo}: the zoo's members ({len(zoo_names)}) are not the {len(pub.members)} members the "
                         f"{spec.stage} stage published; re-run that stage first")
    every = src.sharpness_batches(prot.n_points, prot.batch_size, prot.data_seed)
    bad = [i for i in spec.batches if not 0 <= i < len(every) or i >= prot.n_points // prot.batch_size]
    if bad:
        raise ValueError(f"ablations.rows.{name}.batches: {bad} outside the primary's first-set batches")
    batches = [every[i] for i in spec.batches]
    pos = [list(pub.members.index).index(n) for n in names]
    per_batch = {m: v[pos][:, spec.batches] for m, v in pub.per_batch.items()}
    first = dict(src.loaders(names[:1]))[names[0]]
    diff = check_published(first, batches, spec.batches, per_batch["geodesic_invariant"][0],
                           rho=prot.rho["geodesic_invariant"], n_iters=prot.n_iters, seed=prot.seed, eps=prot.eps,
                           rtol=s.check_rtol, where=f"ablations, row {name}, member {names[0]}")
    lines = lines_of(spec, s)
    task = dict(batches=batches, lines=[(ln.key, ln.measure(prot.eps), prot.rho[ln.rho_of]) for ln in lines],
                n_iters=prot.n_iters, seed=prot.seed)
    raw = run_pool(measure_member, src.loaders(names), task, workers=s.workers, threads=s.threads,
                   progress=progress, desc=f"ablations {name}")
    return analyse_row(name, spec, prot, pub.members.loc[names], per_batch, lines, raw, diff, s)


def analyse_row(name: str, spec: RowSpec, prot, members: pd.DataFrame, per_batch: Mapping[str, np.ndarray],
                lines: Sequence[Line], raw: Sequence[dict], check_diff: float, s: Settings) -> RowResult:
    """The row's per-member table and line statistics from the measured ``raw`` records (``per_batch``: the row's
    published per-batch values of the Table 1 measures on the chosen batches)."""
    gap = members["gap"].to_numpy(dtype=float)
    sign = gl.paper_sign(spec.row)
    tab = pd.DataFrame(index=members.index)
    tab["gap"] = gap
    for m in paper.TABLE1_MEASURES:
        tab[m] = per_batch[m].mean(1)
    rows = []
    for m in paper.TABLE1_MEASURES:         # the published measures on these batches: τ and retest, no Δ
        st = line_stats(tab[m].to_numpy(), per_batch[m], tab[m].to_numpy(), tab["adaptive"].to_numpy(), gap,
                        sign=sign, s=s)
        rows.append(dict(row=name, table1_row=spec.row, line=m, variant="full" if m != "adaptive" else "adaptive",
                         metric=m.removeprefix("geodesic_") if m != "adaptive" else "", eps=prot.eps, measure=m,
                         rho=prot.rho[m], batches=len(spec.batches), paper_tau=paper_tau(spec.row, m), **st))
    for ln in lines:
        rec = [r[ln.key] for r in raw]
        vals = np.array([r["value"] for r in rec], dtype=float)
        pb = np.array([r["per_batch"] for r in rec], dtype=float)
        tab[ln.key] = vals
        st = line_stats(vals, pb, tab[ln.full].to_numpy(), tab["adaptive"].to_numpy(), gap, sign=sign, s=s)
        mname = ln.measure(prot.eps).name
        rows.append(dict(row=name, table1_row=spec.row, line=ln.key, variant=ln.variant, metric=ln.metric,
                         eps=ln.eps if ln.variant == "eps" else prot.eps, measure=mname, rho=prot.rho[ln.rho_of],
                         batches=len(spec.batches), paper_tau=None if ln.variant == "eps" else paper_tau(spec.row, mname),
                         **st, refusal_messages=sorted({r["message"] for r in rec if r["refused"]})))
    table = pd.DataFrame(rows)
    every_refused = table[(table.n == 0) & (table.n_refused > 0)]
    if len(every_refused):
        raise ValueError(f"ablations, row {name}: the library refused {list(every_refused.line)} on every member: "
                         f"{every_refused.refusal_messages.iloc[0]}")
    return RowResult(name, spec, prot, tab, table, check_diff, list(raw))


# --------------------------------------------------------------------------- the language figures (MiniLM)


@dataclass
class LanguageResult:
    fig5: pd.DataFrame         # per member: gap and the row's published primary values
    fig5_tau: pd.DataFrame     # per measure: τ with interval, the paper's τ
    relative: pd.DataFrame     # per member: relative flatness (per batch), gap, the row's values
    relative_lines: pd.DataFrame   # τ of relative flatness, Δ against each measure
    orbit: pd.DataFrame | None     # per (scale, measure): value, before, ratio
    orbit_summary: pd.DataFrame | None
    protocol: Any


def _fig5(pub, s: Settings, row: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    gap = pub.members["gap"].to_numpy(dtype=float)
    tab = pd.DataFrame({"gap": gap, **{m: pub.value[m] for m in paper.TABLE1_MEASURES}}, index=pub.members.index)
    taus = []
    for m in paper.TABLE1_MEASURES:
        t = analysis.kendall(pub.value[m], gap, n_boot=s.n_boot, seed=s.seed, confidence=s.confidence)
        taus.append(dict(measure=m, tau=t.tau, ci_low=t.lo, ci_high=t.hi, n=t.n, paper_tau=paper.table1_tau(row)[m]))
    return tab, pd.DataFrame(taus)


def _relative(src, names, batches, pub, layer: str, s: Settings, row: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Relative flatness of every member on the row's primary batches; τ, Δ against each published measure."""
    from hideseek.relative_flatness import relative_flatness

    per = np.array([relative_flatness(load(), batches, layer=layer).per_batch for _, load in src.loaders(names)])
    tab = pd.DataFrame({"gap": pub.members["gap"].to_numpy(float), "relative_flatness": per.mean(1),
                        "per_batch": [json.dumps(p.tolist()) for p in per],
                        **{m: pub.value[m] for m in paper.TABLE1_MEASURES}}, index=pub.members.index)
    sign = gl.paper_sign(row)
    rows = []
    for m in paper.TABLE1_MEASURES:
        st = line_stats(tab["relative_flatness"].to_numpy(), per, tab[m].to_numpy(), tab["adaptive"].to_numpy(),
                        tab["gap"].to_numpy(), sign=sign, s=s)
        rows.append(dict(line="relative_flatness", against=m, layer=layer, batches=per.shape[1], **st))
    h = per.shape[1] // 2            # pre-registered: the row's halves (first against last batches), Spearman–Brown
    rt = analysis.kendall(per[:, :h].mean(1), per[:, h:].mean(1), n_boot=0, seed=0).tau if h else float("nan")
    return tab, pd.DataFrame(rows).assign(retest=rt, reliability=analysis.spearman_brown(rt, 2))


def _orbit(src, name: str, batch, prot, spec: OrbitSpec, layer: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The orbit A = a·N of one member (:func:`companion.experiments.orbit.orbit_ratios`) and the classifier's relative
    flatness along it, in ``spec.dtype``."""
    from companion.experiments import orbit
    from hideseek.relative_flatness import relative_flatness

    dtype = {"float32": torch.float32, "float64": torch.float64}[spec.dtype]
    model = dict(src.loaders([name]))[name]().to(dtype).eval()
    x, y = batch
    x = {k: v.to(dtype) if torch.is_floating_point(v) else v for k, v in x.items()} if isinstance(x, Mapping) else x
    frame = orbit.orbit_ratios(model, (x, y), [float(a) for a in spec.scales], prot.rho, n_iters=prot.n_iters,
                               seed=prot.seed, action_seeds=[spec.action_seed]).drop(columns=["seconds"])
    before = relative_flatness(model, [(x, y)], layer=layer).value
    ns = orbit.draw_head_matrices(model, seed=spec.action_seed)
    rf = []
    for a in spec.scales:
        moved = orbit.act_on_heads(copy.deepcopy(model), float(a), ns)
        v = relative_flatness(moved, [(x, y)], layer=layer).value
        rf.append(dict(action_seed=spec.action_seed, scale=float(a), measure="relative_flatness", value=v,
                       before=before, ratio=v / before if before else float("nan"),
                       max_logit_change=float(frame[frame.scale == float(a)].max_logit_change.iloc[0])))
    frame = pd.concat([frame, pd.DataFrame(rf)], ignore_index=True).assign(model=name, dtype=spec.dtype)
    return frame, orbit.summarise(frame).reset_index()


def language_figures(ls: LanguageSpec, s: Settings, *, row: str = "language", source=None) -> LanguageResult:
    """Figure 5 (published values), relative flatness of every member and the orbit of one member."""
    prot = gl.read_protocol(ls.stage, s.metrics_dir)
    pub = gl.read_published(ls.stage, prot.n_points // prot.batch_size, s.data_dir)
    fig5, fig5_tau = _fig5(pub, s, row)
    src = gl.zoo_source(ls.stage, ls.zoo) if source is None else source
    names = list(pub.members.index)
    batches = src.sharpness_batches(prot.n_points, prot.batch_size, prot.data_seed)
    if threads := s.threads:
        torch.set_num_threads(threads)
    rel, rel_lines = _relative(src, names, batches, pub, ls.relative_flatness_layer, s, row)
    orb = summ = None
    if ls.orbit is not None:
        member = ls.orbit.model or names[0]
        orb, summ = _orbit(src, member, batches[ls.orbit.batch], prot, ls.orbit, ls.relative_flatness_layer)
    return LanguageResult(fig5, fig5_tau, rel, rel_lines, orb, summ, prot)


# --------------------------------------------------------------------------- Table 1 lines


def _entry(row: str, name: str, variant: str, status: str, **kw) -> dict:
    none3 = {m: None for m in paper.TABLE1_MEASURES}
    return dict(row=row, name=name, stage=STAGE, family="ablation", exploratory=True, primary=False, variant=variant,
                tau=none3, status=status) | kw


def _variant_text(title: str, res: RowResult | None, stage: str) -> str:
    head = f"ablation: {title} — exploratory; Δ columns against the full measure (not adaptive sharpness)"
    if res is None:
        return f"{head}; {stage} zoo"
    nb = res.protocol.n_points // res.protocol.batch_size
    return (f"{head}, same members and batches; batches {res.spec.batches} of the primary's {nb}, the row's radii, "
            f"{res.protocol.n_iters} iterations; reports/preregistration/ablations.md")


def _groups(spec: RowSpec, s: Settings) -> list[tuple[str, list[Line]]]:
    """Table 1's line per ablation: a variant (both metrics) or one ε of the sweep."""
    lines = lines_of(spec, s)
    out = [(TITLES[v], [ln for ln in lines if ln.variant == v]) for v in spec.variants]
    return out + [(f"ε = {ln.eps:g} ({ln.metric} metric)", [ln]) for ln in lines if ln.variant == "eps"]


def table1_lines(results: Mapping[str, RowResult], s: Settings) -> list[dict]:
    """The entries :mod:`companion.experiments.table1` adds under each row: one per ablation, τ with interval in the
    column of its metric, Δτ against the full measure in the Δ column of that metric, retest; a row not computed
    gets its lines with ``status`` = its reason."""
    out = []
    for name, spec in s.rows.items():
        res = results.get(name)
        for title, group in _groups(spec, s):
            if res is None:
                out.append(_entry(spec.row, name, _variant_text(title, None, spec.stage), spec.reason or PENDING))
                continue
            g = res.lines.set_index("line")
            cols = {ln.full: ln.key for ln in group}
            val = lambda k: {col: float(g.loc[key, k]) for col, key in cols.items()}   # noqa: E731
            tau = {m: (float(g.loc[cols[m], "tau"]) if m in cols else None) for m in paper.TABLE1_MEASURES}
            refused = {col: int(g.loc[key, "n_refused"]) for col, key in cols.items()}
            out.append(_entry(spec.row, name, _variant_text(title, res, spec.stage), "computed", tau=tau,
                              n_models=len(res.members), setting=res.protocol.setting or None,
                              ci={col: [float(g.loc[key, "ci_low"]), float(g.loc[key, "ci_high"])]
                                  for col, key in cols.items()},
                              rho=val("rho"), retest=val("retest"), reliability=val("reliability"),
                              delta_tau=val("delta_full"),
                              delta_tau_ci={col: [float(g.loc[key, "delta_full_ci_low"]),
                                                  float(g.loc[key, "delta_full_ci_high"])] for col, key in cols.items()},
                              delta_against="full", n_refused=refused))
    return out


# --------------------------------------------------------------------------- findings and the stage


def _ci(lo: float, hi: float) -> str:
    return f"[{lo:+.2f}, {hi:+.2f}]"


def finding_lines(results: Mapping[str, RowResult], lang: LanguageResult | None, s: Settings) -> list[str]:
    """The findings in words, every number from the tables."""
    out = ["Exploratory lines (pre-registered in reports/preregistration/ablations.md before their values; the primary "
           "tests are unchanged): Δ = s·(τ_line − τ_full) over the same members and batches, s the sign of the paper's "
           f"τ for the row, so Δ < 0 means the ablated measure tracks the gap less well than the full one; paired "
           f"bootstrap ({s.n_boot} resamples), {s.confidence:.0%} intervals; no multiplicity correction."]
    for name, spec in s.rows.items():
        if name not in results:
            out.append(f"{name}: {spec.reason or PENDING}.")
            continue
        res = results[name]
        for r in res.lines.itertuples():
            if not np.isfinite(r.tau):
                out.append(f"{name}, {r.line}: fewer than 4 members with a value ({r.n_refused} refused).")
                continue
            paper_txt = "" if r.paper_tau is None or pd.isna(r.paper_tau) else f" (paper {r.paper_tau:+.2f})"
            head = f"{name} ({r.n} members, {r.batches} batches), {r.line}: τ = {r.tau:+.2f} {_ci(r.ci_low, r.ci_high)}"
            if r.variant in ("full", "adaptive"):
                out.append(f"{head}{paper_txt}; retest {r.retest:.2f}.")
            else:
                out.append(f"{head}{paper_txt}, Δ vs full {r.delta_full:+.2f} {_ci(r.delta_full_ci_low, r.delta_full_ci_high)}"
                           f", Δ vs adaptive {r.delta_adaptive:+.2f} {_ci(r.delta_adaptive_ci_low, r.delta_adaptive_ci_high)}"
                           f"; retest {r.retest:.2f}" + (f"; refused {r.n_refused}" if r.n_refused else "") + ".")
    if lang is not None:
        out += language_findings(lang)
    elif s.language is not None:
        out.append(f"language figures: {s.language.reason or PENDING}.")
    return out


def language_findings(lang: LanguageResult) -> list[str]:
    """Sentences of Figure 5, relative flatness and the orbit, every number from the tables."""
    out = ["Figure 5 (MiniLM row, published primary values): " + ", ".join(
        f"{r.measure} τ = {r.tau:+.2f} {_ci(r.ci_low, r.ci_high)} (paper {r.paper_tau:+.2f})"
        for r in lang.fig5_tau.itertuples()) + "."]
    rl = lang.relative_lines
    first = rl.iloc[0]
    out.append(f"Relative flatness ({first.layer}, {int(first.batches)} batches): τ = {first.tau:+.2f} "
               f"{_ci(first.ci_low, first.ci_high)}, retest of the halves {first.retest:.2f}; Δ against "
               + ", ".join(f"{r.against} {r.delta_full:+.2f} {_ci(r.delta_full_ci_low, r.delta_full_ci_high)}"
                           for r in rl.itertuples()) + ".")
    if lang.orbit_summary is not None:
        sm = lang.orbit_summary
        out.append(f"Orbit invariance (one member, one batch, {lang.orbit.dtype.iloc[0]}; A = a·N per head, a from "
                   f"{lang.orbit.scale.min():g} to {lang.orbit.scale.max():g}): largest |log(after/before)| "
                   + ", ".join(f"{r.measure} {r.max_abs_log_ratio:.2g}" for r in sm.itertuples())
                   + f"; logits moved by at most {sm.max_logit_change.max():.2g} (relative).")
    return out


@dataclass
class AblationReport:
    settings: Settings
    results: dict[str, RowResult]
    language: LanguageResult | None
    lines: pd.DataFrame
    metrics: dict
    findings: list[str]
    seconds: dict


def _records(frame: pd.DataFrame | None) -> list[dict]:
    return [] if frame is None else json.loads(frame.to_json(orient="records"))


def _write(out: Path, results: Mapping[str, RowResult], lang: LanguageResult | None) -> None:
    for name, res in results.items():
        d = out / "data" / name
        d.mkdir(parents=True, exist_ok=True)
        res.members.to_csv(d / "members.csv")
        res.lines.to_csv(d / "lines.csv", index=False)
    if lang is not None:
        d = out / "data" / "language"
        d.mkdir(parents=True, exist_ok=True)
        lang.fig5.to_csv(d / "fig5.csv")
        lang.relative.to_csv(d / "relative_flatness.csv")
        lang.relative_lines.to_csv(d / "relative_flatness_lines.csv", index=False)
        if lang.orbit is not None:
            lang.orbit.to_csv(d / "orbit.csv", index=False)


def run_report(profile: str, params: Mapping[str, Any], out_dir: str | Path, *, progress: bool = True,
               sources: Mapping[str, Any] | None = None) -> AblationReport:
    """Measure and write every output of the stage (module docstring). ``sources``: per row (and ``"language"``) a
    zoo source to use instead of the zoo folder (tests)."""
    from companion import metrics as cm

    s = load_settings(params)
    out, results, seconds, t_all = gl.start_report(
        STAGE, s, out_dir, lambda name, spec: measure_row(name, spec, s, progress=progress,
                                                          source=(sources or {}).get(name)))
    lang = None
    if s.language is not None and s.language.zoo is not None:
        t0 = time.perf_counter()
        lang = language_figures(s.language, s, source=(sources or {}).get("language"))
        seconds["language"] = time.perf_counter() - t0
    lines = pd.concat([r.lines for r in results.values()], ignore_index=True) if results else pd.DataFrame()
    findings = finding_lines(results, lang, s)
    metrics = {"table1_lines": table1_lines(results, s), "lines": _records(lines), "findings": findings,
               "protocol": {n: vars(r.protocol) | {"batches": r.spec.batches} for n, r in results.items()},
               "published_check_max_rel_diff": {n: r.check_diff for n, r in results.items()},
               "language": None if lang is None else {
                   "fig5_tau": _records(lang.fig5_tau), "relative_flatness": _records(lang.relative_lines),
                   "orbit_summary": _records(lang.orbit_summary)},
               "not_computed": {n: sp.reason for n, sp in s.rows.items() if sp.zoo is None},
               "preregistration": "reports/preregistration/ablations.md"}
    cm.write_stage_metrics(out, STAGE, metrics)
    _write(out, results, lang)
    seconds["total"] = time.perf_counter() - t_all
    per_member = {n: float(np.mean([r["elapsed"] for r in res.raw])) for n, res in results.items() if res.raw}
    cm.write_stage_timings(out, STAGE, {"seconds": seconds, "per_member_mean": per_member,
                                        "budget_minutes": s.budget_minutes})
    return AblationReport(s, results, lang, lines, metrics, findings, seconds)


def findings(rep: AblationReport) -> str:
    """The findings as a markdown list (the notebook displays it)."""
    return "\n".join("- " + line for line in rep.findings)


__all__ = ["AblationReport", "Line", "Settings", "analyse_row", "check_published", "findings", "language_figures",
           "line_stats", "lines_of", "load_settings", "measure_member", "measure_row", "run_report",
           "table1_lines"]
