"""Cost of the integrated geodesic step (``Measure(step="exact")``) against the second-order step.

For each benchmark model (:mod:`benchmarks.models`) and each pair metric, the same
:func:`hideseek.sharpness` call — same batches, iterations, radius and seed — is timed with
``step="second_order"`` and with ``step="exact"`` (docs/maths.md §5.6), alternating the two
in one process after one warm-up call of each, so that both see the same machine load; the
ratio of the medians is the cost of the integration (target: at most 1.3×).  Alongside: the
RK4 step count step doubling chooses for a random direction of the ball (largest over the
pair stacks) and both sharpness values.  The mixed metric's geodesics are incomplete, so it
is measured at its own radius (``--rho-mixed``); a radius where they run into a
rank-deficient pair is reported as refused.

    python -m benchmarks.bench_exact                                  # CPU defaults of each model
    python -m benchmarks.bench_exact --models small-bert --write-report

Results: ``benchmarks/results/exact_<device>.json`` and, with ``--write-report``, this
benchmark's own section of ``reports/benchmarks.md`` (generated, replaced on every run).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # ``python benchmarks/bench_exact.py``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "benchmarks"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from .bench_sharpness import machine_info  # noqa: E402
from .models import MODELS, build, make_batches  # noqa: E402
from .report import write_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MARK_START, MARK_END = "<!-- bench_exact:start -->", "<!-- bench_exact:end -->"
METRICS = ("invariant", "mixed")
TARGET = 1.3
DEFAULT_MODELS = ("small-bert", "small-vit", "bert-base", "vit-b32")


def step_count(model, batches, measure, rho: float, seed: int = 0) -> int | None:
    """RK4 steps that step doubling picks for a random direction of the ball at ``rho``
    (largest over the pair stacks; ``None`` without integrated pairs)."""
    from hideseek.symmetries import find_symmetries

    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    geo = measure.geometry_at(params, find_symmetries(model))
    d = geo.random_direction(torch.Generator().manual_seed(seed))
    geo.point([rho * t for t in d])
    counts = [pg.geodesic_steps for pg in geo.pairs if pg.geodesic_steps is not None]
    return max(counts) if counts else None


def bench_model(name: str, *, device: str = "cpu", rho: float = 0.1, rho_mixed: float = 0.01,
                repeats: int | None = None, n_iters: int | None = None, seed: int = 0) -> list[dict]:
    """One row per metric: median seconds of each step, their ratio, step count, values."""
    import hideseek as hs

    spec = MODELS[name]
    d = dict(spec.defaults["cuda" if device.startswith("cuda") else "cpu"])
    n_iters = n_iters or d["n_iters"]
    repeats = repeats or max(d["repeats"], 2)
    model = build(name, seed=seed).to(device)
    batches = [(_to(x, device), y.to(device)) for x, y in
               make_batches(spec, d["batch_size"], 1, d.get("seq_len", 128), seed=seed)]
    sync = (lambda: torch.cuda.synchronize()) if device.startswith("cuda") else (lambda: None)
    rows = []
    for metric in METRICS:
        r = rho if metric == "invariant" else rho_mixed
        row = dict(model=name, metric=metric, rho=r, n_iters=n_iters, batch_size=d["batch_size"],
                   repeats=repeats, seconds={}, value={}, refused=None)
        try:
            for step in ("second_order", "exact"):      # warm-up, untimed
                hs.sharpness(model, batches, hs.Measure(metric=metric, step=step), rho=r, n_iters=n_iters,
                             seed=seed, progress=False)
            times = {"second_order": [], "exact": []}
            for _ in range(repeats):
                for step in times:
                    sync()
                    t0 = time.perf_counter()
                    res = hs.sharpness(model, batches, hs.Measure(metric=metric, step=step), rho=r,
                                       n_iters=n_iters, seed=seed, progress=False)
                    sync()
                    times[step].append(time.perf_counter() - t0)
                    row["value"][step] = float(res.value)
            row["seconds"] = {k: statistics.median(v) for k, v in times.items()}
            row["ratio"] = row["seconds"]["exact"] / row["seconds"]["second_order"]
            row["rk4_steps"] = step_count(model, batches, hs.Measure(metric=metric, step="exact"), r, seed)
        except ValueError as e:                          # a mixed geodesic left the domain
            row["refused"] = str(e).splitlines()[0]
        rows.append(row)
        print(table([row]).splitlines()[-1], flush=True)
    return rows


def _to(obj, device):
    if isinstance(obj, dict):
        return {k: v.to(device) for k, v in obj.items()}
    return obj.to(device)


def table(rows: list[dict]) -> str:
    out = ["| model | metric | ρ | iterations | second order (s) | exact (s) | exact / second order | RK4 steps |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("refused"):
            out.append(f"| {r['model']} | {r['metric']} | {r['rho']:g} | {r['n_iters']} | — | — | refused: "
                       f"{r['refused'][:60]}… | — |")
            continue
        s = r["seconds"]
        out.append(f"| {r['model']} | {r['metric']} | {r['rho']:g} | {r['n_iters']} | {s['second_order']:.2f} | "
                   f"{s['exact']:.2f} | {r['ratio']:.2f}× | {r['rk4_steps']} |")
    return "\n".join(out)


def report_section(rows: list[dict], info: dict) -> str:
    ok = [r for r in rows if not r.get("refused")]
    worst = max((r["ratio"] for r in ok), default=None)
    verdict = ("no model measured" if worst is None else
               f"worst ratio {worst:.2f}×, {'within' if worst <= TARGET else 'above'} the {TARGET}× target")
    return "\n".join([
        MARK_START,
        "## Integrated geodesics: `step=\"exact\"` against the second-order step (issue 26)",
        "",
        "Generated by `python -m benchmarks.bench_exact --write-report` (do not edit by hand). "
        f"Machine: {info.get('gpu', info.get('cpu'))}, {info.get('cores')} cores, torch {info.get('torch')}, "
        f"{info.get('threads')} threads; load average at start {info.get('load_avg_start', [float('nan')])[0]:.2f}. "
        "Median wall time of whole `hs.sharpness` calls, the two steps alternated in one process after a "
        "warm-up call of each; RK4 steps: what step doubling picks for a random direction of the ball "
        "(largest over the pair stacks). Benchmark models not in the table "
        f"({', '.join(sorted(set(DEFAULT_MODELS) - {r['model'] for r in rows})) or 'none'}) were not measured in this run.",
        "",
        table(rows),
        "",
        f"Cost of the integration — {verdict}. The exact step evaluates the Christoffel contraction "
        "4 × (RK4 steps) times at moving points (each with its own Gram inverses) and back-propagates "
        "through them, and the first call of a search also runs the step doubling in float64; the "
        "second-order step evaluates it once at the fixed point.",
        MARK_END,
    ])


def write_report(section: str, path: Path = ROOT / "reports" / "benchmarks.md") -> None:
    """Replace this benchmark's own section of ``path`` (appended at the end the first time)."""
    write_section(section, MARK_START, MARK_END, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rho", type=float, default=0.1, help="radius of the invariant metric")
    ap.add_argument("--rho-mixed", type=float, default=0.01, help="radius of the mixed metric")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls of each step (default: per model, >= 2)")
    ap.add_argument("--n-iters", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/exact_<device>.json)")
    ap.add_argument("--write-report", action="store_true")
    ap.add_argument("--from-json", help="re-write the report section from a saved run")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"exact_{'cuda' if args.device.startswith('cuda') else 'cpu'}.json")
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        rows, info = saved["results"], saved["machine"]
    else:
        info = machine_info(args.device)
        info["load_avg_start"] = os.getloadavg()
        rows = []
        for name in [m.strip() for m in args.models.split(",") if m.strip()]:
            if name not in MODELS:
                raise SystemExit(f"unknown model {name!r}; known: {sorted(MODELS)}")
            rows += bench_model(name, device=args.device, rho=args.rho, rho_mixed=args.rho_mixed,
                                repeats=args.repeats, n_iters=args.n_iters)
        info["load_avg_end"] = os.getloadavg()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(machine=info, results=rows), indent=1, default=str))
        print(f"results written to {out}")
    print("\n" + table(rows))
    if args.write_report:
        write_report(report_section(rows, info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
