"""The README's findings, generated: the paired Δτ figure, Table 1's primary lines with their Δτ, verdict and minimum
detectable Δ, one sentence per row of what it shows and its main caveat, and links to ``reports/`` for the protocol,
the pilots, the exploratory and superseded lines and their history.

Every number comes from the committed results — ``reports/table1.csv`` (written by
:mod:`companion.experiments.table1` from the stages' metrics) and ``reports/metrics/paired.json`` (the vision row's
exploratory train-error line) — and none is typed here; the block names no issue (the project's history lives in
``reports/`` and in git).

``python -m companion.findings --readme README.md`` replaces the block between :data:`BEGIN` and :data:`END` (inserting
both before the README's "What we found" heading, or at its end, when absent); without ``--readme`` it prints the
block.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path
from typing import Any, Sequence

from companion import paper
from companion.params import load_yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
BEGIN = "<!-- findings:begin (python -m companion.findings --readme README.md) -->"
END = "<!-- findings:end -->"
#: where the block goes in a README that has none yet (before this heading; else at the end)
ANCHOR = "### What we found"
FIGURE = "reports/figures/paired/paired_delta_tau.png"
MEASURES = paper.TABLE1_MEASURES
GEODESIC = MEASURES[1:]
SHORT = {"adaptive": "adaptive", "geodesic_invariant": "invariant", "geodesic_mixed": "mixed"}
#: the reliability the design asks of a measure and of the gap (EXPERIMENTS.md, "Making an experiment able to answer";
#: a threshold of the rule, never printed)
TARGET_RELIABILITY = 0.8
#: |τ(gap, train error)| from which the train error is named as the vision row's caveat
CONFOUND_TAU = 0.3
LINKS = [("the protocol and every pre-registration", "reports/preregistration/"),
         ("the pilots that fixed radii, protocols and member counts", "reports/pilots/"),
         ("Table 1 in full, with the exploratory, ablation and superseded lines", "reports/table1.md"),
         ("every executed notebook with its own findings", "reports/notebooks/"),
         ("the figures of every stage, the paper's ablations included", "reports/figures/")]


#: the paper's figures and table (arXiv numbering, the camera-ready's where it differs), what each shows, the files that
#: rebuild them (every profile writes the same paths, labelled with its profile) and the stage that writes them
FIGURE_MAP = [
    ("Figure 1", "scalar toy model: loss, Euclidean and Riemannian gradient norm", ["reports/figures/toy/fig1_toy_gradients.png"], "toy"),
    ("Figure 3", "diagonal networks: test loss against the three measures", ["reports/figures/diagonal/fig3_diagonal.png"], "diagonal"),
    ("Figure 4", "vision transformers: gap against the three measures", ["reports/figures/vision/fig4_vision.png"], "vision"),
    ("Figure 5", "language transformers: gap against the three measures", ["reports/figures/ablations/fig5_language.png"], "ablations"),
    ("Figure 6 (camera-ready 8)", "scalar toy model: Euclidean and Riemannian Hessian trace", ["reports/figures/toy/fig6_toy_hessian.png"], "toy"),
    ("camera-ready Figure 6", "language zoo: gap against relative flatness", ["reports/figures/ablations/relative_flatness.png"], "ablations"),
    ("camera-ready Figure 7", "orbit invariance: each measure along a symmetry orbit", ["reports/figures/ablations/orbit_invariance.png"], "ablations"),
    ("Figure 7 (camera-ready 9)", "ablations, invariant metric", ["reports/figures/ablations/fig7_minilm.png", "reports/figures/ablations/fig7_vision.png"], "ablations"),
    ("Figure 8 (camera-ready 10)", "ablations, mixed metric", ["reports/figures/ablations/fig8_minilm.png", "reports/figures/ablations/fig8_vision.png"], "ablations"),
    ("Figure 9 (camera-ready 11)", "ε relaxation sweep", ["reports/figures/ablations/fig9_eps.png"], "ablations"),
    ("Table 1", "Kendall τ per row and measure, paper beside ours", ["reports/table1.md", "reports/table1.csv"], "table1"),
]


def figure_map(root: str | Path = REPO_ROOT) -> list[str]:
    """Every paper figure and Table 1 with the files that rebuild them, and whether they are built."""
    out = ["| paper | what | file (every profile writes it, labelled) | status |", "|---|---|---|---|"]
    for label, what, files, stage in FIGURE_MAP:
        built = all((Path(root) / f).is_file() for f in files)
        status = "built" if built else f"not built yet: `dvc repro {stage}`"
        out.append(f"| {label} | {what} | " + ", ".join(f"`{f}`" for f in files) + f" | {status} |")
    return out


def _num(v: str) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def read_table(path: str | Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def primary_lines(rows: Sequence[dict[str, str]]) -> list[tuple[dict[str, str], dict[str, str]]]:
    """``(paper line, our primary line)`` per Table 1 row that has a primary line of ours, in the paper's order."""
    out = []
    for row in paper.TABLE1_TAU:
        ours = [r for r in rows if r["row"] == row and r["source"] == "ours" and r["comparison"] == "primary"]
        theirs = [r for r in rows if r["row"] == row and r["source"] == "paper"]
        if ours and theirs:
            out.append((theirs[0], ours[0]))
    return out


