"""Vision pilot: the test-set size and each measure's radius, chosen before the main zoo is measured.

Pilot members are fine-tuned by the main zoo's recipe from the same pre-trained start but
from another random stream (``stream="pilot"`` in :func:`.vision_zoo.member_draws`), so none
is a member of the main zoo. On them the pilot measures, with rules fixed in ``params.yaml``
(section ``vision_pilot``) before it ran:

* **Gap reliability against test-set size.** The members' per-example errors on ``n_test``
  test images; for every size of ``test_sizes`` (a prefix of the test set) the split-half
  reliability of the gap across members (random halves of the images, Pearson r of the
  members' gaps between halves, Spearman–Brown ``2r / (1 + r)``, mean over ``n_splits``
  splits). Chosen: the smallest size whose reliability reaches ``target_reliability``.
* **Test–retest of each measure** on two disjoint sets of ``n_images`` training images
  (pool images ``0 .. n - 1`` and ``n .. 2n - 1``) in batches of ``batch_size``, ``n_iters``
  Auto-PGD iterations, at every radius of ``rho_grid``: Kendall τ over the members between
  the two sets' values. Chosen (``rho_rule: best_retest``): the radius with the largest
  retest τ, ties (equal to 1e-9) to the smaller radius. No generalisation number enters.
* **Power** of the primary comparison at the paper's τ for ``power.n_models`` members with
  the chosen size's reliability and the chosen radius's retest (Monte Carlo, see
  :func:`power`).

``python -m companion.experiments.vision_pilot`` writes ``reports/pilots/vision.json``,
``reports/pilots/vision_sharpness.csv`` and ``reports/pilots/vision.md`` (generated from the
JSON). The chosen values are then written into ``params.yaml`` by hand, in their own commit.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from scipy import stats

from hideseek import Measure

STAGE = "vision_pilot"
OUT = Path("reports/pilots")

#: Kendall τ of the paper's Figure 4 / Table 1 row "ImageNet" (72 CLIP ViT-B/32 fine-tunes).
PAPER_TAU = {"m_apgd_l2": -0.41, "geodesic_invariant": -0.71, "geodesic_mixed": -0.70}


@dataclass(frozen=True)
class PowerSettings:
    n_models: int
    alpha: float
    n_sim: int
    seed: int


@dataclass(frozen=True)
class VisionPilot:
    """The ``vision_pilot`` section."""

    zoo_dir: str
    n_models: int
    n_test: int
    test_sizes: list[int]
    target_reliability: float
    n_splits: int
    n_images: int
    batch_size: int
    n_iters: int
    seed: int
    measures: list[Measure]
    rho_grid: dict[str, list[float]]
    rho_rule: Literal["best_retest"]
    workers: int
    power: PowerSettings


def split_half(test_err: np.ndarray, train_err: np.ndarray, *, seed: int, n_splits: int) -> float:
    """Split-half (Spearman–Brown) reliability of ``mean(test_err, 1) - train_err`` across members."""
    rng = np.random.default_rng(seed)
    n = test_err.shape[1]
    rs = []
    for _ in range(n_splits):
        half = rng.permutation(n) < n // 2
        r = np.corrcoef(test_err[:, half].mean(1) - train_err, test_err[:, ~half].mean(1) - train_err)[0, 1]
        rs.append(2 * r / (1 + r))
    return float(np.mean(rs))


def power(n: int, tau: float, retest_tau: float, rel_y: float, *, alpha: float, n_sim: int, seed: int) -> float:
    """Monte Carlo power of the two-sided level-``alpha`` Kendall test over ``n`` members.

    Latent bivariate normal with Pearson ``sin(pi tau / 2)``; noise added to each variable so
    that its reliability is ``sin(pi retest_tau / 2)`` (the measure) and ``rel_y`` (the gap);
    rejection when scipy's ``kendalltau`` p-value is below ``alpha``.
    """
    r = np.sin(np.pi * tau / 2)
    r_xx, r_yy = max(np.sin(np.pi * retest_tau / 2), 0.0), max(rel_y, 0.0)
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(n_sim):
        z1, z2, ex, ey = rng.standard_normal((4, n))
        x = np.sqrt(r_xx) * z1 + np.sqrt(1 - r_xx) * ex
        y = np.sqrt(r_yy) * (r * z1 + np.sqrt(1 - r * r) * z2) + np.sqrt(1 - r_yy) * ey
        hits += stats.kendalltau(x, y).pvalue < alpha
    return hits / n_sim


def choose_rho(retest: dict[float, float]) -> float:
    """The radius with the largest retest τ; ties (within 1e-9) go to the smaller radius."""
    best = max(retest.values())
    return min(r for r, t in retest.items() if t >= best - 1e-9)


def reliability_curve(errors: np.ndarray, train_err: np.ndarray, p: VisionPilot) -> list[dict]:
    """Gap reliability for each test-set size of ``p.test_sizes`` (prefixes of the test set)."""
    if max(p.test_sizes) > errors.shape[1]:
        raise ValueError(f"test_sizes go up to {max(p.test_sizes)} but the pilot has {errors.shape[1]} test images")
    return [dict(n_test=n, split_half=split_half(errors[:, :n], train_err, seed=p.seed, n_splits=p.n_splits))
            for n in p.test_sizes]


def retest_table(frame, n_batches: int) -> list[dict]:
    """Per (measure, rho): retest τ between the first and the second ``n_batches`` batches, and the values."""
    rows = []
    for (m, rho), g in frame.groupby(["measure", "rho"], sort=False):
        pb = np.array(list(g["per_batch"]))
        a, b = pb[:, :n_batches].mean(1), pb[:, n_batches:].mean(1)
        t = stats.kendalltau(a, b)
        rows.append(dict(measure=m, rho=float(rho), retest=float(t.statistic), pvalue=float(t.pvalue),
                         value_median=float(np.median(a)), value_min=float(a.min()), value_max=float(a.max()),
                         base_loss_median=float(np.median([np.mean(x[:n_batches]) for x in g["base_loss"]]))))
    return rows


def run_pilot(p: VisionPilot, profile: str | None = None, *, progress: bool = True) -> dict:
    """Train the pilot members, measure, choose; returns the report's content (see the module docstring)."""
    import pandas as pd

    from companion.experiments import vision_zoo as vz

    s = vz.load_settings(profile)
    t0 = time.perf_counter()
    meta = vz.train_zoo(p.zoo_dir, s, stream="pilot", n_models=p.n_models, n_test=p.n_test, progress=progress)
    t_train = time.perf_counter() - t0
    errors = vz.test_errors(p.zoo_dir, meta)
    members = vz.members_frame(meta)
    curve = reliability_curve(errors, members["train_error"].to_numpy(), p)
    ok = [c["n_test"] for c in curve if c["split_half"] >= p.target_reliability]
    n_test = min(ok) if ok else max(p.test_sizes)
    data = vz.zoo_data(meta)
    batches = (vz.sharpness_batches(data, p.n_images, p.batch_size, 0)
               + vz.sharpness_batches(data, p.n_images, p.batch_size, p.n_images))
    models = vz.load_zoo(p.zoo_dir)[1]
    t1 = time.perf_counter()
    frame = vz.measure(models, batches, p.measures, p.rho_grid, seed=p.seed, n_iters=p.n_iters, workers=p.workers,
                       progress=progress)
    t_sharp = time.perf_counter() - t1
    rows = retest_table(frame, p.n_images // p.batch_size)
    table = pd.DataFrame(rows)
    rel = next(c["split_half"] for c in curve if c["n_test"] == n_test)
    chosen = {}
    for m in p.measures:
        sub = table[table["measure"] == m.name]
        rho = choose_rho(dict(zip(sub["rho"], sub["retest"])))
        rt = float(sub.set_index("rho").loc[rho, "retest"])
        chosen[m.name] = dict(rho=rho, retest=rt, label=m.label, paper_tau=PAPER_TAU[m.name],
                              power=power(p.power.n_models, PAPER_TAU[m.name], rt, rel, alpha=p.power.alpha,
                                          n_sim=p.power.n_sim, seed=p.power.seed))
    return dict(
        what="vision pilot: test-set size and rho per measure chosen without the gap (rules in params.yaml vision_pilot)",
        rules=dict(test_size=f"smallest of {p.test_sizes} with split-half gap reliability >= {p.target_reliability}",
                   rho=f"{p.rho_rule}: the radius of the grid with the largest test-retest Kendall tau between two "
                       f"disjoint sets of {p.n_images} training images; ties to the smaller radius"),
        settings=dict(n_models=p.n_models, n_test=p.n_test, n_images=p.n_images, batch_size=p.batch_size,
                      n_iters=p.n_iters, seed=p.seed, rho_grid=p.rho_grid, power=vars(p.power),
                      n_splits=p.n_splits),
        members=members.reset_index().to_dict("records"),
        reliability=curve, chosen_n_test=n_test, reliability_at_chosen=rel,
        retest=rows, chosen=chosen,
        seconds=dict(training=t_train, sharpness=t_sharp, per_call_mean=float(frame["seconds"].mean()),
                     n_calls=len(frame)),
    ), frame


def render_markdown(r: dict) -> str:
    """The pilot report as markdown, every number from ``r``."""
    lines = ["# Vision pilot (pre-registration)", "", r["what"] + ".", "",
             f"Pilot members: {r['settings']['n_models']} (stream `pilot`, not in the main zoo); "
             f"sharpness on two disjoint sets of {r['settings']['n_images']} training images in batches of "
             f"{r['settings']['batch_size']}, {r['settings']['n_iters']} Auto-PGD iterations.", "",
             "Rules (fixed in `params.yaml` before the pilot ran):", "",
             f"- test-set size: {r['rules']['test_size']}", f"- ρ: {r['rules']['rho']}", "",
             "## Gap reliability against test-set size", "", "| test images | split-half reliability |", "|---|---|"]
    lines += [f"| {c['n_test']} | {c['split_half']:.3f} |" for c in r["reliability"]]
    lines += ["", f"Chosen test-set size: **{r['chosen_n_test']}** (reliability {r['reliability_at_chosen']:.3f}).",
              "", "## Test–retest per measure and radius", "",
              "| measure | ρ | retest τ | median sharpness (set 1) | median base loss |", "|---|---|---|---|---|"]
    lines += [f"| {x['measure']} | {x['rho']:g} | {x['retest']:.3f} | {x['value_median']:.4g} | "
              f"{x['base_loss_median']:.4g} |" for x in r["retest"]]
    lines += ["", "## Chosen radius, ceiling and power", "",
              f"Power: two-sided Kendall test at α = {r['settings']['power']['alpha']} over "
              f"{r['settings']['power']['n_models']} members, at the paper's τ, with the measured reliabilities "
              f"({r['settings']['power']['n_sim']} simulations).", "",
              "| measure | ρ | retest τ | paper τ | ceiling on abs(τ) | power |", "|---|---|---|---|---|---|"]
    for m, c in r["chosen"].items():
        ceil = 2 / np.pi * np.arcsin(np.sqrt(max(np.sin(np.pi * c["retest"] / 2), 0) * max(r["reliability_at_chosen"], 0)))
        lines.append(f"| {c['label']} | {c['rho']:g} | {c['retest']:.3f} | {c['paper_tau']:+.2f} | {ceil:.3f} | "
                     f"{c['power']:.3f} |")
    sec = r["seconds"]
    lines += ["", f"Timings (shared, busy 2-core machine): training {sec['training']:.0f} s, sharpness "
              f"{sec['sharpness']:.0f} s ({sec['n_calls']} calls, {sec['per_call_mean']:.2f} s each on average).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m companion.experiments.vision_pilot", description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    from companion.params import ParamsError, settings
    from hideseek.utils import set_threads

    try:
        p = settings(VisionPilot, STAGE, args.profile, args.overrides)
    except ParamsError as exc:
        ap.error(str(exc))
    set_threads(1)
    report, frame = run_pilot(p, args.profile, progress=not args.no_progress)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vision.json").write_text(json.dumps(report, indent=1))
    frame.assign(per_batch=frame["per_batch"].map(json.dumps), base_loss=frame["base_loss"].map(json.dumps)).to_csv(
        out / "vision_sharpness.csv", index=False)
    (out / "vision.md").write_text(render_markdown(report))
    print(render_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
