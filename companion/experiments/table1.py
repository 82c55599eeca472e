"""Table 1: Kendall tau between sharpness and generalisation, paper beside ours.

Every stage that contributes a row writes, in its metrics file
``reports/metrics/<stage>.json`` (layout: :mod:`companion.metrics`, read here
with :func:`companion.metrics.table1_entries`), a key ``"table1"`` holding one
entry or a list of entries of the form::

    {"row": "diagonal" | "vision" | "language",
     "variant": "closed forms",            # optional label, one line per variant
     "tau": {"adaptive": t, "geodesic_invariant": t, "geodesic_mixed": t},
     "ci":  {"adaptive": [lo, hi], ...},   # optional, bootstrap 95 % intervals
     "rho": 0.1,                           # optional (a number or a dict per measure)
     "n_models": 50,
     "primary": true, "exploratory": false,  # optional: the row's primary comparison / exploratory
     "gap_reliability": g, "retest": {...}, "tau_ceiling": {...}, "power": {...},   # optional
     "reliability": {...},                 # optional: of the value τ uses, when it is not one retest measurement
     "setting": "..."}                     # optional: the line's own setting (default: the row's), e.g. the
                                           # pre-trained model a zoo is fine-tuned from

(the full layout: :mod:`companion.metrics`; the reliability keys from
:func:`companion.metrics.reliability_fields`) and the pipeline adds the top-level ``"profile"``. This module reads all
metrics files, lists the paper's three rows in the paper's order with the
paper's values, our values (and intervals) beside them, the profile that
produced them, and marks rows no stage has produced as "not computed yet". ``table1.csv`` has
the columns ``comparison`` (primary / secondary (…) / exploratory), ``gap_reliability``, ``retest_<measure>``,
``reliability_<measure>``, ``tau_ceiling_<measure>`` and ``power_<measure>`` (empty where a line lacks them); below the
table, a sentence for every line whose ceiling on |τ| lies below the paper's |τ|.

**Paired Δτ** (issue 24; stage ``paired``, ``reports/metrics/paired.json``, key ``"delta_tau"``: one entry
per row, :func:`companion.experiments.paired.table1_entries`): attached to the primary line of the stage it
names, as the columns ``delta_tau_<g>``, ``delta_tau_<g>_ci_low`` / ``_ci_high``, ``power_delta_<g>`` and
``verdict_delta_<g>`` for each geodesic measure ``g``; the paper's lines carry the paper's Δ in
``delta_tau_<g>``. ``table1.md`` shows them as a table of their own under Table 1 (the primary test of
the paper's claim), with the exploratory vision confound lines of the same stage below.

**Geometry lines** (issues 24 item 4 and 26 item 4; stage ``geometry_lines``, ``reports/metrics/geometry_lines.json``,
key ``"table1_lines"``: :func:`companion.experiments.geometry_lines.table1_lines`): exploratory lines added under
each row — exact-geodesic sharpness (τ in the geodesic columns) and Hessian traces (Riemannian in the geodesic
columns, the Euclidean trace in the adaptive column), their ``delta_tau_*`` against adaptive sharpness, and
``status`` "computed" or "not computed: <why>" (a row whose zoo is not at hand). ``table1.md`` and the README
show them in a table of their own as well.

**Roles.** Each entry carries the row's role as the stage ``paired`` declares it (``params.yaml``
``paired.rows.<row>.comparison``): a stage's primary line whose row is declared ``"secondary (<why>)"`` — the
144 k-parameter BERT language row, which the pre-trained MiniLM row supersedes (issue 24) — is shown with that
label instead of "primary", its numbers and paired Δτ kept (:func:`apply_roles`).

**Stages not run** in the profile (a metrics file with ``"skipped"``: :mod:`companion.skipped`, or
``language_stability``'s ``n_zoos: 0``) contribute no line; ``table1.md`` and the README list them under the
table with the reason their metrics file gives (:func:`not_run_notes`) — in the cpu profile the 144 k-parameter
BERT zoo, the secondary language line.

``python -m companion.experiments.table1 [--metrics-dir reports/metrics] [--out-dir reports]``
writes ``table1.md`` and ``table1.csv`` (each written to a temporary file
and renamed, so a reader never sees half a table).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from companion import paper
from companion.metrics import read_metrics, table1_entries

MEASURES = paper.TABLE1_MEASURES
#: the measures a paired Δτ compares with adaptive sharpness (the first of MEASURES)
GEODESIC = MEASURES[1:]
MEASURE_TITLES = {"adaptive": "adaptive", "geodesic_invariant": "geodesic, invariant (metric 5/9)",
                  "geodesic_mixed": "geodesic, mixed (metric 6/10)"}

_OURS = {"diagonal": "diagonal networks, sparse regression",
         "vision": "vision-transformer zoo (ImageNet analogue)",
         "language": "language-transformer zoo (MNLI analogue)"}
#: The paper's Table 1, in its order (values from :mod:`companion.paper`).
PAPER_ROWS = [{"row": row, "setting": paper.TABLE1_SETTING[row], "ours": ours, "paper": paper.table1_tau(row)}
              for row, ours in _OURS.items()]
NOT_COMPUTED = "not computed yet"


def collect(metrics_dir: str | os.PathLike) -> dict[str, list[dict[str, Any]]]:
    """Table-1 entries from every ``*.json`` in ``metrics_dir``, grouped by row."""
    out: dict[str, list[dict[str, Any]]] = {r["row"]: [] for r in PAPER_ROWS}
    mdir = Path(metrics_dir)
    if not mdir.is_dir():
        return out
    for path in sorted(mdir.glob("*.json")):
        data = read_metrics(path)
        for e in table1_entries(data):
            if e.get("row") not in out:
                raise ValueError(f"{path}: table1 row {e.get('row')!r} is not one of {list(out)}")
            missing = [m for m in MEASURES if m not in e.get("tau", {})]
            if missing:
                raise ValueError(f"{path}: table1 entry for {e['row']!r} lacks tau for {missing}")
            out[e["row"]].append({**e, "profile": data.get("profile", "?"), "stage": path.stem})
    return out


def collect_deltas(metrics_dir: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The paired Δτ entries of ``paired.json`` (stage ``paired``), keyed by the stage whose primary line they
    belong to (``{}`` without that file)."""
    path = Path(metrics_dir) / "paired.json"
    if not path.is_file():
        return {}
    out = {}
    for e in read_metrics(path).get("delta_tau", []):
        missing = [g for g in GEODESIC if g not in e.get("delta", {})]
        if missing:
            raise ValueError(f"{path}: delta_tau entry for stage {e.get('stage')!r} lacks {missing}")
        out[e["stage"]] = e
    return out