def _tau_cell(r: dict[str, str], m: str) -> str:
    v = _num(r[m])
    if v is None:
        return "–"
    lo, hi = _num(r.get(f"{m}_ci_low", "")), _num(r.get(f"{m}_ci_high", ""))
    return f"{v:+.2f}" + (f" [{lo:+.2f}, {hi:+.2f}]" if lo is not None and hi is not None else "")


def _mde(r: dict[str, str], g: str) -> str:
    cell = r.get(f"mde_delta_{g}", "")
    v = _num(cell)
    return f"MDE {v:+.2f}" if v is not None else (f"MDE {cell}" if cell else "")


def _delta_cell(r: dict[str, str], g: str) -> str:
    d = _num(r.get(f"delta_tau_{g}", ""))
    if d is None:
        return "–"
    lo, hi = _num(r[f"delta_tau_{g}_ci_low"]), _num(r[f"delta_tau_{g}_ci_high"])
    if lo is None:
        return f"{d:+.2f}"
    parts = [f"{d:+.2f} [{lo:+.2f}, {hi:+.2f}]", r[f"verdict_delta_{g}"], _mde(r, g)]
    return " · ".join(p for p in parts if p)


def table(pairs: Sequence[tuple[dict[str, str], dict[str, str]]]) -> list[str]:
    """Table 1's primary lines: the paper's, then ours, τ per measure and the paired Δτ per geodesic measure."""
    out = ["| setting | source | models | " + " | ".join(f"τ {SHORT[m]}" for m in MEASURES) + " | "
           + " | ".join(f"Δτ {SHORT[g]} − adaptive" for g in GEODESIC) + " |",
           "|---|---|---|" + "---|" * (len(MEASURES) + len(GEODESIC))]
    for theirs, ours in pairs:
        n_paper = str(paper.TABLE1_N_MODELS[theirs["row"]])
        for r, n in ((theirs, n_paper), (ours, ours["n_models"])):
            out.append(f"| {r['setting']} | {r['source']} | {n} | " + " | ".join(_tau_cell(r, m) for m in MEASURES)
                       + " | " + " | ".join(_delta_cell(r, g) for g in GEODESIC) + " |")
    return out


def _confound(metrics_dir: Path, row: str) -> str | None:
    """The vision row's exploratory train-error line (stage ``paired``), when the gap follows train error."""
    path = metrics_dir / "paired.json"
    if not path.is_file():
        return None
    ex = json.loads(path.read_text()).get("exploratory") or {}
    if ex.get("row") != row:
        return None
    part = ex.get("partial") or []
    head = next((p for p in part if str(p.get("quantity", "")).startswith("tau_gap_")), None)
    if head is None or abs(head["value"]) < CONFOUND_TAU:
        return None
    pt = [p for p in part if p.get("quantity") == "partial_tau"]
    return (f"the gap follows {head['control'].replace('_', ' ')} (τ {head['value']:+.2f}, exploratory) and given it the "
            "measures' partial τ are " + " / ".join(f"{p['value']:+.2f}" for p in pt))


