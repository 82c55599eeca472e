"""A zoo in one pass against the per-model loop, and restarts (issue 17).

For each model of :mod:`benchmarks.models` asked for (default: the ``cpu`` zoos'
architectures, ``small-bert`` and ``small-vit``), ``--members`` random members (seeds 0, 1, …),
one batch, the paper's 20 iterations, in one process, interleaved (loop, zoo, loop, zoo …;
medians of ``--repeats``):

* ``loop``: ``[hs.sharpness(m, batches, measure, rho=ρ) for m in members]``;
* ``zoo``: ``hs.sharpness_zoo(members, batches, measure, rho=ρ)`` (one chunk);
* ``restarts``: one model, ``hs.sharpness(…, restarts=K)`` (the starts one after the
  other) against ``hs.sharpness_zoo([model], …, restarts=K)`` (the starts in one pass) and
  against ``restarts=1``.

* ``passes``: the model's forward + backward passes alone, for all members: one after the other
  (``separate``) and as one ``torch.func.vmap`` over the stacked members (``vmap``, what the zoo
  does per iteration).  The zoo needs at least one set-up pass per member and ``n_iters``
  vmapped passes, so ``ceiling = loop / (members × separate pass + n_iters × vmap pass)``
  bounds its speed-up over the loop whatever the geometry and the solver cost: where the
  vmapped pass is no cheaper than the separate ones, no zoo pass can be much faster.

The largest relative difference between the zoo's values and the loop's is reported too::

    python -m benchmarks.bench_zoo --threads 2 --markdown benchmarks/results/zoo_cpu.md
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "benchmarks"

import torch  # noqa: E402

from . import machine_state  # noqa: E402
from .bench_sharpness import machine_info  # noqa: E402
from .models import MODELS, build, make_batches  # noqa: E402

MEASURES = {"adaptive": dict(measure="adaptive"), "geodesic_mixed": dict(metric="mixed"),
            "geodesic_invariant": dict(metric="invariant")}


def _time(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def pass_times(zoo: list, batch, repeats: int = 3) -> tuple[float, float]:
    """Seconds of one forward + backward pass of every member: one after the other, and as
    one ``vmap`` over the stacked members (medians of ``repeats``)."""
    import torch.nn.functional as F
    from torch.func import functional_call, vmap

    x, y = batch
    base = zoo[0]

    def loss(p, x, y):
        out = functional_call(base, p, (), x) if isinstance(x, dict) else functional_call(base, p, (x,))
        return F.cross_entropy(out if torch.is_tensor(out) else out.logits, y)

    params = [{n: t.detach().clone().requires_grad_(True) for n, t in m.named_parameters()} for m in zoo]
    stacked = {n: torch.stack([p[n] for p in params]).detach().requires_grad_(True) for n in params[0]}

    def separate():
        for p in params:
            torch.autograd.grad(loss(p, x, y), list(p.values()))

    def batched():
        losses = vmap(loss, in_dims=(0, None, None))(stacked, x, y)
        torch.autograd.grad(losses.sum(), list(stacked.values()))

    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)      # as the zoo's pass
    try:
        sep, vm = [], []
        separate(), batched()                           # warm-up
        for _ in range(repeats):
            sep.append(_time(separate)[0])
            vm.append(_time(batched)[0])
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)
    return statistics.median(sep), statistics.median(vm)


def bench(model: str, measure: str, members: int, batch_size: int | None, n_iters: int, repeats: int,
          restarts: int, rho: float = 0.1, device: str = "cpu") -> dict:
    import hideseek as hs

    spec = MODELS[model]
    sizes = spec.defaults["cuda" if device.startswith("cuda") else "cpu"]
    batch_size = batch_size or sizes["batch_size"]
    zoo = [build(model, seed=s).to(device) for s in range(members)]
    batches = make_batches(spec, batch_size, 1, seq_len=sizes.get("seq_len", 40))
    kw = dict(MEASURES[measure], rho=rho, n_iters=n_iters)
    loop_t, zoo_t, one_t, seq_t, bat_t = [], [], [], [], []
    diff = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(repeats):
            t, ref = _time(lambda: [hs.sharpness(m, batches, progress=False, **kw) for m in zoo])
            loop_t.append(t)
            t, got = _time(lambda: hs.sharpness_zoo(zoo, batches, chunk=members, **kw))
            zoo_t.append(t)
            diff = max([diff] + [abs(a.value - b.value) / max(abs(b.value), 1e-12) for a, b in zip(got, ref)])
            if restarts > 1:
                t, one = _time(lambda: hs.sharpness(zoo[0], batches, progress=False, **kw))
                one_t.append(t)
                t, seq = _time(lambda: hs.sharpness(zoo[0], batches, progress=False, restarts=restarts, **kw))
                seq_t.append(t)
                t, bat = _time(lambda: hs.sharpness_zoo(zoo[:1], batches, restarts=restarts, **kw)[0])
                bat_t.append(t)
                gain = [max(v) - v[0] for v in seq.restart_values]
    med = statistics.median
    sep, vm = pass_times(zoo, batches[0], repeats=max(3, repeats))
    out = dict(model=model, measure=measure, members=members, batch=batch_size, n_iters=n_iters,
               loop_s=med(loop_t), zoo_s=med(zoo_t), speedup=med(loop_t) / med(zoo_t), max_rel_diff=diff,
               pass_separate_s=sep, pass_vmap_s=vm,
               ceiling=med(loop_t) / (sep + n_iters * vm))
    if restarts > 1:
        out.update(restarts=restarts, single_s=med(one_t), restarts_loop_s=med(seq_t),
                   restarts_zoo_s=med(bat_t), restart_gain=gain,
                   restarts_values_agree=max(abs(a - b) for a, b in zip(seq.per_batch, bat.per_batch)))
    return out


def table(rows: list[dict]) -> str:
    lines = ["| model | measure | batch | members | loop (s) | zoo (s) | speed-up | passes: separate (ms) | "
             "passes: vmap (ms) | ceiling | max rel. diff | "
             "restarts K | 1 start (s) | K starts, loop (s) | K starts, one pass (s) | best − zero start |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rest = (f"{r['restarts']} | {r['single_s']:.2f} | {r['restarts_loop_s']:.2f} | {r['restarts_zoo_s']:.2f} | "
                f"{max(r['restart_gain']):.3g}" if "restarts" in r else "– | – | – | – | –")
        passes = (f"{1e3 * r['pass_separate_s']:.0f} | {1e3 * r['pass_vmap_s']:.0f} | {r['ceiling']:.2f}×"
                  if "ceiling" in r else "– | – | –")
        lines.append(f"| {r['model']} | {r['measure']} | {r.get('batch', '–')} | {r['members']} | {r['loop_s']:.2f} | "
                     f"{r['zoo_s']:.2f} | {r['speedup']:.2f}× | {passes} | {r['max_rel_diff']:.1e} | {rest} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_zoo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="glyph-vit,nli-bert")
    ap.add_argument("--measures", default="adaptive,geodesic_mixed")
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=None, help="default: the model's cpu/cuda batch")
    ap.add_argument("--n-iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--restarts", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    info = machine_info(args.device)
    info["load_avg_start"] = os.getloadavg()
    rows = []
    for m in args.models.split(","):
        for meas in args.measures.split(","):
            rows.append(bench(m, meas, args.members, args.batch_size, args.n_iters, args.repeats,
                              args.restarts, device=args.device))
            print(json.dumps(rows[-1]), flush=True)
    info["load_avg_end"] = os.getloadavg()
    text = (f"{info.get('gpu', info['cpu'])}, {info['threads']} threads, torch {info['torch']}; load average "
            f"{info['load_avg_start'][0]:.1f} at start, {info['load_avg_end'][0]:.1f} at end "
            f"({machine_state(info)}). Medians of {args.repeats} interleaved run(s), {args.n_iters} iterations, "
            f"one batch, ρ = 0.1; passes: medians of 3 or more.\n\n" + table(rows))
    print("\n" + text)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(machine=info, rows=rows), indent=1, default=str))
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