def collect_lines(metrics_dir: str | os.PathLike) -> dict[str, list[dict[str, Any]]]:
    """The geometry lines of ``geometry_lines.json`` (stage ``geometry_lines``), grouped by Table 1 row
    (``{}`` without that file)."""
    path = Path(metrics_dir) / "geometry_lines.json"
    if not path.is_file():
        return {}
    data = read_metrics(path)
    out: dict[str, list[dict[str, Any]]] = {}
    for e in data.get("table1_lines", []):
        if e.get("row") not in _OURS:
            raise ValueError(f"{path}: geometry line row {e.get('row')!r} is not one of {list(_OURS)}")
        e = {k: v for k, v in e.items() if not (k == "setting" and not v)}   # no own setting: the row's
        out.setdefault(e["row"], []).append({**e, "profile": data.get("profile", "?"), "stage": path.stem})
    return out


#: what Table 1 shows under the MiniLM and vision rows before the stage ``ablations`` has run (no ablations.json)
ABLATIONS_PENDING = "not computed: the stage ablations has not run yet (dvc repro ablations)"
_ABLATION_ROWS = {"minilm": "language", "vision": "vision"}
_ABLATION_TITLES = ("no Christoffel term (metric norm, straight step)",
                    "no metric norm (Christoffel only: second-order step in the adaptive ball)",
                    "ε sweep (invariant metric)")


def pending_ablations(stages: Any = tuple(_ABLATION_ROWS)) -> list[dict[str, Any]]:
    """The stage ``ablations``'s lines, each "not computed" (its metrics file does not exist yet), for the rows whose
    zoo stage is among ``stages`` (a row whose own stage has not published has no ablations to wait for)."""
    return [dict(row=row, name=name, stage="ablations", family="ablation", exploratory=True, primary=False,
                 variant=f"ablation: {title} — exploratory; Δ columns against the full measure (not adaptive sharpness)"
                         f"; {name} zoo", tau={m: None for m in MEASURES}, status=ABLATIONS_PENDING)
            for name, row in _ABLATION_ROWS.items() if name in stages for title in _ABLATION_TITLES]


def collect_ablations(metrics_dir: str | os.PathLike) -> dict[str, list[dict[str, Any]]]:
    """The ablation lines of ``ablations.json`` (stage ``ablations``), grouped by Table 1 row; before that stage has
    run (no file), its lines under the MiniLM and vision rows whose stages have published, with status "not computed"
    (:func:`pending_ablations`)."""
    path = Path(metrics_dir) / "ablations.json"
    published = {p.stem for p in Path(metrics_dir).glob("*.json")}
    data = read_metrics(path) if path.is_file() else {"table1_lines": pending_ablations(published), "profile": "–"}
    out: dict[str, list[dict[str, Any]]] = {}
    for e in data.get("table1_lines", []):
        if e.get("row") not in _OURS:
            raise ValueError(f"{path}: ablation line row {e.get('row')!r} is not one of {list(_OURS)}")
        e = {k: v for k, v in e.items() if not (k == "setting" and not v)}
        out.setdefault(e["row"], []).append({**e, "profile": data.get("profile", "?"), "stage": "ablations"})
    return out


def _line_delta(e: dict[str, Any]) -> dict[str, Any] | None:
    """A geometry line's Δτ in the form :func:`_delta_columns` reads (None without one)."""
    if not e.get("delta_tau"):
        return None
    return {"delta": {g: e["delta_tau"].get(g, "") for g in GEODESIC},
            "ci": {g: (e.get("delta_tau_ci") or {}).get(g, ["", ""]) for g in GEODESIC},
            "power": {g: (e.get("power_delta") or {}).get(g, "") for g in GEODESIC},
            "verdict": {g: "" for g in GEODESIC}}