def _clusters(metrics_dir: Path, row: str) -> str | None:
    """The drawn factors that split the row's gap into separate clusters (stage ``vision``'s pre-registered check,
    ``gap_clusters`` in its metrics file), named with where to read the within-level lines."""
    path = metrics_dir / f"{row}.json"
    if not path.is_file():
        return None
    split = [c for c in json.loads(path.read_text()).get("gap_clusters") or [] if c.get("splits")]
    if not split:
        return None
    return ("the gap splits into separate clusters by " + " and by ".join(c["factor"] for c in split)
            + " (Figure 4 colours them), so a pooled τ mixes the relation between the clusters with the one within "
            "them (the lines within each level: reports/figures/paired/paired_vision_factors.png)")


def mde_target(metrics_dir: str | Path) -> float:
    """The power the minimum detectable Δ is defined at: the stage ``paired``'s setting as its metrics file records it
    (``params.mde.target``), else as ``params.yaml`` states it (a metrics file written before the setting existed)."""
    path = Path(metrics_dir) / "paired.json"
    recorded = ((json.loads(path.read_text()).get("params") or {}).get("mde") or {}) if path.is_file() else {}
    if "target" in recorded:
        return float(recorded["target"])
    from companion.params import stage_params

    return float(stage_params("paired")[1]["mde"]["target"])


def caveat(theirs: dict[str, str], ours: dict[str, str], metrics_dir: Path) -> str:
    """The row's main caveat, by the first rule that applies: the row cannot detect the paper's Δ (its MDE exceeds it
    or is not reached); the gap follows train error (vision); a reliability below the design's target; a τ of the
    other sign than the paper's; else none of these checks flags it."""
    short = []
    for g in GEODESIC:
        m, p = _num(ours.get(f"mde_delta_{g}", "")), _num(theirs.get(f"delta_tau_{g}", ""))
        cell = ours.get(f"mde_delta_{g}", "")
        if p is not None and ((m is not None and m > p) or cell.startswith("not reached")):
            short.append(f"{SHORT[g]} ({_mde(ours, g)} against the paper's {p:+.2f})")
    if short:
        return (f"it cannot detect the paper's effect: the smallest Δ it finds with {mde_target(metrics_dir):.0%} power "
                "exceeds the paper's Δ "
                "for " + " and ".join(short) + ", so an interval around 0 is inconclusive by design")
    if ours["row"] == "vision":
        found = [c for c in (_confound(metrics_dir, "vision"), _clusters(metrics_dir, "vision")) if c]
        if found:
            return "; ".join(found)
    rel = {m: _num(ours.get(f"reliability_{m}", "")) or _num(ours.get(f"retest_{m}", "")) for m in MEASURES}
    low = {m: v for m, v in rel.items() if v is not None and v < TARGET_RELIABILITY}
    gap = _num(ours.get("gap_reliability", ""))
    if low or (gap is not None and gap < TARGET_RELIABILITY):
        parts = [f"{SHORT[m]} {v:.2f}" for m, v in low.items()] + ([f"gap {gap:.2f}"] if gap is not None
                                                                   and gap < TARGET_RELIABILITY else [])
        return "reliabilities below the design's target: " + ", ".join(parts)
    flips = [m for m in MEASURES if _num(ours[m]) is not None and _num(theirs[m]) is not None
             and _num(ours[m]) * _num(theirs[m]) < 0]
    if flips:
        return ("τ of the other sign than the paper's for " + ", ".join(SHORT[m] for m in flips)
                + " (see the row's exploratory lines in reports/table1.md)")
    return "none of the generated checks (detectable Δ, train-error confound, reliability, sign) flags it"


def sentence(theirs: dict[str, str], ours: dict[str, str], metrics_dir: Path) -> str:
    """What a row shows (its paired Δτ verdicts, or its τ against the paper's where it has no Δτ) and its caveat."""
    name = ours["setting"]
    if _num(ours.get(f"delta_tau_{GEODESIC[0]}", "")) is not None and ours.get(f"verdict_delta_{GEODESIC[0]}"):
        shows = "; ".join(f"{SHORT[g]} − adaptive Δτ {_num(ours[f'delta_tau_{g}']):+.2f} "
                          f"({ours[f'verdict_delta_{g}']})" for g in GEODESIC)
    else:
        shows = "τ " + " / ".join(f"{_num(ours[m]):+.2f}" for m in MEASURES if _num(ours[m]) is not None) \
            + " (adaptive / invariant / mixed) against the paper's " \
            + " / ".join(f"{_num(theirs[m]):+.2f}" for m in MEASURES)
    return f"* **{name}** ({ours['n_models']} models): {shows}. Caveat: {caveat(theirs, ours, metrics_dir)}."


