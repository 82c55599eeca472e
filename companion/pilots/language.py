"""Pilot of the language sharpness protocol, run before the main zoo is measured (pre-registration).

On *pilot* members (a zoo of the main recipe with other fine-tuning seeds, never part of the
main zoo) it measures, without looking at any generalisation gap:

1. **the radius scan**: every measure of :data:`companion.experiments.zoo.STANDARD` at every
   radius of a grid fixed in advance, ``radius_iters`` Auto-PGD iterations, on
   ``2 · n_half`` batches of training pairs (two disjoint halves A and B); each measure's
   pre-registered ρ is the radius whose **test–retest** is highest (criterion stated before
   computing: the variance-component retest of the mean over ``n_half`` batches, below;
   generalisation is not involved);
2. **the protocol scan**: at the chosen ρ, the other iteration counts ``n_iters``;
3. for every (iterations, pairs per half) the **direct retest** — Kendall τ over the members
   between the measure on the first ``k`` batches of half A and on the first ``k`` of half B
   (disjoint pairs) — and the **variance-component retest**: the per-batch values (log) of a
   members × batches table split into member variance ``s_m`` and residual (member × batch
   and solver) variance ``s_e``; the mean over ``k`` batches then has reliability
   ``r_k = s_m / (s_m + s_e / k)`` and two disjoint such means a Kendall τ of
   ``(2/π)·arcsin(r_k)``. It says *why* a retest is low (``s_e / s_m``) and how many batches
   a target needs (Spearman–Brown);
4. the **gap reliability** of the pilot's dev set (split halves of the dev pairs,
   Spearman–Brown, from per-example errors) and the **power** of the main comparison
   (Monte Carlo, Kendall τ, both variables attenuated by their reliabilities) against the
   number of members, at the paper's τ.

The smallest protocol (by gradient evaluations, ``2 · pairs / batch_size · n_iters`` per
measurement) whose variance-component retest reaches ``target`` for every measure is the one
the report proposes; params.yaml's ``language`` section records what was chosen.

Command line::

    python -m companion.pilots.language --out reports/pilots/language.json

(section ``language_pilot`` of ``params.yaml``; the pilot zoo is trained beforehand by
``python -m companion.experiments.language_zoo train --out <zoo_dir> --set finetune.n_models=…
--set finetune.base_seed=… --set corpus.n_dev=…`` as the section's comment states).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
from scipy import stats

from companion import analysis
from companion.experiments import language_zoo as lz
from companion.experiments.language_report import split_half
from companion.pilots.common import write_json_report


@dataclass(frozen=True)
class PilotSettings:
    zoo_dir: str               # the pilot zoo (other seeds than the main zoo)
    base_seed: int             # its first fine-tuning seed, checked against zoo.json
    batch_size: int
    n_half: int                # batches per half (A, B): at most n_half · batch_size pairs per half
    data_seed: int
    seed: int
    workers: int
    threads: int
    radius_iters: int          # Auto-PGD iterations of the radius scan
    protocol_half: int         # batches per half of the iteration scan (the first of each half, <= n_half)
    rho_grid: dict[str, list[float]]   # per measure of zoo.STANDARD, fixed before the pilot
    n_iters: list[int]         # iteration counts of the protocol scan (radius_iters among them)
    pairs: list[int]           # pairs per half reported (multiples of batch_size)
    target: float              # retest (Kendall τ) every measure must reach
    max_train_error: float     # fit rule: members above it did not fit (reported, kept)
    gap_splits: int            # random halves of the dev set for the gap reliability
    power_alpha: float         # two-sided level of the Kendall test
    power_n_sim: int
    power_members: list[int]   # zoo sizes at which power is computed
    max_batches_per_half: int  # pre-registration: the training split bounds the pairs (2 halves x batches x batch_size)
    exploratory_runs: int      # budget: exploratory (measure, rho) runs per member at 1 batch x 5 iterations


# --------------------------------------------------------------------------- measuring


def measure(s: PilotSettings, rho: dict[str, list[float]], n_iters: int, half: int) -> pd.DataFrame:
    """Per-batch values of every standard measure at the radii ``rho`` on the first ``half`` batches
    of each half (A: batches 0…, B: batches n_half…; all 2·n_half when ``half == n_half``).

    Kept in ``zoo_dir/pilot/`` (one pickle per call, named by its arguments) and read back when
    present, so an interrupted pilot resumes and the report can be regenerated without measuring."""
    cache = Path(s.zoo_dir) / "pilot" / (f"i{n_iters}_b{s.n_half}x{s.batch_size}_d{s.data_seed}_s{s.seed}_"
                                         + "_".join(f"{k}{'-'.join(f'{r:g}' for r in v)}" for k, v in rho.items())
                                         + ("" if half == s.n_half else f"_h{half}") + ".pkl")
    if cache.is_file():
        return pd.read_pickle(cache)
    frame = _measure(s, rho, n_iters, half)
    cache.parent.mkdir(exist_ok=True)
    frame.to_pickle(cache)
    return frame


def _measure(s: PilotSettings, rho: dict[str, list[float]], n_iters: int, half: int) -> pd.DataFrame:
    from companion.experiments.zoo import STANDARD, measure_zoo

    zoo = lz.load_zoo(s.zoo_dir)
    every = lz.sharpness_batches(s.zoo_dir, 2 * s.n_half * s.batch_size, s.batch_size, s.data_seed)
    batches = every[:half] + every[s.n_half:s.n_half + half]
    loaders = lz.model_loaders(s.zoo_dir, [m["name"] for m in zoo["models"]], "cpu")
    measures = {name: {"measure": m} for name, m in STANDARD.items() if name in rho}
    frame = measure_zoo(loaders, batches, measures, rho, seed=s.seed, n_iters=n_iters,
                        progress=True, workers=s.workers)
    return frame.assign(n_iters=n_iters)


def _values(frame: pd.DataFrame) -> np.ndarray:
    """``members x batches`` per-batch values of one (measure, rho, n_iters) group."""
    return np.array([list(pb) for pb in frame["per_batch"]], dtype=float)


def retest_table(frame: pd.DataFrame, s: PilotSettings, fitted: Sequence[str]) -> pd.DataFrame:
    """One row per (measure, rho, n_iters, pairs per half): :func:`companion.analysis.batch_retest` over the
    ``fitted`` members (a member that did not fit its training set sits apart from the others on every batch and
    would inflate both), and the direct retest over all members (``retest_all``)."""
    rows = []
    for (measure, rho, n_iters), g_all in frame.groupby(["measure", "rho", "n_iters"], sort=False):
        v_all = _values(g_all)
        g = g_all[g_all["model"].isin(list(fitted))]
        v = _values(g)
        h = v.shape[1] // 2    # batches per half of this measurement
        for pairs in (p for p in s.pairs if p // s.batch_size <= h):
            k = pairs // s.batch_size
            a_all, b_all = v_all[:, :k].mean(1), v_all[:, h:h + k].mean(1)
            rows.append(dict(measure=measure, rho=float(rho), n_iters=int(n_iters), pairs=pairs,
                             **analysis.batch_retest(v, k, target=s.target),
                             retest_all=float(stats.kendalltau(a_all, b_all).statistic),
                             grad_evals=2 * k * int(n_iters),
                             seconds_per_batch_iter=float(g["seconds"].sum() / (v.size * n_iters))))
    return pd.DataFrame(rows)


def base_loss_retest(frame: pd.DataFrame, s: PilotSettings, fitted: Sequence[str]) -> dict:
    """The same analysis for the unperturbed loss of each batch (what sharpness adds to), fitted
    members: does the member x batch noise already sit in the loss itself?"""
    g = frame[(frame["measure"] == frame["measure"].iloc[0]) & (frame["rho"] == frame["rho"].iloc[0])
              & frame["model"].isin(list(fitted))]
    v = np.array([list(b) for b in g["base_loss"]], dtype=float)
    s_m, s_e = analysis.variance_components(v)
    k = max(s.pairs) // s.batch_size
    a, b = v[:, :k].mean(1), v[:, s.n_half:s.n_half + k].mean(1)
    return {"retest": float(stats.kendalltau(a, b).statistic), "retest_vc": analysis.component_retest(s_m, s_e, k),
            "retest_vc_one_batch": analysis.component_retest(s_m, s_e, 1),
            "noise_ratio": s_e / s_m if s_m > 0 else math.inf, "pairs": max(s.pairs)}


def choose_rho(table: pd.DataFrame, s: PilotSettings) -> dict[str, float]:
    """Each measure's radius with the highest variance-component retest of the largest protocol
    of the radius scan (ties: the smaller radius). No generalisation gap is read."""
    sub = table[(table["n_iters"] == s.radius_iters) & (table["pairs"] == max(s.pairs))]
    out = {}
    for measure, g in sub.groupby("measure", sort=False):
        g = g.sort_values(["retest_vc", "rho"], ascending=[False, True])
        out[measure] = float(g["rho"].iloc[0])
    return out


def smallest_protocol(table: pd.DataFrame, rho: dict[str, float], target: float) -> dict | None:
    """The (pairs per half, n_iters) of fewest gradient evaluations whose variance-component
    retest reaches ``target`` for every measure at its chosen rho; None when none does."""
    at = table[[rho[m] == r for m, r in zip(table["measure"], table["rho"])]]
    ok = at.groupby(["pairs", "n_iters"])["retest_vc"].min()
    ok = ok[ok >= target]
    if ok.empty:
        return None
    best = min(ok.index, key=lambda pi: (2 * pi[0] * pi[1], pi[1]))
    return {"pairs": int(best[0]), "n_iters": int(best[1])}


# --------------------------------------------------------------------------- the gap and power


def dev_errors(zoo_dir: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Per-example dev errors ``[members, pairs]`` (0/1) and train errors ``[members]`` of a zoo."""
    zoo = lz.load_zoo(zoo_dir)
    errors = lz.source(zoo_dir).eval_errors([m["name"] for m in zoo["models"]])
    return errors, np.array([m["train_error"] for m in zoo["models"]])


