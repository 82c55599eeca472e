"""Pilot of the vision zoo's fit criterion: the training recipe under which every member fits its training set.

Pre-registration: ``reports/preregistration/vision_minima.md`` (issue 31 item 3), committed before this
pilot trained anything; settings in ``params.yaml``, section ``vision_minima_pilot``.

Pilot members are fine-tuned from the start the candidate recipe pre-trains (the zoo's own start: it depends
only on the pre-training settings, the data and the seed) with hyperparameters and seeds from a stream of
their own (``minima_pilot`` in :data:`companion.experiments.vision_zoo.STREAMS`), so none is a zoo member:

* ``n_slow`` **slow corners** (:func:`corner`): every range at the end that makes fitting hardest (smallest
  learning rate, largest weight decay, fewest epochs, largest batch, largest label smoothing, the largest
  shift, input noise and mixup on at their largest), each with its own fine-tuning seed;
* ``n_fast`` **fast corners**: the other end (largest learning rate, most steps, no augmentation);
* ``n_drawn`` members drawn from the candidate's ranges exactly as zoo members are.

Each candidate is a list of ``vision_train`` overrides of the cpu profile, applied on top of ``base_overrides``
(the recipe in force when the pilot ran, spelled out). The candidates are tried in their
order; the pilot stops at the first under which every pilot member's train error (eval mode, whole pool,
unaugmented: :func:`companion.experiments.vision_zoo.error_rate`, as the zoo records it) is at most ``max_train_error`` and whose
projected ``vision_train`` time (:func:`projection`) is within ``budget_minutes``. **The pilot computes train
errors and CPU seconds only: no test error, no gap, no sharpness.**

The pilot trains with the CPU kernels ``vision_train`` pins (the recipe's ``cpu_kernels``; the command restarts
itself with them, :func:`companion.kernels.reexec`), so its train errors are the same on any x86-64 processor.

``python -m companion.pilots.vision_minima`` writes ``reports/pilots/vision_minima.json`` and the
markdown generated from it; ``--render-only`` regenerates the markdown from the JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np

STAGE = "vision_minima_pilot"
OUT = Path("reports/pilots")


@dataclass(frozen=True)
class Candidate:
    name: str
    label: str
    overrides: list[str]          # vision_train overrides (KEY=VALUE) of ``profile``, every change spelled out


@dataclass(frozen=True)
class MinimaPilot:
    """The ``vision_minima_pilot`` section."""

    profile: Literal["cpu"]
    stream: str
    n_slow: int
    n_fast: int
    n_drawn: int
    max_train_error: float
    budget_minutes: float
    stage_timings: str
    workers: int
    report: str
    base_overrides: list[str]     # the recipe in force when the pilot ran; every candidate applies on top of it
    candidates: list[Candidate]


# --------------------------------------------------------------------------- members


def corner(r, which: str):
    """The :class:`companion.experiments.vision_zoo.Hparams` at a corner of the ranges ``r``: ``slow`` (hardest to fit) or ``fast``."""
    from companion.experiments.vision_zoo import Hparams

    if which == "slow":
        return Hparams(lr=float(r.lr[0]), weight_decay=float(r.weight_decay[1]), epochs=int(r.epochs[0]),
                       batch_size=int(max(r.batch_size)), label_smoothing=float(r.label_smoothing[1]),
                       shift=int(max(r.shift)), noise_std=float(r.noise_std[1]), mixup_alpha=float(r.mixup_alpha[1]))
    if which == "fast":
        return Hparams(lr=float(r.lr[1]), weight_decay=float(r.weight_decay[0]), epochs=int(r.epochs[1]),
                       batch_size=int(min(r.batch_size)), label_smoothing=float(r.label_smoothing[0]),
                       shift=int(min(r.shift)), noise_std=0.0, mixup_alpha=0.0)
    raise ValueError(f"corner must be 'slow' or 'fast', got {which!r}")


def pilot_members(s, p: MinimaPilot) -> list[dict]:
    """The pilot's members under the recipe ``s``: ``[{"name", "role", "hparams", "seed"}]``.

    Draws ``n_drawn + n_slow + n_fast`` members of ``p.stream`` (:func:`companion.experiments.vision_zoo.member_draws`): the first
    ``n_drawn`` are the drawn members; the corners take the fine-tuning seeds of the rest (their
    hyperparameters are the corners').
    """
    from companion.experiments import vision_zoo as vz

    draws = vz.member_draws(s, p.stream, p.n_drawn + p.n_slow + p.n_fast)
    out = [dict(name=f"drawn_{i}", role="drawn", hparams=hp, seed=seed) for i, (hp, seed) in enumerate(draws[:p.n_drawn])]
    rest = [seed for _, seed in draws[p.n_drawn:]]
    out += [dict(name=f"slow_{j}", role="slow corner", hparams=corner(s.ranges, "slow"), seed=rest[j])
            for j in range(p.n_slow)]
    out += [dict(name=f"fast_{j}", role="fast corner", hparams=corner(s.ranges, "fast"), seed=rest[p.n_slow + j])
            for j in range(p.n_fast)]
    return out


# --------------------------------------------------------------------------- training


def start_key(s) -> str:
    """What the shared pre-trained start depends on (data, model, pre-training, seed), as a string."""
    return json.dumps(dict(data=asdict(s.data), model=asdict(s.model), pretrain=asdict(s.pretrain), seed=s.seed),
                      sort_keys=True, default=str)


def _data(s):
    from companion.experiments import vision_zoo as vz

    # the pool only is used: a token test set of one image per class (never evaluated)
    return vz.load_data(s.data, n_test=s.data.spec.n_classes)


def pretrain_start(s) -> tuple[dict, dict]:
    """The shared start of the recipe ``s`` (as :func:`companion.experiments.vision_zoo.pretrain`, without its test error):
    ``(state_dict, record)``; the record holds the pool error of the centroid head and the CPU seconds."""
    from companion.experiments import vision_zoo as vz

    data = _data(s)
    t0 = time.process_time()
    model = vz.build_model(s, s.seed)
    loss = vz.pretrain_contrastive(model, data.x_pool, s.pretrain, background=data.background, seed=s.seed)
    vz.centroid_head(model, data.x_pool, data.y_pool)
    seconds = time.process_time() - t0
    record = dict(epochs=s.pretrain.epochs, loss_last=loss[-1], pool_error=vz.error_rate(model, data.x_pool, data.y_pool),
                  cpu_seconds=seconds)
    return {k: v.clone() for k, v in model.state_dict().items()}, record


_WORKER: dict = {}


def _init(s, state: dict) -> None:
    from companion import kernels
    from hideseek.utils import set_threads

    set_threads(s.threads)
    kernels.check(s.cpu_kernels, "vision_minima_pilot")
    _WORKER.update(settings=s, data=_data(s), state=state, kernels=kernels.cpu_kernels())


def _train(task: tuple) -> dict:
    """Fine-tune one pilot member from the start; its train error and CPU seconds (no test error)."""
    from companion.experiments import vision_zoo as vz

    name, hp, seed = task
    s, data = _WORKER["settings"], _WORKER["data"]
    model = vz.build_model(s)
    model.load_state_dict(_WORKER["state"])
    t0, w0 = time.process_time(), time.perf_counter()
    vz.fit(model, data.x_pool, data.y_pool, hp, background=data.background, seed=seed, warmup=s.warmup)
    cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    return dict(name=name, train_error=vz.error_rate(model, data.x_pool, data.y_pool), cpu_seconds=cpu,
                wall_seconds=wall, kernels=_WORKER["kernels"])


def train_members(s, state: dict, members: list[dict], workers: int) -> list[dict]:
    """Train ``members`` under ``s`` from ``state`` in ``workers`` processes (spawned, ``s.threads`` threads each)."""
    from companion.pool import run_tasks

    tasks = [((m["name"], m["hparams"], m["seed"]),) for m in members]
    return run_tasks(_train, tasks, workers=workers, initializer=_init, initargs=(s, state))


# --------------------------------------------------------------------------- cost and choice


def stage_rest(timings: dict, workers: int) -> float:
    """Seconds of the committed stage outside pre-training and fine-tuning: ``total - pretrain - sum(members) / workers``."""
    return float(timings["total"] - timings["pretrain"] - sum(timings["members"].values()) / workers)


def per_epoch_cpu(members: list[dict]) -> dict[int, float]:
    """Median CPU seconds per fine-tuning epoch over the pilot members of each batch size."""
    by: dict[int, list[float]] = {}
    for m in members:
        by.setdefault(int(m["hparams"]["batch_size"]), []).append(m["cpu_seconds"] / m["hparams"]["epochs"])
    return {b: float(np.median(v)) for b, v in sorted(by.items())}


def projection(s, epoch_cpu: dict[int, float], pretrain_cpu: float, rest: float) -> dict:
    """The projected ``vision_train`` cost of the recipe ``s``: its ``n_models`` zoo draws (stream ``main``),
    each its epochs times the measured CPU seconds per epoch of its batch size, in ``s.workers`` processes,
    plus the pre-training and the rest of the stage."""
    from companion.experiments import vision_zoo as vz

    draws = vz.member_draws(s, "main", s.n_models)
    missing = sorted({hp.batch_size for hp, _ in draws} - set(epoch_cpu))
    if missing:
        raise ValueError(f"no pilot member measured batch size(s) {missing}; cannot project the zoo's cost")
    member_cpu = float(sum(hp.epochs * epoch_cpu[hp.batch_size] for hp, _ in draws))
    stage = pretrain_cpu + member_cpu / s.workers + rest
    return dict(member_cpu_seconds=member_cpu, pretrain_cpu_seconds=pretrain_cpu, rest_seconds=rest,
                workers=s.workers, stage_minutes=stage / 60, cpu_minutes=(pretrain_cpu + member_cpu) / 60,
                epochs_total=int(sum(hp.epochs for hp, _ in draws)),
                steps_total=int(sum(hp.epochs * -(-s.data.n_train // hp.batch_size) for hp, _ in draws)))


def verdict(train_errors: list[float], stage_minutes: float, p: MinimaPilot) -> dict:
    """Pass: every member at most ``max_train_error``; eligible: pass and the projection within the budget."""
    worst = max(train_errors)
    n_fail = sum(e > p.max_train_error for e in train_errors)
    fits = n_fail == 0
    within = stage_minutes <= p.budget_minutes
    return dict(max_train_error=worst, n_fail=n_fail, all_fit=fits, within_budget=within, chosen=fits and within)


def calibration(report: dict, base, timings: dict) -> dict:
    """The projection held against the committed stage (added after the pilot ran; it chooses nothing).

    The pilot's CPU seconds per epoch (of the first candidate that measured every batch size of the recipe
    ``base``, the one in force when the pilot ran) times ``base``'s 72 zoo draws give the fine-tuning that the
    committed stage timed (``timings``, seconds of each member's process); their ratio scales each candidate's
    projected fine-tuning. Pre-training: the committed seconds times the candidate's epochs over ``base``'s.
    """
    from companion.experiments import vision_zoo as vz

    need = {int(b) for b in base.ranges.batch_size}
    cover = next((c for c in report["candidates"] if need <= {int(b) for b in c["epoch_cpu_seconds"]}), None)
    if cover is None:
        raise ValueError(f"no candidate measured every batch size {sorted(need)} of the recipe in force")
    cost = {int(b): t for b, t in cover["epoch_cpu_seconds"].items()}
    base_cpu = float(sum(hp.epochs * cost[hp.batch_size] for hp, _ in vz.member_draws(base, "main", base.n_models)))
    committed = float(sum(timings["members"].values()))
    ratio = committed / base_cpu
    rest = stage_rest(timings, base.workers)
    out = dict(costs_from=cover["name"], base_projected_member_seconds=base_cpu, committed_member_seconds=committed,
               ratio=ratio, candidates={})
    for c in report["candidates"]:
        pre = timings["pretrain"] * c["recipe"]["pretrain_epochs"] / base.pretrain.epochs
        member = ratio * c["projection"]["member_cpu_seconds"]
        out["candidates"][c["name"]] = dict(pretrain_seconds=pre, member_seconds=member,
                                            stage_minutes=(pre + member / base.workers + rest) / 60,
                                            process_minutes=(pre + member) / 60)
    return out


# --------------------------------------------------------------------------- run


def run(p: MinimaPilot, *, progress: bool = True) -> dict:
    """Try the candidates in order, stop at the first chosen; the report's content."""
    from companion import kernels
    from companion.experiments import vision_zoo as vz

    timings = json.loads(Path(p.stage_timings).read_text())
    starts: dict[str, tuple[dict, dict]] = {}
    out = dict(what="vision minima pilot: the training recipe under which every pilot member fits its training set "
                    "(reports/preregistration/vision_minima.md); train errors only, no test error, no gap, no sharpness",
               settings=dict(stream=p.stream, n_slow=p.n_slow, n_fast=p.n_fast, n_drawn=p.n_drawn,
                             max_train_error=p.max_train_error, budget_minutes=p.budget_minutes,
                             profile=p.profile, workers=p.workers),
               committed_stage=dict(file=p.stage_timings, total_minutes=timings["total"] / 60,
                                    pretrain_seconds=timings["pretrain"],
                                    member_seconds=float(sum(timings["members"].values())),
                                    n_members=len(timings["members"])),
               candidates=[], chosen=None)
    for c in p.candidates:
        s = vz.load_settings(p.profile, p.base_overrides + c.overrides)
        kernels.check(s.cpu_kernels, "vision_minima_pilot")   # the recipe's pinned kernels, as vision_train runs
        key = start_key(s)
        if key not in starts:
            if progress:
                print(f"[{c.name}] pre-training the shared start ({s.pretrain.epochs} epochs)", flush=True)
            starts[key] = pretrain_start(s)
        state, pre = starts[key]
        members = pilot_members(s, p)
        if progress:
            print(f"[{c.name}] fine-tuning {len(members)} pilot members", flush=True)
        t0 = time.perf_counter()
        results = {r["name"]: r for r in train_members(s, state, members, p.workers)}
        rows = [dict(name=m["name"], role=m["role"], seed=m["seed"], hparams=asdict(m["hparams"]),
                     train_error=results[m["name"]]["train_error"], cpu_seconds=results[m["name"]]["cpu_seconds"])
                for m in members]
        seen = {json.dumps(r["kernels"], sort_keys=True) for r in results.values()}
        if seen != {json.dumps(kernels.cpu_kernels(), sort_keys=True)}:
            raise RuntimeError(f"vision_minima_pilot: the members' processes ran other CPU kernels: {sorted(seen)}")
        epoch_cpu = per_epoch_cpu(rows)
        proj = projection(s, epoch_cpu, pre["cpu_seconds"], stage_rest(timings, s.workers))
        v = verdict([r["train_error"] for r in rows], proj["stage_minutes"], p)
        rec = dict(name=c.name, label=c.label, overrides=list(c.overrides),
                   recipe=dict(ranges=asdict(s.ranges), warmup=s.warmup, pretrain_epochs=s.pretrain.epochs),
                   pretrain=pre, members=rows, epoch_cpu_seconds={str(b): t for b, t in epoch_cpu.items()},
                   projection=proj, wall_seconds=time.perf_counter() - t0, **v)
        out["candidates"].append(rec)
        if progress:
            print(f"[{c.name}] max train error {v['max_train_error']:.4f} ({v['n_fail']} above "
                  f"{p.max_train_error}); projected stage {proj['stage_minutes']:.1f} min", flush=True)
        if v["chosen"]:
            out["chosen"] = c.name
            break
    out["cpu_kernels"] = kernels.cpu_kernels()
    out["pilot_cpu_minutes"] = (sum(pre["cpu_seconds"] for _, pre in starts.values())
                                + sum(m["cpu_seconds"] for c in out["candidates"] for m in c["members"])) / 60
    return out


def render_markdown(r: dict) -> str:
    """The pilot report as markdown, every number from ``r``."""
    st = r["settings"]
    com = r["committed_stage"]
    lines = ["# Vision minima pilot", "",
             "Pre-registration: `reports/preregistration/vision_minima.md`. " + r["what"][0].upper() + r["what"][1:]
             + ".", "",
             f"Criterion: every pilot member's train error (eval mode, the whole training pool, unaugmented) at most "
             f"**{st['max_train_error']:.2f}**; budget: the projected `vision_train` stage within "
             f"**{st['budget_minutes']:g} minutes** on the 2-core machine ({st['workers']} workers). Pilot members: "
             f"{st['n_slow']} slow corners, {st['n_fast']} fast corner(s), {st['n_drawn']} drawn members, stream "
             f"`{st['stream']}` (none is a zoo member). Candidates tried in the declared order; the pilot stops at the "
             f"first that passes.", "",
             "| candidate | changes (vision_train, cpu) | worst train error | members above | projected stage (min) "
             "| projected CPU (min) | fits | within budget |", "|---|---|---|---|---|---|---|---|"]
    for c in r["candidates"]:
        pr = c["projection"]
        lines.append(f"| {c['name']}: {c['label']} | {', '.join(f'`{o}`' for o in c['overrides'])} | "
                     f"{c['max_train_error']:.4f} | {c['n_fail']} of {len(c['members'])} | {pr['stage_minutes']:.1f} | "
                     f"{pr['cpu_minutes']:.1f} | {'yes' if c['all_fit'] else 'no'} | "
                     f"{'yes' if c['within_budget'] else 'no'} |")
    tried = [c["name"] for c in r["candidates"]]
    cal = r.get("calibration")
    if cal:
        lines += ["", "Held against the committed stage (added after the pilot ran; it chooses nothing): the pilot's CPU "
                  f"seconds per epoch ({cal['costs_from']}) over the current recipe's 72 zoo draws give "
                  f"{cal['base_projected_member_seconds'] / 60:.1f} minutes of fine-tuning where the committed stage "
                  f"timed {cal['committed_member_seconds'] / 60:.1f} (ratio {cal['ratio']:.2f}; that run's seconds of each "
                  "member's process on its machine, these CPU seconds on this one). Scaled by that ratio:", "",
                  "| candidate | stage (min, scaled) | pre-training + fine-tuning, all processes (min, scaled) |",
                  "|---|---|---|"]
        lines += [f"| {n} | {v['stage_minutes']:.1f} | {v['process_minutes']:.1f} |" for n, v in cal["candidates"].items()]
    lines += ["", (f"**Chosen: {r['chosen']}.**" if r["chosen"] else
                   "**None chosen**: no candidate passed (the pre-registration's rule: any further step is an amendment)."),
              f"Candidates tried: {', '.join(tried)}.", "",
              f"The committed stage for comparison (`{com['file']}`, the current recipe): {com['total_minutes']:.1f} "
              f"minutes, pre-training {com['pretrain_seconds']:.0f} s, the {com['n_members']} members' fine-tuning "
              f"{com['member_seconds'] / 60:.1f} minutes in total (seconds of each member's process)."]
    for c in r["candidates"]:
        pr, pre = c["projection"], c["pretrain"]
        lines += ["", f"## {c['name']}: {c['label']}", "",
                  f"Shared start: {pre['epochs']} epochs of contrastive pre-training ({pre['cpu_seconds']:.0f} CPU s), "
                  f"pool error of its centroid head {pre['pool_error']:.4f}. Warm-up {c['recipe']['warmup']:g} of the "
                  f"steps.", "",
                  "| member | role | lr | weight decay | epochs | batch | label smoothing | shift | noise std | "
                  "mixup alpha | train error | CPU s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for m in c["members"]:
            h = m["hparams"]
            flag = " **(above)**" if m["train_error"] > r["settings"]["max_train_error"] else ""
            lines.append(f"| {m['name']} | {m['role']} | {h['lr']:.4g} | {h['weight_decay']:.3g} | {h['epochs']} | "
                         f"{h['batch_size']} | {h['label_smoothing']:.3f} | {h['shift']} | {h['noise_std']:.3f} | "
                         f"{h['mixup_alpha']:.3f} | {m['train_error']:.4f}{flag} | {m['cpu_seconds']:.1f} |")
        ep = ", ".join(f"batch {b}: {t:.2f} s" for b, t in c["epoch_cpu_seconds"].items())
        lines += ["", f"CPU seconds per epoch (median over the pilot members): {ep}. Projection for the 72 zoo draws "
                  f"under this recipe: {pr['epochs_total']} epochs ({pr['steps_total']} steps), fine-tuning "
                  f"{pr['member_cpu_seconds'] / 60:.1f} CPU-minutes in {pr['workers']} processes, pre-training "
                  f"{pr['pretrain_cpu_seconds']:.0f} s, the rest of the stage {pr['rest_seconds']:.0f} s: "
                  f"**{pr['stage_minutes']:.1f} minutes** ({pr['cpu_minutes']:.1f} CPU-minutes of pre-training and "
                  f"fine-tuning)."]
    k = r.get("cpu_kernels") or {}
    lines += ["", f"The pilot's own compute: {r['pilot_cpu_minutes']:.1f} CPU-minutes (pre-training and fine-tuning, "
              f"on the shared 2-core machine under `nice -n 10`). CPU kernels: {k.get('capability', 'not recorded')}"
              + (" (pinned, `companion.kernels`, as `vision_train` runs)" if k.get("ATEN_CPU_CAPABILITY") else "") + ".",
              ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m companion.pilots.vision_minima",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--render-only", action="store_true", help="regenerate the markdown from OUT/<report>.json")
    ap.add_argument("--calibrate", action="store_true",
                    help="add the projection held against the committed stage (calibration) to OUT/<report>.json "
                         "(the recipe in force when the pilot ran: base_overrides); then render")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    from companion.params import ParamsError, settings
    from hideseek.utils import set_threads

    from companion import kernels
    from companion.experiments import vision_zoo as vz
    from companion.pilots.common import write_pilot_report

    try:
        p = settings(MinimaPilot, STAGE, "cpu", args.overrides)
        if not p.candidates:
            raise ValueError("vision_minima_pilot.candidates is empty")
        levels = {vz.load_settings(p.profile, p.base_overrides + c.overrides).cpu_kernels for c in p.candidates}
        if len(levels) != 1:
            raise ValueError(f"the candidates pin different CPU kernels: {sorted(map(str, levels))}")
    except (ParamsError, ValueError) as exc:
        ap.error(str(exc))
    if not (args.render_only or args.calibrate):   # the kernels vision_train runs: restart once with them pinned
        kernels.reexec(levels.pop(), "companion.pilots.vision_minima", argv)
    out = Path(args.out)
    if args.render_only or args.calibrate:
        report = json.loads((out / f"{p.report}.json").read_text())
        if args.calibrate:
            report["calibration"] = calibration(report, vz.load_settings(p.profile, p.base_overrides),
                                                json.loads(Path(p.stage_timings).read_text()))
    else:
        set_threads(1)
        report = run(p, progress=not args.no_progress)
    write_pilot_report(out, p.report, report, render_markdown, json_too=args.calibrate or not args.render_only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