def _line_cell(e: dict[str, Any], m: str) -> str:
    if e.get("status") != "computed":
        return e.get("status", NOT_COMPUTED)
    if e["tau"].get(m) is None:
        return "–"
    ci = (e.get("ci") or {}).get(m)
    out = _fmt(e["tau"][m]) + (f" [{_fmt(ci[0])}, {_fmt(ci[1])}]" if ci else "")
    rt, rel = (e.get("retest") or {}).get(m), (e.get("reliability") or {}).get(m)
    if rt is not None and not (isinstance(rt, float) and math.isnan(rt)):
        out += f" · retest {rt:.2f} (mean {rel:.2f})"
    elif rel is not None:
        out += f" · reliability {rel:.2f}"
    return out


def _lines_section(lines_by_row: dict[str, list[dict[str, Any]]], title: str, text: str, delta_title: str, *,
                   power: bool) -> list[str]:
    """A ``table1.md`` section (heading ``title``, paragraph ``text``) with one table row per line of
    ``lines_by_row`` in the paper's row order: its τ cells and its Δ cells (columns ``delta_title`` + the measure's
    title; with the power at the paper's Δ where ``power`` and the line has one). Empty without lines."""
    if not lines_by_row:
        return []
    out = ["", title, "", text, "",
           "| setting | line | models | " + " | ".join(MEASURE_TITLES[m] for m in MEASURES) + " | "
           + " | ".join(f"{delta_title}{MEASURE_TITLES[g]}" for g in GEODESIC) + " |",
           "|---|---|---|" + "---|" * (len(MEASURES) + len(GEODESIC))]
    for row in PAPER_ROWS:
        for e in lines_by_row.get(row["row"], []):
            d = _line_delta(e)
            deltas = []
            for g in GEODESIC:
                if d is None or d["delta"][g] in ("", None):
                    deltas.append("–")
                    continue
                ci = d["ci"][g]
                pw = d["power"][g] if power else None
                deltas.append(f"{_fmt(d['delta'][g])} [{_fmt(ci[0])}, {_fmt(ci[1])}]"
                              + (f" · power {pw:.2f}" if isinstance(pw, float) and not math.isnan(pw) else ""))
            out.append(f"| {e.get('setting') or row['ours']} | {e['variant']} | {e.get('n_models', '–')} | "
                       + " | ".join(_line_cell(e, m) for m in MEASURES) + " | " + " | ".join(deltas) + " |")
    return out


def geometry_section(lines_by_row: dict[str, list[dict[str, Any]]]) -> list[str]:
    """``table1.md``'s table of the geometry lines with their Δτ against adaptive (exploratory)."""
    return _lines_section(
        lines_by_row, "## Geometry lines (exploratory, stage geometry_lines)",
        "Pre-registered in `reports/preregistration/geometry_lines.md` before their values; the primary tests "
        "are unchanged. Exact geodesic: the integrated geodesic (`Measure(step=\"exact\")`) at the rows' "
        "pre-registered radii. Hessian trace: the Riemannian trace (invariant / mixed metric) in the geodesic "
        "columns, the Euclidean trace in the adaptive column. Δ = sign(paper's τ) · (τ line − τ adaptive "
        "sharpness), paired over the same members; power at the paper's Δ for the exact lines only (the paper "
        "has no Hessian-trace τ).", "Δ ", power=True)


def ablation_section(lines_by_row: dict[str, list[dict[str, Any]]]) -> list[str]:
    """``table1.md``'s table of the ablation lines (exploratory) with their Δτ against the full measure."""
    return _lines_section(
        lines_by_row, "## Ablations (exploratory, stage ablations)",
        "The paper's Appendix G and H.2 on the rows' zoos, pre-registered in `reports/preregistration/ablations.md` "
        "before their values: each metric with its Christoffel term turned off (metric norm, straight step) or its "
        "metric norm turned off (second-order step in the adaptive ball), and the ε relaxation of the invariant "
        "metric, on a declared subset of each row's batches. τ in the column of the line's metric; Δ = "
        "sign(paper's τ) · (τ line − τ full measure) against the full measure of the same metric, paired over the "
        "same members and batches (Δ < 0: the ablated measure tracks the gap less well) — these Δ are not against "
        "adaptive sharpness.", "Δ vs full, ", power=False)


def paper_delta(deltas: dict[str, dict[str, Any]], row: str, g: str) -> float | None:
    """The paper's Δ for ``row`` and geodesic measure ``g`` as the stage ``paired`` computed it from
    :mod:`companion.paper` (:func:`companion.experiments.paired.paper_delta`); None when no entry of that row."""
    for d in deltas.values():
        if d["row"] == row and g in d.get("paper_delta", {}):
            return float(d["paper_delta"][g])
    return None


