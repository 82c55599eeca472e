"""MiniLM row: the design (dev-set size, batches per half, member count) of highest power the budget allows.

A design note for issue 31 item 4 ("For MiniLM, the pilot machinery chooses dev-set size, batches per half and
member count for the highest power the budget allows, before training; state the power reached"). Nothing is
trained or measured here: every number comes from published files, and **no gap–sharpness value enters** (the
reliabilities are test–retest values of each measure and the gap's own split-half reliability; the correlation
between the two measures is between sharpness values).

For every candidate dev-set size ``D`` (``dev_sizes``) and batches per half ``k`` (``batches_per_half``):

* **reliabilities** — of each measure's value (the mean of both halves, ``2k`` batches) by Spearman–Brown from a
  published reliability at the current ``k0`` batches per half, and of the gap by Spearman–Brown from its published
  reliability at the current ``D0`` dev pairs. Two sources, reported side by side: ``pilot`` — the MiniLM pilot's
  variance components (``reports/pilots/minilm.json``, exactly :func:`companion.pilots.minilm.reliability`)
  and its gap reliability; ``zoo`` — the main zoo's published reliabilities (``reports/metrics/minilm.json``,
  ``primary_delta_tau``: the reliabilities of the values its primary Δτ used, on the Kendall-retest scale that
  :func:`companion.analysis.delta_power` reads as Pearson ``sin(πr/2)``, and its gap reliability);
* **cost** — the budget is the current design's two stages as the timed fresh-clone rebuild measured them
  (``minilm_train`` + ``minilm``, :func:`companion.budget.stage_seconds`). ``minilm_train`` scales with the members
  and with the pairs each member processes: training forward and backward on the training pairs (counted as
  ``backward_factor`` + 1 forward passes) and one forward pass over the training, dev and HANS-like test pairs;
  ``minilm`` (sharpness) scales with members × batches. (An assumption: the fixed parts of both stages scale too,
  which overstates the cost of a larger design a little.)
* **members** — the largest even count (≤ ``max_members``) whose cost is within the budget;
* **power** — of the primary paired Δτ at the paper's Δ, each geodesic measure against adaptive sharpness:
  :func:`companion.pilots.minilm.paired_power` (the design of ``reports/preregistration/delta_tau.md``,
  the Monte Carlo settings of the ``paired`` stage's primary power), the latent correlation of the two measures
  from the source's values. At the current design the ``zoo`` source reproduces the power the ``minilm`` row
  publishes (tested).

Chosen, per source: the design whose smaller power (of the two geodesic measures) is highest; ties to fewer
members, then the smaller dev set, then fewer batches. ``python -m companion.pilots.minilm_power`` writes
``reports/pilots/minilm_power.json`` and ``reports/pilots/minilm_power.md`` (generated from the JSON).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from companion import analysis, paper
from companion.pilots.common import write_pilot_report

STAGE = "minilm_power"
OUT = Path("reports/pilots")
GEODESIC, BASELINE = paper.GEODESIC, paper.BASELINE


@dataclass(frozen=True)
class PowerPlan:
    """The ``minilm_power`` section."""

    dev_sizes: list[int]
    batches_per_half: list[int]
    min_members: int
    max_members: int
    backward_factor: float     # a backward pass counted as this many forward passes (cost model)
    pilot_report: str          # reports/pilots/minilm.json
    zoo_metrics: str           # reports/metrics/minilm.json
    timings: str               # reports/timings (the timed fresh-clone rebuild)
    report: str                # reports/pilots/<report>.{json,md}


def member_units(n_train: int, n_dev: int, n_test: int, backward_factor: float) -> float:
    """Forward-pass units of one member: training (forward + backward) on the training pairs, then one forward
    pass over the training, dev and test pairs (the errors every member records)."""
    return (1 + backward_factor) * n_train + n_train + n_dev + n_test


def design_seconds(n: int, k: int, d: int, cur: dict, backward_factor: float) -> float:
    """Seconds of both stages for ``n`` members, ``k`` batches per half, ``d`` dev pairs, scaled from ``cur``
    (the current design: its members, batches per half, corpus and the two stages' seconds)."""
    units = member_units(cur["n_train"], d, cur["n_test"], backward_factor)
    units0 = member_units(cur["n_train"], cur["n_dev"], cur["n_test"], backward_factor)
    train = cur["train_seconds"] * (n / cur["n_models"]) * units / units0
    measure = cur["measure_seconds"] * (n * k) / (cur["n_models"] * cur["k"])
    return train + measure


def latent_corr(tau_between: float, rel_a: float, rel_g: float) -> float:
    """Error-free Pearson correlation of two measures from their observed Kendall τ (Greiner's sin(πτ/2)),
    disattenuated by their reliabilities, clipped to [-0.99, 0.99] (as the pilot's ``corr_between``)."""
    r = math.sin(math.pi * tau_between / 2) / math.sqrt(max(rel_a * rel_g, 1e-12))
    return float(min(0.99, max(-0.99, r)))


def sources(p: PowerPlan) -> dict:
    """Per source: the reliabilities at the current design (per measure, and the gap's), the latent correlation of
    each geodesic measure with adaptive sharpness, and the current design they were measured at."""
    from companion.pilots import minilm as mp

    pilot = json.loads(Path(p.pilot_report).read_text())
    zoo = json.loads(Path(p.zoo_metrics).read_text())
    rho = pilot["rho"]
    comps = {r["measure"]: (r["s_member"], r["s_resid"]) for r in pilot["retest"] if r["rho"] == rho[r["measure"]]}
    n_half = pilot["settings"]["n_half"]
    out = {"pilot": dict(what=f"the MiniLM pilot's variance components ({pilot['n_members']} members, chosen radii) "
                              f"and gap reliability ({pilot['n_dev']} dev pairs)",
                         k0=n_half, d0=int(pilot["n_dev"]), gap=float(pilot["gap_reliability"]),
                         per_batch={m: analysis.component_reliability(*comps[m], 1) for m in comps},
                         corr=dict(pilot["corr_latent"]))}
    deltas = {r["measure"]: r for r in zoo["primary_delta_tau"]}
    k0 = zoo["protocol"]["n_batches"] // 2
    # the paired stage's reliabilities are on the Kendall-retest scale (Spearman-Brown of the halves' retest τ);
    # its power reads them as Pearson sin(πr/2) (companion.analysis.delta_power): the same here
    tau_scale = {BASELINE: deltas[GEODESIC[0]]["reliability_baseline"],
                 **{g: deltas[g]["reliability_geodesic"] for g in GEODESIC}}
    rel = {m: math.sin(math.pi * max(r, 0.0) / 2) for m, r in tau_scale.items()}
    per_batch = {m: r / (2 * k0 - (2 * k0 - 1) * r) if r > 0 else 0.0 for m, r in rel.items()}   # SB inverted
    out["zoo"] = dict(what=f"the main zoo's published reliabilities ({zoo['protocol']['n_models']} members, "
                           f"{k0} batches per half; reports/metrics/minilm.json)",
                      k0=k0, d0=None, gap=float(deltas[GEODESIC[0]]["gap_reliability"]), per_batch=per_batch,
                      corr={g: latent_corr(deltas[g]["tau_between"], rel[BASELINE], rel[g]) for g in GEODESIC})
    return out


def current_design(p: PowerPlan) -> dict:
    """The design in force and its cost: members, batches per half, corpus sizes (params.yaml ``minilm_train``) and
    the two stages' seconds from the timed fresh-clone rebuild (:func:`companion.budget.stage_seconds`)."""
    from companion import budget
    from companion.params import stage_params

    train = stage_params("minilm_train", "cpu")[1]
    zoo = json.loads(Path(p.zoo_metrics).read_text())
    secs = budget.stage_seconds(p.timings, ["minilm_train", "minilm"], skipped={})
    if any(v is None for v, _ in secs.values()):
        raise ValueError(f"no timing of minilm_train / minilm under {p.timings}")
    corpus = train["corpus"]
    return dict(n_models=int(zoo["protocol"]["n_models"]), k=int(zoo["protocol"]["n_batches"]) // 2,
                n_iters=int(zoo["protocol"]["n_iters"]), batch_size=int(zoo["protocol"]["batch_size"]),
                n_train=int(corpus["n_train"]), n_dev=int(corpus["n_dev"]), n_test=int(corpus["n_test"]),
                train_seconds=float(secs["minilm_train"][0]), measure_seconds=float(secs["minilm"][0]),
                source={k: v[1] for k, v in secs.items()})


def plan(p: PowerPlan, *, progress: bool = False) -> dict:
    """Every candidate design with its members and power, per source, and the chosen design."""
    from companion import paper
    from companion.pilots import minilm as mp
    from companion.experiments import paired
    from companion.params import stage_params

    ps = paired.load_settings(stage_params("paired", "cpu")[1])   # the primary Δτ's own Monte Carlo settings
    cur = current_design(p)
    budget_s = cur["train_seconds"] + cur["measure_seconds"]
    tau = paper.table1_tau("language")
    sign = math.copysign(1.0, tau["geodesic_mixed"])
    out = dict(current=cur, budget_seconds=budget_s, paper_tau=tau, paper_delta=mp.paper_delta(),
               settings=asdict(p), monte_carlo=dict(n_sim=ps.power.n_sim, n_boot=ps.power.n_boot, seed=ps.power.seed,
                                                    confidence=ps.confidence), sources={})
    for name, src in sources(p).items():
        d0 = src["d0"] if src["d0"] is not None else cur["n_dev"]
        rows = []
        for d in p.dev_sizes:
            rel_y = analysis.step_up(src["gap"], d / d0)
            for k in p.batches_per_half:
                per = design_seconds(1, k, d, cur, p.backward_factor)
                n = int(min(p.max_members, math.floor(budget_s / per + 1e-9)))   # the current design: exactly its own
                n -= n % 2
                rel = {m: analysis.step_up(r1, 2 * k) for m, r1 in src["per_batch"].items()}
                if n < p.min_members:
                    pw = {g: 0.0 for g in GEODESIC}
                else:
                    pw = {g: mp.paired_power(n, tau_a=tau[BASELINE], tau_g=tau[g], sign=sign, rel_a=rel[BASELINE],
                                             rel_g=rel[g], rel_y=min(1.0, rel_y), corr_ag=src["corr"][g],
                                             n_sim=ps.power.n_sim, n_boot=ps.power.n_boot,
                                             confidence=ps.confidence, seed=ps.power.seed) for g in GEODESIC}
                rows.append(dict(n_dev=d, k=k, n_models=n, seconds=n * per, gap_reliability=rel_y, reliability=rel,
                                 power=pw, min_power=min(pw.values())))
                if progress:
                    print(f"[{name}] dev {d}, k {k}: {n} members, power {pw}", flush=True)
        best = max(rows, key=lambda r: (r["min_power"], -r["n_models"], -r["n_dev"], -r["k"]))
        best = best if best["min_power"] > 0 else None     # no design with any power: none chosen
        now = next((r for r in rows if r["n_dev"] == cur["n_dev"] and r["k"] == cur["k"]), None)
        out["sources"][name] = dict(what=src["what"], corr_latent=src["corr"], designs=rows, chosen=best,
                                    current_grid_design=now)
    return out


def render_markdown(r: dict) -> str:
    """The note as markdown, every number from ``r``."""
    cur = r["current"]
    lines = ["# MiniLM row: the design of highest power within the budget (generated)", "",
             "A design note (issue 31 item 4), computed by `python -m companion.pilots.minilm_power` from "
             "published files only: nothing trained or measured, no gap–sharpness value used.", "",
             f"**Budget**: the current design's two stages as the timed fresh-clone rebuild measured them — "
             f"`minilm_train` {cur['train_seconds'] / 60:.1f} min + `minilm` {cur['measure_seconds'] / 60:.1f} min = "
             f"**{r['budget_seconds'] / 60:.1f} min** ({cur['n_models']} members, {cur['k']} batches of "
             f"{cur['batch_size']} per half, {cur['n_iters']} iterations, {cur['n_dev']} dev pairs). A design's cost "
             f"scales `minilm_train` with members × pairs processed per member (training forward + backward, a "
             f"backward counted as {r['settings']['backward_factor']:g} forwards, then one forward over "
             f"{cur['n_train']} training, the dev and {cur['n_test']} test pairs) and `minilm` with members × batches.",
             "",
             f"**Power**: of the primary paired Δτ at the paper's Δ (invariant {r['paper_delta']['geodesic_invariant']:+.2f}, "
             f"mixed {r['paper_delta']['geodesic_mixed']:+.2f}), `companion.pilots.minilm.paired_power` "
             f"({r['monte_carlo']['n_sim']} simulated zoos × {r['monte_carlo']['n_boot']} paired resamples, seed "
             f"{r['monte_carlo']['seed']}); reliabilities by Spearman–Brown in batches (measures) and dev pairs (gap)."]
    for name, s in r["sources"].items():
        b = s["chosen"] or {}
        lines += ["", f"## From {s['what']}", "",
                  "Latent correlation with adaptive sharpness: " + ", ".join(f"{g} {v:.2f}" for g, v in
                                                                               s["corr_latent"].items()) + ".", "",
                  "| dev pairs | batches per half | members | minutes | gap reliability | reliability adaptive / inv. / "
                  "mixed | power Δ invariant | power Δ mixed |", "|---|---|---|---|---|---|---|---|"]
        for d in s["designs"]:
            rel = d["reliability"]
            mark = " **(chosen)**" if b and (d["n_dev"], d["k"]) == (b["n_dev"], b["k"]) else ""
            lines.append(f"| {d['n_dev']} | {d['k']} | {d['n_models']} | {d['seconds'] / 60:.1f} | "
                         f"{d['gap_reliability']:.2f} | {rel['adaptive']:.2f} / {rel['geodesic_invariant']:.2f} / "
                         f"{rel['geodesic_mixed']:.2f} | {d['power']['geodesic_invariant']:.2f} | "
                         f"{d['power']['geodesic_mixed']:.2f}{mark} |")
        now = s["current_grid_design"]
        if not b:
            lines += ["", "**None chosen**: every design has power 0 from this source — a measure without member "
                      "variance (reliability 0 at every batch count) leaves the paired Δτ nothing to detect, whatever "
                      "the budget buys."]
            continue
        lines += ["", f"**Chosen**: {b['n_dev']} dev pairs, {b['k']} batches per half, {b['n_models']} members "
                  f"({b['seconds'] / 60:.1f} min): power {b['power']['geodesic_invariant']:.2f} (invariant) and "
                  f"{b['power']['geodesic_mixed']:.2f} (mixed) at the paper's Δ."
                  + (f" The current design by the same computation: {now['n_models']} members, power "
                     f"{now['power']['geodesic_invariant']:.2f} / {now['power']['geodesic_mixed']:.2f}." if now else "")]
        se = math.sqrt(b["min_power"] * (1 - b["min_power"]) / r["monte_carlo"]["n_sim"])
        close = [d for d in s["designs"] if d["min_power"] >= b["min_power"] - 2 * se]
        lines += ["", f"Monte Carlo standard error of the chosen smaller power: {se:.3f}; {len(close)} of "
                  f"{len(s['designs'])} designs lie within two of them of it"
                  + (" — the current design is the choice: **the budget binds: no other dev-set size, batch count or "
                     "member count it allows has higher power at the paper's Δ**." if now is not None and
                     (now["n_dev"], now["k"]) == (b["n_dev"], b["k"]) else ".")]
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m companion.pilots.minilm_power", description=__doc__.split("\n")[0])
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--render-only", action="store_true")
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args(argv)
    from companion.params import ParamsError, settings

    try:
        p = settings(PowerPlan, STAGE, "cpu", args.overrides)
    except ParamsError as exc:
        ap.error(str(exc))
    out = Path(args.out)
    r = json.loads((out / f"{p.report}.json").read_text()) if args.render_only else plan(p, progress=args.progress)
    write_pilot_report(out, p.report, r, render_markdown, json_too=not args.render_only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
