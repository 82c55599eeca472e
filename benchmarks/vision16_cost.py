"""What more patch tokens cost the vision stand-in (issue 24 item 3): measured on the stages' own code paths.

For each model configuration asked for (``--config patch:width:layers``, heads, MLP ratio and the rest
of ``vision_train``'s model as the profile states them; default: the profile's own model and the same
with patch 4, i.e. 16 patch tokens on 16×16 glyphs), in one process with one thread, interleaved
(config A, config B, …, repeated ``--repeats`` times; medians reported):

* ``pretrain_epoch``: one epoch of :func:`companion.experiments.vision_zoo.pretrain_contrastive` (the
  profile's pre-training settings, the whole pool);
* ``finetune_epoch_bs<b>``: one epoch of :func:`companion.experiments.vision_zoo.fit` from that start with
  batch size ``b`` (each size of the profile's ``ranges.batch_size``; input noise and shift on, no mixup);
* ``sharpness_<measure>_<k>``: one :func:`companion.experiments.vision_zoo.measure` call (the ``vision``
  stage's path: :func:`companion.experiments.zoo.measure_zoo`, workers 1) on ``k`` batches of the stage's
  ``batch_size`` pool images at the stage's pre-registered radius and ``n_iters``, for ``k`` = 1 and 3:
  per batch = (t3 − t1) / 2, per call set-up = t1 − per batch;
* ``geometry_member``: :func:`companion.experiments.geometry_lines.measure_member` on the vision row's
  ``exact_batches`` / ``hessian_batches`` (the vision part of the ``geometry_lines`` stage, one member).

Every timing is recorded twice: the process's CPU seconds (the key itself; one thread, so the cost of the
step whatever else the machine runs — what the projection uses) and the wall-clock seconds (``<key>_wall``).
The model is the fine-tuned one of the same repeat (weights matter to sharpness' cost only through the
solver's path; all configurations are treated alike). The machine's load average is recorded before
and after each repeat. :func:`project` turns the medians into stage times (72 members, the members'
own drawn epochs and batch sizes, ``workers`` processes; sharpness at 2048 and 1024 images per set)
and the pilot's. Results: JSON (``--out``), not a DVC output::

    nice -n 15 python -m benchmarks.vision16_cost --repeats 3 --out reports/pilots/vision16_cost.json
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "benchmarks"

import torch  # noqa: E402


def parse_config(text: str) -> dict:
    """``"patch:width:layers"`` -> model overrides (a one-line error for anything else)."""
    try:
        patch, width, layers = (int(v) for v in text.split(":"))
    except ValueError:
        raise SystemExit(f"--config {text!r}: expected patch:width:layers, e.g. 4:32:2") from None
    return dict(patch_size=patch, width=width, layers=layers)


def config_name(model) -> str:
    tokens = (16 // model.patch_size) ** 2
    return f"p{model.patch_size}_w{model.width}_l{model.layers}_t{tokens}"


def _recipe(profile: str) -> list[str]:
    """The fine-tuning recipe this probe was written for (the 16-token pre-registration's): on the cpu profile, the
    ``base_overrides`` of ``vision_minima_pilot`` (the recipe before the zoo at its minima), else none."""
    from companion.params import stage_params

    return list(stage_params("vision_minima_pilot", "cpu")[1]["base_overrides"]) if profile == "cpu" else []


def _settings(profile: str, cfg: dict):
    from companion.experiments import vision_zoo as vz

    s = vz.load_settings(profile, _recipe(profile))
    model = dataclasses.replace(s.model, **cfg)
    if "width" in cfg and cfg["width"] != s.model.width:
        model = dataclasses.replace(model, embed_dim=cfg["width"])   # projection width follows the width
    return dataclasses.replace(s, model=model)


class _Clock:
    """Wall and CPU seconds of a block (one thread: the CPU time is what the block costs, whatever else runs on
    the machine; the wall time shows the load)."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def one_repeat(s, data, vision, geo, geo_task, rep: int) -> dict:
    """Every timing of one configuration (see the module docstring): ``<key>`` CPU seconds, ``<key>_wall`` wall."""
    from companion.experiments import geometry_lines as gl
    from companion.experiments import vision_zoo as vz

    out: dict[str, float] = {}

    def record(key: str, c: _Clock) -> None:
        out[key], out[f"{key}_wall"] = c.cpu, c.wall

    model = vz.build_model(s, s.seed)
    pre = dataclasses.replace(s.pretrain, epochs=1)
    with _Clock() as c:
        vz.pretrain_contrastive(model, data.x_pool, pre, background=data.background, seed=s.seed + rep)
    record("pretrain_epoch", c)
    vz.centroid_head(model, data.x_pool, data.y_pool)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    for bs in s.ranges.batch_size:
        model.load_state_dict(start)
        hp = vz.Hparams(lr=2e-3, weight_decay=0.01, epochs=1, batch_size=int(bs), label_smoothing=0.1, shift=1,
                        noise_std=0.1, mixup_alpha=0.0)
        with _Clock() as c:
            vz.fit(model, data.x_pool, data.y_pool, hp, background=data.background, seed=rep)
        record(f"finetune_epoch_bs{bs}", c)
    model.eval()
    batches = vz.sharpness_batches(data, 3 * vision.batch_size, vision.batch_size, 0)
    for key, m in vision.measures.items():
        for k in (1, 3):
            with _Clock() as c:
                vz.measure([("m", model)], batches[:k], {key: m}, {key: [vision.rho[key]]}, seed=vision.seed,
                           n_iters=vision.n_iters, workers=1, progress=False)
            record(f"sharpness_{key}_{k}", c)
    spec = geo.rows["vision"]
    need = max(spec.exact_batches + spec.hessian_batches) + 1   # the stage's set-1 batches the row uses
    allb = vz.sharpness_batches(data, need * vision.batch_size, vision.batch_size, 0)
    with _Clock() as c:
        gl.measure_member("m", model, exact_batches=[allb[i] for i in spec.exact_batches],
                          hessian_batches=[(i, allb[i]) for i in spec.hessian_batches], **geo_task)
    record("geometry_member", c)
    return out


def run(profile: str, configs: list[dict], repeats: int) -> dict:
    from companion.experiments import geometry_lines as gl
    from companion.experiments import vision_report as vr
    from companion.experiments import vision_zoo as vz
    from companion.params import settings, stage_params

    torch.set_num_threads(1)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    base = vz.load_settings(profile, _recipe(profile))
    t0 = time.perf_counter()
    data = vz.load_data(base.data, 1000)
    data_seconds = time.perf_counter() - t0
    vision = settings(vr.VisionSettings, "vision", profile)
    geo = gl.load_settings(stage_params("geometry_lines", profile)[1])
    spec = geo.rows["vision"]
    geo_task = dict(metrics=list(geo.metrics), rho={m: vision.rho[gl.METRIC_COLUMN[m]] for m in geo.metrics},
                    n_iters=vision.n_iters, seed=vision.seed, eps=float(vision.measures["geodesic_invariant"].eps),
                    hessian=geo.hessian, probes=int(spec.hessian_probes))
    runs = [_settings(profile, c) for c in configs]
    names = [config_name(s.model) for s in runs]
    raw: dict[str, list[dict]] = {n: [] for n in names}
    load = []
    for rep in range(repeats):
        before = os.getloadavg()
        for n, s in zip(names, runs):
            raw[n].append(one_repeat(s, data, vision, geo, geo_task, rep))
            print(f"repeat {rep} {n}: " + ", ".join(f"{k} {v:.2f}" for k, v in raw[n][-1].items()), file=sys.stderr,
                  flush=True)
        load.append(dict(repeat=rep, before=before, after=os.getloadavg()))
    med = {n: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for n, rows in raw.items()}
    for n, m in med.items():
        for key in vision.measures:   # per batch: both calls' time over their 4 batches (the set-up is ~0: below)
            m[f"sharpness_{key}_per_batch"] = (m[f"sharpness_{key}_3"] + m[f"sharpness_{key}_1"]) / 4
            m[f"sharpness_{key}_setup_estimate"] = (3 * m[f"sharpness_{key}_1"] - m[f"sharpness_{key}_3"]) / 2
    models = {n: dataclasses.asdict(s.model) for n, s in zip(names, runs)}
    params = {n: sum(p.numel() for p in vz.build_model(s, 0).parameters()) for n, s in zip(names, runs)}
    return dict(what="vision stand-in cost per step at different patch sizes (benchmarks/vision16_cost.py)",
                clock="keys: CPU seconds of the process (one thread); <key>_wall: wall-clock seconds",
                profile=profile, repeats=repeats, threads=1, machine=platform.processor() or platform.machine(),
                cpus=os.cpu_count(), started_utc=started,
                finished_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                data_seconds=data_seconds, models=models, n_parameters=params, load_average=load,
                raw=raw, median=med)


RECORDED = {"vision_train": ("reports/timings/vision_train.json", ("total",)),
            "vision": ("reports/timings/vision.json", ("sharpness",)),
            "geometry_lines_vision": ("reports/timings/geometry_lines.json", ("seconds", "vision")),
            "sam": ("reports/timings/sam.json", ("total",))}


def recorded_seconds(root: Path = Path(".")) -> dict[str, float]:
    """The committed wall times of the profile's own model (``reports/timings``), which calibrate the projection."""
    out = {}
    for key, (file, path) in RECORDED.items():
        value = json.loads((root / file).read_text())
        for p in path:
            value = value[p]
        out[key] = float(value)
    return out


@functools.lru_cache(maxsize=None)
def _stage_settings(profile: str):
    """``(vision_train, vision, vision16_pilot settings, members' draws per stream)`` of a profile (read once)."""
    from companion.pilots import vision as vp
    from companion.experiments import vision_report as vr
    from companion.experiments import vision_zoo as vz
    from companion.params import settings

    s = vz.load_settings(profile, _recipe(profile))
    pilot = settings(vp.VisionPilot, "vision16_pilot", profile)
    draws = {"main": vz.member_draws(s, "main", s.n_models), "pilot": vz.member_draws(s, "pilot", pilot.n_models)}
    return s, settings(vr.VisionSettings, "vision", profile), pilot, draws


def model_seconds(m: dict, profile: str, n_images: int, *, explore: bool) -> dict[str, float]:
    """Stage times in the probe's own units from one configuration's medians ``m``: members' drawn epochs and
    batch sizes, the ``vision`` stage's calls (primary radius on both sets of ``n_images``; with ``explore`` the
    exploratory radii on set 1), the pilot's grid on two sets of its ``n_images``; ``workers`` processes."""
    from companion.experiments import vision_zoo as vz

    s, vision, pilot, draws = _stage_settings(profile)
    bs = vision.batch_size

    def train(stream: str, n: int) -> float:
        ft = sum(hp.epochs * m[f"finetune_epoch_bs{hp.batch_size}"] for hp, _ in draws[stream][:n])
        return s.pretrain.epochs * m["pretrain_epoch"] + ft / s.workers

    def batches(k: str) -> int:
        extra = [r for r in vision.exploratory_rho[k] if r != vision.rho[k]] if explore else []
        return 2 * n_images // bs + len(extra) * n_images // bs

    return dict(
        vision_train=train("main", s.n_models),
        vision=s.n_models * sum(batches(k) * m[f"sharpness_{k}_per_batch"] for k in vision.measures) / vision.workers,
        geometry_lines_vision=s.n_models * m["geometry_member"] / 2,
        sam=m["finetune_epoch_bs64"],
        pilot_training=train("pilot", pilot.n_models),
        pilot_sharpness=pilot.n_models * statistics.mean(
            len(pilot.rho_grid[p.name]) * 2 * pilot.n_images // bs * m[f"sharpness_{k}_per_batch"]
            for p, k in zip(pilot.measures, vision.measures)) * len(vision.measures) / pilot.workers)


def project(r: dict, recorded: dict[str, float], n_images: tuple[int, ...] = (2048, 1024)) -> dict:
    """Projected wall times (seconds): each stage's committed time (``recorded``, the profile's own model at its
    protocol: 2048 images, exploratory radii) times the ratio of :func:`model_seconds` between the configuration
    and the profile's own model (the first configuration) — the ratio measured under the same load, interleaved.
    ``sam`` scales by the fine-tuning epoch's ratio (batch 64; its steps are fine-tuning steps), an approximation.
    The pilot scales from the ``vision_train`` (training) and ``vision`` (sharpness) calibrations."""
    profile = r["profile"]
    names = list(r["median"])
    base_name = names[0]
    ref = model_seconds(r["median"][base_name], profile, _stage_settings(profile)[1].n_images, explore=True)
    factor = {k: recorded[k] / ref[k] for k in recorded}
    factor["pilot_training"], factor["pilot_sharpness"] = factor["vision_train"], factor["vision"]
    out: dict[str, dict] = {"calibration_factor": factor, "recorded_seconds": recorded, "base": base_name}
    for name in names:
        row = {}
        for n in n_images:
            for explore in (True, False):
                ms = model_seconds(r["median"][name], profile, n, explore=explore)
                row[f"vision_{n}" + ("" if explore else "_no_exploratory_rho")] = ms["vision"] * factor["vision"]
        ms = model_seconds(r["median"][name], profile, n_images[0], explore=True)
        for k in ("vision_train", "geometry_lines_vision", "sam", "pilot_training", "pilot_sharpness"):
            row[k] = ms[k] * factor[k]
        out[name] = {k: round(v, 1) for k, v in row.items()}
    return out


MEASURED = ("pretrain_epoch", "finetune_epoch_bs64", "finetune_epoch_bs128", "sharpness_adaptive_per_batch",
            "sharpness_geodesic_invariant_per_batch", "sharpness_geodesic_mixed_per_batch", "geometry_member")


def table(r: dict) -> str:
    """Markdown: the measured medians (CPU seconds) with their ratio to the first configuration, and the projected
    minutes of each vision stage (the vision share: vision_train + vision + geometry_lines' vision part + sam)."""
    names = list(r["median"])
    base = r["median"][names[0]]
    unit = "CPU seconds" if r.get("clock", "").startswith("keys: CPU") else "wall seconds"
    lines = [f"| {unit} (median of {r['repeats']}) | " + " | ".join(
                 f"{n} ({r['n_parameters'][n]} parameters)" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for k in MEASURED:
        lines.append(f"| {k} | " + " | ".join(
            f"{r['median'][n][k]:.2f}" + ("" if n == names[0] else f" (×{r['median'][n][k] / base[k]:.2f})")
            for n in names) + " |")
    proj = r["projection_seconds"]
    stages = ["vision_train", "geometry_lines_vision", "sam"]
    lines += ["", "| projected minutes | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for k in stages + [k for k in proj[names[0]] if k.startswith("vision_") and k != "vision_train"]:
        lines.append(f"| {k} | " + " | ".join(f"{proj[n][k] / 60:.1f}" for n in names) + " |")
    for n_img in sorted({int(k.split("_")[1]) for k in proj[names[0]] if k.startswith("vision_") and
                         k.split("_")[1].isdigit()}, reverse=True):
        for suffix, what in (("", "with the exploratory radii"), ("_no_exploratory_rho", "without them")):
            lines.append(f"| **vision share, {n_img} images, {what}** | " + " | ".join(
                f"**{(sum(proj[n][k] for k in stages) + proj[n][f'vision_{n_img}{suffix}']) / 60:.1f}**"
                for n in names) + " |")
    lines.append("| pilot (training + sharpness) | " + " | ".join(
        f"{(proj[n]['pilot_training'] + proj[n]['pilot_sharpness']) / 60:.1f}" for n in names) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.vision16_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--config", action="append", default=[], metavar="PATCH:WIDTH:LAYERS",
                    help="a model to time (repeatable); default: the profile's model and the same with patch 4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON file for the raw timings, medians and projections")
    ap.add_argument("--markdown", default=None, help="also write the markdown tables (with a header) to this file")
    ap.add_argument("--table", default=None, metavar="JSON",
                    help="print the markdown tables of a saved JSON (re-projected from its medians) and exit")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.table:
        r = json.loads(Path(args.table).read_text())
        r["projection_seconds"] = project(r, recorded_seconds())
        print(table(r))
        if args.markdown:
            write_markdown(Path(args.markdown), r, args.table)
        return 0
    configs = [parse_config(c) for c in args.config] or [{}, {"patch_size": 4}]
    r = run(args.profile, configs, args.repeats)
    r["projection_seconds"] = project(r, recorded_seconds())
    text = json.dumps(r, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(json.dumps(dict(median=r["median"], projection_seconds=r["projection_seconds"]), indent=1))
    print(table(r))
    if args.markdown:
        write_markdown(Path(args.markdown), r, args.out or "(not saved)")
    return 0


def write_markdown(path: Path, r: dict, source: str) -> None:
    """The tables of :func:`table` under a header naming the source JSON, the clock and the load."""
    loads = [x for rec in r["load_average"] for x in (rec["before"][0], rec["after"][0])]
    head = ["# Cost of the vision stand-in per patch size (issue 24 item 3)", "",
            f"Generated by `python -m benchmarks.vision16_cost` from `{source}` ({r['clock']}; {r['repeats']} "
            f"interleaved repeats, one thread, {r['started_utc']} – {r.get('finished_utc', '?')}, 1-minute load average "
            f"{min(loads):.1f}–{max(loads):.1f} on {r['cpus']} CPUs). Projections: committed stage times of the "
            "first configuration (reports/timings) times the measured ratios (`benchmarks.vision16_cost.project`); "
            "pre-registration: reports/preregistration/vision16.md.", ""]
    path.write_text("\n".join(head) + "\n" + table(r) + "\n")


if __name__ == "__main__":
    sys.exit(main())
