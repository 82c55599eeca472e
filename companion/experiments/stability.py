"""How much of the language zoo's Kendall tau is the zoo's draw: tau over independently seeded zoos.

The language row of Table 1 rests on one zoo: one pre-training seed and one block of
fine-tuning seeds.  This module trains ``n_zoos`` zoos that differ only in their
fine-tuning seeds (same corpus, same recipe; zoo ``j`` uses seeds ``base_seed + j·stride +
i``), from one shared pre-trained model as McCoy et al.'s 100 runs share one BERT, or with
``vary_pretrain`` also from its own pre-training seed ``pretrain_seed + j``; and reports, for each zoo and each measure,
Kendall tau between the measure and the generalisation gap over all members of that zoo,
at a radius fixed in advance (no per-zoo selection), for the in-distribution gap (dev −
train, the paper's) and the HANS-like gap (test − train).  The spread of tau across zoos
is the part of a single zoo's tau that is the draw.

Command line (a DVC stage of its own, ``language_stability``)::

    python -m companion.experiments.stability --out data/zoos/language_stability \\
        --report reports/data/language/stability.csv --profile cpu

reads ``params.yaml`` section ``language_stability`` into :class:`StabilitySettings` (every key
required, none defaulted in code): ``zoo`` (a ``language_train`` profile dict, the recipe; its
``finetune.n_models`` is the zoo size), ``n_zoos``, ``seed_stride``, ``vary_pretrain``, ``n_points``,
``batch_size``, ``data_seed``, ``n_iters``, ``seed``, ``rho`` (one radius per measure of
:data:`companion.experiments.zoo.STANDARD_MEASURES`), ``relative_flatness`` (bool), ``n_boot``,
``threads``, ``workers``.

``n_zoos: 0`` means "not run in this profile" (the cpu profile: a secondary experiment dropped to
keep ``make repro`` within its budget, issue 16 item 8): nothing is trained or measured; the
metrics file says it was skipped and why, with an empty ``table1`` (so Table 1 has no stability
line), and the report tables hold their header only. One zoo (``n_zoos: 1``) shows no spread and is
refused.

The wall-clock times (per zoo: training, with the per-member record :func:`language_zoo.train_zoo`
writes beside a zoo, and measuring) go to ``reports/timings/language_stability.json`` (``--timings``;
git, not DVC): no DVC output holds a time, so the zoos' own timing files are moved out of ``--out``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from companion.experiments import language_zoo as lz

TIMINGS = Path("reports/timings/language_stability.json")

GAPS = {"gap_in_distribution": ("dev_error", "train_error"), "gap_hans": ("test_error", "train_error")}
#: columns of the report tables (the per-zoo taus, the members), also written, header only, when skipped
TAU_COLUMNS = ["measure", "rho", "gap", "tau", "ci_low", "ci_high", "pvalue", "n", "zoo", "pretrain_seed", "base_seed"]
MEMBER_COLUMNS = ["model", "seed", "train_error", "dev_error", "test_error", *GAPS, "zoo"]
#: what the metrics file says when the profile does not run the experiment (n_zoos: 0)
SKIPPED = ("not run in this profile (n_zoos: 0): a secondary experiment, dropped so that the profile's "
           "make repro fits its time budget; the gpu and paper profiles run it")


@dataclass(frozen=True)
class StabilitySettings:
    """``params.yaml`` section ``language_stability`` (see the module docstring)."""

    zoo: dict[str, Any]          # a language_train profile mapping (checked by language_zoo.ZooSpec.from_dict)
    n_zoos: int                  # 0: not run in this profile; otherwise >= 2
    seed_stride: int
    vary_pretrain: bool
    n_points: int
    batch_size: int
    data_seed: int
    n_iters: int
    seed: int
    rho: dict[str, float]
    relative_flatness: bool
    n_boot: int
    threads: int | None
    workers: int


def stability_settings(params: "StabilitySettings | Mapping[str, Any]",
                       where: str = "language_stability") -> StabilitySettings:
    """Typed settings from a resolved mapping (checked: missing and unknown keys refused), or as given."""
    from companion.params import from_mapping

    return params if isinstance(params, StabilitySettings) else from_mapping(StabilitySettings, params, where)


def zoo_spec(base: Mapping[str, Any], j: int, stride: int, *, vary_pretrain: bool = True,
             shared_pretrained: str | Path | None = None) -> "lz.ZooSpec":
    """The recipe ``base`` with zoo ``j``'s seeds: fine-tuning ``base_seed + j·stride``
    (``stride`` ≥ the zoo size, so no two zoos share a seed); pre-training ``seed + j`` when
    ``vary_pretrain``, else zoo ``j ≥ 1`` fine-tunes ``shared_pretrained`` (zoo 0's model)."""
    spec = lz.ZooSpec.from_dict({k: v for k, v in base.items() if k != "threads"})
    n_models = spec.finetune.n_models
    if stride < n_models:
        raise ValueError(f"seed_stride={stride} is smaller than the zoo size {n_models}: zoos would share seeds")
    pre = dataclasses.replace(spec.pretrain, seed=spec.pretrain.seed + j) if vary_pretrain else spec.pretrain
    if not vary_pretrain and j > 0:
        if shared_pretrained is None:
            raise ValueError("zoos that share the pre-trained model need its folder (shared_pretrained)")
        spec = dataclasses.replace(spec, base=str(shared_pretrained))
    ft = dataclasses.replace(spec.finetune, base_seed=spec.finetune.base_seed + j * stride)
    return dataclasses.replace(spec, pretrain=pre, finetune=ft)


def member_gaps(zoo: Mapping[str, Any]):
    """One row per member: its errors and both gaps, computed here from the recorded errors."""
    import pandas as pd

    rows = []
    for m in zoo["models"]:
        row = {"model": m["name"], "seed": m["seed"], **{k: m[k] for k in ("train_error", "dev_error", "test_error")}}
        for g, (a, b) in GAPS.items():
            row[g] = m[a] - m[b]
        rows.append(row)
    return pd.DataFrame(rows).set_index("model")


def measure_one_zoo(zoo_dir: str | Path, params: "StabilitySettings | Mapping[str, Any]", *,
                    progress: bool = False):
    """Values of every measure on every member of one zoo: a frame ``model, measure, rho, value``."""
    import pandas as pd

    from companion.experiments.zoo import STANDARD_MEASURES, measure_zoo

    s = stability_settings(params)
    rho = dict(s.rho)
    unknown = set(rho) - set(STANDARD_MEASURES)
    if unknown:
        raise ValueError(f"unknown measures {sorted(unknown)} in rho; known: {sorted(STANDARD_MEASURES)}")
    batches = lz.sharpness_batches(zoo_dir, s.n_points, s.batch_size, s.data_seed)
    loaders = lz.model_loaders(zoo_dir)
    frame = measure_zoo(loaders, batches, {k: STANDARD_MEASURES[k] for k in rho},
                        {k: [float(v)] for k, v in rho.items()}, seed=s.seed,
                        n_iters=s.n_iters, progress=progress, common={"progress": False},
                        workers=s.workers)
    frame = frame[["model", "measure", "rho", "value"]]
    if s.relative_flatness:
        from companion.experiments.relative import relative_flatness_values

        rf = relative_flatness_values(loaders, batches)[["model", "value"]]
        frame = pd.concat([frame, rf.assign(measure="relative_flatness", rho=float("nan"))], ignore_index=True)
    return frame


def zoo_taus(frame, gaps, *, n_boot: int, seed: int):
    """Kendall tau of each measure against each gap over all members of one zoo."""
    import pandas as pd

    from companion.analysis import kendall as kendall_tau

    rows = []
    for measure, sub in frame.groupby("measure", sort=False):
        vals = sub.set_index("model")["value"]
        for g in GAPS:
            y = gaps.loc[vals.index, g].to_numpy()
            t = kendall_tau(vals.to_numpy(), y, n_boot=n_boot, seed=seed)
            rows.append(dict(measure=measure, rho=float(sub["rho"].iloc[0]), gap=g, tau=t.tau,
                             ci_low=t.ci_low, ci_high=t.ci_high, pvalue=t.pvalue, n=t.n))
    return pd.DataFrame(rows)


def run_stability(params: "StabilitySettings | Mapping[str, Any]", out_dir: str | Path, *, progress: bool = True,
                  train: bool = True):
    """Train (unless ``train=False`` and the zoos exist) and measure ``n_zoos`` zoos.

    Returns ``(taus, members, summary, seconds)``: tau per (zoo, measure, gap); every member's errors
    and gaps; per (measure, gap) the mean, standard deviation, min and max of tau over
    zoos (the spread a reader should hold a single zoo's tau against); the wall-clock times per zoo.
    """
    import pandas as pd

    from hideseek.utils import set_threads

    s = stability_settings(params)
    check_n_zoos(s.n_zoos, allow_skip=False)
    if s.threads is not None:
        set_threads(s.threads)
    out = Path(out_dir)
    all_taus, all_members, seconds = [], [], {}
    for j in range(s.n_zoos):
        zdir = out / f"zoo_{j}"
        spec = zoo_spec(s.zoo, j, s.seed_stride, vary_pretrain=s.vary_pretrain,
                        shared_pretrained=out / "zoo_0" / "pretrained")
        t0 = time.perf_counter()
        training = None
        if train or not (zdir / "zoo.json").is_file():
            zoo = lz.train_zoo(spec, zdir, progress=progress)
            beside = lz.timings_file(zdir)   # beside the zoo, i.e. inside this stage's DVC output: moved out
            training = json.loads(beside.read_text())
            beside.unlink()
        else:
            zoo = lz.load_zoo(zdir)
            if zoo["spec"] != json.loads(json.dumps(spec.to_dict())):
                raise ValueError(f"{zdir} holds a zoo of another recipe or seeds; train it again")
        t1 = time.perf_counter()
        gaps = member_gaps(zoo)
        frame = measure_one_zoo(zdir, s, progress=progress)
        taus = zoo_taus(frame, gaps, n_boot=s.n_boot, seed=s.seed)
        seconds[f"zoo_{j}"] = {"train": t1 - t0, "measure": time.perf_counter() - t1, "training": training}
        all_taus.append(taus.assign(zoo=j, pretrain_seed=spec.pretrain.seed,
                                    base_seed=spec.finetune.base_seed))
        all_members.append(gaps.reset_index().assign(zoo=j))
    taus = pd.concat(all_taus, ignore_index=True)
    members = pd.concat(all_members, ignore_index=True)
    summary = (taus.groupby(["measure", "gap"], sort=False)["tau"]
               .agg(["mean", "std", "min", "max", "count", "size"]).reset_index()
               .rename(columns={"count": "n_defined", "size": "n_zoos"}))   # tau undefined for a constant gap
    return taus, members, summary, seconds


def check_n_zoos(n_zoos: int, *, allow_skip: bool) -> None:
    """``n_zoos`` must be >= 2 (one zoo shows no spread), or 0 (not run) where skipping is allowed."""
    if n_zoos == 0 and allow_skip:
        return
    if n_zoos < 2:
        raise ValueError(f"language_stability.n_zoos must be >= 2 to show a spread over zoos, or 0 to skip the "
                         f"experiment in this profile; got {n_zoos}")


def table1_entry(taus) -> dict[str, Any]:
    """The Table 1 line of the stability zoos: per measure the mean tau over zoos (in-distribution
    gap, all members of each zoo, rho fixed in advance) with the per-zoo taus as its ``spread``."""
    from companion import metrics as cm
    from companion.experiments.zoo import STANDARD_MEASURES

    sub = taus[(taus["gap"] == "gap_in_distribution") & taus["measure"].isin(list(STANDARD_MEASURES))]
    spread = cm.tau_spread(sub, measures=[m for m in STANDARD_MEASURES if m in set(sub["measure"])])
    n_zoos, size = len(set(sub["zoo"])), int(sub["n"].max())
    return {"row": "language",
            "variant": f"{n_zoos} other seeded zoos of {size} (all members, ρ fixed in advance): mean τ over zoos",
            "tau": {m: s["mean"] for m, s in spread.items()},
            "rho": {m: float(sub[sub["measure"] == m]["rho"].iloc[0]) for m in spread},
            "n_models": size, "spread": spread}


def write_skipped(profile: str, s: StabilitySettings, out: str | Path, report: str | Path,
                  metrics: str | Path) -> None:
    """The stage's outputs when the profile does not run it (``n_zoos: 0``): no zoo, report tables with
    their header only, and a metrics file that says it was skipped and why (no Table 1 line)."""
    out, report = Path(out), Path(report)
    out.mkdir(parents=True, exist_ok=True)
    (out / "SKIPPED.txt").write_text(f"language_stability, profile {profile}: {SKIPPED}\n")
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(",".join(TAU_COLUMNS) + "\n")
    report.with_name(report.stem + "_members.csv").write_text(",".join(MEMBER_COLUMNS) + "\n")
    Path(metrics).parent.mkdir(parents=True, exist_ok=True)
    Path(metrics).write_text(json.dumps({"profile": profile, "skipped": SKIPPED, "params": dataclasses.asdict(s),
                                         "table1": []}, indent=1))


def main(argv: Sequence[str] | None = None) -> int:
    from companion.metrics import write_json
    from companion.params import stage_params

    ap = argparse.ArgumentParser(prog="python -m companion.experiments.stability",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="data/zoos/language_stability")
    ap.add_argument("--report", default="reports/data/language/stability.csv")
    ap.add_argument("--metrics", default="reports/metrics/language_stability.json")
    ap.add_argument("--timings", default=str(TIMINGS), help="where the wall-clock times go (git, not DVC)")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--no-train", action="store_true", help="reuse zoos already in --out")
    args = ap.parse_args(argv)
    profile, raw = stage_params("language_stability", args.profile, path=args.params)
    s = stability_settings(raw, f"params.yaml language_stability ({profile})")
    check_n_zoos(s.n_zoos, allow_skip=True)
    if s.n_zoos == 0:
        write_skipped(profile, s, args.out, args.report, args.metrics)
        print(f"language_stability: {SKIPPED}")
        return 0
    taus, members, summary, seconds = run_stability(s, args.out, train=not args.no_train)
    report = Path(args.report)
    report.parent.mkdir(parents=True, exist_ok=True)
    taus.to_csv(report, index=False)
    members.to_csv(report.with_name(report.stem + "_members.csv"), index=False)
    metrics = {"profile": profile, "params": dataclasses.asdict(s),
               "summary": summary.to_dict("records"), "table1": table1_entry(taus)}
    write_json(args.timings, {"profile": profile, "seconds": seconds})
    Path(args.metrics).parent.mkdir(parents=True, exist_ok=True)
    Path(args.metrics).write_text(json.dumps(metrics, indent=1, default=float))
    print(summary.to_string(index=False, float_format=lambda v: f"{v:+.3f}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
