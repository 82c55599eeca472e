"""The ``geometry_lines`` stage without its plots: exploratory Table 1 lines from the complete geometry
(issue 24 item 4, issue 26 item 4).

Pre-registered in ``reports/preregistration/geometry_lines.md`` (settings: ``params.yaml`` section
``geometry_lines``), committed before any of these values was computed. **Every line here is exploratory**;
the rows' primary tests stay as pre-registered. Per transformer row (the vision zoo, the MiniLM zoo):

* **exact-geodesic sharpness**: :func:`hideseek.sharpness` with ``Measure(metric=m, step="exact")`` (the
  integrated geodesic, RK4, docs/maths.md §5.6) for the invariant and the mixed metric at the row's
  pre-registered radii, with the row's iterations and seed, read from the protocol the row's primary τ used
  (``reports/metrics/<stage>.json``); a member whose mixed geodesic runs into a rank-deficient pair (the
  library's refusal) is recorded as refused (NaN) and counted;
* each member's **second-order correction ratio** ‖½Γ(ξ, ξ)‖/‖ξ‖ (``ProductGeometry.correction_ratio``,
  the quantity behind the library's "correction is large" warning) at the maximiser of each batch's exact
  search, the largest and the median over batches;
* **Hessian traces** as further sharpness measures: :class:`hideseek.RiemannianHessian` (invariant, mixed
  metric) and :class:`hideseek.EuclideanHessian`, Hutchinson per batch (docs/maths.md §14).

For the diagonal networks, whose exact-geodesic lines already are the row's primary line, the Hessian traces
only: the library applies to them directly (``hs.DiagonalPair``), exactly (2d dimensions). The 144 k-parameter
language zoo is not in the DVC cache: its lines say so.

Statistics per line (:func:`line_stats`): Kendall τ with the row's generalisation measure (bootstrap interval,
:func:`companion.analysis.kendall`), the paired Δτ against the row's adaptive sharpness on the same members
and batches (:func:`companion.analysis.paired_delta_tau`, signed as ``reports/preregistration/delta_tau.md``),
the retest between batches (:func:`companion.analysis.random_split_retest`) and the reliability of the mean
(Spearman–Brown), and for the exact lines the power at the paper's Δ (:func:`companion.analysis.delta_power`).

``run_report(profile, params, out_dir)`` measures, writes ``metrics/geometry_lines.json`` (key
``table1_lines``: what :mod:`companion.experiments.table1` adds to Table 1), ``data/<row>/members.csv``,
``data/<row>/correction_ratio.csv``, ``data/<row>/lines.csv`` and the timings; the notebook plots.
"""
from __future__ import annotations

import json
import math
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pandas as pd
import torch

from companion import analysis, paper
from companion.experiments.paired import PowerSettings, SplitSettings
from companion.params import from_mapping
from companion.pool import run_pool

STAGE = "geometry_lines"
METRIC_COLUMN = {"invariant": "geodesic_invariant", "mixed": "geodesic_mixed"}
#: the Hessian operators of a member: Riemannian (metric name) and the Euclidean one
HESSIANS = ("invariant", "mixed", "euclidean")
FAMILIES = ("exact", "hessian")
#: the text of the library's refusal of an incomplete geodesic (hideseek.geometry.geodesic.RankLossMonitor)
REFUSAL = "reach a rank-deficient pair"
#: the library's refusal when a Gram matrix on the path is exactly singular (torch.linalg rejects it before the
#: rank-loss monitor looks; hideseek.geometry.geodesic.singular_gram_refusal): the same event (the pair lost rank
#: on the path), recorded as a refusal and counted apart (the pre-registration's amendment)
SINGULAR = "exactly singular at an RK4 point"
#: the title each Table 1 line's variant text starts with (before " — ")
TITLES = {"exact": "exact geodesic (integrated, RK4)", "hessian": "Hessian trace"}
LABELS = {"exact_invariant": "exact geodesic, invariant", "exact_mixed": "exact geodesic, mixed",
          "hessian_invariant": "Riemannian Hessian trace, invariant", "hessian_mixed": "Riemannian Hessian trace, mixed",
          "hessian_euclidean": "Euclidean Hessian trace"}


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class RowSpec:
    row: str                           # Table 1 row (vision / language)
    stage: str                         # the stage whose tables and protocol the lines reuse
    zoo: str | None                    # the zoo folder; None: not computed (``reason``)
    exact_batches: list[int] | None    # indices into the primary's (first-set) batches; None: all
    hessian_batches: list[int] | None
    hessian_probes: int | None
    families: list[str]                # the line families computed ("exact", "hessian")
    reason: str                        # why a family (or the row) is not computed


@dataclass(frozen=True)
class DiagonalSpec:
    stage: str
    hessian: str                       # trace method ("exact")
    compute: bool                      # False: the line says ``reason``
    reason: str


@dataclass(frozen=True)
class HessianSettings:
    method: str
    keep_graph: bool
    probe_seed: int


@dataclass(frozen=True)
class Settings:
    rows: dict[str, RowSpec]
    diagonal: DiagonalSpec | None
    metrics: list[str]
    hessian: HessianSettings
    baseline: str
    n_boot: int
    seed: int
    confidence: float
    power: PowerSettings
    retest_splits: SplitSettings
    max_correction_ratio: float
    workers: int
    threads: int | None
    budget_minutes: float
    cpu_kernels: str | None        # CPU kernels pinned to this level (companion.kernels), checked before measuring


def load_settings(params: Mapping[str, Any]) -> Settings:
    """Typed settings from the stage's resolved ``params`` (every key required)."""
    s = from_mapping(Settings, params, "params.yaml geometry_lines")
    bad = [m for m in s.metrics if m not in METRIC_COLUMN]
    if bad:
        raise ValueError(f"geometry_lines.metrics: {bad} are not metrics of Table 1's geodesic measures "
                         f"({', '.join(METRIC_COLUMN)})")
    if s.baseline != "adaptive":
        raise ValueError(f"geometry_lines.baseline must be 'adaptive' (the pre-registered Δτ), got {s.baseline!r}")
    for name, r in s.rows.items():
        if r.row not in paper.TABLE1_TAU:
            raise ValueError(f"geometry_lines.rows.{name}.row = {r.row!r}: not a Table 1 row")
        if r.zoo is not None and (r.hessian_probes is None or r.hessian_probes < 2):
            raise ValueError(f"geometry_lines.rows.{name}.hessian_probes must be an integer >= 2 (Hutchinson's "
                             f"standard error needs two probes), got {r.hessian_probes!r}")
        if (r.zoo is None or set(FAMILIES) - set(r.families)) and not r.reason:
            raise ValueError(f"geometry_lines.rows.{name}: a line family is not computed, so `reason` must say why")
        if set(r.families) - set(FAMILIES):
            raise ValueError(f"geometry_lines.rows.{name}.families: {r.families}; choose from {FAMILIES}")
    return s


