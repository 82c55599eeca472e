"""The ``vision`` stage without its plots: what ``notebooks/vision.ipynb`` shows.

:func:`run_report` measures every member of the vision zoo and writes every output of the
stage: ``metrics/vision.json`` (layout: :mod:`companion.metrics`), ``data/*.csv`` and the
findings text. The notebook only plots what it returns.

**Primary comparison** (pre-registered in ``params.yaml`` from the pilot,
``reports/pilots/vision.md``): Kendall τ between each of the paper's three measures, each at
its pre-registered radius ``rho``, and the gap (test error − train error) over **all**
members, on the first ``n_images`` training images (the paper's 2048 in batches of 256, 20
Auto-PGD iterations). Beside it: the gap's reliability (split halves of the shared test set,
Spearman–Brown, :func:`companion.analysis.gap_reliability`), each measure's test–retest (τ
between its values on the first and on a second, disjoint set of ``n_images`` training
images), the ceiling on |τ| these imply and the power at the paper's τ
(:mod:`companion.analysis`). Everything else (τ against ρ, between measures, against the
hyperparameters, train and test error separately) is **exploratory**.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from companion import analysis, paper
from companion.experiments import vision_zoo as vz
from hideseek import Measure

STAGE = "vision"
#: Hyperparameters whose Kendall τ with the gap the report shows (exploratory).
HP_COLUMNS = ("lr", "weight_decay", "epochs", "batch_size", "label_smoothing", "shift", "noise_std", "mixup_alpha")


@dataclass(frozen=True)
class PowerSettings:
    alpha: float
    n_sim: int
    seed: int


@dataclass(frozen=True)
class VisionSettings:
    """The ``vision`` section: the primary protocol (pre-registered) and the exploratory radii."""

    zoo_dir: str
    n_images: int
    batch_size: int
    n_iters: int
    seed: int
    data_seed: int                        # the paper's zoo only: which ImageNet training images
    measures: dict[str, Measure]          # Table 1 column -> measure
    rho: dict[str, float]                 # pre-registered radius per column
    exploratory_rho: dict[str, list[float]]
    retest: bool
    max_train_error: float                # members above it are drawn as "did not fit" (kept in every τ)
    n_boot: int
    n_splits: int
    power: PowerSettings
    workers: int
    threads: int | None
    device: str
    cpu_kernels: str | None               # CPU kernels pinned to this level (companion.kernels): checked on cpu
    cluster_factors: list[str]            # drawn binary factors checked for splitting the gap into clusters
    cluster_auc: float                    # a factor splits the gap when its AUC is >= this or <= 1 - this


@dataclass
class VisionReport:
    """What ``notebooks/vision.ipynb`` shows (every table also under ``out_dir/data``)."""

    members: pd.DataFrame      # one row per member: errors, gap, hyperparameters, sharpness at the primary rho
    primary: pd.DataFrame      # one row per measure: rho, tau, interval, retest, ceiling, power, paper tau
    curve: pd.DataFrame        # exploratory: tau against rho (set 1)
    reliability: pd.DataFrame  # gap reliability against test-set size (prefixes of the test set)
    between: pd.DataFrame      # exploratory: Kendall tau between the measures at the primary rho
    hp_rank: pd.Series | None  # exploratory: Kendall tau of each hyperparameter with the gap
    labels: dict[str, str]     # column -> Measure.label
    findings: list[str]        # sentences generated from the numbers
    metrics: dict
    seconds: dict              # wall-clock times (sharpness in total and per measure): timings/vision.json only
    clusters: list = dataclasses.field(default_factory=list)   # gap_clusters: which drawn factor splits the gap
    split: dict | None = None                 # the splitting factor farthest from AUC 0.5 (None: none splits)
    split_levels: pd.Series | None = None     # each member's level of that factor (figure 4 colours them)


def load_settings(profile: str, params: dict) -> VisionSettings:
    """Typed settings from the notebook's resolved ``params``."""
    return vz.settings_from_mapping(VisionSettings, STAGE, profile, params)


def _batches(src, s: VisionSettings) -> tuple[list, list | None]:
    """The primary sharpness batches and, with ``s.retest``, the disjoint second set."""
    if s.retest:   # before any image is read: a zoo that draws one set refuses here
        second = src.retest_batches(s.n_images, s.batch_size, s.data_seed)
        return src.sharpness_batches(s.n_images, s.batch_size, s.data_seed), second
    return src.sharpness_batches(s.n_images, s.batch_size, s.data_seed), None


