"""Exploratory: the language zoo's test–retest against the number of batches per half (issue 16 item 3).

The primary language row measures each member on ``2·h`` batches of ``batch_size`` training pairs and
reports the test–retest τ between the means over the first ``h`` and the last ``h`` batches (the
pre-registered halves, ``reports/data/language/primary.csv``, column ``retest``). From the same
per-batch values (``reports/data/language/sharpness.csv``, column ``per_batch``; nothing is measured
again, no primary number changes) this stage shows how the retest grows with the data:

* for each ``k`` of ``batches``: τ between the members' means over ``k`` batches of the first half and
  over ``k`` of the second (:func:`companion.analysis.retest_by_subsets`: the mean over ``n_draws``
  seeded random choices; ``k = h`` is the pre-registered retest itself, which the stage checks);
* the Spearman–Brown curve through the ``k = h`` value (Pearson scale ``r = sin(πτ/2)``,
  :func:`companion.analysis.spearman_brown`), beside the measured points, so a reader sees whether
  the batches behave as parallel measurements;
* the retest of the halves by the pre-registered split rule of issue 24 (``params.yaml`` ``paired.retest_splits``):
  the mean over random splits of all the batches into two halves (:func:`random_splits`), beside the
  first/last split, and the reliability of the mean of both halves from it (``retest_random_splits.csv``);
* the batches per half at which the curve reaches ``target``
  (:func:`companion.analysis.spearman_brown_factor`), the training pairs per member that makes (two
  halves), and the pairs the corpus's training split holds (``language_train``'s ``corpus.n_train``).

Command line (DVC stage ``language_retest``)::

    python -m companion.experiments.language_retest [--profile P]

reads ``params.yaml`` section ``language_retest`` (``batches``, ``n_draws``, ``seed``, ``target``) and,
of the same profile, ``language``'s ``batch_size`` and ``n_points`` and ``language_train``'s
``corpus.n_train`` into :class:`RetestSettings`; writes ``reports/data/language_retest/retest_by_batches.csv``
(and its wide form for ``dvc plots``, ``plot_retest_by_batches.csv``),
``reports/figures/language_retest/retest_by_batches.png`` and ``reports/metrics/language_retest.json``.
(Its own folders: ``reports/data/language/`` is the ``language`` stage's output, replaced whole.)
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from companion import analysis
from companion.metrics import write_json
from companion.params import from_mapping, stage_params


@dataclass(frozen=True)
class RetestSettings:
    """``params.yaml`` ``language_retest`` plus the three keys it reads from the zoo's sections."""

    batches: list[int]         # batches per half at which the retest is measured (the largest: all of a half)
    n_draws: int               # random choices of the batches per k below a whole half
    seed: int
    target: float              # the retest the extrapolation aims at (the issue's 0.8)
    batch_size: int            # language.batch_size: training pairs per batch
    n_points: int              # language.n_points: training pairs per member, both halves
    n_train: int | None        # language_train.corpus.n_train (None: a zoo without a generated corpus)
    split_n_splits: int        # paired.retest_splits: the pre-registered split rule (issue 24), random splits
    split_seed: int            #   of all the batches into two halves, and their seed


def load_settings(profile: str | None = None, path: str | Path | None = None) -> tuple[str, RetestSettings]:
    """``(profile, settings)`` from ``params.yaml``: every key required, the zoo's keys of the same profile."""
    profile, own = stage_params("language_retest", profile, path=path)
    _, lang = stage_params("language", profile, path=path)
    _, train = stage_params("language_train", profile, path=path)
    _, pair = stage_params("paired", profile, path=path)
    data = {**own, "batch_size": lang["batch_size"], "n_points": lang["n_points"],
            "n_train": train["corpus"]["n_train"] if "corpus" in train else None,
            "split_n_splits": pair["retest_splits"]["n_splits"], "split_seed": pair["retest_splits"]["seed"]}
    return profile, from_mapping(RetestSettings, data, f"params.yaml language_retest ({profile}) with "
                                                       "language.batch_size, language.n_points, "
                                                       "language_train.corpus.n_train, paired.retest_splits")