# --------------------------------------------------------------------------- the pilot


def run(s: PilotSettings) -> dict:
    """The radius scan, the protocol scan, the gap reliability and the power: the report's content."""
    zoo = lz.load_zoo(s.zoo_dir)
    seeds = [m["seed"] for m in zoo["models"]]
    if min(seeds) != s.base_seed:
        raise ValueError(f"{s.zoo_dir} starts at seed {min(seeds)}, the pilot section says {s.base_seed}")
    t0 = time.perf_counter()
    scan = measure(s, s.rho_grid, s.radius_iters, s.n_half)
    t_scan = time.perf_counter() - t0
    fitted = [m["name"] for m in zoo["models"] if m["train_error"] <= s.max_train_error]
    table = retest_table(scan, s, fitted)
    rho = choose_rho(table, s)
    frames, seconds = [scan], {"radius_scan": t_scan}
    for n_iters in (i for i in s.n_iters if i != s.radius_iters):
        t0 = time.perf_counter()
        frames.append(measure(s, {k: [v] for k, v in rho.items()}, n_iters, s.protocol_half))
        seconds[f"n_iters={n_iters}"] = time.perf_counter() - t0
    table = retest_table(pd.concat(frames, ignore_index=True), s, fitted)
    test_err, train_err = dev_errors(s.zoo_dir)
    fit = train_err <= s.max_train_error
    rel = {"all": split_half(test_err, train_err, s), "fitted": split_half(test_err[fit], train_err[fit], s)}
    protocol = smallest_protocol(table, rho, s.target)
    return {"extrapolated": extrapolated_protocols(table, rho, s),"settings": asdict(s), "n_members": len(seeds), "seeds": seeds, "n_fitted": len(fitted),
            "train_error": train_err.tolist(), "n_dev": int(test_err.shape[1]),
            "rho": rho, "protocol": protocol, "gap_reliability": rel, "base_loss": base_loss_retest(scan, s, fitted),
            "power": power_table(rel["all"], s),
            "retest": table.to_dict("records"), "seconds": seconds}


