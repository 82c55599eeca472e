"""The per-stage metrics files of the report pipeline, and their DVC headlines.

Layout (defined here once; the notebooks write it, :mod:`companion.experiments.table1`
and :func:`headline` read it):

``reports/metrics/<stage>.json`` (full; a plain DVC output)
    whatever the stage records, plus ``stage``, ``profile`` and ``params``
    (added by :mod:`companion.pipeline`) and, for stages that contribute to
    Table 1, a key ``table1``: one entry or a list of entries::

        {"row": "diagonal" | "vision" | "language",
         "variant": "held-out half",            # optional, one Table 1 line per entry
         "tau": {measure: t, ...},              # Kendall tau of sharpness vs generalisation
         "ci":  {measure: [lo, hi], ...},       # optional, bootstrap 95 % interval
         "rho": r | {measure: r, ...},          # optional
         "n_models": n,
         "spread": {measure: {"mean", "std", "min", "max",   # optional: tau of the same
                              "n_zoos", "n_models", "taus"}}, # measure at the same rho over
                                                 # independently seeded zoos (:func:`tau_spread`)
         "primary": true | false,               # optional: the row's one primary comparison
         "exploratory": true | false,           # optional: everything else (labelled as such)
         "gap_reliability": g,                  # optional (:func:`reliability_fields`): the gap's
         "retest": {measure: t},                #   reliability across members, each measure's
         "tau_ceiling": {measure: c},           #   test-retest tau, the ceiling on |tau| they imply
         "power": {measure: p}}                 #   and the power at the paper's tau (companion.analysis)

``reports/headline/<stage>.json`` (small; DVC ``metrics:``)
    derived from the full file by :func:`headline`: the primary (else the first) Table 1 entry's
    ``tau`` per measure and ``n`` (the scalars ``dvc metrics show`` prints, a
    few columns for every stage), and, as lists DVC does not print, every
    entry's interval, radius, variant and model count (``table1``).

``reports/timings/<stage>.json`` (wall-clock times; committed to git, declared nowhere in ``dvc.yaml``)
    a stage's timings (:func:`write_stage_timings`): no DVC output holds a wall-clock time or a
    ratio of two, because its hash would change on every run and every downstream stage would
    re-run (``tests/test_dvc_timings.py`` scans the committed outputs with :func:`timing_keys`).

``python -m companion.metrics headline [--metrics-dir reports/metrics] [--out-dir reports/headline]``
re-derives the headlines from existing full metrics (no sharpness is
recomputed); :func:`companion.pipeline.run_stage` does the same after a stage.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
METRICS_DIR = REPO_ROOT / "reports" / "metrics"
HEADLINE_DIR = REPO_ROOT / "reports" / "headline"
TIMINGS_DIR = REPO_ROOT / "reports" / "timings"
#: a key or column that holds a wall-clock time (or a ratio of two): never in a DVC output
TIMING_KEY = re.compile(r"(seconds|timing|duration|elapsed|wall|per_step|step_vs|_time$|^time$|_s$|_ms$)", re.I)


# --------------------------------------------------------------------------- writing (notebooks)


def table1_entry(row: str, variant: str, table, *, measures: Iterable[str] | None = None,
                 models: str = "eval", n_models: int | None = None) -> dict[str, Any]:
    """One Table 1 entry from a per-measure τ table.

    ``models="eval"``: τ and interval on the held-out half (``tau``, ``ci_low``,
    ``ci_high``); ``"all"``: over all models (``tau_all``, ``ci_low_all``,
    ``ci_high_all``). ``n_models`` defaults to ``n_eval`` / ``n_all`` of the
    table's first row.
    """
    if models not in ("eval", "all"):
        raise ValueError(f"models must be 'eval' or 'all', got {models!r}")
    sfx = "" if models == "eval" else "_all"
    t = table.set_index("measure")
    names = list(t.index) if measures is None else list(measures)
    if n_models is None:
        n_models = int(table["n_eval" if models == "eval" else "n_all"].iloc[0])
    return {"row": row, "variant": variant,
            "tau": {m: float(t.loc[m, "tau" + sfx]) for m in names},
            "ci": {m: [float(t.loc[m, "ci_low" + sfx]), float(t.loc[m, "ci_high" + sfx])] for m in names},
            "rho": {m: float(t.loc[m, "rho"]) for m in names},
            "n_models": int(n_models)}


def tau_spread(taus, *, measures: Iterable[str] | None = None) -> dict[str, dict[str, Any]]:
    """The ``spread`` of a Table 1 entry: tau of each measure over independently seeded zoos.

    ``taus`` has one row per (zoo, measure) with columns ``zoo``, ``measure``, ``tau`` and
    ``n`` (models in that zoo). Per measure: ``mean``, ``std`` (sample, ddof 1; NaN for one
    zoo), ``min``, ``max``, ``n_zoos``, ``n_models`` (per zoo, a list) and ``taus`` (per zoo,
    in the frame's order). Zoos whose tau is undefined count in ``n_zoos`` but not in the
    statistics.
    """
    names = list(dict.fromkeys(taus["measure"])) if measures is None else list(measures)
    out: dict[str, dict[str, Any]] = {}
    for m in names:
        sub = taus[taus["measure"] == m]
        if sub.empty:
            raise ValueError(f"no tau for measure {m!r} in the spread table")
        t = sub["tau"].to_numpy(dtype=float)
        ok = t[np.isfinite(t)]
        out[m] = {"mean": float(ok.mean()) if ok.size else float("nan"),
                  "std": float(ok.std(ddof=1)) if ok.size > 1 else float("nan"),
                  "min": float(ok.min()) if ok.size else float("nan"),
                  "max": float(ok.max()) if ok.size else float("nan"),
                  "n_zoos": int(len(t)), "n_models": [int(n) for n in sub["n"]],
                  "taus": [float(v) for v in t]}
    return out


def reliability_fields(*, gap_reliability: float, retest: Mapping[str, float], n_models: int,
                       paper_tau: Mapping[str, float], alpha: float, n_sim: int, seed: int) -> dict[str, Any]:
    """The reliability keys of a Table 1 entry: ``gap_reliability``, ``retest`` (each measure's
    test-retest τ), ``tau_ceiling`` (:func:`companion.analysis.ceiling`) and ``power`` (of the
    two-sided level-``alpha`` test at ``n_models`` members if the error-free τ were the paper's,
    :func:`companion.analysis.power`). Merge into an entry: ``{**entry, **reliability_fields(...)}``."""
    from companion.analysis import ceiling, power

    missing = [m for m in retest if m not in paper_tau]
    if missing:
        raise ValueError(f"no paper tau for {missing}; pass companion.paper.table1_tau(row)")
    return {"gap_reliability": float(gap_reliability),
            "retest": {m: float(t) for m, t in retest.items()},
            "tau_ceiling": {m: ceiling(t, gap_reliability) for m, t in retest.items()},
            "power": {m: power(n_models, paper_tau[m], t, gap_reliability, alpha=alpha, n_sim=n_sim, seed=seed)
                      for m, t in retest.items()}}


def write_plot_data(data_dir: str | os.PathLike, curves, scatter) -> list[Path]:
    """The files ``dvc.yaml``'s ``plots:`` read (``dvc plots show``), one column per measure:
    ``plot_tau_vs_rho.csv`` (``rho`` and each measure's τ, from the long ``curves`` table with
    columns ``measure, rho, tau``) and ``plot_scatter.csv`` (``scatter`` as given: one row per
    model, the generalisation column and each measure's value at its primary ρ)."""
    out = Path(data_dir)
    out.mkdir(parents=True, exist_ok=True)
    wide = curves.pivot_table(index="rho", columns="measure", values="tau", sort=True).reset_index()
    wide.columns.name = None
    paths = [out / "plot_tau_vs_rho.csv", out / "plot_scatter.csv"]
    wide.to_csv(paths[0], index=False)
    scatter.to_csv(paths[1], index=False)
    return paths


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


def write_stage_metrics(out_dir: str | os.PathLike, stage: str, metrics: Mapping[str, Any]) -> Path:
    """Write ``out_dir/metrics/<stage>.json`` (the file the pipeline publishes)."""
    path = Path(out_dir) / "metrics" / f"{stage}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(metrics, fh, indent=2)
    return path


def write_stage_timings(out_dir: str | os.PathLike, stage: str, timings: Mapping[str, Any]) -> Path:
    """Write ``out_dir/timings/<stage>.json``, which the pipeline publishes to ``reports/timings/``
    (git, not DVC: see the module docstring)."""
    path = Path(out_dir) / "timings" / f"{stage}.json"
    write_json(path, timings)
    return path


def timing_keys(obj: Any, path: str = "") -> list[str]:
    """Every key of the nested mapping ``obj`` (lists entered) that names a wall-clock time
    (:data:`TIMING_KEY`), as ``a/b/c`` paths: what must not sit in a DVC output."""
    found = []
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            where = f"{path}/{k}"
            if TIMING_KEY.search(str(k)):
                found.append(where)
            found += timing_keys(v, where)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            found += timing_keys(v, f"{path}[{i}]")
    return found


# --------------------------------------------------------------------------- reading (table1, headline)


def read_metrics(path: str | os.PathLike) -> dict[str, Any]:
    """A full metrics file; invalid JSON or a non-object is an error naming the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def table1_entries(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The Table 1 entries of a full metrics mapping (``[]`` when it has none)."""
    entries = data.get("table1")
    if entries is None:
        return []
    return list(entries) if isinstance(entries, list) else [entries]


def headline(data: Mapping[str, Any]) -> dict[str, Any] | None:
    """The DVC headline of a full metrics mapping, ``None`` for a stage without Table 1 entries.

    Printed by ``dvc metrics show`` (scalars): ``n`` and ``tau.<measure>`` of
    the primary entry (else the first). Kept in the
    file but not printed (DVC skips lists): ``table1``, every entry's
    ``variant``, ``n_models``, ``rho``, ``tau``, ``ci`` and ``spread``.
    """
    entries = table1_entries(data)
    if not entries:
        return None
    first = next((e for e in entries if e.get("primary")), entries[0])
    keep = ("variant", "n_models", "rho", "tau", "ci", "spread", "primary", "gap_reliability", "retest",
            "tau_ceiling")
    return {"n": first.get("n_models"), "tau": dict(first["tau"]),
            "table1": [{k: e[k] for k in keep if k in e} for e in entries]}


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as sorted, indented JSON to ``path`` atomically (temporary file, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as fh:
        json.dump(_jsonable(obj), fh, indent=1, sort_keys=True, ensure_ascii=False)
        fh.write("\n")
    os.replace(tmp, path)


def write_headline(full: str | os.PathLike, out_dir: str | os.PathLike = HEADLINE_DIR) -> Path | None:
    """Derive ``out_dir/<stage>.json`` from the full metrics file ``full``; None if it has no Table 1 entry."""
    full = Path(full)
    head = headline(read_metrics(full))
    if head is None:
        return None
    dst = Path(out_dir) / full.name
    write_json(dst, head)
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m companion.metrics", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    hd = sub.add_parser("headline", help="derive reports/headline/<stage>.json from the full metrics")
    hd.add_argument("--metrics-dir", default=str(METRICS_DIR))
    hd.add_argument("--out-dir", default=str(HEADLINE_DIR))
    args = ap.parse_args(argv)
    mdir = Path(args.metrics_dir)
    if not mdir.is_dir():
        print(f"error: metrics folder {mdir} does not exist; run a stage first", file=sys.stderr)
        return 1
    for full in sorted(mdir.glob("*.json")):
        dst = write_headline(full, args.out_dir)
        print(f"{full} -> {dst if dst else '(no Table 1 entry, no headline)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