def measure_members(s: VisionSettings, *, progress: bool) -> tuple[object, pd.DataFrame, pd.DataFrame, float]:
    """``(zoo source, primary frame, exploratory frame, seconds)``: sharpness at the pre-registered radii on
    set 1 (+ set 2) and at the exploratory radii on set 1."""
    from hideseek.utils import set_threads

    set_threads(s.threads)
    src = vz.source(s.zoo_dir)
    models = src.loaders(device=s.device)
    first, second = _batches(src, s)
    t0 = time.perf_counter()
    primary = vz.measure(models, first + (second or []), s.measures, {k: [r] for k, r in s.rho.items()},
                         seed=s.seed, n_iters=s.n_iters, workers=s.workers, progress=progress)
    extra = {k: [r for r in s.exploratory_rho[k] if r != s.rho[k]] for k in s.measures}
    explore = vz.measure(models, first, {k: m for k, m in s.measures.items() if extra[k]}, extra, seed=s.seed,
                         n_iters=s.n_iters, workers=s.workers, progress=progress) if any(extra.values()) else None
    return src, primary, explore, time.perf_counter() - t0


def _split_sets(primary: pd.DataFrame, n_first: int) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """The primary frame's values on set 1 and (if measured) set 2, from the per-batch values."""
    pb = primary["per_batch"].map(np.asarray)
    first = primary.assign(value=pb.map(lambda v: float(v[:n_first].mean())))
    if pb.map(len).min() == n_first:
        return first, None
    return first, primary.assign(value=pb.map(lambda v: float(v[n_first:].mean())))


def sharpness_table(primary: pd.DataFrame, explore: pd.DataFrame | None, n_first: int) -> pd.DataFrame:
    """The published ``sharpness.csv`` frame: every measured (member, measure, ρ), ``set`` primary or exploratory,
    with ``value`` the mean over the first set's ``n_first`` batches — the value every τ of the stage uses
    (:func:`_split_sets`) — and, for the primary radii, ``value_set2`` the mean over the second set (the retest's
    other measurement; NaN without one and on exploratory lines). ``per_batch`` holds both sets' batches.
    (Before issue 24 ``value`` was the mean over both sets, which no τ used.)"""
    pb = primary["per_batch"].map(lambda v: json.loads(v) if isinstance(v, str) else v)
    first, second = _split_sets(primary.assign(per_batch=pb), n_first)
    prim = first.assign(per_batch=primary["per_batch"], set="primary",
                        value_set2=second["value"] if second is not None else np.nan)
    if explore is None:
        return prim
    return pd.concat([prim, explore.assign(set="exploratory", value_set2=np.nan)], ignore_index=True)


def republish_sharpness(path: str | Path, n_first: int) -> pd.DataFrame:
    """Rewrite a published ``sharpness.csv`` (from a run before issue 24) with :func:`sharpness_table`, from its
    own per-batch values: no zoo needed, nothing measured again. Refuses a file without per-batch values."""
    frame = pd.read_csv(path, float_precision="round_trip")
    if "per_batch" not in frame or "set" not in frame:
        raise ValueError(f"{path}: no per_batch/set columns; re-run the vision stage instead")
    cols = [c for c in frame.columns if c != "value_set2"]
    frame = frame[cols]
    out = sharpness_table(frame[frame["set"] == "primary"].reset_index(drop=True),
                          frame[frame["set"] == "exploratory"].reset_index(drop=True), n_first)
    out = out[[*cols, "value_set2"]]
    out.to_csv(path, index=False)
    return out


