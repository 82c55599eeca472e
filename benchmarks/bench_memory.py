"""Peak memory of one sharpness call, in parameter-sized copies beyond the model (issue 17).

Each (model, measure) runs in a fresh (spawned) process: the model (random weights, float32,
eval mode) and one batch are built, then the resident set size is read and the peak
(``VmHWM``) reset to it (:class:`benchmarks.bench_sharpness.MemoryProbe`), then one call runs;

    copies = (peak RSS − RSS after model and batch are built) / bytes of the parameters.

``floor`` is one forward + backward pass (gradient with respect to every parameter), what a
training step needs at least.  On CUDA the same with ``torch.cuda.max_memory_allocated``.
Models: ``minilm-shape`` (a random BERT of all-MiniLM-L6-v2's shape, 22.7 M parameters) and
``bert-base`` (:mod:`benchmarks.models`); default batch 4 × 32 tokens::

    python -m benchmarks.bench_memory                                # both models, all measures
    python -m benchmarks.bench_memory --models minilm-shape --measures geodesic_mixed
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # ``python benchmarks/bench_memory.py``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "benchmarks"

import torch  # noqa: E402

from .bench_sharpness import MemoryProbe, floor_run, machine_info  # noqa: E402
from .models import MODELS, build, make_batches  # noqa: E402
from .report import LIVE_ENV, in_fresh_process  # noqa: E402

#: every worst-case measure and ablation (keyword form), plus the floor
MEASURES: dict[str, dict | None] = {
    "floor": None,
    "adaptive_l2": dict(measure="adaptive", p="l2"),
    "adaptive_linf": dict(measure="adaptive", p="linf"),
    "geodesic_invariant": dict(metric="invariant"),
    "geodesic_mixed": dict(metric="mixed"),
    "geodesic_mixed_no_christoffel": dict(metric="mixed", christoffel=False),
    "geodesic_mixed_adaptive_ball": dict(metric="mixed", norm="adaptive"),
}


@dataclass
class MemoryResult:
    model: str
    measure: str
    batch: str
    n_iters: int
    restarts: int
    n_params: int
    param_bytes: int
    peak_bytes: int
    method: str
    live_bytes: int | None = None   # the same with a fixed mmap threshold (live memory)

    @property
    def copies(self) -> float:
        return self.peak_bytes / self.param_bytes

    @property
    def live_copies(self) -> float | None:
        return None if self.live_bytes is None else self.live_bytes / self.param_bytes


def run_one(model_name: str, measure: str, batch_size: int, seq_len: int, n_iters: int,
            device: str = "cpu", restarts: int = 1, low_memory: bool | None = False) -> MemoryResult:
    """Build, reset the peak, measure one call (in this process)."""
    import hideseek as hs

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    dev = torch.device(device)
    spec = MODELS[model_name]
    model = build(model_name).to(dev)
    batches = [({k: v.to(dev) for k, v in x.items()} if isinstance(x, dict) else x.to(dev), y.to(dev))
               for x, y in make_batches(spec, batch_size, 1, seq_len)]
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    probe = MemoryProbe(dev)
    probe.start()
    if measure == "floor":
        floor_run(model, batches, 1)
    else:
        kw = dict(MEASURES[measure])
        if restarts != 1:
            kw["restarts"] = restarts
        kw["low_memory"] = low_memory
        hs.sharpness(model, batches, rho=0.1, n_iters=n_iters, progress=False, **kw)
    peak = probe.peak()
    shape = f"{batch_size}×{seq_len}" if spec.kind == "text" else f"{batch_size}"
    return MemoryResult(model_name, measure + SUFFIX[low_memory], shape, n_iters,
                        restarts, n_params, param_bytes, peak, probe.method)


#: the measure's label by ``low_memory``: kept gradient, ``low_memory=True``, the default (``None``)
SUFFIX = {False: "", True: " (low_memory)", None: " (default)"}




def run_fresh(*args, live: bool = False, **kw) -> MemoryResult:
    """:func:`run_one` in a spawned process; ``live``: with :data:`LIVE_ENV` set, so that
    heap fragmentation (freed memory glibc keeps) does not count."""
    return in_fresh_process(run_one, *args, live=live, **kw)


def table(results: list[MemoryResult]) -> str:
    lines = ["| model | parameters | batch | iters | measure | peak extra (MiB) | copies | "
             "copies, live |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        what = r.measure + (f" (restarts={r.restarts})" if r.restarts != 1 else "")
        live = "–" if r.live_copies is None else f"{r.live_copies:.2f}"
        lines.append(f"| {r.model} | {r.n_params / 1e6:.1f} M | {r.batch} | {r.n_iters} | {what} | "
                     f"{r.peak_bytes / 2**20:.0f} | {r.copies:.2f} | {live} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_memory",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="minilm-shape,bert-base")
    ap.add_argument("--measures", default=",".join(MEASURES))
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--n-iters", type=int, default=5,
                    help="Auto-PGD iterations (the first step-size checkpoint falls inside 5)")
    ap.add_argument("--restarts", type=int, default=1)
    ap.add_argument("--low-memory", choices=("no", "yes", "both", "default"), default="both",
                    help="hideseek.sharpness(low_memory=…): False, True, both, or the default None "
                         "(True from hideseek.problem.LOW_MEMORY_FROM perturbed elements)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-live", action="store_true",
                    help="skip the second run per measure with a fixed mmap threshold (live memory)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--markdown", default=None, help="write the table here")
    args = ap.parse_args(argv)
    results = []
    for m in args.models.split(","):
        for meas in args.measures.split(","):
            lows = {"no": [False], "yes": [True], "both": [False, True], "default": [None]}[args.low_memory]
            for low in (lows if meas != "floor" else [False]):
                run = (m, meas, args.batch_size, args.seq_len, args.n_iters, args.device)
                kw = dict(restarts=args.restarts, low_memory=low)
                r = run_fresh(*run, **kw)
                if args.device == "cpu" and not args.no_live:
                    r.live_bytes = run_fresh(*run, **kw, live=True).peak_bytes
                print(f"{m:>14} {r.measure:<45} {r.peak_bytes / 2**20:8.0f} MiB  {r.copies:6.2f} copies "
                      f"(live {r.live_copies})", flush=True)
                results.append(r)
    info = machine_info(args.device)
    text = (f"Memory: {results[0].method}; copies = that / bytes of the parameters; "
            f"*live*: the same in a process started with {LIVE_ENV} (glibc then returns freed "
            f"memory at once: the peak of live allocations, without heap fragmentation). "
            f"torch {info['torch']}, {args.device}.\n\n" + table(results))
    print("\n" + text)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(machine=info, results=[
            dict(asdict(r), copies=r.copies, live_copies=r.live_copies) for r in results]), indent=1, default=str))
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
