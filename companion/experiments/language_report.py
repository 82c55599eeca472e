"""The ``language`` stage without its plots: what ``notebooks/language.ipynb`` shows.

:func:`run_report` measures the language zoo (:func:`~companion.experiments.language_zoo.measure_language_zoo`),
runs the solver check of the Christoffel-only ablation, and writes the stage's
metrics (layout: :mod:`companion.metrics`) and data tables; the notebook only
plots what it returns. Kept apart from the zoo's training code so that editing
the report does not re-run the DVC training stage.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from companion.experiments.correlation import kendall_tau
from companion.experiments.crossfit import crossfit_taus
from companion.experiments.crossfit import table1_entry as crossfit_entry
from companion.experiments.language_zoo import (PAPER_ABLATION_TAU, PAPER_TAU, LanguageResult, load_model,
                                                measure_language_zoo, sharpness_batches)


@dataclass
class LanguageReport:
    """What ``notebooks/language.ipynb`` shows, measured and saved by :func:`run_report`."""

    result: LanguageResult
    measures: list          # the three measures, in the frame's order
    mccoy: bool             # profile paper: McCoy et al.'s bert-base fine-tunes on MNLI
    solver_check: Any       # DataFrame (see :func:`christoffel_only_check`) or None without ablations
    metrics: dict           # the metrics JSON written to out_dir/metrics/language.json


def christoffel_only_check(result: LanguageResult, params: Mapping[str, Any]):
    """Lower bound check of the Christoffel-only (adaptive-norm) ablation on the first model.

    The Christoffel-only ball (adaptive sharpness's elementwise ball on every
    parameter, pairs included) contains every perturbation that leaves the
    attention pairs alone, so at the same ρ its worst case can never be below
    adaptive sharpness restricted to the parameters outside the pairs. One row
    per (measure, ρ): both values and ``consistent`` (Christoffel-only ≥ 0.9 ×
    the restricted value). ``None`` when the ablations were skipped.
    """
    import pandas as pd

    import hideseek as hs

    if result.ablation_frame is None:
        return None
    members, abl = result.members, result.ablation_frame
    m0 = members.index[0]
    model0 = load_model(params["zoo_dir"], m0)
    pair_names = sorted({n for b in hs.find_symmetries(model0) for n in b.param_names})
    batches0 = sharpness_batches(params["zoo_dir"], int(params["n_points"]), int(params["batch_size"]),
                                 int(params.get("data_seed", 0)))
    rows = []
    for metric in ("invariant", "mixed"):
        name = f"geodesic_{metric}_christoffel_only"
        if name not in set(abl["measure"]):
            continue
        sub = abl[(abl["measure"] == name) & (abl["model"] == m0)]
        for _, r in sub.iterrows():
            free = hs.sharpness(model0, batches0, measure="adaptive", rho=float(r["rho"]), n_iters=int(params["n_iters"]),
                                seed=int(params.get("seed", 0)), exclude=pair_names, progress=False).value
            rows.append(dict(measure=name, rho=float(r["rho"]), christoffel_only=float(r["value"]),
                             adaptive_outside_pairs=float(free), consistent=bool(r["value"] >= free * 0.9)))
    return pd.DataFrame(rows)


def fit_rule(res: LanguageResult, params: Mapping[str, Any]) -> tuple[dict, Any]:
    """Members that did not fit their training set (train error above ``max_train_error``), and the
    split-half taus without them (``None`` when every member fits or no threshold is set).

    A sensitivity line, not the main result: the main row keeps every member. The threshold was
    set after the all-member taus had been seen (stated in the notebook), on training error alone.
    """
    from companion.experiments.zoo import split_half_taus

    thr = params.get("max_train_error")
    members = res.members
    if thr is None:
        return {"max_train_error": None, "excluded": {}}, None
    out = members["train_error"] > float(thr)
    rule = {"max_train_error": float(thr),
            "excluded": {str(n): float(e) for n, e in members.loc[out, "train_error"].items()}}
    if not out.any():
        return rule, None
    keep = list(members.index[~out])
    table, _ = split_half_taus(res.frame[res.frame["model"].isin(keep)], members.loc[keep, "gap"],
                               seed=int(params.get("split_seed", 0)), n_boot=int(params.get("n_boot", 2000)),
                               criterion=params.get("criterion", "abs"))
    return rule, table


def report_metrics(res: LanguageResult, profile: str, solver_check=None, params: Mapping[str, Any] | None = None) -> dict:
    """The ``language`` stage's metrics (layout: :mod:`companion.metrics`)."""
    from companion import metrics as cm

    members, table, proto, meta = res.members, res.table, res.protocol, res.meta
    mccoy = meta.get("kind") == "mccoy_bert"
    measures = list(dict.fromkeys(res.frame["measure"]))
    gap = members["gap"]
    rule, fitted = fit_rule(res, params or {})
    cf = crossfit_taus(res.frame, gap, res.halves, n_boot=int(proto["n_boot"]), seed=int(proto["split_seed"]),
                       criterion=proto.get("criterion", "abs"))
    hans = None
    if "gap_hans" in members:   # the HANS-like gap (test - train), beside the paper's in-distribution gap
        hans = {}
        for m, r in table.set_index("measure").iterrows():
            vals = res.frame[(res.frame["measure"] == m) & (res.frame["rho"] == r["rho"])].set_index("model")["value"]
            t = kendall_tau(vals.loc[members.index].to_numpy(), members["gap_hans"].to_numpy(),
                            n_boot=int(proto["n_boot"]), seed=int(proto["split_seed"]))
            hans[m] = {"rho": float(r["rho"]), "tau": t.tau, "ci_low": t.ci_low, "ci_high": t.ci_high, "n": t.n}
    extra_entries = [] if fitted is None else [cm.table1_entry(
        "language", f"fitted members only (train error ≤ {rule['max_train_error']:g}, rule set after the all-member τ): "
        f"{len(members) - len(rule['excluded'])} of {len(members)}, held-out half", fitted, measures=measures)]
    return {
        "crossfit": cf.to_dict("records"),
        "tau_gap_hans": hans,
        "retest": None if res.retest is None else res.retest.to_dict("records"),
        "fit_rule": rule,
        "table1": [
            cm.table1_entry("language", f"{len(members)} seed-only BERT fine-tunes, held-out half "
                            f"(ρ chosen on the other {int(table['n_all'].iloc[0] - table['n_eval'].iloc[0])} models)",
                            table, measures=measures, models="eval"),
            cm.table1_entry("language", "all models, same ρ (ρ chosen on half of them)", table, measures=measures,
                            models="all"),
            crossfit_entry("language", cf, len(members)),
            *extra_entries,
        ],
        "table1_row": "MNLI",
        "setting": (f"McCoy et al. BERT zoo ({len(members)} bert-base MNLI fine-tunes)" if mccoy else
                    f"generated-NLI BERT zoo ({len(members)} seed-only fine-tunes, HANS-like test split)"),
        "profile": profile,
        "tau": cm.tau_records(table),
        "paper_tau": PAPER_TAU,
        "ablations": None if res.ablation_table is None else cm.tau_records(res.ablation_table),
        "paper_ablation_tau": PAPER_ABLATION_TAU,
        "eps_sweep": None if res.eps_table is None else res.eps_table.to_dict("records"),
        "solver_check_christoffel_only": None if res.ablation_frame is None else solver_check.to_dict("records"),
        "protocol": {k: proto[k] for k in ("n_models", "n_points", "batch_size", "n_batches", "n_iters", "rho_grid",
                                           "ablation_rho_grid", "eps", "eps_grid", "seed", "data_seed", "split_seed",
                                           "n_boot", "n_parameters", "model")},
        "seconds": {"sharpness": proto["seconds"], "zoo_training": meta["seconds_total"]},
        "zoo": {"n_models": len(members), "gap_min": float(gap.min()), "gap_max": float(gap.max()),
                "gap_median": float(gap.median()), "train_error_min": float(members["train_error"].min()),
                "train_error_max": float(members["train_error"].max()),
                "test_error_min": float(members["test_error"].min()),
                "test_error_max": float(members["test_error"].max()),
                "corpus": meta.get("corpus"), "overlap_heuristic": meta.get("overlap_heuristic")},
    }


