"""Check that two versions of hideseek give bit-identical sharpness values.

Runs a grid of settings — every measure and ablation, ε, worst and average case, ℓ2 and
ℓ∞, with and without a random start, two batches, tiny models (``tests/models.py``) in
float32 and float64 — once with each version, each in a fresh process with that version
first on ``PYTHONPATH``, and compares every per-batch value, base loss and Auto-PGD
history entry with ``==`` (floats are passed as ``float.hex``)::

    git worktree add /tmp/base <commit>
    python benchmarks/check_identical.py --base /tmp/base            # base vs this checkout

Only the keyword form of :func:`hideseek.sharpness` is used, so that any version runs it.
Exits 1 when a value differs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: keyword forms of every measure and ablation (the keywords every version accepts)
GEODESIC = [dict(norm=n, christoffel=c) for n, c in
            (("riemannian", True), ("riemannian", False), ("adaptive", True), ("adaptive", False))]


def settings() -> list[dict]:
    out = []
    for kind in ("worst", "average"):
        for p in ("l2", "linf"):
            out.append(dict(measure="adaptive", p=p, kind=kind))
        for metric in ("invariant", "mixed"):
            for abl in GEODESIC:
                for eps in (0.0, 0.1):
                    out.append(dict(measure="geodesic", metric=metric, eps=eps, kind=kind, **abl))
    return out


def _models():
    import importlib.util

    import torch
    # this checkout's tiny models, loaded by path: the repository root must not go on sys.path
    # ahead of the version under test (its hideseek would shadow that version's)
    spec = importlib.util.spec_from_file_location("tests_models", ROOT / "tests" / "models.py")
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    MHAClassifier, bert_batch, tiny_bert = models.MHAClassifier, models.bert_batch, models.tiny_bert

    def mha_batches(dtype, n=2):
        out = []
        for s in range(n):
            g = torch.Generator().manual_seed(s)
            out.append((torch.randn(5, 4, 12, generator=g, dtype=torch.float64).to(dtype),
                        torch.randint(0, 3, (5,), generator=g)))
        return out

    def gl1_batches(dtype, n=2):   # head width 1: the exact GL(1) geodesic applies
        out = []
        for s in range(n):
            g = torch.Generator().manual_seed(10 + s)
            out.append((torch.randn(5, 4, 3, generator=g, dtype=torch.float64).to(dtype),
                        torch.randint(0, 3, (5,), generator=g)))
        return out

    for dtype in (torch.float64, torch.float32):
        tag = str(dtype).removeprefix("torch.")
        yield f"mha-{tag}", (lambda d=dtype: MHAClassifier().to(d).eval()), mha_batches(dtype), True
        yield (f"bert-{tag}", (lambda d=dtype: tiny_bert().to(d).eval()),
               [bert_batch(seed=s) for s in range(2)], False)
        yield f"gl1-{tag}", (lambda d=dtype: MHAClassifier(dim=3, heads=3).to(d).eval()), gl1_batches(dtype), None


def worker() -> None:
    import hideseek as hs
    rows = []
    for mname, make, batches, full_grid in _models():
        model = make()
        grid = settings() if full_grid else [s for s in settings() if s.get("eps", 0) == 0.0]
        if full_grid is None:   # GL(1): the exact step (and the second-order one beside it)
            grid = [dict(measure="geodesic", metric="invariant", christoffel=c, kind=k)
                    for c in ("exact", True) for k in ("worst", "average")]
        for kw in grid:
            for random_start in ((False, True) if kw["kind"] == "worst" else (False,)):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    res = hs.sharpness(model, batches, rho=0.05, n_iters=5, n_samples=4, seed=3,
                                       random_start=random_start, progress=False, **kw)
                rows.append(dict(model=mname, kw=kw, random_start=random_start, name=res.name,
                                 per_batch=[float(v).hex() for v in res.per_batch],
                                 base=[float(v).hex() for v in res.base_losses],
                                 history=[[float(v).hex() for v in s.history] for s in res.solver]))
    json.dump(dict(hideseek=hs.__file__, rows=rows), sys.stdout)


def run_version(root: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    out = subprocess.run([sys.executable, __file__, "--worker"], env=env, check=True,
                         capture_output=True, text=True, cwd=str(root))
    data = json.loads(out.stdout)
    if not data["hideseek"].startswith(str(root)):
        raise SystemExit(f"{root}: imported hideseek from {data['hideseek']}, not from this version")
    return data


def compare(base: dict, new: dict) -> tuple[int, float, list[str]]:
    n, worst, bad = 0, 0.0, []
    if len(base["rows"]) != len(new["rows"]):
        return 0, float("inf"), ["different number of settings"]
    for a, b in zip(base["rows"], new["rows"]):
        where = f"{a['model']} {a['kw']} random_start={a['random_start']}"
        if a["name"] != b["name"]:
            bad.append(f"{where}: name {a['name']} vs {b['name']}")
        va = a["per_batch"] + a["base"] + [v for h in a["history"] for v in h]
        vb = b["per_batch"] + b["base"] + [v for h in b["history"] for v in h]
        if len(va) != len(vb):
            bad.append(f"{where}: {len(va)} vs {len(vb)} values")
            continue
        for x, y in zip(va, vb):
            fx, fy = float.fromhex(x), float.fromhex(y)
            n += 1
            worst = max(worst, abs(fx - fy))
            if not fx == fy:
                bad.append(f"{where}: {fx!r} vs {fy!r}")
    return n, worst, bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--base", help="checkout of the reference version (e.g. a git worktree)")
    ap.add_argument("--new", default=str(ROOT), help="checkout to check (default: this one)")
    args = ap.parse_args(argv)
    if args.worker:
        worker()
        return 0
    if not args.base:
        ap.error("--base is required")
    base, new = run_version(Path(args.base).resolve()), run_version(Path(args.new).resolve())
    n, worst, bad = compare(base, new)
    print(f"{len(base['rows'])} settings, {n} values compared, max |difference| {worst!r}, "
          f"{len(bad)} differ")
    for line in bad[:20]:
        print("  " + line)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
