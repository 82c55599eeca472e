"""Cost of a SAM-family training step (issue 19): AdamW, SAM, ASAM and geodesic SAM.

    python -m benchmarks.bench_sam                   # cpu models, writes benchmarks/results/sam_cpu.*
    python -m benchmarks.bench_sam --write-report    # and its section of reports/benchmarks.md

One process, the methods interleaved round by round (so a busy machine slows them alike):
each round times ``steps`` training steps of every method on its own copy of the model, the
median over rounds is reported.  A step is the whole update: AdamW alone = one forward and
backward and the AdamW step; each SAM variant = forward, backward, ``first_step`` (the
geometry rebuilt at the current weights, the ascent), forward, backward, ``second_step``.
``sam-plain`` is the canonical implementation's arithmetic written out (``e = ρ g/‖g‖`` added
and subtracted in place), the floor for hideseek's own SAM.  The ascent's own time
(``first_step``) is timed separately.  Not a test: nothing is asserted.
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import hideseek as hs
from benchmarks.bench_sharpness import _logits, machine_info
from benchmarks.models import MODELS, build, make_batches
from benchmarks.report import write_section

ROOT = Path(__file__).resolve().parents[1]
METHODS = {"adamw": None, "sam-plain": None, "sam": "euclidean", "asam": "adaptive",
           "geodesic-invariant": "geodesic_invariant", "geodesic-mixed": "geodesic_mixed"}
MARK_START, MARK_END = "<!-- bench_sam:start -->", "<!-- bench_sam:end -->"


def _loss(model, batch):
    x, y = batch
    out = model(**x) if isinstance(x, dict) else model(x)
    return F.cross_entropy(_logits(out), y)


class _PlainSAM:
    """The canonical SAM step's arithmetic (Foret et al.; davda54/sam), for the floor."""

    def __init__(self, model, rho):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.base, self.rho = torch.optim.AdamW(self.params, lr=1e-5), rho

    @torch.no_grad()
    def first_step(self):
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        self.e = [(p, p.grad * (self.rho / (norm + 1e-12))) for p in self.params if p.grad is not None]
        for p, e in self.e:
            p.add_(e)
        self.base.zero_grad()

    @torch.no_grad()
    def second_step(self):
        for p, e in self.e:
            p.sub_(e)
        self.base.step()
        self.base.zero_grad()


def _stepper(method, model, rho):
    """``(step(), ascent_seconds_list)`` for one method on ``model``."""
    ascent: list[float] = []
    if method == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step(batch):
            _loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
        return step, ascent
    sam = _PlainSAM(model, rho) if method == "sam-plain" else \
        hs.optim.SAM(model, torch.optim.AdamW(model.parameters(), lr=1e-5), METHODS[method], rho=rho)

    def step(batch):
        _loss(model, batch).backward()
        t = time.perf_counter()
        sam.first_step() if method == "sam-plain" else sam.first_step(zero_grad=True)
        ascent.append(time.perf_counter() - t)
        _loss(model, batch).backward()
        sam.second_step() if method == "sam-plain" else sam.second_step(zero_grad=True)
    return step, ascent


def bench_model(name: str, *, rounds: int, steps: int, rho: float = 0.01, batch_size: int | None = None) -> dict:
    spec = MODELS[name]
    cpu = spec.defaults["cpu"]
    batch = make_batches(spec, batch_size or cpu["batch_size"], 1, seq_len=cpu.get("seq_len", 40))[0]
    base = build(name).train()
    steppers = {m: _stepper(m, copy.deepcopy(base), rho) for m in METHODS}
    for m, (step, _) in steppers.items():       # warm-up (first calls allocate)
        step(batch)
    times = {m: [] for m in METHODS}
    for _ in range(rounds):
        for m, (step, asc) in steppers.items():
            asc.clear()
            t = time.perf_counter()
            for _ in range(steps):
                step(batch)
            times[m].append((time.perf_counter() - t) / steps)
            if asc:
                times.setdefault(m + ":ascent", []).append(statistics.median(asc))
    med = {k: statistics.median(v) for k, v in times.items()}
    n_params = sum(p.numel() for p in base.parameters())
    n_pairs = len(hs.find_symmetries(base))
    return dict(model=name, batch_size=batch_size or cpu["batch_size"], n_params=n_params, n_attention=n_pairs,
                rounds=rounds, steps=steps, rho=rho, seconds=med, raw=times)