def halves(frame: pd.DataFrame, s: RetestSettings) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per measure, the members' per-batch values on the first and on the second half (``[members, h]``),
    members in the frame's order. Refuses values whose batch count is not ``n_points / batch_size``."""
    out = {}
    for measure, g in frame.groupby("measure", sort=False):
        v = np.array([json.loads(p) if isinstance(p, str) else list(p) for p in g["per_batch"]], dtype=float)
        if v.shape[1] * s.batch_size != s.n_points or v.shape[1] % 2:
            raise ValueError(f"{measure}: {v.shape[1]} batches per member, but language.n_points / batch_size = "
                             f"{s.n_points} / {s.batch_size}: the sharpness table is not this profile's zoo")
        out[measure] = (v[:, :v.shape[1] // 2], v[:, v.shape[1] // 2:])
    return out


def curve(frame: pd.DataFrame, primary: pd.DataFrame, s: RetestSettings) -> pd.DataFrame:
    """One row per (measure, k): the measured retest (mean and sd over the draws) and the
    Spearman–Brown prediction through the whole-half value. Refuses a whole-half retest that differs
    from ``primary``'s ``retest`` (then these are not the pre-registered halves)."""
    rows = []
    prim = primary.set_index("measure")
    for measure, (first, second) in halves(frame, s).items():
        h = first.shape[1]
        ks = sorted({*s.batches, h})
        t = analysis.retest_by_subsets(first, second, ks, n_draws=s.n_draws, seed=s.seed)
        whole = float(t.loc[t["k"] == h, "tau"].iloc[0])
        if measure in prim.index and not math.isclose(whole, float(prim.loc[measure, "retest"]), abs_tol=1e-12):
            raise ValueError(f"{measure}: retest of the whole halves {whole} differs from primary.csv's "
                             f"{prim.loc[measure, 'retest']}: not the pre-registered halves")
        known = measure in prim.index
        rows.append(t.assign(measure=measure, label=prim.loc[measure, "label"] if known else measure,
                             retest_ci_low=float(prim.loc[measure, "retest_ci_low"]) if known else math.nan,
                             retest_ci_high=float(prim.loc[measure, "retest_ci_high"]) if known else math.nan,
                             rho=float(frame.loc[frame["measure"] == measure, "rho"].iloc[0]),
                             pairs_per_half=t["k"] * s.batch_size,
                             spearman_brown=[analysis.spearman_brown(whole, k / h) for k in t["k"]]))
    cols = ["measure", "label", "rho", "k", "pairs_per_half", "tau", "tau_sd", "n_draws", "spearman_brown",
            "retest_ci_low", "retest_ci_high"]
    return pd.concat(rows, ignore_index=True)[cols].rename(columns={"k": "batches_per_half"})


def random_splits(frame: pd.DataFrame, primary: pd.DataFrame, s: RetestSettings) -> pd.DataFrame:
    """The retest of the halves by the pre-registered split rule (reports/preregistration/delta_tau.md): the mean
    (and sd) over ``split_n_splits`` random splits of all the batches into two halves
    (:func:`companion.analysis.random_split_retest`), beside the first/last split ``primary.csv`` reports, and the
    reliability of the mean of both halves from each (Spearman–Brown, k = 2)."""
    prim = primary.set_index("measure")
    rows = []
    for measure, (first, second) in halves(frame, s).items():
        mean, sd = analysis.random_split_retest(np.hstack([first, second]), n_splits=s.split_n_splits,
                                                seed=s.split_seed)
        fl = float(prim.loc[measure, "retest"]) if measure in prim.index else math.nan
        rows.append(dict(measure=measure, batches=first.shape[1] + second.shape[1], retest_first_last=fl,
                         reliability_first_last=analysis.spearman_brown(fl, 2), retest_random_splits=mean,
                         retest_random_splits_sd=sd, reliability_random_splits=analysis.spearman_brown(mean, 2),
                         n_splits=s.split_n_splits, seed=s.split_seed))
    return pd.DataFrame(rows)


def batches_for(retest: float, h: int, target: float) -> int | None:
    """Batches per half (whole, rounded up) at which the Spearman–Brown curve through a retest of
    ``retest`` at ``h`` batches per half reaches ``target``; None without signal (retest ≤ 0)."""
    need = h * analysis.spearman_brown_factor(retest, target)
    return math.ceil(need - 1e-9) if math.isfinite(need) else None


def summary(table: pd.DataFrame, s: RetestSettings, splits: pd.DataFrame | None = None) -> dict:
    """The metrics: per measure the whole-half retest, the reliability of the mean of both halves, the
    batches per half (and training pairs per member) the target needs, also at the ends of the retest's
    bootstrap interval, the measured retest nearest below a whole half against the curve, and the
    findings in words."""
    per = {}
    for measure, g in table.groupby("measure", sort=False):
        h = int(g["batches_per_half"].max())
        at = g.set_index("batches_per_half")
        whole, near = float(at.loc[h, "tau"]), at.loc[at.index[at.index < h].max()] if (at.index < h).any() else None
        batches = batches_for(whole, h, s.target)
        per[measure] = {
            "label": str(g["label"].iloc[0]), "rho": float(g["rho"].iloc[0]), "batches_per_half": h,
            "retest": whole, "reliability_of_mean": analysis.spearman_brown(whole, 2),
            "batches_per_half_for_target": batches,
            "pairs_per_member_for_target": None if batches is None else 2 * batches * s.batch_size,
            # the retest's 95 % bootstrap interval over members (primary.csv), high end first: fewer batches
            "batches_per_half_for_target_interval": [batches_for(float(at.loc[h, c]), h, s.target)
                                                     for c in ("retest_ci_high", "retest_ci_low")
                                                     if math.isfinite(at.loc[h, c])],
            "below_whole": None if near is None else {
                "batches_per_half": int(near.name), "measured": float(near["tau"]), "sd": float(near["tau_sd"]),
                "spearman_brown": float(near["spearman_brown"])}}
    if splits is not None:
        for r in splits.itertuples():
            per[r.measure] |= {"retest_random_splits": r.retest_random_splits,
                               "retest_random_splits_sd": r.retest_random_splits_sd,
                               "reliability_of_mean_random_splits": r.reliability_random_splits,
                               "n_splits": r.n_splits}
    return {"exploratory": True, "settings": asdict(s), "target": s.target, "batch_size": s.batch_size,
            "training_pairs_available": s.n_train, "measures": per, "findings": findings(per, s)}


def findings(per: dict, s: RetestSettings) -> list[str]:
    """Sentences generated from :func:`summary`'s per-measure numbers."""
    lines = []
    for m, r in per.items():
        need = ("never (no signal)" if r["batches_per_half_for_target"] is None else
                f"about {r['batches_per_half_for_target']} batches of {s.batch_size} per half "
                f"({r['pairs_per_member_for_target']} training pairs per member)")
        iv = r["batches_per_half_for_target_interval"]
        line = (f"{r['label']} (ρ = {r['rho']:g}): retest {r['retest']:.2f} at {r['batches_per_half']} batches per "
                f"half (mean of both halves {r['reliability_of_mean']:.2f}); a retest of {s.target:g} would need {need}"
                + (f", {iv[0]}–{iv[1]} batches over the retest's 95 % interval" if len(iv) == 2 and None not in iv
                   else "") + ".")
        b = r["below_whole"]
        if b is not None:
            shape = ("above the curve: the retest grew more slowly than Spearman–Brown assumes, so the extrapolation "
                     "is likely optimistic" if b["measured"] > b["spearman_brown"] else
                     "below the curve: the retest grew at least as fast as Spearman–Brown assumes")
            line += (f" At {b['batches_per_half']} batches per half it measured {b['measured']:.2f} (sd over choices "
                     f"of batches {b['sd']:.2f}) against {b['spearman_brown']:.2f} on the curve, {shape}.")
        if "retest_random_splits" in r:
            line += (f" Over {r['n_splits']} random splits of all its batches into two halves (the pre-registered "
                     f"rule) the retest is {r['retest_random_splits']:.2f} (sd {r['retest_random_splits_sd']:.2f}), "
                     f"the mean of both halves {r['reliability_of_mean_random_splits']:.2f}.")
        lines.append(line)
    if s.n_train is not None:
        lines.append(f"The corpus's training split holds {s.n_train} pairs per member.")
    return lines


def figure(table: pd.DataFrame, metrics: dict, path: Path) -> None:
    """Measured retest (mean ± sd over draws) and the Spearman–Brown curve against batches per half,
    the target line, and the batches the training split allows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    top = max([int(table["batches_per_half"].max())] + [r["batches_per_half_for_target"] or 0
                                                         for r in metrics["measures"].values()])
    ks = np.geomspace(1, top * 1.2, 200)
    for (measure, g), color in zip(table.groupby("measure", sort=False), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        r = metrics["measures"][measure]
        h = r["batches_per_half"]
        ax.errorbar(g["batches_per_half"], g["tau"], yerr=g["tau_sd"], fmt="o", color=color, capsize=3,
                    label=f"{r['label']} (ρ = {r['rho']:g}), measured")
        ax.plot(ks, [analysis.spearman_brown(r["retest"], k / h) for k in ks], color=color, ls="--", lw=1)
        if r["batches_per_half_for_target"]:
            ax.plot([r["batches_per_half_for_target"]], [metrics["target"]], marker="x", ms=9, color=color)
            ax.annotate(str(r["batches_per_half_for_target"]), (r["batches_per_half_for_target"], metrics["target"]),
                        textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8, color=color)
    ax.axhline(metrics["target"], color="black", lw=1, label=f"target retest {metrics['target']:g}")
    if metrics["training_pairs_available"]:
        ax.axvline(metrics["training_pairs_available"] / (2 * metrics["batch_size"]), color="grey", ls=":",
                   label="all training pairs (two halves)")
    ax.set_xscale("log")
    ticks = [k for k in sorted({1, 2, 4, 8, 32, 64, 128, 256, *map(int, table["batches_per_half"])}) if k <= top * 1.2]
    ax.set_xticks(ticks, [str(k) for k in ticks])
    ax.minorticks_off()
    ax.set(xlabel=f"batches of {metrics['batch_size']} training pairs per half",
           ylabel="test–retest Kendall τ (two disjoint halves)", ylim=(0, 1),
           title="Language zoo (exploratory): sharpness retest against batches per half\n"
                 "points: measured (mean ± sd over draws); dashed: Spearman–Brown through the whole halves")
    ax.legend(fontsize=7, loc="lower right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m companion.experiments.language_retest",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--sharpness", default="reports/data/language/sharpness.csv")
    ap.add_argument("--primary", default="reports/data/language/primary.csv")
    ap.add_argument("--data", default="reports/data/language_retest/retest_by_batches.csv")
    ap.add_argument("--figure", default="reports/figures/language_retest/retest_by_batches.png")
    ap.add_argument("--metrics", default="reports/metrics/language_retest.json")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--params", default=None)
    args = ap.parse_args(argv)
    import time

    t0 = time.perf_counter()
    profile, s = load_settings(args.profile, args.params)
    frame, primary = pd.read_csv(args.sharpness), pd.read_csv(args.primary)
    table = curve(frame, primary, s)
    splits = random_splits(frame, primary, s)
    metrics = {"profile": profile, **summary(table, s, splits)}
    Path(args.data).parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.data, index=False)
    splits.to_csv(Path(args.data).with_name("retest_random_splits.csv"), index=False)
    wide = table.pivot(index="batches_per_half", columns="measure", values="tau").reset_index()   # dvc.yaml plots
    wide.columns.name = None
    wide.to_csv(Path(args.data).with_name("plot_retest_by_batches.csv"), index=False)
    figure(table, metrics, Path(args.figure))
    write_json(args.metrics, metrics)
    timings = Path(args.metrics).parent.parent / "timings" / "language_retest.json"   # git only (companion.budget)
    timings.parent.mkdir(parents=True, exist_ok=True)
    timings.write_text(json.dumps({"stage_wall_s": round(time.perf_counter() - t0, 1)}, indent=1) + "\n")
    print("\n".join(metrics["findings"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