# --------------------------------------------------------------------------- what a row's primary used


@dataclass
class Protocol:
    """What the row's primary τ was measured with (its published metrics file)."""

    rho: dict[str, float]      # Table 1 measure -> radius
    n_iters: int
    seed: int
    eps: float
    batch_size: int
    n_points: int              # per (first) set
    data_seed: int
    setting: str               # the row's primary line's own setting text in Table 1 ("": the row's)
    n_planned: int | None = None   # members the row's pre-registration asked for (MiniLM), when recorded


def read_protocol(stage: str, metrics_dir: str | Path = "reports/metrics") -> Protocol:
    """The protocol of ``reports/metrics/<stage>.json`` (vision or MiniLM layout)."""
    path = Path(metrics_dir) / f"{stage}.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run (or dvc pull) the {stage} stage first")
    data = json.loads(path.read_text())
    p = data["protocol"]
    setting = next((e.get("setting") for e in (data.get("table1") or []) if e.get("primary")), None) or ""
    planned = (data.get("zoo") or {}).get("n_planned")
    if "n_images" in p:          # vision layout
        eps = {float(m["eps"]) for k, m in p["measures"].items() if k in METRIC_COLUMN.values()}
        if len(eps) != 1:
            raise ValueError(f"{path}: the geodesic measures use different eps {sorted(eps)}")
        return Protocol({k: float(v) for k, v in p["rho"].items()}, int(p["n_iters"]), int(p["seed"]), eps.pop(),
                        int(p["batch_size"]), int(p["n_images"]), 0, setting, planned)
    return Protocol({k: float(v) for k, v in p["rho"].items()}, int(p["n_iters"]), int(p["seed"]), float(p["eps"]),
                    int(p["batch_size"]), int(p["n_points"]), int(p["data_seed"]), setting, planned)


def _read(path: Path, **kw) -> pd.DataFrame:
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run (or dvc pull) the stage that publishes it")
    return pd.read_csv(path, float_precision="round_trip", **kw)


@dataclass
class Published:
    """A row's published members and the per-batch values of its primary runs (first set)."""

    members: pd.DataFrame                  # index: name; ``gap``
    per_batch: dict[str, np.ndarray]       # Table 1 measure -> [members, batches of the first set]
    value: dict[str, np.ndarray]           # the value the row's primary τ uses
    gap_reliability: float


def read_published(stage: str, n_first: int, data_dir: str | Path = "reports/data") -> Published:
    """``reports/data/<stage>``: members, the primary runs' per-batch values (the first ``n_first`` batches: set 1)
    and the primary value, checked to be the first set's mean (so these are the values the row's τ used)."""
    d = Path(data_dir) / stage
    members = _read(d / "members.csv", index_col="name")
    sharp = _read(d / "sharpness.csv")
    if "set" in sharp:
        sharp = sharp[sharp["set"] == "primary"]
    prim = _read(d / "primary.csv").set_index("measure")
    per_batch, value = {}, {}
    for m in paper.TABLE1_MEASURES:
        at = sharp[(sharp["measure"] == m) & np.isclose(sharp["rho"], float(prim.loc[m, "rho"]))].set_index("model")
        if at.index.duplicated().any() or set(at.index) != set(members.index):
            raise ValueError(f"{d / 'sharpness.csv'}: {m} must have one primary value per member of members.csv")
        at = at.loc[members.index]
        pb = np.array([json.loads(v) for v in at["per_batch"]], dtype=float)
        if pb.shape[1] < n_first:
            raise ValueError(f"{d / 'sharpness.csv'}: {m} has {pb.shape[1]} batches per member, fewer than {n_first}")
        per_batch[m] = pb[:, :n_first]
        value[m] = (members[f"sharpness_{m}"] if f"sharpness_{m}" in members else at["value"]).to_numpy(dtype=float)
        if not np.allclose(per_batch[m].mean(1), value[m], rtol=1e-12, atol=0):
            raise ValueError(f"{d}: {m}'s value is not the mean of its first {n_first} batches: not the tables "
                             "the row's primary τ used")
    return Published(members, per_batch, value, float(prim["gap_reliability"].iloc[0]))


# --------------------------------------------------------------------------- measuring one member


def exact_measure(metric: str, eps: float):
    """The exact-geodesic measure of a metric (the row's ε)."""
    from hideseek.measures import Measure

    return Measure(metric=metric, step="exact", eps=eps)


def hessian_operator(kind: str, model, batches, keep_graph: bool, **kw):
    """``hs.RiemannianHessian`` of metric ``kind`` or, for ``"euclidean"``, ``hs.EuclideanHessian``."""
    import hideseek as hs

    if kind == "euclidean":
        return hs.EuclideanHessian(model, batches, keep_graph=keep_graph, **kw)
    return hs.RiemannianHessian(model, batches, hs.Measure(metric=kind), keep_graph=keep_graph, **kw)


