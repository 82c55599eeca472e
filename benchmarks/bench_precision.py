"""Does mixed precision change the sharpness values?  (issue 6)

``hideseek.sharpness(..., autocast="bfloat16" | "float16")`` runs the model's forward and
backward passes under ``torch.autocast``; the geometry stays in float32.  Sharpness is a
*difference* of two losses at the end of a search, so rounding in the loss matters more
than it does for training.  This script measures, on trained models, how far the values
move from full precision and whether the ranking of models — what the correlation studies
use — survives:

* for each zoo (the ``cpu`` vision and language zoos, ``data/zoos/…``, built by
  ``dvc repro``) and each of the three measures at the radius the zoo's split-half
  protocol chose (``reports/metrics/<zoo>.json``), sharpness of every member in float32 and
  under autocast, same batches, seed and iterations as the zoo stage;
* per measure: the median and largest relative difference ``|s_amp − s_fp32| / s_fp32``,
  Kendall τ between the two sets of values (1 = same ranking), and Kendall τ with the
  generalisation gap under each precision.

Run::

    python -m benchmarks.bench_precision                      # both zoos, bfloat16, CPU
    python -m benchmarks.bench_precision --zoos vision --n-models 8
    python -m benchmarks.bench_precision --device cuda --dtype float16

Results go to ``benchmarks/results/precision_<device>_<dtype>.json|md``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):  # ``python benchmarks/bench_precision.py``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "benchmarks"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import hideseek as hs  # noqa: E402
from companion.experiments.zoo import STANDARD_MEASURES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _zoo(kind: str, device: str, n_models: int | None):
    """(models [(name, loader)], batches, gaps {name: gap}, n_iters, seed, chosen rho per measure)."""
    metrics_file = ROOT / "reports" / "metrics" / f"{kind}.json"
    if not metrics_file.is_file():
        raise SystemExit(f"{metrics_file} is missing: run `dvc repro {kind}` first")
    metrics = json.loads(metrics_file.read_text())
    params = metrics["params"]
    rho = {m: float(metrics["tau"][m]["rho"]) for m in STANDARD_MEASURES}
    zoo_dir = ROOT / params["zoo_dir"]
    if kind == "vision":
        from companion.experiments import vision_zoo as vz

        meta, models = vz.load_zoo(zoo_dir, device=device)
        batches = vz.sharpness_batches(vz.zoo_data(meta), int(params["n_images"]), int(params["batch_size"]))
        gaps = vz.members_frame(meta)["gap"].to_dict()
    else:
        from companion.experiments import language_zoo as lz

        zoo = lz.load_zoo(zoo_dir)
        models = lz.model_loaders(zoo_dir, device=device)
        batches = lz.sharpness_batches(zoo_dir, int(params["n_points"]), int(params["batch_size"]),
                                       int(params.get("data_seed", 0)))
        gaps = {m["name"]: m["gap"] for m in zoo["models"]}
    models = models[:n_models] if n_models else models
    return models, batches, gaps, int(params["n_iters"]), int(params["seed"]), rho


def measure(kind: str, dtype: str, device: str, n_models: int | None, progress: bool) -> dict:
    from scipy.stats import kendalltau
    from tqdm.auto import tqdm

    models, batches, gaps, n_iters, seed, rho = _zoo(kind, device, n_models)
    if device != "cpu":
        from hideseek.inputs import to_device as _to
        batches = [(_to(x, device), _to(y, device)) for x, y in batches]
    rows = []
    for name, load in tqdm(models, desc=f"{kind} fp32 vs {dtype}", disable=not progress):
        model = load()
        for mname, kw in STANDARD_MEASURES.items():
            row = dict(model=name, measure=mname, rho=rho[mname])
            for tag, amp in (("fp32", None), (dtype, dtype)):
                t0 = time.perf_counter()
                with warnings.catch_warnings():   # large-correction warnings: same in both precisions
                    warnings.simplefilter("ignore", RuntimeWarning)
                    res = hs.sharpness(model, batches, rho=rho[mname], n_iters=n_iters, seed=seed,
                                       autocast=amp, progress=False, **kw)
                row[tag], row[f"seconds_{tag}"] = res.value, time.perf_counter() - t0
            rows.append(row)
        del model
    names = list(dict.fromkeys(r["model"] for r in rows))
    gap = [float(gaps[n]) for n in names]
    summary = {}
    for mname in STANDARD_MEASURES:
        a = np.array([r["fp32"] for r in rows if r["measure"] == mname])
        b = np.array([r[dtype] for r in rows if r["measure"] == mname])
        rel = np.abs(b - a) / np.abs(a)
        s = dict(rho=rho[mname], n_models=len(a), median_rel_diff=float(np.median(rel)),
                 max_rel_diff=float(rel.max()), tau_fp32_vs_amp=float(kendalltau(a, b).statistic),
                 seconds_fp32=float(sum(r["seconds_fp32"] for r in rows if r["measure"] == mname)),
                 seconds_amp=float(sum(r[f"seconds_{dtype}"] for r in rows if r["measure"] == mname)))
        if len(a) > 2:
            s["tau_gap_fp32"] = float(kendalltau(a, gap).statistic)
            s["tau_gap_amp"] = float(kendalltau(b, gap).statistic)
        summary[mname] = s
    return dict(zoo=kind, dtype=dtype, n_iters=n_iters, batches=[int(y.shape[0]) for _, y in batches],
                summary=summary, rows=rows)


def markdown(results: list[dict], machine: dict) -> str:
    lines = [f"Machine: {machine['cpu']}, torch {machine['torch']}, device {machine['device']}, "
             f"{machine['threads']} torch threads.", "",
             "| zoo | measure | ρ | models | median rel. diff | max rel. diff | τ(fp32, amp) | "
             "τ(gap) fp32 | τ(gap) amp | time fp32 (s) | time amp (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for m, s in r["summary"].items():
            lines.append(f"| {r['zoo']} ({r['dtype']}) | {m} | {s['rho']:g} | {s['n_models']} | "
                         f"{s['median_rel_diff']:.2%} | {s['max_rel_diff']:.2%} | {s['tau_fp32_vs_amp']:+.3f} | "
                         f"{s.get('tau_gap_fp32', float('nan')):+.3f} | {s.get('tau_gap_amp', float('nan')):+.3f} | "
                         f"{s['seconds_fp32']:.1f} | {s['seconds_amp']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_precision", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--zoos", default="vision,language")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n-models", type=int, default=None, help="first N members of each zoo (default all)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="output stem (default benchmarks/results/precision_<device>_<dtype>)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = dict(cpu=platform.processor() or platform.machine(), torch=torch.__version__,
                   device=args.device if args.device == "cpu" else torch.cuda.get_device_name(args.device),
                   threads=args.threads)
    results = [measure(z, args.dtype, args.device, args.n_models, True) for z in args.zoos.split(",")]
    stem = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / \
        f"precision_{args.device.split(':')[0]}_{args.dtype}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(dict(machine=machine, results=results), indent=1))
    md = markdown(results, machine)
    stem.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