def power_table(rel_y: float, s: PilotSettings) -> list[dict]:
    """Power against zoo size at the paper's τ, for a protocol whose retest is the target (the one
    the pre-registration asks for) and the measured gap reliability ``rel_y``."""
    rows = []
    for measure, tau in lz.PAPER_TAU.items():
        for n in s.power_members:
            rows.append(dict(measure=measure, paper_tau=tau, retest=s.target, gap_reliability=rel_y, n=n,
                             power=analysis.power(n, tau, s.target, rel_y, alpha=s.power_alpha,
                                                  n_sim=s.power_n_sim, seed=s.seed)))
    return rows


def extrapolated_protocols(table: pd.DataFrame, rho: dict[str, float], s: PilotSettings) -> list[dict]:
    """Per iteration count: the batches per half every measure needs (at its chosen rho) for a
    variance-component retest of ``target`` (Spearman–Brown from the members x batches table), the
    pairs and gradient evaluations per measurement that makes."""
    at = table[[rho[m] == r for m, r in zip(table["measure"], table["rho"])]]
    rows = []
    for n_iters, g in at.groupby("n_iters"):
        k = int(math.ceil(g.groupby("measure")["batches_for_target"].first().max()))
        rows.append(dict(n_iters=int(n_iters), batches_per_half=k, pairs_per_half=k * s.batch_size,
                         grad_evals=2 * k * int(n_iters)))
    return rows