def ascent_ratio(r: dict, method: str) -> float:
    """A step's cost relative to SAM's estimated from the ascent alone: the methods differ only
    in ``first_step``, so ``1 + (ascent − SAM's ascent) / SAM's step`` (robust to a busy machine,
    where whole-step medians of different methods wander by more than the difference)."""
    s = r["seconds"]
    return 1.0 + (s[method + ":ascent"] - s["sam:ascent"]) / s["sam"]


def table(results: list[dict]) -> str:
    lines = ["| model | batch | method | step (ms) | × AdamW | × SAM | × sam-plain | ascent (ms) | × SAM from ascent |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = r["seconds"]
        for m in METHODS:
            asc = s.get(m + ":ascent")
            lines.append(f"| {r['model']} | {r['batch_size']} | {m} | {1e3 * s[m]:.1f} | {s[m] / s['adamw']:.2f} | "
                         f"{s[m] / s['sam']:.2f} | {s[m] / s['sam-plain']:.2f} | "
                         f"{'–' if asc is None else f'{1e3 * asc:.2f}'} | "
                         f"{'–' if asc is None or m == 'sam-plain' else f'{ascent_ratio(r, m):.2f}'} |")
    return "\n".join(lines)


def report_section(results: list[dict], info: dict) -> str:
    geo = [m for m in METHODS if m.startswith("geodesic")]
    est = {r["model"]: max(ascent_ratio(r, m) for m in geo) for r in results}
    measured = {r["model"]: max(r["seconds"][m] / r["seconds"]["sam"] for m in geo) for r in results}
    verdict = "; ".join(f"{name}: {est[name]:.2f}× from the ascent ({measured[name]:.2f}× whole-step medians), "
                        f"{'within' if est[name] <= 1.10 else 'above'} the 1.10× target" for name in est)
    rounds, steps = results[0]["rounds"], results[0]["steps"]
    return "\n".join([
        MARK_START,
        "## SAM-family training steps (issue 19)",
        "",
        "Produced by `python -m benchmarks.bench_sam --write-report` (code and method: `benchmarks/bench_sam.py`; "
        "raw numbers `benchmarks/results/sam_cpu.json`). One process, 1 thread, the methods interleaved round by "
        f"round ({rounds} rounds of {steps} steps, median per step), ρ = {results[0]['rho']}, models in training "
        f"mode, random weights. Machine: {info.get('cpu', platform.processor())}, torch {torch.__version__}; "
        "**shared and busy** while measured (other sessions' jobs kept both cores saturated): whole-step "
        "medians of different methods wander by more than their difference, so the last column estimates each "
        "step from its ascent (`first_step`, the only part in which the methods differ) and SAM's step.",
        "",
        table(results),
        "",
        f"Geodesic SAM's step relative to SAM's (worst of the two metrics) — {verdict}. "
        "The ascent rebuilds the geometry at the current weights (Gram matrices, Cholesky and eigen-decompositions "
        "of every head's h×h blocks in float64), takes the Riemannian gradient, projects it and takes the "
        "second-order step: a fixed cost of small operations per head, so the ratio is largest on the smallest "
        "model, where a forward and backward pass is cheapest.",
        MARK_END,
    ])


def write_report(section: str, path: Path = ROOT / "reports" / "benchmarks.md") -> None:
    """Replace this benchmark's own section of ``path`` (appended at the end the first time)."""
    write_section(section, MARK_START, MARK_END, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["small-bert", "small-vit"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sam_cpu"))
    ap.add_argument("--write-report", action="store_true")
    ap.add_argument("--from-json", help="re-write the tables and the report section from a saved run")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        results, info = saved["results"], saved["machine"]
    else:
        results = []
        for name in args.models:
            results.append(bench_model(name, rounds=args.rounds, steps=args.steps))
            print(table(results[-1:]), flush=True)
        info = machine_info("cpu")
    Path(args.out + ".json").write_text(json.dumps(dict(machine=info, results=results), indent=1))
    Path(args.out + ".md").write_text(table(results) + "\n")
    if args.write_report:
        write_report(report_section(results, info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