def save_report_data(res: LanguageResult, out_dir: str | Path) -> None:
    """``out_dir/data``: sharpness.csv, ablations.csv, eps_sweep.csv, members.csv, taus.csv, tau_vs_rho.csv."""
    data = Path(out_dir) / "data"
    data.mkdir(parents=True, exist_ok=True)
    for fname, fr in (("sharpness", res.frame), ("ablations", res.ablation_frame), ("eps_sweep", res.eps_frame)):
        if fr is not None:
            fr.assign(per_batch=fr["per_batch"].map(json.dumps)).to_csv(data / f"{fname}.csv", index=False)
    members = res.members
    if res.meta.get("kind") == "mccoy_bert":
        members.to_csv(data / "members.csv")
    else:
        members.assign(test_error_by_template=members["test_error_by_template"].map(json.dumps),
                       hyperparameters=members["hyperparameters"].map(json.dumps)).to_csv(data / "members.csv")
    res.table.to_csv(data / "taus.csv", index=False)
    res.curves.to_csv(data / "tau_vs_rho.csv", index=False)


def run_report(params: Mapping[str, Any], out_dir: str | Path, profile: str = "cpu", *,
               progress: bool = True) -> LanguageReport:
    """The ``language`` stage without its plots: measure, check, write metrics and data.

    In order: threads (``params["threads"]``), :func:`measure_language_zoo`,
    :func:`christoffel_only_check`, then ``out_dir/metrics/language.json``
    (:func:`report_metrics`) and ``out_dir/data/*.csv`` (:func:`save_report_data`).
    The notebook only plots what this returns into ``out_dir/figures``.
    """
    from companion import metrics as cm
    from hideseek.utils import set_threads

    set_threads(params.get("threads"))
    out = Path(out_dir)
    for sub in ("figures", "metrics", "data"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    res = measure_language_zoo(params, progress=progress)
    check = christoffel_only_check(res, params)
    metrics = report_metrics(res, profile, check, params)
    cm.write_stage_metrics(out, "language", metrics)
    save_report_data(res, out)
    return LanguageReport(result=res, measures=list(dict.fromkeys(res.frame["measure"])),
                          mccoy=res.meta.get("kind") == "mccoy_bert", solver_check=check, metrics=metrics)
