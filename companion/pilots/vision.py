"""Vision pilot: the test-set size and each measure's radius, chosen before the main zoo is measured.

Pilot members are fine-tuned by the main zoo's recipe from the same pre-trained start but
from another random stream (``stream="pilot"`` in :func:`companion.experiments.vision_zoo.member_draws`), so none
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
  the chosen size's reliability and the chosen radius's retest (Monte Carlo,
  :func:`companion.analysis.power`), with the ceiling on |τ| they imply.

``python -m companion.pilots.vision`` writes ``reports/pilots/vision.json``,
``reports/pilots/vision_sharpness.csv`` and ``reports/pilots/vision.md`` (generated from the
JSON); ``--summarise-only`` recomputes the report from the saved members and sharpness. The
chosen values are then written into ``params.yaml`` by hand, in their own commit. The
statistics are :mod:`companion.analysis`'s.

``--section vision16_pilot`` runs the 16-token stand-in's pilot (pre-registration
``reports/preregistration/vision16.md``; files ``reports/pilots/vision16*``): its members are
``vision_train`` with ``vision_overrides`` (patch 4 on the 16×16 glyphs), and two further rules
apply (both fixed in the section before it ran):

* **Sharpness images per set** (:func:`choose_count`): for each count of
  ``n_images_candidates`` the two sets are the first ``2 n / batch_size`` measured batches
  (pool images ``0 .. n - 1`` and ``n .. 2n - 1``, exactly the vision stage's layout at that
  count; each batch's random draws depend on its index alone, so these are the values a stage
  run at that count gives); chosen: the smallest count whose best retest over the grid
  reaches ``min_retest`` for every measure, else the largest. ρ is then chosen at that count.
* **Power of the primary paired Δτ** (``paired_power``, :func:`paired_power`; nothing is
  chosen by it): :func:`companion.analysis.delta_power` at ``power.n_models`` members, the
  paper's τ, the chosen retests and the pilot members' τ between each geodesic measure and
  adaptive sharpness.
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

from companion import analysis
from hideseek import Measure

STAGE = "vision_pilot"
#: The pilots' params.yaml sections: the 4-token stand-in's (reports/pilots/vision.md) and the 16-token one's
#: (reports/preregistration/vision16.md, reports/pilots/vision16.md).
SECTIONS = ("vision_pilot", "vision16_pilot")
OUT = Path("reports/pilots")

#: Table 1 column of each measure's name.
COLUMN = {"m_apgd_l2": "adaptive", "geodesic_invariant": "geodesic_invariant", "geodesic_mixed": "geodesic_mixed"}


@dataclass(frozen=True)
class PowerSettings:
    n_models: int
    alpha: float
    n_sim: int
    seed: int


@dataclass(frozen=True)
class PairedPower:
    """Monte Carlo settings of :func:`companion.analysis.delta_power` (reports/preregistration/delta_tau.md)."""

    n_sim: int
    n_boot: int
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
    report: str                           # file stem under the output folder: <report>.md, .json, _sharpness.csv
    vision_overrides: list[str]           # vision_train overrides of the pilot members (e.g. model.patch_size=4)
    n_images_candidates: list[int]        # images per set to choose from (the largest = n_images, measured)
    min_retest: float                     # count rule: smallest candidate whose best retest reaches it, every measure
    paired_power: PairedPower | None      # power of the primary paired Δτ at power.n_models (null: not computed)


def choose_rho(retest: dict[float, float]) -> float:
    """The radius with the largest retest τ; ties (within 1e-9) go to the smaller radius."""
    best = max(retest.values())
    return min(r for r, t in retest.items() if t >= best - 1e-9)


def reliability_curve(errors: np.ndarray, train_err: np.ndarray, p: VisionPilot) -> list[dict]:
    """Gap reliability (:func:`companion.analysis.gap_reliability`) for each size of ``p.test_sizes``
    (prefixes of the test set)."""
    if max(p.test_sizes) > errors.shape[1]:
        raise ValueError(f"test_sizes go up to {max(p.test_sizes)} but the pilot has {errors.shape[1]} test images")
    out = []
    for n in p.test_sizes:
        r = analysis.gap_reliability(errors[:, :n], train_err, seed=p.seed, n_splits=p.n_splits)
        out.append(dict(n_test=n, split_half=r.split_half, disagreement=r.disagreement))
    return out


def retest_table(frame, n_batches: int) -> list[dict]:
    """Per (measure, rho): retest τ between batches ``0 .. n_batches - 1`` and ``n_batches .. 2 n_batches - 1``
    (the two sets of ``n_batches`` batches, as the ``vision`` stage lays them out), and the values."""
    rows = []
    for (m, rho), g in frame.groupby(["measure", "rho"], sort=False):
        pb = np.array(list(g["per_batch"]))
        if pb.shape[1] < 2 * n_batches:
            raise ValueError(f"{m} at rho {rho}: {pb.shape[1]} batches measured, two sets of {n_batches} need "
                             f"{2 * n_batches}")
        a, b = pb[:, :n_batches].mean(1), pb[:, n_batches:2 * n_batches].mean(1)
        t = analysis.retest(a, b, n_boot=0, seed=0)
        rows.append(dict(measure=m, rho=float(rho), retest=t.tau, pvalue=t.pvalue,
                         value_median=float(np.median(a)), value_min=float(a.min()), value_max=float(a.max()),
                         base_loss_median=float(np.median([np.mean(x[:n_batches]) for x in g["base_loss"]]))))
    return rows


def check_candidates(p: VisionPilot) -> None:
    """The image counts must be positive multiples of the batch size, the largest the measured ``n_images``."""
    bad = [c for c in p.n_images_candidates if c <= 0 or c % p.batch_size]
    if bad or not p.n_images_candidates:
        raise ValueError(f"n_images_candidates {p.n_images_candidates}: each must be a positive multiple of "
                         f"batch_size {p.batch_size}")
    if max(p.n_images_candidates) != p.n_images:
        raise ValueError(f"the largest of n_images_candidates {p.n_images_candidates} must equal n_images "
                         f"{p.n_images} (the images per set the pilot measures)")


def choose_count(best: dict[int, dict[str, float]], min_retest: float) -> int:
    """The smallest count whose best retest τ reaches ``min_retest`` for every measure (``best``: count ->
    measure -> best retest over the grid); none: the largest count."""
    ok = [c for c, per in best.items() if all(t >= min_retest for t in per.values())]
    return min(ok) if ok else max(best)


def measure_pilot(p: VisionPilot, profile: str | None, *, progress: bool):
    """Train the pilot members and measure them on both sets: ``(meta, frame, seconds)``."""
    from companion.experiments import vision_zoo as vz

    s = vz.load_settings(profile, p.vision_overrides)
    t0 = time.perf_counter()
    meta = vz.train_zoo(p.zoo_dir, s, stream="pilot", n_models=p.n_models, n_test=p.n_test, progress=progress)
    t_train = time.perf_counter() - t0
    data = vz.zoo_data(meta)
    batches = (vz.sharpness_batches(data, p.n_images, p.batch_size, 0)
               + vz.sharpness_batches(data, p.n_images, p.batch_size, p.n_images))
    t1 = time.perf_counter()
    frame = vz.measure(vz.load_zoo(p.zoo_dir)[1], batches, {m.name: m for m in p.measures}, p.rho_grid,
                       seed=p.seed, n_iters=p.n_iters, workers=p.workers, progress=progress)
    seconds = dict(training=t_train, sharpness=time.perf_counter() - t1, per_call_mean=float(frame["seconds"].mean()),
                   n_calls=len(frame))
    return meta, frame, seconds


def summarise(p: VisionPilot, meta: dict, errors: np.ndarray, frame, seconds: dict) -> dict:
    """The pilot report's content from the trained members, their test errors and the sharpness frame."""
    import pandas as pd

    from companion import paper
    from companion.experiments import vision_zoo as vz

    paper_tau = paper.table1_tau("vision")
    members = vz.members_frame(meta)
    curve = reliability_curve(errors, members["train_error"].to_numpy(), p)
    ok = [c["n_test"] for c in curve if c["split_half"] >= p.target_reliability]
    n_test = min(ok) if ok else max(p.test_sizes)
    rel = next(c["split_half"] for c in curve if c["n_test"] == n_test)
    check_candidates(p)
    by_count = {c: retest_table(frame, c // p.batch_size) for c in sorted(p.n_images_candidates)}
    best = {c: {m.name: max(r["retest"] for r in rows if r["measure"] == m.name) for m in p.measures}
            for c, rows in by_count.items()}
    count = choose_count(best, p.min_retest)
    rows = by_count[count]
    table = pd.DataFrame(rows)
    chosen = {}
    for m in p.measures:
        sub = table[table["measure"] == m.name]
        rho = choose_rho(dict(zip(sub["rho"], sub["retest"])))
        rt = float(sub.set_index("rho").loc[rho, "retest"])
        tau = paper_tau[COLUMN[m.name]]
        chosen[m.name] = dict(column=COLUMN[m.name], rho=rho, retest=rt, label=m.label, paper_tau=tau,
                              tau_ceiling=analysis.ceiling(rt, rel),
                              expected_at_paper_tau=analysis.attenuated(tau, rt, rel),
                              power=analysis.power(p.power.n_models, tau, rt, rel, alpha=p.power.alpha,
                                                   n_sim=p.power.n_sim, seed=p.power.seed))
    rules = dict(test_size=f"smallest of {p.test_sizes} with split-half gap reliability >= {p.target_reliability}",
                 rho=f"{p.rho_rule}: the radius of the grid with the largest test-retest Kendall tau between two "
                     f"disjoint sets of {count} training images; ties to the smaller radius")
    if len(p.n_images_candidates) > 1:
        rules["n_images"] = (f"smallest of {sorted(p.n_images_candidates)} images per set whose best test-retest "
                             f"over the grid reaches {p.min_retest} for every measure; none: the largest")
    out = dict(
        what=f"vision pilot: test-set size and rho per measure chosen without the gap (rules in params.yaml "
             f"{p.report}_pilot)",
        rules=rules,
        settings=dict(n_models=p.n_models, n_test=p.n_test, n_images=p.n_images, batch_size=p.batch_size,
                      n_iters=p.n_iters, seed=p.seed, rho_grid=p.rho_grid, power=vars(p.power), n_splits=p.n_splits),
        members=members.reset_index().to_dict("records"),
        reliability=curve, chosen_n_test=n_test, reliability_at_chosen=rel,
        retest=rows, chosen=chosen, seconds=seconds)
    if len(p.n_images_candidates) > 1:
        out.update(chosen_n_images=count, best_retest_by_count={str(c): v for c, v in best.items()},
                   retest_by_count={str(c): v for c, v in by_count.items()},
                   settings=dict(out["settings"], n_images_candidates=sorted(p.n_images_candidates),
                                 min_retest=p.min_retest, vision_overrides=list(p.vision_overrides),
                                 model=meta["settings"]["model"], image_size=meta["settings"]["data"]["spec"]["image_size"]))
    if p.paired_power is not None:
        out["paired_power"] = paired_power(p, frame, count, chosen, rel)
    return out


def paired_power(p: VisionPilot, frame, count: int, chosen: dict, rel: float) -> list[dict]:
    """Power of the primary paired Δτ (reports/preregistration/delta_tau.md) at ``p.power.n_models`` members and
    the paper's τ, with the pilot's retests at ``count`` images and the chosen radii, the gap's reliability
    ``rel`` and the pilot members' observed τ between each geodesic measure and adaptive sharpness (set 1)."""
    from companion.experiments import paired

    nb = count // p.batch_size
    first = {}
    for m in p.measures:
        g = frame[(frame["measure"] == m.name) & (frame["rho"] == chosen[m.name]["rho"])].sort_values("model")
        first[COLUMN[m.name]] = np.array([np.mean(v[:nb]) for v in g["per_batch"]])
    base = next(m.name for m in p.measures if COLUMN[m.name] == "adaptive")
    out = []
    for m in p.measures:
        col = COLUMN[m.name]
        if col == "adaptive":
            continue
        between = analysis.kendall(first[col], first["adaptive"], n_boot=0, seed=0).tau
        sign = paired.paper_sign("vision", col)
        pw = analysis.delta_power(p.power.n_models, chosen[m.name]["paper_tau"], chosen[base]["paper_tau"],
                                  retest_x=chosen[m.name]["retest"], retest_base=chosen[base]["retest"], rel_y=rel,
                                  tau_between=between, sign=sign, n_sim=p.paired_power.n_sim,
                                  n_boot=p.paired_power.n_boot, seed=p.paired_power.seed)
        out.append(dict(measure=col, paper_delta=paired.paper_delta("vision", col, "adaptive"), sign=sign,
                        tau_between_pilot=between, power=pw))
    return out


def render_markdown(r: dict) -> str:
    """The pilot report as markdown, every number from ``r``."""
    st = r["settings"]
    tr = [m["train_error"] for m in r["members"]]
    gaps = [m["gap"] for m in r["members"]]
    counts = "chosen_n_images" in r
    lines = ["# Vision pilot (pre-registration)", "", r["what"] + ".", ""]
    if counts:
        md = st["model"]
        tokens = (st["image_size"] // md["patch_size"]) ** 2
        lines += [f"Model: patch {md['patch_size']} on {st['image_size']}×{st['image_size']} images ({tokens} patch "
                  f"tokens), width {md['width']}, {md['layers']} layers, {md['heads']} heads (vision_train overrides "
                  f"{', '.join(f'`{o}`' for o in st['vision_overrides']) or 'none'}).", ""]
    lines += [f"Pilot members: {st['n_models']} (stream `pilot`: the main zoo's recipe and pre-trained start, other "
              f"draws; none is in the main zoo), train error {min(tr):.3f}–{max(tr):.3f}, gap (test − train) "
              f"{min(gaps):+.3f}–{max(gaps):+.3f}. Sharpness on two disjoint sets of {st['n_images']} training images "
              f"in batches of {st['batch_size']}, {st['n_iters']} Auto-PGD iterations.", "",
              "Rules (fixed in `params.yaml` before the pilot ran):", "",
              f"- test-set size: {r['rules']['test_size']}", f"- ρ: {r['rules']['rho']}"]
    if counts:
        lines += [f"- sharpness images per set: {r['rules']['n_images']} (the smaller sets are the first batches of "
                  f"each measured set's layout: set 1 = pool images 0 … n − 1, set 2 = n … 2n − 1, as the vision "
                  f"stage draws them)"]
        lines += ["", "## Sharpness images per set", "",
                  "Best test–retest τ over the radius grid, per measure and images per set:", "",
                  "| images per set | " + " | ".join(r["best_retest_by_count"][next(iter(r["best_retest_by_count"]))])
                  + " |", "|---|" + "---|" * len(r["chosen"])]
        lines += [f"| {c} | " + " | ".join(f"{v:.3f}" for v in per.values()) + " |"
                  for c, per in r["best_retest_by_count"].items()]
        lines += ["", f"Chosen: **{r['chosen_n_images']}** images per set; the tables below are at that count."]
    lines += ["", "## Gap reliability against test-set size", "",
             "| test images | split halves (Spearman–Brown) | pairwise disagreement |", "|---|---|---|"]
    lines += [f"| {c['n_test']} | {c['split_half']:.3f} | {c['disagreement']:.3f} |" for c in r["reliability"]]
    lines += ["", f"Chosen test-set size: **{r['chosen_n_test']}** (split-half reliability "
              f"{r['reliability_at_chosen']:.3f}).", "", "## Test–retest per measure and radius", "",
              "| measure | ρ | retest τ | median sharpness (set 1) | median base loss |", "|---|---|---|---|---|"]
    lines += [f"| {x['measure']} | {x['rho']:g} | {x['retest']:.3f} | {x['value_median']:.4g} | "
              f"{x['base_loss_median']:.4g} |" for x in r["retest"]]
    pw = st["power"]
    lines += ["", "## Chosen radius, ceiling and power", "",
              f"Power: two-sided test of τ = 0 at α = {pw['alpha']} over {pw['n_models']} members, at the paper's τ, "
              f"with the measured reliabilities ({pw['n_sim']} simulations, `companion.analysis.power`).", "",
              "| measure | ρ | retest τ | paper τ | ceiling on abs(τ) | expected τ at the paper's | power |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {c['label']} | {c['rho']:g} | {c['retest']:.3f} | {c['paper_tau']:+.2f} | {c['tau_ceiling']:.3f} | "
              f"{c['expected_at_paper_tau']:+.3f} | {c['power']:.3f} |" for c in r["chosen"].values()]
    if r.get("paired_power"):
        pp = r["paired_power"]
        lines += ["", "Power of the primary paired Δτ (reports/preregistration/delta_tau.md) at the paper's τ over "
                  f"{pw['n_models']} members, with these retests, the gap's reliability and the pilot members' τ "
                  f"between each geodesic measure and adaptive sharpness (`companion.analysis.delta_power`):", "",
                  "| geodesic measure | paper Δ (signed) | τ with adaptive (pilot) | power |", "|---|---|---|---|"]
        lines += [f"| {x['measure']} | {x['paper_delta']:+.2f} | {x['tau_between_pilot']:+.3f} | {x['power']:.3f} |"
                  for x in pp]
    sec = r["seconds"]
    lines += ["", f"Timings (shared, busy 2-core machine): training {sec['training']:.0f} s, sharpness "
              f"{sec['sharpness']:.0f} s ({sec['n_calls']} calls of {2 * st['n_images'] // st['batch_size']} batches, "
              f"{sec['per_call_mean']:.2f} s each on average).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m companion.pilots.vision", description=__doc__.split("\n")[0])
    ap.add_argument("--section", default=STAGE, choices=SECTIONS,
                    help=f"params.yaml section of the pilot (default {STAGE}; vision16_pilot: 16 patch tokens)")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--summarise-only", action="store_true",
                    help="recompute the report from the saved pilot zoo and OUT/vision_sharpness.csv (no training)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    import pandas as pd

    from companion.experiments import vision_zoo as vz
    from companion.params import ParamsError, settings
    from hideseek.utils import set_threads

    try:
        p = settings(VisionPilot, args.section, args.profile, args.overrides)
        check_candidates(p)
    except (ParamsError, ValueError) as exc:
        ap.error(str(exc))
    set_threads(1)
    out = Path(args.out)
    if args.summarise_only:
        meta = vz.load_zoo(p.zoo_dir)[0]
        frame = pd.read_csv(out / f"{p.report}_sharpness.csv")
        frame["per_batch"] = frame["per_batch"].map(json.loads)
        frame["base_loss"] = frame["base_loss"].map(json.loads)
        seconds = json.loads((out / f"{p.report}.json").read_text())["seconds"]
    else:
        meta, frame, seconds = measure_pilot(p, args.profile, progress=not args.no_progress)
        out.mkdir(parents=True, exist_ok=True)
        frame.assign(per_batch=frame["per_batch"].map(json.dumps), base_loss=frame["base_loss"].map(json.dumps)) \
            .to_csv(out / f"{p.report}_sharpness.csv", index=False)
    report = summarise(p, meta, vz.test_errors(p.zoo_dir, meta), frame, seconds)
    (out / f"{p.report}.json").write_text(json.dumps(report, indent=1))
    (out / f"{p.report}.md").write_text(render_markdown(report))
    print(render_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