def stale_measurements(root: str | Path = REPO_ROOT) -> list[str]:
    """Sentences naming each stage whose committed results were measured on another zoo than the one its training
    stage now records in ``dvc.lock`` (the zoo was re-trained, the measuring stage not yet re-run)."""

    lock_path = Path(root) / "dvc.lock"
    if not lock_path.exists():
        return []
    stages = (load_yaml(lock_path.read_text()) or {}).get("stages", {})
    made = {o["path"]: (name, o.get("md5")) for name, st in stages.items() for o in st.get("outs", [])
            if str(o.get("path", "")).startswith("data/zoos/")}
    out = []
    for name, st in stages.items():
        for d in st.get("deps", []):
            producer = made.get(d.get("path"))
            if producer and producer[1] != d.get("md5"):
                out.append(f"* **Not current:** stage `{name}`'s committed results were measured on an earlier "
                           f"`{d['path']}` than the one stage `{producer[0]}` now trains; `dvc repro {name}` "
                           f"re-measures it (and the stages that read it).")
    return sorted(set(out))


def block(table_csv: str | Path = "reports/table1.csv", metrics_dir: str | Path = "reports/metrics",
          root: str | Path = REPO_ROOT) -> str:
    """The README's findings block (markers included); ``root``: the checkout whose figures the map looks for."""
    rows = read_table(table_csv)
    pairs = primary_lines(rows)
    lines = [BEGIN, "", f"![Paired Δτ: is geodesic sharpness the better predictor of the gap?]({FIGURE})", "",
             "The paper's claim is comparative, so each transformer row's primary test is the paired Δτ = sign(paper's "
             "τ) · (τ geodesic − τ adaptive) over the same members (> 0: the geodesic measure tracks the gap more "
             "strongly, in the paper's direction), pre-registered with its decision rule; beside each verdict, the "
             f"smallest Δ the row detects with {mde_target(metrics_dir):.0%} power (MDE). The paper's primary lines and "
             "ours:", "",
             *table(pairs), ""]
    lines += [sentence(theirs, ours, Path(metrics_dir)) for theirs, ours in pairs]
    lines += stale_measurements(root)
    lines += ["", "Where each of the paper's figures is rebuilt:", "", *figure_map(root)]
    lines += ["", "More in `reports/`: " + "; ".join(f"{what} (`{path}`)" for what, path in LINKS) + ".", "", END]
    return "\n".join(lines)


def update_readme(readme: str | Path, text: str) -> None:
    """Replace the block between the markers; insert it (before :data:`ANCHOR`, else at the end) when absent."""
    path = Path(readme)
    body = path.read_text()
    a, b = body.find(BEGIN), body.find(END)
    if a >= 0 and b > a:
        body = body[:a] + text + body[b + len(END):]
    elif a >= 0 or b >= 0:
        raise ValueError(f"{readme} has only one of the findings markers ({BEGIN!r}, {END!r}); fix it by hand")
    else:
        at = body.find(ANCHOR)
        body = body[:at] + text + "\n\n" + body[at:] if at >= 0 else body.rstrip("\n") + "\n\n" + text + "\n"
    path.write_text(body)


def read_block(readme: str | Path) -> str | None:
    """The findings block of a README (markers included), None without one."""
    body = Path(readme).read_text()
    a, b = body.find(BEGIN), body.find(END)
    return body[a:b + len(END)] if a >= 0 and b > a else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m companion.findings", description=__doc__.split("\n")[0])
    ap.add_argument("--table", default="reports/table1.csv")
    ap.add_argument("--metrics-dir", default="reports/metrics")
    ap.add_argument("--readme", default=None, help="replace (or insert) the findings block of this README")
    args = ap.parse_args(argv)
    text = block(args.table, args.metrics_dir)
    if args.readme:
        update_readme(args.readme, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