def measure_member(name: str, model, *, exact_batches: Sequence, hessian_batches: Sequence[tuple[int, Any]],
                   metrics: Sequence[str], rho: Mapping[str, float], n_iters: int, seed: int, eps: float,
                   hessian: HessianSettings, probes: int) -> dict:
    """Every geometry value of one member (``model``: an ``nn.Module`` or a zero-argument loader).

    Exact lines: per metric, :class:`hideseek.problem.SharpnessProblem` (what :func:`hideseek.sharpness` runs)
    with ``torch.manual_seed(seed)`` first, as :func:`companion.experiments.zoo.measure_zoo`; its value,
    per-batch values and the correction ratio at each batch's maximiser; a refusal of the library
    (:data:`REFUSAL`; an exactly singular Gram matrix on the path, :data:`SINGULAR`, counted apart)
    gives NaN, ``refused`` True and ``refusal`` ``"rank_loss"`` / ``"singular_gram"``. Hessian lines: per
    operator of :data:`HESSIANS` and batch ``(b, batch)`` of ``hessian_batches``, ``trace(method, n_probes=probes, seed=probe_seed + b)``."""
    from hideseek.problem import SharpnessProblem

    if not isinstance(model, torch.nn.Module):
        model = model()
    model = model.eval()
    out: dict[str, Any] = {"model": name}
    t0 = time.perf_counter()
    for metric in metrics:
        torch.manual_seed(seed)
        rec: dict[str, Any] = {"value": float("nan"), "per_batch": [float("nan")] * len(exact_batches),
                               "ratio": [float("nan")] * len(exact_batches), "refused": False, "refusal": "",
                               "message": "", "warnings": []}
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                prob = SharpnessProblem(model, exact_batches, exact_measure(metric, eps), rho=rho[metric],
                                        n_iters=n_iters, seed=seed, progress=False)
                res = prob.run()
            rec.update(value=float(res.value), per_batch=[float(v) for v in res.per_batch],
                       ratio=[float(prob.geometry.correction_ratio(s.best)) if s.best else 0.0 for s in res.solver],
                       warnings=sorted({str(w.message).split(":")[0][:120] for w in caught}))
        except ValueError as exc:
            if REFUSAL not in str(exc):
                raise
            # amendment of the pre-registration: an exactly singular Gram matrix is the same event, counted apart
            rec.update(refused=True, refusal="singular_gram" if SINGULAR in str(exc) else "rank_loss",
                       message=str(exc))
        out[f"exact_{metric}"] = rec
    out["exact_seconds"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for kind in (HESSIANS if hessian_batches else ()):
        est, se = [], []
        for b, batch in hessian_batches:
            op = hessian_operator(kind, model, [batch], hessian.keep_graph)
            tr = op.trace(hessian.method, n_probes=probes, seed=hessian.probe_seed + b)
            est.append(float(tr.value))
            se.append(float(tr.stderr))
            del op
        out[f"hessian_{kind}"] = {"per_batch": est, "stderr_per_batch": se, "value": float(np.mean(est)),
                                  "stderr": float(math.sqrt(sum(v * v for v in se)) / len(se))}
    out["hessian_seconds"] = time.perf_counter() - t0
    return out


def measure_members(items: Sequence[tuple[str, Any]], task: dict, *, workers: int, threads: int | None,
                    progress: bool = True) -> list[dict]:
    """:func:`measure_member` for every ``(name, loader)``, in ``workers`` spawned processes of ``threads``
    intra-op threads each, the order kept; every value as with ``workers=1``, which runs here
    (:func:`companion.pool.run_pool`)."""
    return run_pool(measure_member, items, task, workers=workers, threads=threads, progress=progress,
                    desc="geometry lines")


# --------------------------------------------------------------------------- statistics of a line


def paper_sign(row: str) -> int:
    """s of the pre-registration: the sign of the paper's geodesic τ for the row (both geodesic τ share it in
    every row of the paper's Table 1; refused otherwise)."""
    from companion.experiments import paired

    signs = {paired.paper_sign(row, g) for g in METRIC_COLUMN.values()}
    if len(signs) != 1:
        raise ValueError(f"the paper's geodesic τ of row {row!r} differ in sign: no single direction")
    return signs.pop()


def reliability_of(per_batch: np.ndarray, s: Settings) -> tuple[float, float]:
    """``(retest, reliability)``: the mean over random splits of the batches into two halves of the Kendall τ
    between the halves' means (:func:`companion.analysis.random_split_retest`; with 2 batches the one split) and
    the Spearman–Brown reliability of the mean of both halves (k = 2); NaN with fewer than 3 members or an odd
    number of batches."""
    pb = np.asarray(per_batch, dtype=float)
    if pb.ndim != 2 or pb.shape[0] < 3 or pb.shape[1] < 2 or pb.shape[1] % 2:
        return float("nan"), float("nan")
    rt, _ = analysis.random_split_retest(pb, n_splits=s.retest_splits.n_splits, seed=s.retest_splits.seed)
    return rt, analysis.spearman_brown(rt, 2)


def line_stats(values: np.ndarray, base: np.ndarray, gap: np.ndarray, *, row: str, s: Settings,
               per_batch: np.ndarray | None = None, base_per_batch: np.ndarray | None = None,
               paper_tau: float | None = None, gap_reliability: float = float("nan"),
               base_reliability: float | None = None) -> dict:
    """τ(values, gap) with its interval, the paired Δ = s·(τ − τ_adaptive) over the members with a value
    (refused ones left out of both τ), the retest and reliability (from ``per_batch``; ``base_reliability``
    overrides the one from ``base_per_batch``) and, with ``paper_tau``, the power at the paper's Δ."""
    values, base, gap = (np.asarray(a, dtype=float) for a in (values, base, gap))
    ok = np.isfinite(values)
    n = int(ok.sum())
    out: dict[str, Any] = {"n": n, "n_refused": int((~ok).sum())}
    nan = float("nan")
    if n < 4:
        return out | {"tau": nan, "ci_low": nan, "ci_high": nan, "delta": nan, "delta_ci_low": nan,
                      "delta_ci_high": nan, "retest": nan, "reliability": nan, "power": nan, "tau_between": nan}
    t = analysis.kendall(values[ok], gap[ok], n_boot=s.n_boot, seed=s.seed, confidence=s.confidence)
    sign = paper_sign(row)
    d = analysis.paired_delta_tau(values[ok], base[ok], gap[ok], sign=sign, n_boot=s.n_boot, seed=s.seed,
                                  confidence=s.confidence)
    rt, rel = reliability_of(per_batch[ok], s) if per_batch is not None else (nan, nan)
    if base_reliability is None:
        base_reliability = reliability_of(base_per_batch[ok], s)[1] if base_per_batch is not None else nan
    between = analysis.kendall(values[ok], base[ok], n_boot=0, seed=0).tau
    out |= {"tau": t.tau, "ci_low": t.lo, "ci_high": t.hi, "pvalue": t.pvalue, "sign": sign, "delta": d.delta,
            "delta_ci_low": d.lo, "delta_ci_high": d.hi, "tau_adaptive": d.tau_base, "retest": rt,
            "reliability": rel, "reliability_adaptive": base_reliability, "tau_between": between,
            "gap_reliability": gap_reliability, "power": nan, "power_note": ""}
    if paper_tau is not None:
        ptau = paper.table1_tau(row)
        out["paper_tau"] = paper_tau
        out["paper_delta"] = sign * (paper_tau - ptau["adaptive"])
        rels = (rel, base_reliability, gap_reliability)
        if all(np.isfinite(rels)) and rel > 0 and base_reliability > 0 and 0 < gap_reliability <= 1:
            out["power"] = analysis.delta_power(n, paper_tau, ptau["adaptive"], retest_x=rel,
                                                retest_base=base_reliability, rel_y=gap_reliability,
                                                tau_between=between, sign=sign, n_sim=s.power.n_sim,
                                                n_boot=s.power.n_boot, seed=s.power.seed, confidence=s.confidence)
        else:
            out["power_note"] = ("a reliability is not positive (retest shows no signal) or undefined: "
                                 "no power")
    return out


# --------------------------------------------------------------------------- a transformer row


def zoo_source(stage: str, zoo: str):
    """The row's zoo (:class:`companion.experiments.zoo.ZooSource`) by its stage."""
    if stage == "vision":
        from companion.experiments import vision_zoo as vz

        return vz.source(zoo)
    if stage == "minilm":
        from companion.experiments import minilm_zoo as mz

        return mz.MiniLMZoo(zoo)
    raise ValueError(f"geometry_lines: no zoo reader for stage {stage!r} (vision, minilm)")


def _pick(batches: list, idx: list[int] | None, what: str) -> list[tuple[int, Any]]:
    idx = list(range(len(batches))) if idx is None else list(idx)
    bad = [i for i in idx if not 0 <= i < len(batches)]
    if bad:
        raise ValueError(f"geometry_lines: {what} {bad} outside the primary's {len(batches)} batches")
    return [(i, batches[i]) for i in idx]


@dataclass
class RowResult:
    name: str
    spec: RowSpec
    protocol: Protocol
    members: pd.DataFrame          # per member: gap and every value of the lines
    lines: pd.DataFrame            # per line: statistics
    ratios: pd.DataFrame           # per member: correction ratios
    raw: list[dict]


def measure_row(name: str, spec: RowSpec, s: Settings, *, metrics_dir="reports/metrics", data_dir="reports/data",
                progress: bool = True, source=None, names: Sequence[str] | None = None) -> RowResult:
    """Measure every member of a transformer row and compute its lines (``source``/``names``: tests)."""
    prot = read_protocol(spec.stage, metrics_dir)
    n_first = prot.n_points // prot.batch_size
    pub = read_published(spec.stage, n_first, data_dir)
    src = zoo_source(spec.stage, spec.zoo) if source is None else source
    names = list(pub.members.index) if names is None else list(names)
    zoo_names = [n for n, _ in src.loaders()]
    missing = sorted(set(names) - set(zoo_names))
    if missing or len(zoo_names) != len(pub.members):
        raise ValueError(f"{spec.zoo}: the zoo's members ({len(zoo_names)}) are not the {len(pub.members)} members "
                         f"the {spec.stage} stage published (missing {missing[:3]}); re-run that stage first")
    batches = src.sharpness_batches(prot.n_points, prot.batch_size, prot.data_seed)
    exact = _pick(batches, spec.exact_batches, "exact_batches")
    hess = _pick(batches, spec.hessian_batches, "hessian_batches") if "hessian" in spec.families else []
    task = dict(exact_batches=[b for _, b in exact], hessian_batches=hess, metrics=list(s.metrics),
                rho={m: prot.rho[METRIC_COLUMN[m]] for m in s.metrics}, n_iters=prot.n_iters, seed=prot.seed,
                eps=prot.eps, hessian=s.hessian, probes=int(spec.hessian_probes or 0))
    raw = measure_members(src.loaders(names), task, workers=s.workers, threads=s.threads, progress=progress)
    sub = pub.members.loc[names]
    pos = [list(pub.members.index).index(n) for n in names]
    eidx = [i for i, _ in exact]
    return analyse_row(name, spec, prot, sub, {m: v[pos] for m, v in pub.per_batch.items()}, pub.gap_reliability,
                       eidx, raw, s)


def analyse_row(name: str, spec: RowSpec, prot: Protocol, members: pd.DataFrame, per_batch: dict[str, np.ndarray],
                gap_reliability: float, exact_idx: list[int], raw: list[dict], s: Settings) -> RowResult:
    """The row's per-member table, correction ratios and line statistics from the measured ``raw`` records
    (``per_batch``: the row's published first-set per-batch values per Table 1 measure)."""
    gap = members["gap"].to_numpy(dtype=float)
    base_pb = per_batch[s.baseline][:, exact_idx]              # adaptive on the exact lines' batches
    tab = pd.DataFrame(index=members.index)
    tab["gap"] = gap
    tab["adaptive_same_batches"] = base_pb.mean(1)
    tab["adaptive_primary"] = per_batch[s.baseline].mean(1)
    rows, ratio_rows = _exact_lines(name, spec, prot, tab, per_batch, base_pb, gap_reliability, exact_idx, raw, s)
    if "hessian" in spec.families:
        rows += _hessian_lines(name, spec, tab, base_pb, gap_reliability, raw, s)
    return RowResult(name, spec, prot, tab, pd.DataFrame(rows), pd.DataFrame(ratio_rows), raw)


def _exact_lines(name, spec, prot, tab, per_batch, base_pb, gap_reliability, exact_idx, raw, s):
    """The exact-geodesic lines (adds the member columns to ``tab``) and the correction-ratio rows."""
    gap, base = tab["gap"].to_numpy(), tab["adaptive_same_batches"].to_numpy()
    ptau = paper.table1_tau(spec.row)
    rows, ratio_rows = [], []
    for m in s.metrics:
        col = METRIC_COLUMN[m]
        rec = [r[f"exact_{m}"] for r in raw]
        vals = np.array([r["value"] for r in rec], dtype=float)
        so = per_batch[col][:, exact_idx].mean(1)
        ratios = [np.asarray(r["ratio"], dtype=float) for r in rec]
        tab[f"exact_{m}"] = vals
        tab[f"second_order_{m}"] = so
        tab[f"refused_{m}"] = [r["refused"] for r in rec]
        tab[f"correction_ratio_max_{m}"] = [float(rr.max()) if rr.size else np.nan for rr in ratios]
        st = line_stats(vals, base, gap, row=spec.row, s=s, per_batch=np.array([r["per_batch"] for r in rec], float),
                        base_per_batch=base_pb, paper_tau=ptau[col], gap_reliability=gap_reliability)
        ok = np.isfinite(vals)
        tau0 = lambda a, b: analysis.kendall(a, b, n_boot=0, seed=0).tau if ok.sum() >= 4 else float("nan")  # noqa: E731
        rel_diff = np.abs(vals[ok] - so[ok]) / np.abs(so[ok]) if ok.any() else np.array([np.nan])
        rows.append(dict(row=name, table1_row=spec.row, family="exact", line=f"exact_{m}", measure=col, metric=m,
                         rho=prot.rho[col], batches=len(exact_idx), **st,
                         tau_second_order_same_batches=tau0(so[ok], gap[ok]),
                         tau_exact_vs_second_order=tau0(vals[ok], so[ok]),
                         max_rel_diff_exact_second_order=float(np.max(rel_diff)),
                         median_rel_diff_exact_second_order=float(np.median(rel_diff)),
                         n_refused_rank_loss=sum(r["refusal"] == "rank_loss" for r in rec),
                         n_refused_singular_gram=sum(r["refusal"] == "singular_gram" for r in rec),
                         refusal_messages=sorted({r["message"] for r in rec if r["refused"]}),
                         library_warnings=sorted({w for r in rec for w in r["warnings"]})))
        for n_, r, rr in zip(tab.index, rec, ratios):
            ratio_rows.append(dict(model=n_, metric=m, rho=prot.rho[col], refused=r["refused"],
                                   ratio_max=float(rr.max()) if rr.size else float("nan"),
                                   ratio_median=float(np.median(rr)) if rr.size else float("nan"),
                                   per_batch=json.dumps([float(v) for v in rr]),
                                   above_bound=bool(rr.size and rr.max() > s.max_correction_ratio)))
        if spec.stage == "vision" and ok.sum() >= 4:   # Δ against the primary adaptive value (all of set 1)
            d = analysis.paired_delta_tau(vals[ok], tab["adaptive_primary"].to_numpy()[ok], gap[ok],
                                          sign=paper_sign(spec.row), n_boot=s.n_boot, seed=s.seed,
                                          confidence=s.confidence)
            rows.append(dict(row=name, table1_row=spec.row, family="exact_vs_primary_adaptive",
                             line=f"exact_{m}_vs_primary_adaptive", measure=col, metric=m, n=d.n, delta=d.delta,
                             delta_ci_low=d.lo, delta_ci_high=d.hi, tau=d.tau_x, tau_adaptive=d.tau_base))
    return rows, ratio_rows


def _hessian_lines(name, spec, tab, base_pb, gap_reliability, raw, s):
    """The Hessian-trace lines (adds the member columns to ``tab``) and the Riemannian-vs-Euclidean Δ."""
    gap, base = tab["gap"].to_numpy(), tab["adaptive_same_batches"].to_numpy()
    rows = []
    for k in HESSIANS:
        rec = [r[f"hessian_{k}"] for r in raw]
        vals = np.array([r["value"] for r in rec], dtype=float)
        se = np.array([r["stderr"] for r in rec], dtype=float)
        tab[f"hessian_{k}"] = vals
        tab[f"hessian_{k}_stderr"] = se
        st = line_stats(vals, base, gap, row=spec.row, s=s, per_batch=np.array([r["per_batch"] for r in rec], float),
                        base_per_batch=base_pb, gap_reliability=gap_reliability)
        sd = float(np.std(vals, ddof=1)) if len(vals) > 1 else float("nan")
        rows.append(dict(row=name, table1_row=spec.row, family="hessian", line=f"hessian_{k}",
                         measure=k if k == "euclidean" else METRIC_COLUMN[k], metric=k,
                         batches=len(rec[0]["per_batch"]) if rec else 0, probes=spec.hessian_probes, **st,
                         median_stderr=float(np.median(se)), sd_across_members=sd,
                         noise_to_spread=float(np.median(se)) / sd if sd > 0 else float("nan")))
    for k in ("invariant", "mixed"):           # Riemannian vs Euclidean trace (metrics and notebook only)
        a, e = tab[f"hessian_{k}"].to_numpy(), tab["hessian_euclidean"].to_numpy()
        if len(a) >= 4:
            d = analysis.paired_delta_tau(a, e, gap, sign=paper_sign(spec.row), n_boot=s.n_boot, seed=s.seed,
                                          confidence=s.confidence)
            rows.append(dict(row=name, table1_row=spec.row, family="hessian_vs_euclidean",
                             line=f"hessian_{k}_vs_euclidean", measure=METRIC_COLUMN[k], metric=k, n=d.n,
                             delta=d.delta, delta_ci_low=d.lo, delta_ci_high=d.hi, tau=d.tau_x,
                             tau_adaptive=float("nan")))
    return rows


# --------------------------------------------------------------------------- the diagonal networks


class DiagonalNet(torch.nn.Module):
    """``f(x) = ⟨u ⊙ v, x⟩`` (float64) with the trained ``u``, ``v``: a diagonal network as an ``nn.Module``, so that
    :class:`hideseek.RiemannianHessian` reads it with ``pairs=[hs.DiagonalPair("u", "v")]``."""

    def __init__(self, u: np.ndarray, v: np.ndarray) -> None:
        super().__init__()
        self.u = torch.nn.Parameter(torch.as_tensor(np.asarray(u), dtype=torch.float64).clone())
        self.v = torch.nn.Parameter(torch.as_tensor(np.asarray(v), dtype=torch.float64).clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.u * self.v)


def half_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The diagonal stage's training loss ``‖Xβ − y‖² / (2n)``."""
    return 0.5 * ((out - y) ** 2).mean()


def diagonal_traces(u: np.ndarray, v: np.ndarray, X: np.ndarray, y: np.ndarray, method: str = "exact") -> dict:
    """The three Hessian traces of one diagonal network (the whole training set as one batch)."""
    import hideseek as hs

    model = DiagonalNet(u, v).eval()
    batch = [(torch.as_tensor(X, dtype=torch.float64), torch.as_tensor(y, dtype=torch.float64))]
    out = {}
    for k in HESSIANS:
        if k == "euclidean":
            op = hs.EuclideanHessian(model, batch, loss_fn=half_mse)
        else:     # every product of the 2d columns in one vectorised backward pass (values as with chunks)
            op = hs.RiemannianHessian(model, batch, hs.Measure(metric=k), loss_fn=half_mse,
                                      pairs=[hs.DiagonalPair("u", "v")], chunk=2 * len(u))
        tr = op.trace(method) if method == "exact" else op.trace(method, seed=0)
        out[k] = (float(tr.value), float(tr.stderr))
    return out


def _diagonal_member(name: str, uv: tuple[np.ndarray, np.ndarray], *, X: np.ndarray, y: np.ndarray,
                     method: str) -> dict:
    return diagonal_traces(uv[0], uv[1], X, y, method)


def diagonal_row(spec: DiagonalSpec, s: Settings, *, metrics_dir="reports/metrics", data_dir="reports/data",
                 progress: bool = True) -> RowResult:
    """The diagonal networks retrained with the diagonal stage's own code and settings (its published
    ``params``; checked against its published test losses), their exact Hessian traces and the lines."""
    from companion.experiments import diagonal as dg

    dm = json.loads((Path(metrics_dir) / f"{spec.stage}.json").read_text())
    # the retraining runs here, under this stage's own pin (run_report checks it); a diagonal record from before
    # the diagonal stage had cpu_kernels lacks the key
    ds = dg.Settings.from_params({**dm["params"], "cpu_kernels": None})
    problem = dg.make_problem(ds.n, ds.d, ds.kappa, seed=ds.seed)
    nets, U, V = dg._population(problem, ds.main, ds, seed=ds.seed + 1, progress=False)   # as dg._run does
    pub = _read(Path(data_dir) / spec.stage / "networks.csv")
    if len(pub) != len(nets) or not np.allclose(nets["test_loss"], pub["test_loss"], rtol=1e-12, atol=0) \
            or not (nets["converged"].to_numpy() == pub["converged"].to_numpy()).all():
        raise ValueError(f"the retrained diagonal networks differ from {data_dir}/{spec.stage}/networks.csv "
                         "(test losses or convergence): re-run the diagonal stage first")
    sharp = _read(Path(data_dir) / spec.stage / "sharpness.csv")
    ad = sharp[(sharp.measure == "adaptive") & (sharp.step == "straight") & np.isclose(sharp.rho, ds.rho)] \
        .set_index("net")["sharpness"]
    conv = nets[nets["converged"]]
    tab = pd.DataFrame(index=pd.Index(conv["net"].to_numpy(), name="net"))
    tab["test_loss"] = conv["test_loss"].to_numpy()
    tab["adaptive_primary"] = ad.loc[tab.index].to_numpy()
    traces = run_pool(_diagonal_member, [(str(i), (U[i], V[i])) for i in conv["net"]],
                      dict(X=problem.X, y=problem.y, method=spec.hessian), workers=s.workers, threads=s.threads,
                      progress=progress, desc="diagonal Hessian traces")
    vals = {k: [tr[k] for tr in traces] for k in HESSIANS}
    rows = []
    gap = tab["test_loss"].to_numpy()
    for k in HESSIANS:
        tab[f"hessian_{k}"] = [v for v, _ in vals[k]]
        tab[f"hessian_{k}_stderr"] = [e for _, e in vals[k]]
        st = line_stats(tab[f"hessian_{k}"].to_numpy(), tab["adaptive_primary"].to_numpy(), gap, row="diagonal", s=s)
        st |= {"retest": float("nan"), "reliability": 1.0,
               "reliability_note": "exact trace on the whole training set: deterministic, reliability 1 by "
                                   "construction (not measured)"}
        rows.append(dict(row="diagonal", table1_row="diagonal", family="hessian", line=f"hessian_{k}",
                         measure=k if k == "euclidean" else METRIC_COLUMN[k], metric=k, batches=1, probes=None,
                         method=spec.hessian, **st))
    prot = Protocol({"adaptive": ds.rho}, ds.n_iters, ds.seed, 0.0, ds.n, ds.n, 0, "")
    spec_row = RowSpec("diagonal", spec.stage, None, None, None, None, ["hessian"], "")
    return RowResult("diagonal", spec_row, prot, tab, pd.DataFrame(rows), pd.DataFrame(), [])


# --------------------------------------------------------------------------- Table 1 lines


def _tau_dict(g: pd.DataFrame, key: str, cols: Mapping[str, str]) -> dict:
    return {col: (float(g.loc[line, key]) if line in g.index and np.isfinite(g.loc[line, key]) else None)
            for col, line in cols.items()}


def table1_lines(results: Mapping[str, RowResult], s: Settings) -> list[dict]:
    """The entries :mod:`companion.experiments.table1` adds to Table 1 (one per row and line family; the language
    row's "not computed" ones included). ``tau``/``ci``/``delta_tau`` are keyed by Table 1 column: exact lines
    fill the geodesic columns; Hessian lines the geodesic columns with the Riemannian traces and the adaptive
    column with the Euclidean trace (said in the variant text)."""
    out = []
    none3 = {m: None for m in paper.TABLE1_MEASURES}
    def absent(row, name, fam, stage, reason):
        return dict(row=row, name=name, stage=STAGE, family=fam, exploratory=True, primary=False,
                    variant=f"{TITLES[fam]} — exploratory; {stage}", tau=none3, status=reason)

    for name, spec in s.rows.items():
        computed = spec.families if spec.zoo is not None and name in results else []
        if computed:
            out += _row_lines(results[name], s)
        out += [absent(spec.row, name, f, f"{spec.stage} zoo", spec.reason) for f in FAMILIES if f not in computed]
    if "diagonal" in results:
        out += _row_lines(results["diagonal"], s)
    elif s.diagonal is not None:
        out.append(absent("diagonal", "diagonal", "hessian", "diagonal networks", s.diagonal.reason))
    return out


def _row_lines(res: RowResult, s: Settings) -> list[dict]:
    g = res.lines.set_index("line")
    out = []
    n = len(res.members)
    geo = {METRIC_COLUMN[m]: f"exact_{m}" for m in s.metrics}
    if "exact_invariant" in g.index or "exact_mixed" in g.index:
        refused = {METRIC_COLUMN[m]: int(g.loc[f"exact_{m}", "n_refused"]) for m in s.metrics}
        ratio = res.ratios
        ratio_txt = "; ".join(
            f"{m}: correction ratio median {ratio[ratio.metric == m].ratio_max.median():.3g}, max "
            f"{ratio[ratio.metric == m].ratio_max.max():.3g}, {int(ratio[ratio.metric == m].above_bound.sum())} "
            f"above {s.max_correction_ratio:g}" for m in s.metrics)
        batches = int(g.loc[geo[METRIC_COLUMN[s.metrics[0]]], "batches"])
        what = ("the primary's batches" if res.spec.exact_batches is None else
                f"the first {batches} of the primary's {res.protocol.n_points // res.protocol.batch_size} batches "
                "(a cut for cost), Δ against adaptive on the same batches")
        if res.protocol.n_planned and res.protocol.n_planned != n:
            what += f"; {n} of the {res.protocol.n_planned} pre-registered members (the zoo as measured)"
        out.append(dict(
            row=res.spec.row, name=res.name, stage=STAGE, family="exact", exploratory=True, primary=False,
            setting=res.protocol.setting or None, n_models=n,
            variant=(f"{TITLES['exact']} — exploratory; Measure(step='exact'), pre-registered ρ, "
                     f"{what}; refused (rank loss, NaN): " + ", ".join(f"{k.removeprefix('geodesic_')} {v} of {n}"
                                                                      for k, v in refused.items())
                     + f"; {ratio_txt}"),
            tau={"adaptive": None, **_tau_dict(g, "tau", geo)},
            ci={c: [float(g.loc[line, "ci_low"]), float(g.loc[line, "ci_high"])] for c, line in geo.items()},
            rho={c: float(g.loc[line, "rho"]) for c, line in geo.items()},
            retest={c: float(g.loc[line, "retest"]) for c, line in geo.items()},
            reliability={c: float(g.loc[line, "reliability"]) for c, line in geo.items()},
            delta_tau=_tau_dict(g, "delta", geo),
            delta_tau_ci={c: [float(g.loc[line, "delta_ci_low"]), float(g.loc[line, "delta_ci_high"])]
                          for c, line in geo.items()},
            power_delta={c: float(g.loc[line, "power"]) for c, line in geo.items()},
            paper_delta_tau={c: float(g.loc[line, "paper_delta"]) for c, line in geo.items()},
            n_refused=refused, status="computed"))
    cols = {"adaptive": "hessian_euclidean", "geodesic_invariant": "hessian_invariant",
            "geodesic_mixed": "hessian_mixed"}
    if all(c in g.index for c in cols.values()):
        first = g.loc["hessian_invariant"]
        how = ("exact trace (hs.DiagonalPair), converged networks" if res.name == "diagonal" else
               f"Hutchinson, {int(first['probes'])} probes on each of {int(first['batches'])} batches of the primary")
        rel = {c: float(g.loc[line, "reliability"]) for c, line in cols.items()}
        out.append(dict(
            row=res.spec.row, name=res.name, stage=STAGE, family="hessian", exploratory=True, primary=False,
            setting=res.protocol.setting or None, n_models=n,
            variant=(f"{TITLES['hessian']} — exploratory; Riemannian (hs.RiemannianHessian) in the geodesic columns, the "
                     f"Euclidean Hessian trace in the adaptive column; {how}; Δ of the Riemannian traces against "
                     "adaptive sharpness" + ("" if res.name == "diagonal" else
                                             "; retest between the two batches, noise/spread " + ", ".join(
                                                 f"{k} {float(g.loc[f'hessian_{k}', 'noise_to_spread']):.2f}"
                                                 for k in HESSIANS))),
            tau=_tau_dict(g, "tau", cols),
            ci={c: [float(g.loc[line, "ci_low"]), float(g.loc[line, "ci_high"])] for c, line in cols.items()},
            retest={c: float(g.loc[line, "retest"]) for c, line in cols.items()}, reliability=rel,
            delta_tau={c: v for c, v in _tau_dict(g, "delta", cols).items() if c != "adaptive"},
            delta_tau_ci={c: [float(g.loc[line, "delta_ci_low"]), float(g.loc[line, "delta_ci_high"])]
                          for c, line in cols.items() if c != "adaptive"},
            status="computed"))
    return out


# --------------------------------------------------------------------------- the stage


@dataclass
class GeometryReport:
    settings: Settings
    results: dict[str, RowResult]
    lines: pd.DataFrame
    metrics: dict
    findings: list[str]
    seconds: dict


def finding_lines(lines: pd.DataFrame, results: Mapping[str, RowResult], s: Settings) -> list[str]:
    """The findings in words, every number from the tables."""
    out = ["Exploratory lines (pre-registered in reports/preregistration/geometry_lines.md before their values; "
           "the primary tests are unchanged): Δ = s·(τ − τ_adaptive) over the same members, paired bootstrap "
           f"({s.n_boot} resamples), {s.confidence:.0%} intervals."]
    for name, spec in s.rows.items():
        if spec.zoo is None or set(FAMILIES) - set(spec.families):
            out.append(f"{name}: {spec.reason}.")
    if s.diagonal is not None and not s.diagonal.compute:
        out.append(f"diagonal: {s.diagonal.reason}.")
    for r in lines[lines.family.isin(["exact", "hessian"])].itertuples():
        if not np.isfinite(r.tau):
            out.append(f"{r.row}, {LABELS[r.line]}: fewer than 4 members with a value ({r.n_refused} refused).")
            continue
        extra = ""
        if r.family == "exact":
            extra = (f"; second order on the same batches τ {r.tau_second_order_same_batches:+.2f}, τ(exact, second "
                     f"order) {r.tau_exact_vs_second_order:+.2f}, largest relative difference "
                     f"{r.max_rel_diff_exact_second_order:.2g}; refused {int(r.n_refused)}; paper's Δ "
                     f"{r.paper_delta:+.2f}, power " + (f"{r.power:.2f}" if np.isfinite(r.power) else "not computed"))
        rel = "reliability 1 (exact)" if r.row == "diagonal" else \
            f"retest {r.retest:.2f}, reliability of the mean {r.reliability:.2f}"
        out.append(f"{r.row} ({r.n} members), {LABELS[r.line]}: τ = {r.tau:+.2f} [{r.ci_low:+.2f}, {r.ci_high:+.2f}]"
                   f", Δ vs adaptive {r.delta:+.2f} [{r.delta_ci_low:+.2f}, {r.delta_ci_high:+.2f}]; {rel}{extra}.")
    for name, res in results.items():
        if len(res.ratios):
            for m, g in res.ratios.groupby("metric", sort=False):
                out.append(f"{name}, {m} metric: second-order correction ratio at the exact maximiser (largest over "
                           f"batches) median {g.ratio_max.median():.3g}, max {g.ratio_max.max():.3g} over members; "
                           f"{int(g.above_bound.sum())} of {len(g)} above {s.max_correction_ratio:g}.")
    return out


def start_report(stage: str, s: Any, out_dir: str | Path,
                 measure: Callable[[str, Any], Any]) -> tuple[Path, dict[str, Any], dict[str, float], float]:
    """The common start of a stage's ``run_report`` (this stage's and ``ablations``'): check the pinned CPU kernels
    (``s.cpu_kernels``; the stage's command pins them, python -m companion.kernels ...), make ``out_dir``'s
    figures/metrics/data folders, and measure each row of ``s.rows`` that has a zoo with ``measure(name, spec)``,
    timing it and reporting its member count on stderr. Returns the output folder, the rows' results, their seconds
    and the start time of the whole report (``time.perf_counter``)."""
    from companion import kernels

    kernels.check(s.cpu_kernels, stage)
    out = Path(out_dir)
    for sub in ("figures", "metrics", "data"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    t_all = time.perf_counter()
    for name, spec in s.rows.items():
        if spec.zoo is None:
            continue
        t0 = time.perf_counter()
        results[name] = measure(name, spec)
        seconds[name] = time.perf_counter() - t0
        print(f"{stage}: {name}: {len(results[name].members)} members in {seconds[name]:.0f} s", file=sys.stderr)
    return out, results, seconds, t_all


def run_report(profile: str, params: Mapping[str, Any], out_dir: str | Path, *, progress: bool = True,
               metrics_dir: str | Path = "reports/metrics", data_dir: str | Path = "reports/data",
               sources: Mapping[str, Any] | None = None, names: Mapping[str, Sequence[str]] | None = None) -> GeometryReport:
    """Measure and write every output of the stage (module docstring). ``sources`` / ``names``: per row a zoo
    source and member names to use instead of the row's zoo (tests)."""
    from companion import metrics as cm

    s = load_settings(params)
    out, results, seconds, t_all = start_report(
        STAGE, s, out_dir, lambda name, spec: measure_row(
            name, spec, s, metrics_dir=metrics_dir, data_dir=data_dir, progress=progress,
            source=(sources or {}).get(name), names=(names or {}).get(name)))
    if s.diagonal is not None and s.diagonal.compute:
        t0 = time.perf_counter()
        results["diagonal"] = diagonal_row(s.diagonal, s, metrics_dir=metrics_dir, data_dir=data_dir,
                                           progress=progress)
        seconds["diagonal"] = time.perf_counter() - t0
    lines = pd.concat([r.lines for r in results.values()], ignore_index=True) if results else pd.DataFrame()
    findings = finding_lines(lines, results, s) if len(lines) else []
    entries = table1_lines(results, s)
    metrics = {"table1_lines": entries, "lines": lines.to_dict("records"), "findings": findings,
               "correction_ratio": {n: r.ratios.groupby("metric").agg(
                   median=("ratio_max", "median"), max=("ratio_max", "max"), n_above=("above_bound", "sum"),
                   n=("ratio_max", "size")).reset_index().to_dict("records") for n, r in results.items() if len(r.ratios)},
               "protocol": {n: vars(r.protocol) for n, r in results.items()},
               "not_computed": {n: sp.reason for n, sp in s.rows.items()
                                if sp.zoo is None or set(FAMILIES) - set(sp.families)},
               "preregistration": "reports/preregistration/geometry_lines.md"}
    cm.write_stage_metrics(out, STAGE, metrics)
    for name, res in results.items():
        d = out / "data" / name
        d.mkdir(parents=True, exist_ok=True)
        res.members.to_csv(d / "members.csv")
        res.lines.to_csv(d / "lines.csv", index=False)
        if len(res.ratios):
            res.ratios.to_csv(d / "correction_ratio.csv", index=False)
    seconds["total"] = time.perf_counter() - t_all
    per_member = {n: {"exact_mean": float(np.mean([r["exact_seconds"] for r in res.raw])),
                      "hessian_mean": float(np.mean([r["hessian_seconds"] for r in res.raw]))}
                  for n, res in results.items() if res.raw}
    cm.write_stage_timings(out, STAGE, {"seconds": seconds, "per_member": per_member,
                                        "budget_minutes": s.budget_minutes})
    return GeometryReport(s, results, lines, metrics, findings, seconds)


def findings(rep: GeometryReport) -> str:
    """The findings as a markdown list (the notebook displays it)."""
    return "\n".join("- " + line for line in rep.findings)


__all__ = ["GeometryReport", "Settings", "analyse_row", "diagonal_row", "diagonal_traces", "findings", "line_stats",
           "load_settings", "measure_member", "measure_members", "measure_row", "read_protocol", "read_published",
           "run_report", "start_report", "table1_lines"]