def primary_table(members: pd.DataFrame, first: pd.DataFrame, second: pd.DataFrame | None, rel: float,
                  s: VisionSettings) -> tuple[pd.DataFrame, dict]:
    """One row per measure (the primary τ with its interval, retest, ceiling, power, the paper's τ) and the
    Table 1 reliability keys (:func:`companion.metrics.reliability_fields`; empty without retest or reliability)."""
    from companion.metrics import reliability_fields

    paper_tau = paper.table1_tau("vision")
    retest = None if second is None else analysis.retest_table(first, second, n_boot=s.n_boot, seed=s.seed) \
        .set_index("measure")["tau"]
    fields = {}
    if retest is not None and np.isfinite(rel) and retest.notna().all():
        fields = reliability_fields(gap_reliability=rel, retest=retest.to_dict(), n_models=len(members),
                                    paper_tau=paper_tau, alpha=s.power.alpha, n_sim=s.power.n_sim, seed=s.power.seed)
    rows = []
    for k in s.measures:
        v = first[first["measure"] == k].set_index("model")["value"].loc[members.index]
        t = analysis.kendall(v.to_numpy(), members["gap"].to_numpy(), n_boot=s.n_boot, seed=s.seed)
        rt = float("nan") if retest is None else float(retest[k])
        rows.append(dict(
            measure=k, name=s.measures[k].name, rho=s.rho[k], tau=t.tau, ci_low=t.lo, ci_high=t.hi, pvalue=t.pvalue,
            n=t.n, retest=rt, gap_reliability=rel, paper_tau=paper_tau[k],
            tau_ceiling=fields["tau_ceiling"][k] if fields else float("nan"),
            expected_at_paper_tau=analysis.attenuated(paper_tau[k], rt, rel) if fields else float("nan"),
            power=fields["power"][k] if fields else float("nan")))
    return pd.DataFrame(rows), fields