def _delta_columns(row: dict[str, Any], source: str, d: dict[str, Any] | None,
                   deltas: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``delta_tau_<g>`` (+ interval, power, verdict) of a line: the paper's Δ on the paper's line, ours on the
    primary line the stage ``paired`` measured, empty elsewhere."""
    out: dict[str, Any] = {}
    for g in GEODESIC:
        if source == "paper":
            p = paper_delta(deltas, row["row"], g)
            out[f"delta_tau_{g}"] = "" if p is None else p
        else:
            out[f"delta_tau_{g}"] = d["delta"][g] if d else ""
        out[f"delta_tau_{g}_ci_low"] = d["ci"][g][0] if d else ""
        out[f"delta_tau_{g}_ci_high"] = d["ci"][g][1] if d else ""
        out[f"power_delta_{g}"] = d["power"][g] if d else ""
        out[f"verdict_delta_{g}"] = d["verdict"][g] if d else ""
        out[f"mde_delta_{g}"] = _mde_csv(d, g)
    return out


def _mde_csv(d: dict[str, Any] | None, g: str) -> Any:
    """The minimum detectable Δ of a primary line (``paired``'s entry): a number, "not reached (power p at the largest
    Δ)" where no Δ reaches 80 % power, "not computed: …" where the entry predates it, "" on other lines."""
    if not d or "verdict" not in d or not d["verdict"].get(g):
        return ""
    if "mde" not in d:
        return "not computed: re-run the stage paired"
    m = d["mde"].get(g)
    return m if m is not None else f"not reached (power {d['mde_power_max'][g]:.2f} at the largest Δ)"


def _mde_str(v: Any) -> str:
    return f"{v:+.2f}" if isinstance(v, (int, float)) else str(v)


def _fmt(x: Any) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:+.2f}"


def _rho_str(rho: Any) -> str:
    if rho is None:
        return ""
    if isinstance(rho, dict):
        return ", ".join(f"{k}: {v:g}" for k, v in rho.items())
    return f"{rho:g}"


def _spread_str(sp: dict[str, Any] | None) -> str:
    """`` · zoos: a / b / c (sd s)``: tau of the same measure at the same rho in each other seeded zoo."""
    if not sp:
        return ""
    taus = " / ".join(_fmt(t) for t in sp["taus"])
    sd = sp.get("std")
    sd = "" if sd is None or (isinstance(sd, float) and math.isnan(sd)) else f" (sd {sd:.2f})"
    return f" · zoos: {taus}{sd}"