def budget(protocol: dict, n_models: int, exploratory_runs: int, reference: dict, stability: dict | None) -> dict:
    """Wall-time estimate (2 cores, 2 one-thread workers) of language_train + language (+ language_stability)
    for ``n_models`` members and ``protocol`` (``batches_per_half``, ``n_iters``), scaled by pass count from a
    reference run's measured times (``reports/metrics/language.json`` of the former protocol: ``seconds``,
    ``protocol``). ``exploratory_runs``: (measure, rho) runs per member at 1 batch x 5 iterations."""
    ref_p, ref_s = reference["protocol"], reference["seconds"]
    ref_runs = sum(len(g) for g in ref_p["rho_grid"].values())
    per_pass = ref_s["sharpness"]["main"] / (ref_p["n_models"] * ref_runs * ref_p["n_batches"] * ref_p["n_iters"])
    out = {"seconds_per_batch_iteration": per_pass,
           "train": ref_s["zoo_training"] / ref_p["n_models"] * n_models,
           "primary": per_pass * n_models * 3 * 2 * protocol["batches_per_half"] * protocol["n_iters"],
           "exploratory": per_pass * n_models * exploratory_runs * 5}
    out["language_train_and_language"] = out["train"] + out["primary"] + out["exploratory"]
    seconds = stability_seconds(stability)
    if seconds is not None:
        out["language_stability"] = seconds
    return out


def stability_seconds(stability: dict | None) -> float | None:
    """Wall time of a ``language_stability`` run from its timings file (``reports/timings/language_stability.json``);
    None when it did not run (no file, or a profile that skips it: ``n_zoos: 0``, said by its metrics file)."""
    if stability is None or "skipped" in stability:
        return None
    return sum(v["train"] + v["measure"] for v in stability["seconds"].values())


def largest_protocol(report: dict, batches_per_half: int) -> dict:
    """``batches_per_half`` batches per half at the iteration count whose worst measure has the highest
    variance-component retest there (ties: fewer iterations), with each measure's predicted retest."""
    t = pd.DataFrame(report["retest"])
    at = t[[report["rho"][m] == r for m, r in zip(t["measure"], t["rho"])]]
    best = None
    for n_iters, g in at.groupby("n_iters"):
        comp = g.groupby("measure")[["s_member", "s_resid"]].first()
        pred = {m: analysis.component_retest(r.s_member, r.s_resid, batches_per_half) for m, r in comp.iterrows()}
        if best is None or min(pred.values()) > min(best["predicted_retest"].values()):
            best = {"n_iters": int(n_iters), "batches_per_half": batches_per_half,
                    "pairs_per_half": batches_per_half * int(report["settings"]["batch_size"]),
                    "grad_evals": 2 * batches_per_half * int(n_iters), "predicted_retest": pred,
                    "reaches_target": False}
    return best


