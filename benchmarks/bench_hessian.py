"""Cost of one Hessian-vector product of ``hs.RiemannianHessian`` against one gradient (issue 26).

    python -m benchmarks.bench_hessian                  # cpu models, writes benchmarks/results/hessian_cpu.*
    python -m benchmarks.bench_hessian --write-report   # and its section of reports/benchmarks.md

Per model (:mod:`benchmarks.models`, random weights, float32, one batch of the model's cpu
size) one spawned process, one thread, glibc returning large frees to the system (so peak
RSS tracks live memory).  Timed, interleaved round by round (median over rounds):

* ``gradient`` — the loss and its gradient with respect to the perturbed weights (one
  forward and backward pass, the operator's own set-up pass);
* ``euclidean`` — one product of ``hs.EuclideanHessian`` (forward, backward with graph,
  second backward);
* ``invariant``, ``mixed`` — one product of ``hs.RiemannianHessian`` with that metric (the
  same passes plus the metric, the connection term and two horizontal projections);
* ``mixed, kept graph`` — ``keep_graph=True``: the gradient's graph built once, a product is
  one backward pass;
* ``mixed, 16 batched`` — ``matmat`` of 16 columns with the kept graph, per column.

Memory: the peak RSS (``VmHWM`` reset before each) of one gradient and one product beyond
what is held when it starts (the model, the batch, the operator's set-up), in MiB.  Not a
test: nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # ``python benchmarks/bench_hessian.py``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "benchmarks"

import torch  # noqa: E402

from .bench_sharpness import MemoryProbe, machine_info  # noqa: E402
from .models import MODELS, build, make_batches  # noqa: E402
from .report import in_fresh_process, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODELS_CPU = ("small-bert", "small-vit", "nli-bert", "glyph-vit")
METHODS = ("gradient", "euclidean", "invariant", "mixed", "mixed, kept graph", "mixed, 16 batched")
MARK_START, MARK_END = "<!-- bench_hessian:start -->", "<!-- bench_hessian:end -->"


def bench_model(name: str, rounds: int = 5, memory: bool = True) -> dict:
    """Times (seconds per product, median over ``rounds``) and peak memory of each method
    (``memory=False``: none, 0 each)."""
    import hideseek as hs

    torch.set_num_threads(1)
    spec = MODELS[name]
    d = spec.defaults["cpu"]
    model = build(name)
    batches = make_batches(spec, d["batch_size"], 1, d.get("seq_len", 128))
    ops = {"euclidean": hs.EuclideanHessian(model, batches),
           "invariant": hs.RiemannianHessian(model, batches, hs.Measure(metric="invariant")),
           "mixed": hs.RiemannianHessian(model, batches, hs.Measure(metric="mixed")),
           "mixed, kept graph": hs.RiemannianHessian(model, batches, hs.Measure(metric="mixed"), keep_graph=True),
           "mixed, 16 batched": hs.RiemannianHessian(model, batches, hs.Measure(metric="mixed"), keep_graph=True,
                                                     chunk=16)}
    gen = torch.Generator().manual_seed(0)
    vecs = {k: op.project([torch.randn(s, generator=gen) for s in op.shapes]) for k, op in ops.items()}
    X = torch.randn(ops["mixed, 16 batched"].dim, 16, generator=gen)

    def run(method):
        if method == "gradient":
            ops["mixed"]._value_and_grad()
        elif method == "mixed, 16 batched":
            ops[method].matmat(X)
        else:
            ops[method].matvec(vecs[method])

    for m in METHODS:          # warm-up (and the kept graph is built here)
        run(m)
    times = {m: [] for m in METHODS}
    for _ in range(rounds):
        for m in METHODS:
            t = time.perf_counter()
            run(m)
            times[m].append(time.perf_counter() - t)
    sec = {m: statistics.median(v) / (16 if m == "mixed, 16 batched" else 1) for m, v in times.items()}
    probe = MemoryProbe(torch.device("cpu"))
    mem = {m: 0 for m in METHODS}
    for m in METHODS if memory else ():
        probe.start()
        run(m)
        mem[m] = probe.peak()
    return dict(model=name, description=spec.description, dim=ops["mixed"].dim,
                n_params=sum(p.numel() for p in model.parameters()),
                batch=d["batch_size"], seq_len=d.get("seq_len") if spec.kind == "text" else None,
                rounds=rounds, seconds=sec, peak_bytes=mem, memory_method=probe.method)


def run_fresh(name: str, rounds: int) -> dict:
    return in_fresh_process(bench_model, name, rounds, live=True)


def table(results: list[dict]) -> str:
    lines = ["| model | dims | " + " | ".join(METHODS) + " |",
             "|---|---|" + "---|" * len(METHODS)]
    for r in results:
        g = r["seconds"]["gradient"]
        cells = [f"{1e3 * r['seconds'][m]:.1f} ms" + ("" if m == "gradient" else f" ({r['seconds'][m] / g:.2f}×)")
                 for m in METHODS]
        lines.append(f"| {r['model']} | {r['dim']:,} | " + " | ".join(cells) + " |")
    lines += ["", "| model | " + " | ".join(f"peak MiB, {m}" for m in METHODS) + " |",
              "|---|" + "---|" * len(METHODS)]
    for r in results:
        lines.append(f"| {r['model']} | " + " | ".join(f"{r['peak_bytes'][m] / 2**20:.1f}" for m in METHODS) + " |")
    return "\n".join(lines)


def report_section(results: list[dict], info: dict, note: str = "") -> str:
    ratio = lambda r, m: r["seconds"][m] / r["seconds"]["gradient"]  # noqa: E731
    worst = max(ratio(r, m) for r in results for m in ("invariant", "mixed"))
    kept = max(ratio(r, "mixed, kept graph") for r in results)
    eucl = [ratio(r, "euclidean") for r in results]
    within = [f"{r['model']} ({m})" for r in results for m in METHODS[1:] if ratio(r, m) <= 3.0]
    return "\n".join([
        MARK_START,
        "## The Riemannian Hessian operator: one product against one gradient (issue 26)",
        "",
        f"Generated by `python -m benchmarks.bench_hessian --write-report` ({info.get('cpu', '?')}, "
        f"{info.get('date', '?')}; raw numbers `benchmarks/results/hessian_cpu.json`). One spawned process per "
        "model, 1 thread, one batch of the model's cpu size, random float32 weights; median of "
        f"{results[0]['rounds']} interleaved rounds; the ratio is to one gradient (forward and backward). "
        "A product of `hs.RiemannianHessian` is a forward pass, a backward pass with graph and a second backward "
        "pass, plus the metric, the connection term and two horizontal projections; with `keep_graph=True` the "
        "gradient's graph is built once and a product is one backward pass; `16 batched` is `matmat` of 16 "
        "columns with the kept graph, per column. Memory: peak RSS during one call beyond what is held when it "
        "starts (MiB).",
        "",
        table(results),
        "",
        f"Worst ratio of a plain product (invariant or mixed) to a gradient: {worst:.2f}× (target ≤ 3×); with "
        f"the kept graph: {kept:.2f}×. The Euclidean product, the same double backward pass without the "
        f"geometry, takes {min(eucl):.2f}–{max(eucl):.2f}× a gradient; within 3×: "
        f"{', '.join(within) if within else 'none'}." + (f" {note}" if note else ""),
        MARK_END,
        ""])


def write_report(section: str, path: Path = ROOT / "reports" / "benchmarks.md") -> None:
    """Replace this benchmark's own section of ``path`` (appended at the end the first time)."""
    write_section(section, MARK_START, MARK_END, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS_CPU))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hessian_cpu"))
    ap.add_argument("--write-report", action="store_true")
    ap.add_argument("--from-json", help="rewrite the report from a saved result file")
    ap.add_argument("--note", default="", help="a sentence appended to the report section (conditions of the run)")
    args = ap.parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        results, info = saved["results"], saved["machine"]
    else:
        info = machine_info("cpu")
        results = []
        for name in args.models:
            results.append(run_fresh(name, args.rounds))
            print(table(results[-1:]), flush=True)
        Path(args.out + ".json").write_text(json.dumps(dict(machine=info, results=results), indent=1))
        Path(args.out + ".md").write_text(table(results) + "\n")
    if args.write_report:
        write_report(report_section(results, info, args.note))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
