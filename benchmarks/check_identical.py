"""Check that two versions of hideseek give bit-identical values.

Runs, once with each version, each in a fresh process with that version first on
``PYTHONPATH``, and compares every value with ``==`` (floats are passed as ``float.hex``):

* **sharpness**: a grid of settings — every measure and ablation, ε, worst and average case,
  ℓ2 and ℓ∞, with and without a random start, two batches, tiny models (``tests/models.py``) in
  float32 and float64, the exact GL(1) step — every per-batch value, base loss and Auto-PGD
  history entry;
* **training**: a few steps of SAM, ASAM (ℓ2, ℓ∞) and geodesic SAM (invariant and mixed metric,
  second-order, straight and exact step, ε) on the tiny models — the loss at θ and at the
  ascent point of every step and every trained weight after the last;
* **curvature**: the Euclidean and Riemannian Hessians (invariant, mixed, adaptive) — exact
  traces, Hutchinson and Hutch++ estimates, the top eigenvalues and one product.

::

    git worktree add /tmp/base <commit>
    python benchmarks/check_identical.py --base /tmp/base            # base vs this checkout
    python benchmarks/check_identical.py --record base.json --new /tmp/base   # values kept once
    python benchmarks/check_identical.py --against base.json          # this checkout vs those

Only the keyword form of :func:`hideseek.sharpness`, ``hs.Measure``, ``hs.optim.SAM`` and
``hs.RiemannianHessian`` / ``hs.EuclideanHessian`` are used.  Exits 1 when a value differs.
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
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


def _hex(values) -> list[str]:
    return [float(v).hex() for v in values]


def sharpness_rows(hs) -> list[dict]:
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
                rows.append(dict(where=f"sharpness {mname} {kw} random_start={random_start}", name=res.name,
                                 values=_hex(res.per_batch) + _hex(res.base_losses)
                                 + [v for s in res.solver for v in _hex(s.history)]))
    return rows


#: the SAM family: (name, Measure keywords, models it runs on)
SAM_RULES = [
    ("sam", dict(geometry="euclidean"), ("mha", "bert")),
    ("sam_linf", dict(geometry="euclidean", p="linf"), ("mha",)),
    ("asam", dict(geometry="adaptive"), ("mha", "bert")),
    ("asam_linf", dict(geometry="adaptive", p="linf"), ("mha",)),
    ("geodesic_invariant", dict(), ("mha", "bert", "gl1")),
    ("geodesic_mixed", dict(metric="mixed"), ("mha", "bert")),
    ("geodesic_straight", dict(step="straight"), ("mha",)),
    ("geodesic_invariant_eps", dict(eps=0.1), ("mha",)),
    ("geodesic_exact", dict(step="exact"), ("gl1",)),
]


def training_rows(hs) -> list[dict]:
    """A few SAM steps (SGD with momentum, then AdamW) per rule and model: the loss at θ and at
    θ̃ each step, and every trained weight after the last step."""
    import torch
    import torch.nn.functional as F

    def loss_of(model, batch):
        x, y = batch
        out = model(**x) if isinstance(x, dict) else model(x)
        return F.cross_entropy(getattr(out, "logits", out), y)

    rows = []
    for mname, make, batches, _ in _models():
        family = mname.split("-")[0]
        for rule, kw, families in SAM_RULES:
            if family not in families:
                continue
            for base in ("sgd", "adamw"):
                model = make()
                if base == "sgd":
                    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
                else:
                    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
                sam = hs.optim.SAM(model, opt, hs.Measure(**kw), rho=0.05)
                losses = []
                for step in range(3):
                    batch = batches[step % len(batches)]
                    loss = loss_of(model, batch)
                    loss.backward()
                    sam.first_step(zero_grad=True)
                    ascent = loss_of(model, batch)
                    ascent.backward()
                    sam.second_step(zero_grad=True)
                    losses += [loss.item(), ascent.item()]
                weights = [v for _, p in sorted(model.named_parameters()) for v in p.detach().double().flatten().tolist()]
                rows.append(dict(where=f"training {mname} {rule} {base}", name=rule,
                                 values=_hex(losses) + _hex(weights)))
    return rows


def curvature_rows(hs) -> list[dict]:
    """Traces (exact, Hutchinson, Hutch++), the top eigenvalues and one product of the
    Euclidean and Riemannian Hessians on the tiny float64 models."""
    import torch

    rows = []
    for mname, make, batches, _ in _models():
        if not mname.endswith("float64"):
            continue
        ops = [("euclidean", lambda m: hs.EuclideanHessian(m, batches))]
        ops += [(name, lambda m, kw=kw: hs.RiemannianHessian(m, batches, hs.Measure(**kw)))
                for name, kw in (("invariant", dict()), ("mixed", dict(metric="mixed")),
                                 ("invariant_eps", dict(eps=0.1)), ("adaptive", dict(geometry="adaptive")))]
        for name, build in ops:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                H = build(make())
                values = [H.loss_value]
                if H.dim <= 1000:
                    values.append(float(H.trace()))
                for method, n in (("hutchinson", 6), ("hutch++", 9)):
                    t = H.trace(method, n_probes=n, seed=1)
                    values += [t.value, t.stderr]
                values += list(H.eigenvalues(2, seed=0))
                v = torch.randn(H.dim, generator=torch.Generator().manual_seed(5), dtype=H.dtype)
                values += H.flatten(H.matvec(H.unflatten(v))).tolist()
            rows.append(dict(where=f"curvature {mname} {name}", name=name, values=_hex(values)))
    return rows


SECTIONS = {"sharpness": sharpness_rows, "training": training_rows, "curvature": curvature_rows}


def grid_hash() -> str:
    """A hash of the code that chooses and computes the values (a recorded file is comparable
    only with values from the same grid)."""
    src = "".join(inspect.getsource(f) for f in (settings, _models, *SECTIONS.values())) + repr(SAM_RULES)
    return hashlib.sha256(src.encode()).hexdigest()[:16]


def worker(sections) -> None:
    import hideseek as hs
    rows = [r for name in sections for r in SECTIONS[name](hs)]
    json.dump(dict(hideseek=hs.__file__, grid=grid_hash(), sections=list(sections), rows=rows), sys.stdout)


def run_version(root: Path, sections) -> dict:
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    out = subprocess.run([sys.executable, __file__, "--worker", "--sections", ",".join(sections)], env=env,
                         check=True, capture_output=True, text=True, cwd=str(root))
    data = json.loads(out.stdout)
    if not data["hideseek"].startswith(str(root)):
        raise SystemExit(f"{root}: imported hideseek from {data['hideseek']}, not from this version")
    return data


def compare(base: dict, new: dict) -> tuple[int, float, list[str]]:
    n, worst, bad = 0, 0.0, []
    if base.get("grid") != new.get("grid") or base.get("sections") != new.get("sections"):
        return 0, float("inf"), ["the two runs computed different grids (recorded with another version of "
                                 "this script, or other --sections)"]
    if len(base["rows"]) != len(new["rows"]):
        return 0, float("inf"), ["different number of settings"]
    for a, b in zip(base["rows"], new["rows"]):
        where = a["where"]
        if a["where"] != b["where"] or a["name"] != b["name"]:
            bad.append(f"{where}: {a['name']} vs {b['where']}: {b['name']}")
        va, vb = a["values"], b["values"]
        if len(va) != len(vb):
            bad.append(f"{where}: {len(va)} vs {len(vb)} values")
            continue
        for x, y in zip(va, vb):
            fx, fy = float.fromhex(x), float.fromhex(y)
            n += 1
            if fx == fy or (math.isnan(fx) and math.isnan(fy)):
                continue
            worst = max(worst, abs(fx - fy))
            bad.append(f"{where}: {fx!r} vs {fy!r}")
    return n, worst, bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--base", help="checkout of the reference version (e.g. a git worktree)")
    ap.add_argument("--against", help="values recorded with --record (instead of --base)")
    ap.add_argument("--record", help="write the values of --new to this file (no comparison)")
    ap.add_argument("--new", default=str(ROOT), help="checkout to check (default: this one)")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated subset of {', '.join(SECTIONS)} (default: all)")
    args = ap.parse_args(argv)
    asked = [s for s in args.sections.split(",") if s]
    if not asked or any(s not in SECTIONS for s in asked):
        ap.error(f"--sections: choose from {', '.join(SECTIONS)}, got {args.sections!r}")
    sections = [s for s in SECTIONS if s in asked]     # one order, whatever the order asked
    if args.worker:
        worker(sections)
        return 0
    if args.record:
        data = run_version(Path(args.new).resolve(), sections)
        data.pop("hideseek")       # no machine paths in the recorded file
        Path(args.record).write_text(json.dumps(data, indent=0) + "\n")
        print(f"{args.record}: {len(data['rows'])} settings, "
              f"{sum(len(r['values']) for r in data['rows'])} values recorded")
        return 0
    if bool(args.base) == bool(args.against):
        ap.error("give one of --base (a checkout) or --against (a recorded file), or --record")
    base = json.loads(Path(args.against).read_text()) if args.against else run_version(Path(args.base).resolve(),
                                                                                        sections)
    new = run_version(Path(args.new).resolve(), sections)
    n, worst, bad = compare(base, new)
    print(f"{len(base['rows'])} settings, {n} values compared, max |difference| {worst!r}, "
          f"{len(bad)} values differing")
    for line in bad[:20]:
        print("  " + line)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