def preregistration(report: dict, reference: dict, stability: dict | None, s: PilotSettings) -> dict:
    """The rules fixed before the pilot was read, applied to it: the extrapolated protocol of fewest
    gradient evaluations with at most ``max_batches_per_half`` batches per half (the training split
    bounds the pairs), the smallest zoo size whose power at the paper's geodesic τ reaches 0.8 (even,
    for the two workers; the largest computed when none does), and the budget that makes."""
    ok = [e for e in report["extrapolated"] if e["batches_per_half"] <= s.max_batches_per_half]
    protocol = min(ok, key=lambda e: (e["grad_evals"], -e["n_iters"])) if ok else None
    rows = report["power"]
    if protocol is None:   # rules added after the pilot was read: the largest protocol the split allows, and
        protocol = largest_protocol(report, s.max_batches_per_half)   # the power at its predicted retest
        rel_y = report["gap_reliability"]["all"]
        rows = [dict(measure=m, paper_tau=tau, retest=protocol["predicted_retest"][m], gap_reliability=rel_y, n=n,
                     power=analysis.power(n, tau, protocol["predicted_retest"][m], rel_y, alpha=s.power_alpha,
                                 n_sim=s.power_n_sim, seed=s.seed))
                for m, tau in lz.PAPER_TAU.items() for n in s.power_members]
    power_ = pd.DataFrame(rows).pivot(index="n", columns="measure", values="power")
    enough = power_[(power_["geodesic_invariant"] >= 0.8) & (power_["geodesic_mixed"] >= 0.8)].index
    n_models = int(enough.min() if len(enough) else power_.index.max())
    n_models += n_models % 2
    return {"rho": report["rho"], "protocol": protocol, "n_models": n_models, "power": rows,
            "power_at_n_models": power_.loc[power_.index >= n_models].iloc[0].to_dict(),
            "budget_seconds": budget(protocol, n_models, s.exploratory_runs, reference, stability)}


def markdown(report: dict) -> str:
    """The pilot report in words and tables, generated from ``report``."""
    t = pd.DataFrame(report["retest"])
    rho = report["rho"]
    lines = ["# Language pilot: test–retest of the sharpness protocol (generated)", "",
             f"{report['n_members']} pilot members (seeds {min(report['seeds'])}–{max(report['seeds'])}, not in "
             f"the main zoo; {report['n_fitted']} fitted), dev set of {report['n_dev']} pairs.", "",
             "## Radius scan (retest at the largest pairs per half)", "",
             "Retest over the fitted members; the direct retest over all members beside it.", "",
             "| measure | rho | retest (one split) | retest (all splits) | retest (variance comp.) | s_resid / s_member "
             "| retest, all members |", "|---|---|---|---|---|---|---|"]
    s = report["settings"]
    scan = t[(t["n_iters"] == s["radius_iters"]) & (t["pairs"] == max(s["pairs"]))]
    for r in scan.itertuples():
        mark = " (chosen)" if rho[r.measure] == r.rho else ""
        lines.append(f"| {r.measure} | {r.rho:g}{mark} | {r.retest:.2f} | {r.retest_splits:.2f} | {r.retest_vc:.2f} "
                     f"| {r.noise_ratio:.2f} "
                     f"| {r.retest_all:.2f} |")
    lines += ["", "## Retest against pairs per half × iterations (at the chosen rho; one split / mean over all "
              "disjoint splits / variance components)", "",
              "| measure | iterations | " + " | ".join(f"{p} pairs" for p in s["pairs"]) + " | batches for target |",
              "|---|---|" + "---|" * (len(s["pairs"]) + 1)]
    at = t[[rho[m] == r for m, r in zip(t["measure"], t["rho"])]]
    for (measure, n_iters), g in at.groupby(["measure", "n_iters"], sort=False):
        by = {r.pairs: f"{r.retest:.2f} / {r.retest_splits:.2f} / {r.retest_vc:.2f}" for r in g.itertuples()}
        cells = " | ".join(by[p] if p in by else "–" for p in s["pairs"])
        lines.append(f"| {measure} | {n_iters} | {cells} | {g['batches_for_target'].iloc[0]:.1f} |")
    p = report["protocol"]
    lines += ["", "Chosen protocol: " + ("none of the pilot's reaches the target" if p is None else
              f"{p['pairs']} pairs per half ({2 * p['pairs']} in all) × {p['n_iters']} iterations") + ".",
              "", "Batches per half for the target (variance components, Spearman–Brown): " + "; ".join(
                  f"{e['n_iters']} iterations: {e['batches_per_half']} ({e['pairs_per_half']} pairs per half, "
                  f"{e['grad_evals']} gradient evaluations per measurement)" for e in report["extrapolated"]) + ".",
              "", "Unperturbed training loss of the same batches, {pairs} pairs per half: retest {retest:.2f} "
              "(variance comp. {retest_vc:.2f}; one batch {retest_vc_one_batch:.2f}; s_resid / s_member "
              "{noise_ratio:.2f}).".format(**report["base_loss"]),
              "", f"Gap reliability (split halves, Spearman–Brown): all members "
              f"{report['gap_reliability']['all']:.2f}, fitted {report['gap_reliability']['fitted']:.2f}.", "",
              "## Power (two-sided Kendall test) against members, at retest = target", "", "| measure | paper tau | retest | "
              + " | ".join(f"n={n}" for n in s["power_members"]) + " |", "|---|---|---|" + "---|" * len(s["power_members"])]
    pw = pd.DataFrame(report["power"])
    for measure, g in pw.groupby("measure", sort=False):
        lines.append(f"| {measure} | {g['paper_tau'].iloc[0]:g} | {g['retest'].iloc[0]:.2f} | "
                     + " | ".join(f"{v:.2f}" for v in g["power"]) + " |")
    if "preregistration" in report:
        lines += _preregistration_lines(report["preregistration"])
    return "\n".join(lines) + "\n"


