"""The ``vision`` stage without its plots: what ``notebooks/vision.ipynb`` shows.

:func:`run_report` measures the vision zoo (:func:`~companion.experiments.vision_zoo.measure_vision_zoo`),
computes the diagnostics, and writes the stage's metrics (layout:
:mod:`companion.metrics`) and data tables; the notebook only plots what it
returns. Kept apart from the zoo's training code so that editing the report
does not re-run the DVC training stage.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from companion.experiments.crossfit import crossfit_taus
from companion.experiments.crossfit import table1_entry as crossfit_entry
from companion.experiments.vision_zoo import PAPER_TAU, VisionResults, load_zoo, measure_stability, measure_vision_zoo


#: Hyperparameters whose Kendall tau with the gap the report shows (trained zoos only).
HP_COLUMNS = ("lr", "weight_decay", "epochs", "batch_size", "label_smoothing", "shift", "noise_std", "mixup_alpha")


@dataclass
class VisionReport:
    """What ``notebooks/vision.ipynb`` shows, measured and saved by :func:`run_report`."""

    result: VisionResults
    measures: list          # the three measures, in the frame's order
    clip_soups: bool        # profile paper: the model-soups CLIP fine-tunes on ImageNet
    hp_rank: Any            # Series: Kendall tau of each hyperparameter with the gap (None for clip_soups)
    between: Any            # DataFrame: Kendall tau between the measures (each at its chosen rho)
    track: Any              # DataFrame: tau of each measure with gap, test error, train error
    n_in_pairs: int         # parameters of the first model that lie in GL(h) attention pairs
    stability: Any          # None, or DataFrame: tau per (stability zoo, measure) at the main zoo's chosen rho
    stability_members: Any  # None, or DataFrame: every stability-zoo member's errors and gap
    stability_seconds: Any  # None, or dict: sharpness seconds per stability zoo and in total
    metrics: dict           # the metrics JSON written to out_dir/metrics/vision.json


def vision_retest(res: VisionResults):
    """Test-retest of each measure at its chosen rho: tau between its values on the two halves of the
    sharpness batches (disjoint images), ``None`` with a single batch."""
    from companion.experiments.zoo import per_batch_halves, retest_taus

    chosen = res.table.set_index("measure")["rho"]
    at = res.frame[res.frame["rho"] == res.frame["measure"].map(chosen)]
    if at["per_batch"].map(len).min() < 2:
        return None
    first, second = per_batch_halves(at)
    return retest_taus(first, second, n_boot=int(res.protocol["n_boot"]), seed=int(res.protocol["split_seed"]))


def report_metrics(res: VisionResults, clip_soups: bool, stability=None, stability_members=None,
                   stability_seconds=None) -> dict:
    """The ``vision`` stage's metrics (layout: :mod:`companion.metrics`).

    With ``stability`` (tau per stability zoo, :func:`measure_stability`), the whole-zoo
    Table 1 entry carries its ``spread`` and the metrics a ``stability`` block.
    """
    from companion import metrics as cm

    members, table, proto, meta = res.members, res.table, res.protocol, res.meta
    gap = members["gap"]
    retest = vision_retest(res)
    cf = crossfit_taus(res.frame, gap, res.halves, n_boot=int(proto["n_boot"]), seed=int(proto["split_seed"]))
    entry_all = cm.table1_entry("vision", "all models, same ρ (ρ chosen on half of them)", table, models="all")
    extra = {}
    if stability is not None:
        spread = cm.tau_spread(stability)
        entry_all["spread"] = spread
        sm = stability_members
        extra["stability"] = {
            "what": ("Kendall tau over all members of each independently seeded zoo (own pre-training and "
                     "fine-tuning seeds, same recipe), each measure at the rho chosen on the main zoo's selection half"),
            "zoos": stability.to_dict("records"), "summary": spread,
            "population": {z: {"n_models": int(len(g)), "train_error_min": float(g["train_error"].min()),
                               "train_error_max": float(g["train_error"].max()),
                               "test_error_min": float(g["test_error"].min()),
                               "test_error_max": float(g["test_error"].max()),
                               "gap_min": float(g["gap"].min()), "gap_max": float(g["gap"].max()),
                               "training_seconds": float(g["zoo_training_seconds"].iloc[0])}
                           for z, g in sm.groupby("zoo", sort=False)},
            "seconds": stability_seconds,
        }
    return {
        "crossfit": cf.to_dict("records"),
        "retest": None if retest is None else {
            "what": ("Kendall tau over the models between each measure on the first and on the second half of the "
                     "sharpness batches (disjoint images, each half of the data), at the chosen rho"),
            "taus": retest.to_dict("records")},
        "table1_row": "ImageNet",
        "setting": (f"model-soups CLIP zoo ({len(members)} ViT-B/32 fine-tunes on ImageNet)" if clip_soups
                    else f"digits ViT zoo ({len(members)} open_clip ViTs)"),
        "tau": cm.tau_records(table),
        "paper_tau": PAPER_TAU,
        "table1": [
            cm.table1_entry("vision", f"held-out half (ρ chosen on the other {int(table['n_eval'].iloc[0])} models)",
                            table, models="eval"),
            entry_all,
            crossfit_entry("vision", cf, len(members)),
        ],
        "protocol": {k: proto[k] for k in ("n_models", "n_images", "batch_size", "n_batches", "n_iters", "rho_grid",
                                           "seed", "split_seed", "n_boot", "n_parameters", "model")},
        "seconds": {"sharpness": proto["seconds"], "zoo_training": meta["seconds_total" if clip_soups else "seconds"],
                    "per_measure": proto["seconds_per_measure"]},
        "zoo": {"n_models": len(members), "gap_min": float(gap.min()), "gap_max": float(gap.max()),
                "gap_median": float(gap.median()), "test_error_min": float(members["test_error"].min()),
                "test_error_max": float(members["test_error"].max()),
                "train_error_min": float(members["train_error"].min()),
                "train_error_max": float(members["train_error"].max()),
                "pretrain_test_error": None if clip_soups else meta["pretrain"]["test_error"]},
    } | extra


def save_report_data(res: VisionResults, out_dir: str | Path) -> None:
    """``out_dir/data``: sharpness.csv, members.csv, taus.csv, tau_vs_rho.csv."""  # stability: run_report
    data = Path(out_dir) / "data"
    data.mkdir(parents=True, exist_ok=True)
    frame = res.frame
    frame.assign(per_batch=frame["per_batch"].map(json.dumps), base_loss=frame["base_loss"].map(json.dumps)).to_csv(
        data / "sharpness.csv", index=False)
    res.members.to_csv(data / "members.csv")
    res.table.to_csv(data / "taus.csv", index=False)
    res.curves.to_csv(data / "tau_vs_rho.csv", index=False)


def run_report(params: Mapping[str, Any], out_dir: str | Path, *, progress: bool = True) -> VisionReport:
    """The ``vision`` stage without its plots: measure, diagnose, write metrics and data.

    :func:`measure_vision_zoo`, then the diagnostics (Kendall τ of the
    hyperparameters with the gap, between the measures at their chosen ρ, and of
    each measure with gap / test error / train error; the number of parameters in
    GL(h) pairs), then, when ``zoo_dir/stability`` holds zoos, their tau at the chosen
    radii (:func:`measure_stability`); ``out_dir/metrics/vision.json``
    (:func:`report_metrics`) and ``out_dir/data/*.csv`` (:func:`save_report_data`,
    ``stability.csv``, ``stability_members.csv``). The notebook only plots.
    """
    import pandas as pd
    from scipy import stats

    import hideseek as hs
    from companion import metrics as cm

    out = Path(out_dir)
    for sub in ("figures", "metrics", "data"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    res = measure_vision_zoo(params, progress=progress)
    members, frame, table = res.members, res.frame, res.table
    clip_soups = res.meta.get("kind") == "clip_soups"
    measures = list(dict.fromkeys(frame["measure"]))
    # the checkpoints of the model soups do not record their fine-tuning hyperparameters
    hp_rank = None if clip_soups else \
        members[list(HP_COLUMNS) + ["gap"]].corr(method="kendall")["gap"].drop("gap")
    chosen = {m: frame[(frame["measure"] == m) & (frame["rho"] == table.set_index("measure").loc[m, "rho"])]
              .set_index("model")["value"].loc[members.index] for m in measures}
    between = pd.DataFrame({a: {b: stats.kendalltau(chosen[a], chosen[b]).statistic for b in measures} for a in measures})
    track = pd.DataFrame({m: {q: stats.kendalltau(chosen[m], members[q]).statistic
                          for q in ("gap", "test_error", "train_error")} for m in measures}).T
    probe = load_zoo(params["zoo_dir"], device="cpu")[1][0][1]()  # the first model of the zoo
    named = dict(probe.named_parameters())
    n_in_pairs = sum(named[n].numel() for b in hs.find_symmetries(probe) for n in b.param_names)
    stab = None if clip_soups else measure_stability(
        params, {m: float(table.set_index("measure").loc[m, "rho"]) for m in measures}, progress=progress)
    stability, stability_members, stability_seconds = stab if stab is not None else (None, None, None)
    metrics = report_metrics(res, clip_soups, stability, stability_members, stability_seconds)
    cm.write_stage_metrics(out, "vision", metrics)
    save_report_data(res, out)
    if stability is not None:
        stability.to_csv(out / "data" / "stability.csv", index=False)
        stability_members.to_csv(out / "data" / "stability_members.csv", index=False)
    return VisionReport(result=res, measures=measures, clip_soups=clip_soups, hp_rank=hp_rank, between=between,
                        track=track, n_in_pairs=int(n_in_pairs), stability=stability,
                        stability_members=stability_members, stability_seconds=stability_seconds, metrics=metrics)