def reliability_curve(errors: np.ndarray | None, train_error: np.ndarray, s: VisionSettings) -> pd.DataFrame:
    """Gap reliability on prefixes of the test set (1/8, 1/4, 1/2, all); empty without per-example errors."""
    if errors is None:
        return pd.DataFrame(columns=["n_test", "split_half", "disagreement"])
    n = errors.shape[1]
    rows = []
    for size in sorted({max(4, n // 8), max(4, n // 4), max(4, n // 2), n}):
        r = analysis.gap_reliability(errors[:, :size], train_error, seed=s.seed, n_splits=s.n_splits)
        rows.append(dict(n_test=size, split_half=r.split_half, disagreement=r.disagreement))
    return pd.DataFrame(rows)


def finding_lines(primary: pd.DataFrame, rel: float, n_test: int, labels: dict[str, str], n_failed: int,
                  max_train_error: float) -> list[str]:
    """The findings sentences (also in the metrics file), every number from the tables."""
    n = int(primary["n"].iloc[0])
    out = [f"Primary comparison (pre-registered ρ, all {n} members, gap = test error − train error on a shared "
           f"test set of {n_test} images; gap reliability {rel:.2f}):"]
    for r in primary.itertuples():
        verdict = ("the ceiling is below the paper's |τ|, so this row cannot reproduce it"
                   if r.tau_ceiling < abs(r.paper_tau) else
                   f"at the paper's τ one would observe about {r.expected_at_paper_tau:+.2f} (power {r.power:.2f})")
        out.append(f"{labels[r.measure]} at ρ = {r.rho:g}: τ = {r.tau:+.2f} [{r.ci_low:+.2f}, {r.ci_high:+.2f}] "
                   f"(paper {r.paper_tau:+.2f}); test–retest {r.retest:.2f}, ceiling on |τ| {r.tau_ceiling:.2f}; "
                   f"{verdict}.")
    out.append(f"{n_failed} of {n} members have train error above {max_train_error:g} (drawn apart in the figure, "
               "kept in every τ).")
    return out


def gap_clusters(members: pd.DataFrame, factors: list[str], threshold: float) -> list[dict]:
    """Does a drawn binary factor split the gap into separate clusters? (reports/preregistration/vision_minima.md,
    section 3.) For each factor (levels as :func:`companion.experiments.paired.factor_levels` reads them): the
    Mann–Whitney AUC, the probability that a member of the second level (sorted) has a larger gap than a member
    of the first (ties count one half), over all pairs; it splits the gap when the AUC is ``>= threshold`` or
    ``<= 1 - threshold``. A factor whose column the members lack (the paper's checkpoints record none) or that
    takes one level only is not a factor here and is left out."""
    from companion.experiments.paired import factor_levels

    out = []
    for f in factors:
        col = f[:-3].strip() if f.endswith("> 0") else f
        if col not in members or (not f.endswith("> 0") and members[col].nunique() != 2):
            continue
        levels = factor_levels(members, f)
        names = sorted(levels.unique())
        if len(names) != 2:
            continue
        a = members["gap"][levels == names[0]].to_numpy(float)
        b = members["gap"][levels == names[1]].to_numpy(float)
        diff = b[:, None] - a[None, :]
        auc = float((np.sum(diff > 0) + 0.5 * np.sum(diff == 0)) / diff.size)
        out.append(dict(factor=f, low=names[0], high=names[1], n_low=len(a), n_high=len(b), auc=auc,
                        splits=bool(auc >= threshold or auc <= 1 - threshold)))
    return out


def cluster_line(clusters: list[dict], threshold: float) -> str:
    """The findings sentence of :func:`gap_clusters`."""
    split = [c for c in clusters if c["splits"]]
    if split:
        return "The gap splits into separate clusters by " + "; ".join(
            f"{c['factor']} (AUC {c['auc']:.2f}: {c['high']} against {c['low']})" for c in split) + \
            f" (a drawn binary factor with AUC >= {threshold:g} or <= {1 - threshold:g}; figure 4 colours its levels)."
    if not clusters:
        return "No drawn binary factor to check for clusters of the gap."
    far = max(clusters, key=lambda c: abs(c["auc"] - 0.5))
    return (f"No drawn binary factor splits the gap into separate clusters (AUC within ({1 - threshold:g}, "
            f"{threshold:g}); farthest from 0.5: {far['factor']}, {far['auc']:.2f}).")


def report_metrics(primary: pd.DataFrame, fields: dict, members: pd.DataFrame, curve: pd.DataFrame,
                   rel_curve: pd.DataFrame, src, s: VisionSettings, lines: list[str]) -> dict:
    """The stage's metrics (layout: :mod:`companion.metrics`; Table 1 entry per the issue-16 contract)."""
    p = primary.set_index("measure")
    col = lambda c: {k: float(p.loc[k, c]) for k in p.index}  # noqa: E731
    gap = members["gap"]
    entry = dict(row="vision", variant="primary: pre-registered ρ, all members", primary=True, exploratory=False,
                 tau=col("tau"), ci={k: [float(p.loc[k, "ci_low"]), float(p.loc[k, "ci_high"])] for k in p.index},
                 rho=col("rho"), n_models=int(len(members))) | fields
    return {
        "table1_row": "ImageNet", "table1": [entry], "paper_tau": paper.table1_tau("vision"),
        "setting": src.description(),
        "primary": primary.to_dict("records"), "findings": lines,
        "gap_reliability": rel_curve.to_dict("records"),
        "exploratory": {"what": "τ against ρ on set 1 (not pre-registered; no choice is made from it)",
                        "tau_vs_rho": curve.to_dict("records")},
        "protocol": dict(n_models=len(members), n_images=s.n_images, batch_size=s.batch_size, n_iters=s.n_iters,
                         rho=s.rho, exploratory_rho=s.exploratory_rho, retest=s.retest, seed=s.seed,
                         max_train_error=s.max_train_error,
                         n_boot=s.n_boot, measures={k: m.to_dict() for k, m in s.measures.items()}),
        "zoo": {"n_models": len(members), "gap_min": float(gap.min()), "gap_max": float(gap.max()),
                "gap_median": float(gap.median()), "gap_sd": float(gap.std()),
                "test_error_min": float(members["test_error"].min()),
                "test_error_max": float(members["test_error"].max()),
                "train_error_min": float(members["train_error"].min()),
                "train_error_max": float(members["train_error"].max()),
                "n_test": int(src.meta["n_test"]) if "n_test" in src.meta else None},
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m companion.experiments.vision_report republish-sharpness [--profile P] [--path CSV]``:
    :func:`republish_sharpness` with the profile's ``n_images / batch_size`` batches in the first set."""
    import argparse

    from companion.params import stage_params

    ap = argparse.ArgumentParser(prog="python -m companion.experiments.vision_report")
    ap.add_argument("command", choices=["republish-sharpness"])
    ap.add_argument("--profile", default=None)
    ap.add_argument("--path", default="reports/data/vision/sharpness.csv")
    args = ap.parse_args(argv)
    _, p = stage_params(STAGE, args.profile)
    republish_sharpness(args.path, p["n_images"] // p["batch_size"])
    print(f"rewrote {args.path}: value = the first set's mean (what τ uses), value_set2 = the second set's")
    return 0


def findings(rep: VisionReport) -> str:
    """The findings as a markdown list (the notebook displays it)."""
    return "\n".join("- " + line for line in rep.findings)


def run_report(profile: str, params: dict, out_dir: str | Path, *, progress: bool = True) -> VisionReport:
    """Measure, analyse and write every output of the ``vision`` stage (see the module docstring).

    The wall-clock times are returned (``VisionReport.seconds``, which the notebook prints to stderr)
    and written to ``timings/vision.json`` (published to ``reports/timings/``): no DVC output holds a
    timing."""
    from companion import metrics as cm

    from companion import kernels

    s = load_settings(profile, params)
    if s.device == "cpu":   # the stage's command pins them (python -m companion.kernels vision -- ...)
        kernels.check(s.cpu_kernels, "vision")
    out = Path(out_dir)
    for sub in ("figures", "metrics", "data"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    src, primary_frame, explore, seconds = measure_members(s, progress=progress)
    members = src.member_table()
    first, second = _split_sets(primary_frame, s.n_images // s.batch_size)
    errors = src.eval_errors(list(members.index))
    rel_curve = reliability_curve(errors, members["train_error"].to_numpy(), s)
    rel = float(rel_curve["split_half"].iloc[-1]) if len(rel_curve) else float("nan")
    primary, fields = primary_table(members, first, second, rel, s)
    labels = {k: m.label for k, m in s.measures.items()}
    curve = analysis.tau_curve(pd.concat([first, explore]) if explore is not None else first,
                               members["gap"], n_boot=s.n_boot, seed=s.seed)
    at = {k: first[first["measure"] == k].set_index("model")["value"].loc[members.index] for k in s.measures}
    members = members.assign(**{f"sharpness_{k}": v.to_numpy() for k, v in at.items()})
    between = pd.DataFrame({a: {b: analysis.kendall(at[a], at[b], n_boot=0, seed=s.seed).tau for b in at} for a in at})
    hp_rank = (members[list(HP_COLUMNS) + ["gap"]].corr(method="kendall")["gap"].drop("gap")
               if set(HP_COLUMNS) <= set(members) else None)   # the paper's checkpoints record no hyperparameters
    members = members.assign(did_not_fit=members["train_error"] > s.max_train_error)
    n_failed = int(members["did_not_fit"].sum())
    lines = finding_lines(primary, rel, int(src.meta["n_test"]) if "n_test" in src.meta else 0, labels, n_failed,
                          s.max_train_error)
    clusters = gap_clusters(members, s.cluster_factors, s.cluster_auc)
    lines.append(cluster_line(clusters, s.cluster_auc))
    metrics = report_metrics(primary, fields, members, curve, rel_curve, src, s, lines)
    metrics["gap_clusters"] = clusters
    cm.write_stage_metrics(out, STAGE, metrics)
    data = out / "data"
    frames = sharpness_table(primary_frame, explore, s.n_images // s.batch_size)
    frames.drop(columns="seconds").assign(per_batch=frames["per_batch"].map(json.dumps),
                                          base_loss=frames["base_loss"].map(json.dumps)).to_csv(
        data / "sharpness.csv", index=False)
    members.to_csv(data / "members.csv")
    primary.to_csv(data / "primary.csv", index=False)
    curve.to_csv(data / "tau_vs_rho.csv", index=False)
    rel_curve.to_csv(data / "gap_reliability.csv", index=False)
    cm.write_plot_data(data, curve, members[["gap"] + [f"sharpness_{k}" for k in s.measures]]
                       .rename(columns={f"sharpness_{k}": k for k in s.measures}))
    timing = dict(sharpness=seconds, per_measure=frames.groupby("measure")["seconds"].agg(["mean", "sum"])
                  .to_dict(orient="index"))
    cm.write_stage_timings(out, STAGE, timing)
    split = max((c for c in clusters if c["splits"]), key=lambda c: abs(c["auc"] - 0.5), default=None)
    from companion.experiments.paired import factor_levels

    levels = factor_levels(members, split["factor"]) if split else None
    return VisionReport(members, primary, curve, rel_curve, between, hp_rank, labels, lines, metrics, timing, clusters,
                        split, levels)


if __name__ == "__main__":
    raise SystemExit(main())