def _preregistration_lines(pre: dict) -> list[str]:
    p, b = pre["protocol"], pre.get("budget_seconds")
    lines = ["", "## Pre-registration (the rules applied to the numbers above)", "",
             "rho: " + ", ".join(f"{k} {v:g}" for k, v in pre["rho"].items()) + "."]
    if p is None:
        return lines + ["No protocol within the training split reaches the target."]
    lines.append(f"Protocol: {p['batches_per_half']} batches of 128 per half ({2 * p['pairs_per_half']} pairs in all) "
                 f"x {p['n_iters']} iterations, {p['grad_evals']} gradient evaluations per measurement; "
                 f"members: {pre['n_models']}.")
    if "predicted_retest" in p:
        lines.append("No protocol within the training split reaches the target; the largest it allows is registered, "
                     "with predicted retest " + ", ".join(f"{m} {v:.2f}" for m, v in p["predicted_retest"].items())
                     + " (variance components); power at those retests: " + "; ".join(
                         f"{m} {v:.2f}" for m, v in pre["power_at_n_models"].items()) + f" with {pre['n_models']} members.")
    if b is not None:
        lines.append(f"Estimated wall time on 2 cores, scaled by pass count from the former cpu run: training "
                     f"{b['train'] / 60:.0f} min, primary sharpness {b['primary'] / 60:.0f} min, exploratory "
                     f"{b['exploratory'] / 60:.0f} min (language_train + language {b['language_train_and_language'] / 60:.0f}"
                     f" min)" + (f"; language_stability {b['language_stability'] / 60:.0f} min" if "language_stability" in b
                                 else "") + ".")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    from companion.params import settings

    ap = argparse.ArgumentParser(prog="python -m companion.pilots.language",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="reports/pilots/language.json")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--preregister", action="store_true",
                    help="apply the pre-registration rules to the existing report (--out) and rewrite it")
    args = ap.parse_args(argv)
    s = settings(PilotSettings, "language_pilot", args.profile, args.set)
    out = Path(args.out)
    if args.preregister:
        report = json.loads(out.read_text())
        zoo = lz.load_zoo(s.zoo_dir)
        fitted = [m["name"] for m in zoo["models"] if m["train_error"] <= s.max_train_error]
        frames = [measure(s, s.rho_grid, s.radius_iters, s.n_half)] + [
            measure(s, {k: [v] for k, v in report["rho"].items()}, n, s.protocol_half)
            for n in s.n_iters if n != s.radius_iters]
        report["retest"] = retest_table(pd.concat(frames, ignore_index=True), s, fitted).to_dict("records")
        metrics = Path("reports/metrics")
        stability = json.loads((metrics / "language_stability.json").read_text())
        timings = Path("reports/timings/language_stability.json")   # its times: git, not the DVC output
        if "skipped" not in stability:
            stability = json.loads(timings.read_text()) if timings.is_file() else None
        report["preregistration"] = preregistration(
            report, json.loads((metrics / "language.json").read_text()), stability, s)
        write_json_report(out, report, markdown, echo=_preregistration_lines(report["preregistration"]))
        return 0
    import torch

    torch.set_num_threads(s.threads)
    write_json_report(out, run(s), markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