def _spread_columns(spread: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in MEASURES:
        sp = spread.get(m)
        out[f"{m}_zoo_taus"] = ";".join(f"{t:.6g}" for t in sp["taus"]) if sp else ""
        out[f"{m}_zoo_std"] = sp["std"] if sp else ""
    return out


def _status(e: dict[str, Any]) -> str:
    if e.get("primary"):
        return "primary"
    return e["secondary"] if e.get("secondary") else "exploratory" if e.get("exploratory") else "not declared"


def apply_roles(entries: dict[str, list[dict[str, Any]]], deltas: dict[str, dict[str, Any]]) -> None:
    """A stage's primary line takes the role the stage ``paired`` gives its row (the delta entry's ``comparison``):
    where that is not ``"primary"`` the line is no longer primary but ``secondary`` (the label, e.g. "secondary
    (superseded by the pre-trained MiniLM row)"); its numbers and its paired Δτ stay. In place."""
    for row_entries in entries.values():
        for e in row_entries:
            role = deltas.get(e["stage"], {}).get("comparison", "primary")
            if e.get("primary") and role != "primary":
                e["primary"], e["secondary"] = False, role


def _order(e: dict[str, Any]) -> tuple[bool, bool]:
    """Primary lines first, then secondary, then the rest."""
    return not e.get("primary"), not e.get("secondary")


def _reliability_columns(e: dict[str, Any]) -> dict[str, Any]:
    """``gap_reliability``, ``retest_<m>``, ``reliability_<m>``, ``tau_ceiling_<m>``, ``power_<m>``
    (empty where absent). ``reliability_<m>``: the reliability (Kendall-τ scale) of the value τ is
    computed from — the retest itself where the value is one of the two measurements (vision), the
    Spearman–Brown reliability of their mean where it averages both (language)."""
    out: dict[str, Any] = {"gap_reliability": e.get("gap_reliability", "")}
    for key in ("retest", "reliability", "tau_ceiling", "power"):
        vals = e.get(key) or (e.get("retest") or {} if key == "reliability" else {})
        out.update({f"{key}_{m}": vals.get(m, "") for m in MEASURES})
    return out


def _reliability_str(e: dict[str, Any], m: str) -> str:
    """"retest r" and, where the value averages both measurements, "(mean of both r')"."""
    out = f"retest {e['retest'][m]:.2f}"
    rel = (e.get("reliability") or {}).get(m)
    return out + (f" (mean of both halves {rel:.2f})" if rel is not None and rel != e["retest"][m] else "")


def _record(row: dict[str, Any], source: str, e: dict[str, Any] | None, status: str,
            delta: dict[str, Any] | None = None, deltas: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """One CSV record: the paper's line (``e`` None, values from ``row``), a line of ours, or a
    placeholder for a row no stage produced; ``delta``: the paired Δτ entry of a primary line."""
    e = e or {}
    tau = row["paper"] if source == "paper" else e.get("tau", {})
    ci = e.get("ci") or {}
    return {"row": row["row"], "setting": row["setting"] if source == "paper" else e.get("setting", row["ours"]),
            "source": source,
            "variant": e.get("variant", ""), "profile": e.get("profile", ""), "stage": e.get("stage", ""),
            "n_models": e.get("n_models", ""), "rho": _rho_str(e.get("rho")),
            "comparison": "" if source == "paper" or not e else _status(e),
            **{m: tau.get(m, "") for m in MEASURES},
            **{f"{m}_ci_low": (ci.get(m) or ["", ""])[0] for m in MEASURES},
            **{f"{m}_ci_high": (ci.get(m) or ["", ""])[1] for m in MEASURES},
            **_spread_columns(e.get("spread") or {}), **_reliability_columns(e),
            **_delta_columns(row, source, delta, deltas or {}), "status": status}


def _cell(e: dict[str, Any], m: str) -> str:
    ci = (e.get("ci") or {}).get(m)
    out = _fmt(e["tau"][m]) + (f" [{_fmt(ci[0])}, {_fmt(ci[1])}]" if ci else "")
    out += _spread_str((e.get("spread") or {}).get(m))
    if m in (e.get("tau_ceiling") or {}):
        out += f" · {_reliability_str(e, m)}, ceiling {e['tau_ceiling'][m]:.2f}"
    return out


def ceiling_notes(row: dict[str, Any], e: dict[str, Any]) -> list[str]:
    """Sentences for every measure of an entry whose ceiling on |τ| lies below the paper's |τ|."""
    notes = []
    for m, c in (e.get("tau_ceiling") or {}).items():
        p = row["paper"].get(m)
        if p is not None and c < abs(p):
            power = (e.get("power") or {}).get(m)
            notes.append(
                f"* {row['ours']} ({e.get('variant') or _status(e)}), {MEASURE_TITLES[m]}: the gap's reliability "
                f"{e['gap_reliability']:.2f} and the measure's {_reliability_str(e, m)} cap the observable "
                f"|τ| at {c:.2f}, below the paper's |τ| = {abs(p):.2f}; this zoo cannot show the paper's value"
                + (f" (power at the paper's τ with {e.get('n_models')} models: {power:.2f})." if power is not None
                   else "."))
    return notes


def retest_note(metrics_dir: str | os.PathLike) -> str | None:
    """The exploratory sentence under the language row, from ``language_retest.json`` (stage
    ``language_retest``; None without that file): the batches per half, and training pairs per member,
    at which every measure's test–retest would reach the target (Spearman–Brown through the whole
    halves' retest), beside the pairs the corpus's training split holds."""
    path = Path(metrics_dir) / "language_retest.json"
    if not path.is_file():
        return None
    data = read_metrics(path)
    if data.get("skipped"):    # the stage was not run in this profile: not_run_notes says so
        return None
    per = data["measures"]
    head = (f"* {_OURS['language']} (exploratory, stage language_retest): a test–retest of {data['target']:g} for "
            f"every measure")
    if any(r["batches_per_half_for_target"] is None for r in per.values()):
        return head + " cannot be reached: a measure's retest shows no signal."
    slow = max(per.values(), key=lambda r: r["batches_per_half_for_target"])
    avail = data["training_pairs_available"]
    return (head + f" would need about {slow['batches_per_half_for_target']} batches of {data['batch_size']} pairs per "
            f"half ({slow['pairs_per_member_for_target']} training pairs per member; {slow['label']} is the slowest; "
            f"Spearman–Brown from the retest at {slow['batches_per_half']} batches per half, "
            f"{slow['retest']:.2f})" + (f"; the corpus's training split has {avail}." if avail else "."))


NOT_RUN_HEAD = "Not run in this profile (no line of theirs in the table):"


def not_run_notes(metrics_dir: str | os.PathLike) -> list[str]:
    """One bullet per stage whose metrics file says it was not run in its profile (``"skipped"``), with the
    reason it gives; ``[]`` when every stage ran."""
    mdir = Path(metrics_dir)
    if not mdir.is_dir():
        return []
    out = []
    for path in sorted(mdir.glob("*.json")):
        data = read_metrics(path)
        if data.get("skipped"):
            out.append(f"* stage `{path.stem}`: {data['skipped']}")
    return out


def build(metrics_dir: str | os.PathLike) -> tuple[str, list[dict[str, Any]]]:
    """Markdown text and CSV records of Table 1 (per row: the paper, then our primary comparison,
    then the exploratory lines; reliability, retest and ceiling where a stage recorded them)."""
    entries = collect(metrics_dir)
    deltas = collect_deltas(metrics_dir)
    geometry = collect_lines(metrics_dir)
    ablation_lines = collect_ablations(metrics_dir)
    apply_roles(entries, deltas)
    records: list[dict[str, Any]] = []
    notes: list[str] = []
    lines = [
        "# Table 1: Kendall τ between sharpness and generalisation",
        "",
        "Paper values beside ours; ours with bootstrap 95 % intervals, the profile that produced "
        "them and the radius ρ. Generalisation: test loss (diagonal networks), the gap between "
        "evaluation and train error (transformer zoos). Each row has one primary comparison; a line marked "
        "secondary is a former primary comparison another line supersedes, kept with its numbers; every "
        "other line is exploratory (\"not declared\": a stage that has not labelled its lines yet). "
        "\"zoos: a / b / c (sd s)\": τ of the same measure at the same ρ over independently seeded "
        "zoos. \"retest r, ceiling c\": the measure's test–retest τ and the largest |τ| the gap's "
        "reliability (column \"gap rel.\") and that retest allow; \"(mean of both halves r')\": where the value "
        "averages the two retest halves, its reliability (Spearman–Brown, τ scale), which sets the ceiling.",
        "",
        "| setting | source | comparison | profile | models | ρ | gap rel. | "
        + " | ".join(MEASURE_TITLES[m] for m in MEASURES) + " |",
        "|---|---|---|---|---|---|---|" + "---|" * len(MEASURES),
    ]
    for row in PAPER_ROWS:
        lines.append(f"| {row['setting']} | paper | – | – | – | – | – | "
                     + " | ".join(f"{row['paper'][m]:+.2f}" for m in MEASURES) + " |")
        records.append(_record(row, "paper", None, "paper", deltas=deltas))
        ours = sorted(entries[row["row"]], key=_order)
        if not ours:
            lines.append(f"| {row['ours']} | ours | – | – | – | – | – | "
                         + " | ".join(NOT_COMPUTED for _ in MEASURES) + " |")
            records.append(_record(row, "ours", None, NOT_COMPUTED, deltas=deltas))
        for e in geometry.get(row["row"], []) + ablation_lines.get(row["row"], []):
            lines.append(f"| {e.get('setting') or row['ours']} ({e['variant']}) | ours | exploratory | {e['profile']} "
                         f"| {e.get('n_models', '–')} | {_rho_str(e.get('rho'))} | – | "
                         + " | ".join(_line_cell(e, m) for m in MEASURES) + " |")
            records.append(_record(row, "ours", e, e.get("status", NOT_COMPUTED), _line_delta(e), deltas))
        for e in ours:
            label = e.get("setting", row["ours"]) + (f" ({e['variant']})" if e.get("variant") else "")
            rel = e.get("gap_reliability")
            lines.append(f"| {label} | ours | {_status(e)} | {e['profile']} | {e.get('n_models', '')} | "
                         f"{_rho_str(e.get('rho'))} | {'–' if rel is None else f'{rel:.2f}'} | "
                         + " | ".join(_cell(e, m) for m in MEASURES) + " |")
            records.append(_record(row, "ours", e, "computed",
                                   deltas.get(e["stage"]) if e.get("primary") or e.get("secondary") else None, deltas))
            notes += ceiling_notes(row, e)
    if notes:
        lines += ["", "Rows that cannot show the paper's effect:", "", *notes]
    if not_run := not_run_notes(metrics_dir):
        lines += ["", NOT_RUN_HEAD, "", *not_run]
    lines += delta_section(metrics_dir, entries, deltas)
    lines += geometry_section(geometry)
    lines += ablation_section(ablation_lines)
    if (retest := retest_note(metrics_dir)) is not None:
        lines += ["", "How much data the language row would need:", "", retest]
    lines.append("")
    return "\n".join(lines), records


def _delta_cell(d: dict[str, Any], g: str) -> str:
    lo, hi = d["ci"][g]
    return (f"{_fmt(d['delta'][g])} [{_fmt(lo)}, {_fmt(hi)}] · power {d['power'][g]:.2f} · {d['verdict'][g]} · "
            f"MDE {_mde_str(_mde_csv(d, g))}")


def delta_sentences(metrics_dir: str | os.PathLike, *, primary_only: bool = False) -> list[str]:
    """The generated findings of the stage ``paired`` (its primary lines, then — unless ``primary_only`` — the
    exploratory ones), as markdown bullets; ``[]`` without ``paired.json``."""
    path = Path(metrics_dir) / "paired.json"
    if not path.is_file():
        return []
    data = read_metrics(path)
    return [f"* {line}" for line in data["findings_primary" if primary_only else "findings"]]


def delta_section(metrics_dir: str | os.PathLike, entries: dict[str, list[dict[str, Any]]],
                  deltas: dict[str, dict[str, Any]]) -> list[str]:
    """``table1.md``'s paired Δτ table (the primary test of the paper's claim: the paper's Δ, then ours per
    transformer row) and the exploratory lines of the stage ``paired``; nothing without ``paired.json``."""
    if not deltas:
        return []
    out = ["", "## Paired Δτ: is the geodesic measure the better predictor? (primary test, stage paired)", "",
           "Δ = sign(paper's τ) · (τ geodesic − τ adaptive) over the same members, positive when the geodesic "
           "measure tracks the gap more strongly in the paper's direction; paired bootstrap 95 % interval, power at "
           "the paper's Δ with this zoo's reliabilities, the verdict of the pre-registered rule "
           "(`reports/preregistration/delta_tau.md`), and the minimum detectable Δ (MDE: the smallest error-free Δ "
           "this row's members and reliabilities find with 80 % power).", "",
           "| setting | source | comparison | models | " + " | ".join(f"Δ {MEASURE_TITLES[g]}" for g in GEODESIC) + " |",
           "|---|---|---|---|" + "---|" * len(GEODESIC)]
    for row in PAPER_ROWS:
        ours = [(e, deltas[e["stage"]]) for e in sorted(entries[row["row"]], key=_order)
                if (e.get("primary") or e.get("secondary")) and e["stage"] in deltas]
        if not ours:
            continue
        out.append(f"| {row['setting']} | paper | – | {paper.TABLE1_N_MODELS[row['row']]} | "
                   + " | ".join(_fmt(paper_delta(deltas, row["row"], g)) for g in GEODESIC) + " |")
        for e, d in ours:
            out.append(f"| {e.get('setting', row['ours'])} ({e.get('variant') or 'primary'}) | ours | {_status(e)} | "
                       f"{d['n_models']} | " + " | ".join(_delta_cell(d, g) for g in GEODESIC) + " |")
    out += ["", "Findings of the stage paired (generated; the vision confound lines are exploratory, declared "
                "before their values):", "", *delta_sentences(metrics_dir)]
    return out


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", newline="") as fh:
        fh.write(text)
    os.replace(tmp, path)


def write(metrics_dir: str | os.PathLike = "reports/metrics", out_dir: str | os.PathLike = "reports") -> tuple[Path, Path]:
    """Write ``table1.md`` and ``table1.csv`` into ``out_dir``."""
    md, records = build(metrics_dir)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(records[0]))
    writer.writeheader()
    writer.writerows(records)
    out = Path(out_dir)
    _atomic_write(out / "table1.csv", buf.getvalue())
    _atomic_write(out / "table1.md", md)
    return out / "table1.md", out / "table1.csv"


README_BEGIN, README_END = "<!-- table1:begin (python -m companion.experiments.table1 --readme docs/profiles.md) -->", \
    "<!-- table1:end -->"


def readme_summary(csv_path: str | os.PathLike, notes: list[str] = ()) -> str:
    """The README's summary of Table 1: the paper's lines and our primary and secondary lines (the comparison
    column says which), with the gap's reliability and each measure's retest and ceiling (generated from
    ``table1.csv``), then ``notes`` (generated sentences, e.g. :func:`retest_note`)."""
    with open(csv_path, newline="") as fh:
        every = list(csv.DictReader(fh))
    rows = [r for r in every if r["source"] == "paper" or r["comparison"] == "primary"
            or r["comparison"].startswith("secondary")]
    head = ["| setting | source | comparison | models | gap rel. | adaptive | geodesic, invariant | geodesic, mixed |",
            "|---|---|---|---|---|---|---|---|"]
    body = []
    for r in rows:
        cells = []
        for m in MEASURES:
            if not r[m]:
                cells.append("–")
                continue
            c = f"{float(r[m]):+.2f}"
            if r[f"{m}_ci_low"]:
                c += f" [{float(r[f'{m}_ci_low']):+.2f}, {float(r[f'{m}_ci_high']):+.2f}]"
            if r[f"retest_{m}"]:
                c += f" · retest {float(r[f'retest_{m}']):.2f}"
                if r.get(f"reliability_{m}") and r[f"reliability_{m}"] != r[f"retest_{m}"]:
                    c += f" (mean of both halves {float(r[f'reliability_{m}']):.2f})"
                c += f", ceiling {float(r[f'tau_ceiling_{m}']):.2f}"
            cells.append(c)
        rel = f"{float(r['gap_reliability']):.2f}" if r["gap_reliability"] else "–"
        body.append(f"| {r['setting']} | {r['source']} | {r['comparison'] or '–'} | {r['n_models'] or '–'} | {rel} | "
                    + " | ".join(cells) + " |")
    return "\n".join([README_BEGIN, *head, *body, *readme_delta_table(rows),
                      *readme_geometry_table([r for r in every if r["stage"] == "geometry_lines"]),
                      *(["", *notes] if notes else []), README_END])


def readme_delta_table(rows: list[dict[str, str]]) -> list[str]:
    """The README's paired Δτ table (generated from ``table1.csv``'s ``delta_tau_*`` columns): the paper's Δ
    and ours, with interval, power and verdict, for every row that has one; ``[]`` when none has."""
    keep = [r for r in rows if r.get(f"delta_tau_{GEODESIC[0]}")]
    if not any(r["source"] == "ours" for r in keep):
        return []
    out = ["", "Paired Δτ = sign(paper's τ) · (τ geodesic − τ adaptive) over the same members (> 0: the geodesic "
               "measure is the better predictor in the paper's direction; the primary test of the paper's claim, "
               "pre-registered in `reports/preregistration/delta_tau.md`; MDE: the smallest Δ the row detects with "
               "80 % power):", "",
           "| setting | source | comparison | models | Δ geodesic, invariant | Δ geodesic, mixed |",
           "|---|---|---|---|---|---|"]
    for r in keep:
        cells = []
        for g in GEODESIC:
            c = f"{float(r[f'delta_tau_{g}']):+.2f}"
            if r[f"delta_tau_{g}_ci_low"]:
                c += (f" [{float(r[f'delta_tau_{g}_ci_low']):+.2f}, {float(r[f'delta_tau_{g}_ci_high']):+.2f}]"
                      f" · power {float(r[f'power_delta_{g}']):.2f} · {r[f'verdict_delta_{g}']}"
                      + (f" · MDE {_mde_str(_number(r[f'mde_delta_{g}']))}" if r.get(f"mde_delta_{g}") else ""))
            cells.append(c)
        n = r["n_models"] or (str(paper.TABLE1_N_MODELS[r["row"]]) if r["source"] == "paper" else "–")
        out.append(f"| {r['setting']} | {r['source']} | {r['comparison'] or '–'} | {n} | " + " | ".join(cells) + " |")
    return out


def _number(v: str) -> Any:
    """A CSV cell back to a number where it is one (the MDE column holds numbers or a reason)."""
    try:
        return float(v)
    except ValueError:
        return v


def _csv_cell(r: dict[str, str], m: str) -> str:
    if not r[m]:
        return "–"
    c = f"{float(r[m]):+.2f}"
    if r[f"{m}_ci_low"]:
        c += f" [{float(r[f'{m}_ci_low']):+.2f}, {float(r[f'{m}_ci_high']):+.2f}]"
    if r.get(f"reliability_{m}") and r[f"reliability_{m}"] != "nan":
        c += f" · reliability {float(r[f'reliability_{m}']):.2f}"
    return c


def readme_geometry_table(rows: list[dict[str, str]]) -> list[str]:
    """The README's table of the exploratory geometry lines (stage ``geometry_lines``, generated from
    ``table1.csv``): τ with interval and reliability per column, Δτ against adaptive, the status; ``[]`` when
    there are none."""
    if not rows:
        return []
    out = ["", "Exploratory geometry lines (stage geometry_lines, pre-registered in "
               "`reports/preregistration/geometry_lines.md`; exact geodesic: τ of the integrated-geodesic sharpness in "
               "the geodesic columns; Hessian trace: the Riemannian trace in the geodesic columns, the Euclidean trace "
               "in the adaptive column; Δ against adaptive sharpness as above; `reports/table1.md` has the full "
               "variant text):", "",
           "| setting | line | models | adaptive | geodesic, invariant | geodesic, mixed | Δ invariant | Δ mixed | "
           "status |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ds = []
        for g in GEODESIC:
            if not r[f"delta_tau_{g}"]:
                ds.append("–")
                continue
            c = f"{float(r[f'delta_tau_{g}']):+.2f} [{float(r[f'delta_tau_{g}_ci_low']):+.2f}, " \
                f"{float(r[f'delta_tau_{g}_ci_high']):+.2f}]"
            if r[f"power_delta_{g}"] and r[f"power_delta_{g}"] != "nan":
                c += f" · power {float(r[f'power_delta_{g}']):.2f}"
            ds.append(c)
        line = r["variant"].split(" — ")[0] + ("" if r["status"] == "computed" else f" ({r['variant'].split('; ')[-1]})")
        out.append(f"| {r['setting']} | {line} | {r['n_models'] or '–'} | "
                   + " | ".join(_csv_cell(r, m) for m in MEASURES) + " | " + " | ".join(ds) + f" | {r['status']} |")
    return out


def readme_notes(metrics_dir: str | os.PathLike) -> list[str]:
    """The generated sentences under the README's Table 1: the paired Δτ findings (primary), the language row's
    data need (:func:`retest_note`, where its stage ran) and the stages not run in the profile (:func:`not_run_notes`)."""
    note = retest_note(metrics_dir)
    not_run = not_run_notes(metrics_dir)
    return (delta_sentences(metrics_dir, primary_only=True) + ([] if note is None else [note])
            + (["", NOT_RUN_HEAD, "", *not_run] if not_run else []))


def update_readme(readme: str | os.PathLike, csv_path: str | os.PathLike, notes: list[str] = ()) -> None:
    """Replace the generated Table 1 block of ``readme`` (between its markers)."""
    text = Path(readme).read_text()
    a, b = text.find(README_BEGIN), text.find(README_END)
    if a < 0 or b < a:
        raise ValueError(f"{readme} has no generated Table 1 block ({README_BEGIN!r} … {README_END!r})")
    _atomic_write(Path(readme), text[:a] + readme_summary(csv_path, notes) + text[b + len(README_END):])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m companion.experiments.table1", description=__doc__.split("\n")[0])
    ap.add_argument("--metrics-dir", default="reports/metrics")
    ap.add_argument("--out-dir", default="reports")
    ap.add_argument("--readme", default=None, help="also refresh this README's generated Table 1 block")
    args = ap.parse_args(argv)
    import time

    t0 = time.perf_counter()
    md, csv_path = write(args.metrics_dir, args.out_dir)
    timings = Path(args.out_dir) / "timings" / "table1.json"     # git only (companion.budget), no DVC output
    timings.parent.mkdir(parents=True, exist_ok=True)
    timings.write_text(json.dumps({"stage_wall_s": round(time.perf_counter() - t0, 1)}, indent=1) + "\n")
    if args.readme:
        update_readme(args.readme, csv_path, readme_notes(args.metrics_dir))
    print(Path(md).read_text())
    print(f"wrote {md} and {csv_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
