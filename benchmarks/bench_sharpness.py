"""Cost of geodesic sharpness against adaptive sharpness and against the forward/backward floor.

For each model, on the same batches and with the same number of Auto-PGD iterations, this
measures

* ``floor``: ``n_iters`` forward + backward passes of the same loss through the same
  ``torch.func.functional_call`` path, gradient with respect to every parameter;
* ``adaptive``: ``hideseek.sharpness(model, batches, "m_apgd_l2")``;
* ``geodesic_invariant`` / ``geodesic_mixed``: ``hideseek.sharpness(model, batches,
  Measure(metric=…))`` (second-order geodesic step, Riemannian norm: the paper's measure);

each as wall time (median of ``repeats`` runs after a warm-up run) and peak memory, and as
ratios to the floor and to adaptive.  Each (model, measure) runs in a fresh process, so
that the memory high-water mark belongs to that measure alone:

* CPU: peak resident set size (``VmHWM`` of ``/proc/self/status``, reset through
  ``/proc/self/clear_refs`` after the model and batches are built) minus the resident set
  size at that moment — the extra memory the measurement needs on top of model and data;
* CUDA: ``torch.cuda.max_memory_allocated()`` minus ``memory_allocated()`` at the start.

The warm-up run is instrumented (``--attribute``, default on) through ``torch.profiler`` and
the labels hideseek gives its phases (see :class:`Attribution`; nothing in the library is
patched): wall time spent in the model's forward pass, in the geodesic step and merge, in
autograd's backward pass, in the geometry of the search (``direction``, ``ball``), in the rest
of the Auto-PGD loop (Python, momentum, the one host sync per iteration) and in the set-up
(symmetry discovery, deterministic-loss check, precomputation).  Host syncs inside Auto-PGD
are counted in one more untimed run through the solvers' ``callback`` (:func:`auto_pgd_syncs`).

``--projection`` also times the horizontal projection of the invariant metric for all 144
query/key head pairs of BERT-base (769 × 64 each) in one batched call, with its one-off
precomputation, against ``scipy.linalg.solve_sylvester`` head by head, and checks that they
agree.

Defaults are per device (see :data:`benchmarks.models.MODELS`): on the CPU BERT-base and
ViT-B/32 use tiny batches and 2 iterations so the whole run takes minutes on 2 cores; on a
GPU, the paper's protocol (batches of 128 sequences of 128 tokens / 256 images, 20
iterations).  Examples::

    python -m benchmarks.bench_sharpness                                # all models, defaults
    python -m benchmarks.bench_sharpness --models small-bert,small-vit --n-iters 20
    python -m benchmarks.bench_sharpness --device cuda                  # the paper's sizes
    python -m benchmarks.bench_sharpness --models bert-base --batch-size 8 --n-iters 5
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import gc
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # ``python benchmarks/bench_sharpness.py``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "benchmarks"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.func import functional_call  # noqa: E402

from hideseek.measures import Measure  # noqa: E402
from hideseek.solvers import SolverStep  # noqa: E402

from .models import MODELS, build, make_batches  # noqa: E402

MEASURES: dict[str, Measure | None] = {
    "floor": None,
    "adaptive": Measure.parse("m_apgd_l2"),
    "geodesic_invariant": Measure(metric="invariant"),
    "geodesic_mixed": Measure(metric="mixed"),
}
ATTRIBUTION = ("forward (model)", "geodesic step + merge", "backward (autograd)",
               "geometry (direction, ball)", "loop: other", "set-up")


# ----------------------------------------------------------------------------- tasks
@dataclass
class Task:
    """One (model, measure) measurement."""

    model: str
    measure: str
    batch_size: int
    n_iters: int
    seq_len: int = 128
    n_batches: int = 1
    repeats: int = 3
    rho: float = 0.1
    device: str = "cpu"
    threads: int | None = None
    seed: int = 0
    attribute: bool = True
    autocast: str | None = None   # "bfloat16" / "float16": forward and backward under torch.autocast
    count_syncs: bool = True      # one more (untimed) run counting host syncs inside Auto-PGD

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; known: {sorted(MODELS)}")
        if self.measure not in MEASURES:
            raise ValueError(f"unknown measure {self.measure!r}; known: {list(MEASURES)}")
        for k in ("batch_size", "n_iters", "seq_len", "n_batches", "repeats"):
            if int(getattr(self, k)) < 1:
                raise ValueError(f"{k} must be >= 1, got {getattr(self, k)}")
        if not self.rho > 0:
            raise ValueError(f"rho must be positive, got {self.rho}")


@dataclass
class Result:
    task: Task
    seconds: list[float]                 # total wall time of each timed repeat
    loop_seconds: list[float]            # of which inside Auto-PGD (sharpness measures)
    peak_bytes: int                      # extra peak memory over model + batches
    memory_method: str
    n_evals: int                         # forward+backward passes per repeat
    value: float | None                  # sharpness (sanity), None for the floor
    attribution: dict[str, float] = field(default_factory=dict)  # seconds, warm-up run
    #: host syncs inside Auto-PGD's loops (all batches), by origin {"hideseek", "other"}
    syncs: dict[str, int] | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def loop_median(self) -> float:
        return statistics.median(self.loop_seconds)


# ---------------------------------------------------------------------------- memory
class MemoryProbe:
    """Extra peak memory of a block of work over the memory in use when it starts."""

    def __init__(self, device: torch.device):
        self.device = device
        self.method = ""

    @staticmethod
    def _status_kb(key: str) -> int:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        raise KeyError(key)

    def start(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            self.method = "torch.cuda.max_memory_allocated − memory_allocated at start"
            return
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")          # reset VmHWM (the peak RSS) to the current RSS
            self.base = self._status_kb("VmRSS") * 1024
            self.method = "peak RSS (VmHWM, reset via /proc/self/clear_refs) − RSS at start"
        except OSError:
            import resource
            self.base = self._status_kb("VmRSS") * 1024
            self._maxrss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            self.method = ("ru_maxrss − RSS at start (no reset possible: may include the model's "
                           "construction)")

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device) - self.base)
        if self.method.startswith("peak RSS"):
            return int(self._status_kb("VmHWM") * 1024 - self.base)
        import resource
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.base)


# ------------------------------------------------------------------------ attribution
class Attribution:
    """Wall time by component of one sharpness (or floor) run, without touching the library:
    hideseek labels the phases of each Auto-PGD iteration for ``torch.profiler``
    (``hideseek.forward``, ``hideseek.backward``, ``hideseek.step``, ``hideseek.geometry``),
    and the solvers time themselves (``SolverResult.seconds``, passed in with
    :meth:`record_loop`).  On the CPU a label's time is its inclusive CPU time; on CUDA the
    device time of the kernels launched under it.  Set-up = total − Auto-PGD; "loop: other"
    = Auto-PGD − the labelled phases (Python, momentum, the one host sync per iteration)."""

    LABELS = {"hideseek.forward": "forward (model)", "hideseek.backward": "backward (autograd)",
              "hideseek.step": "geodesic step + merge", "hideseek.geometry": "geometry (direction, ball)"}

    def __init__(self, device: torch.device, enabled: bool = True):
        self.device, self.enabled = device, enabled
        self.seconds = {k: 0.0 for k in ATTRIBUTION}
        self._loop_total = 0.0

    def record_loop(self, seconds: float) -> None:
        """Time spent inside the solvers (all batches) during the block."""
        self._loop_total += seconds

    def __enter__(self) -> "Attribution":
        if not self.enabled:
            return self
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._prof = profile(activities=acts)
        self._prof.__enter__()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        total = time.perf_counter() - self._t0
        self._prof.__exit__(*exc)
        if exc[0] is not None:
            return
        from torch.autograd import DeviceType
        cuda = self.device.type == "cuda"
        for ev in self._prof.events():
            key = self.LABELS.get(ev.name)
            if key is None or ev.device_type != DeviceType.CPU:
                continue
            us = ev.device_time_total if cuda else ev.cpu_time_total
            self.seconds[key] += us * 1e-6
        inner = sum(v for k, v in self.seconds.items() if k not in ("loop: other", "set-up"))
        self.seconds["loop: other"] = max(self._loop_total - inner, 0.0)
        self.seconds["set-up"] = total - self._loop_total


# ---------------------------------------------------------------------------- running
def _logits(out):
    return out if isinstance(out, torch.Tensor) else out.logits


def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    return {k: v.to(device) for k, v in obj.items()}


def floor_run(model, batches, n_iters: int, autocast: str | None = None) -> int:
    """``n_iters`` forward + backward passes per batch of the mean cross-entropy through
    ``functional_call``, gradient with respect to every parameter (what one Auto-PGD
    iteration cannot do without).  Returns the number of passes."""
    params = {n: p.detach().requires_grad_(True) for n, p in model.named_parameters()}
    leaves = list(params.values())
    device_type = leaves[0].device.type
    dtype = getattr(torch, autocast) if autocast else None
    n = 0
    for x, y in batches:
        for _ in range(n_iters):
            with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=dtype is not None):
                out = functional_call(model, params, (x,)) if isinstance(x, torch.Tensor) else \
                    functional_call(model, params, (), x)
                loss = F.cross_entropy(_logits(out), y)
                grads = torch.autograd.grad(loss, leaves, allow_unused=True)
            del grads, loss, out
            n += 1
    return n


def _one_run(task: Task, model, batches, callback: Callable[[SolverStep], Any] | None = None
             ) -> tuple[float, float, int, float | None]:
    """(total seconds, Auto-PGD seconds, forward+backward passes, sharpness value);
    ``callback`` observes the solvers (:class:`hideseek.solvers.SolverStep`)."""
    import hideseek as hs

    dev = torch.device(task.device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    if task.measure == "floor":
        n = floor_run(model, batches, task.n_iters, task.autocast)
        sync()
        dt = time.perf_counter() - t0
        return dt, dt, n, None
    res = hs.sharpness(model, batches, MEASURES[task.measure], rho=task.rho, n_iters=task.n_iters,
                       seed=task.seed, autocast=task.autocast, progress=False, callback=callback)
    sync()
    dt = time.perf_counter() - t0
    loop = sum(r.seconds for r in res.solver)
    # Auto-PGD's evaluations + the set-up's gradient pass (used parameters; it is also the
    # first batch's starting point, so Auto-PGD counts one evaluation less there); the
    # deterministic-loss check adds one more forward pass.
    n = sum(r.n_evals for r in res.solver) + 1
    return dt, loop, n, float(res.value)


def auto_pgd_syncs(run: Callable[[Callable[[SolverStep], Any]], Any]) -> list[dict[str, int]]:
    """Call ``run(callback)`` — ``run`` passes ``callback`` to :func:`hideseek.sharpness` —
    and return, for each Auto-PGD search it makes, the host syncs inside the search's loop
    (from its start, iteration 0, to its last iteration) by origin
    (:class:`hideseek.utils.HostSyncCounter`: ``"hideseek"`` or ``"other"``, the model's).
    The one read of the starting value before iteration 0 is not included."""
    from hideseek.utils import HostSyncCounter

    counter = HostSyncCounter()
    marks: list[list[dict[str, int]]] = []   # per search: [counts at its start, counts now]

    def observe(step: SolverStep) -> None:
        now = dict(counter.counts)
        if step.iteration == 0:
            marks.append([now, now])
        else:
            marks[-1][1] = now

    with counter:
        run(observe)
    return [{k: end[k] - start[k] for k in start} for start, end in marks]


def count_syncs(task: Task, model, batches) -> dict[str, int] | None:
    """Host syncs inside Auto-PGD (all batches) in one untimed run, by origin."""
    if task.measure == "floor":
        return None
    per_search = auto_pgd_syncs(lambda cb: _one_run(task, model, batches, callback=cb))
    return {k: sum(c[k] for c in per_search) for k in ("hideseek", "other")}


def run_task(task: Task) -> Result:
    """Build the model and batches, warm up (instrumented), then time ``repeats`` runs."""
    if task.threads:
        torch.set_num_threads(int(task.threads))
    dev = torch.device(task.device)
    spec = MODELS[task.model]
    model = build(task.model, seed=task.seed).to(dev)
    if spec.kind == "text":
        max_pos = model.config.max_position_embeddings
        if task.seq_len > max_pos:
            raise ValueError(f"seq_len {task.seq_len} exceeds {task.model}'s "
                             f"max_position_embeddings {max_pos}")
    batches = [(_to(x, dev), y.to(dev)) for x, y in
               make_batches(spec, task.batch_size, task.n_batches, task.seq_len, seed=task.seed)]
    probe = MemoryProbe(dev)
    probe.start()
    with Attribution(dev, enabled=task.attribute) as attr:
        _, loop, _, value = _one_run(task, model, batches)
        attr.record_loop(loop if task.measure != "floor" else 0.0)
    seconds, loops = [], []
    n_evals = 0
    for _ in range(task.repeats):
        dt, loop, n_evals, value = _one_run(task, model, batches)
        seconds.append(dt)
        loops.append(loop)
    peak = probe.peak()
    syncs = count_syncs(task, model, batches) if task.count_syncs else None
    return Result(task, seconds, loops, peak, probe.method, n_evals, value,
                  attr.seconds if task.attribute else {}, syncs)


def run_fresh(task: Task) -> Result:
    """:func:`run_task` in a fresh (spawned) process: its own memory high-water mark."""
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(run_task, task).result()


# ------------------------------------------------------------------------- projection
def bench_projection(device: str = "cpu", repeats: int = 5, calls: int = 20,
                     seed: int = 0, scipy_repeats: int = 3, threads: int | None = None,
                     bert_config: dict | None = None) -> dict:
    """All 144 query/key head pairs of a BERT-base (random weights, as initialised), stacked
    as ``G, H`` of shape (144, 769, 64): the invariant-metric horizontal projection in one
    batched call (``PairGeometry.project``) and its one-off precomputation, against
    ``scipy.linalg.solve_sylvester`` head by head; the mixed metric for comparison.
    ``bert_config``: ``BertConfig`` keyword arguments for another size (tests)."""
    import numpy as np
    import scipy.linalg
    from transformers import BertConfig, BertModel

    from hideseek import find_symmetries
    from hideseek.geometry.gl import PairGeometry

    if threads:
        torch.set_num_threads(int(threads))
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(seed)
    bert = BertModel(BertConfig(**(bert_config or {}))).eval()
    params = {n: p.detach() for n, p in bert.named_parameters()}
    Gs, Hs = [], []
    for blk in find_symmetries(bert):
        (G, H), _vo = blk.split({n: params[n] for n in blk.param_names})
        Gs.append(G)
        Hs.append(H)
    G64 = torch.cat(Gs).double().to(dev)
    H64 = torch.cat(Hs).double().to(dev)
    del bert, params
    g = torch.Generator().manual_seed(seed + 1)
    xG64 = torch.randn(G64.shape, generator=g, dtype=torch.float64).to(dev) * 0.02
    xH64 = torch.randn(H64.shape, generator=g, dtype=torch.float64).to(dev) * 0.02

    def timeit(fn, n):
        fn()
        sync()
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            sync()
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    result: dict[str, Any] = dict(pairs=int(G64.shape[0]), shape_G=list(G64.shape[1:]),
                                  shape_H=list(H64.shape[1:]), device=device,
                                  threads=torch.get_num_threads())
    outs = {}
    for dtype in (torch.float32, torch.float64):
        G, H, xG, xH = (t.to(dtype) for t in (G64, H64, xG64, xH64))
        tag = str(dtype).replace("torch.", "")
        for metric in ("invariant", "mixed"):
            pre = timeit(lambda: PairGeometry(G, H, metric), repeats)
            pg = PairGeometry(G, H, metric)
            call = timeit(lambda: pg.project(xG, xH), calls)
            result[f"{metric}_{tag}_precompute_s"] = pre
            result[f"{metric}_{tag}_project_s"] = call
            outs[(metric, tag)] = tuple(t.double().cpu() for t in pg.project(xG, xH))
            if metric == "invariant":
                pg64 = PairGeometry(G64, H64, metric)
                rG, rH = outs[(metric, tag)]
                res_in = pg64.horizontal_residual(xG64, xH64).norm()
                res_out = pg64.horizontal_residual(rG.to(dev), rH.to(dev)).norm()
                result[f"invariant_{tag}_residual_rel"] = float(res_out / res_in)

    # scipy, head by head, float64 numpy: the full solve (Gram matrices, P, C, Sylvester,
    # applying X) as a user without precomputation would do it, and the solve alone.
    Gn, Hn, xGn, xHn = (t.cpu().numpy() for t in (G64, H64, xG64, xH64))

    def scipy_project(precomputed=None):
        oG, oH = np.empty_like(xGn), np.empty_like(xHn)
        for i in range(Gn.shape[0]):
            Gi, Hi, a, b = Gn[i], Hn[i], xGn[i], xHn[i]
            if precomputed is None:
                SG, SH = Gi.T @ Gi, Hi.T @ Hi
                P = SG @ SH
            else:
                SG, SH, P = precomputed[i]
            C = a.T @ Gi @ SH - SG @ Hi.T @ b
            X = scipy.linalg.solve_sylvester(P, P, C)     # P X + X P = C, X = Λᵀ
            oG[i] = a - Gi @ X.T
            oH[i] = b + Hi @ X
        return oG, oH

    pre_np = [(Gn[i].T @ Gn[i], Hn[i].T @ Hn[i], (Gn[i].T @ Gn[i]) @ (Hn[i].T @ Hn[i]))
              for i in range(Gn.shape[0])]
    ts_full, ts_solve = [], []
    for _ in range(scipy_repeats):
        t0 = time.perf_counter()
        sG, sH = scipy_project()
        ts_full.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        scipy_project(pre_np)
        ts_solve.append(time.perf_counter() - t0)
    result["scipy_full_s"] = statistics.median(ts_full)
    result["scipy_with_grams_precomputed_s"] = statistics.median(ts_solve)
    sG, sH = torch.from_numpy(sG), torch.from_numpy(sH)
    scale = max(float(sG.abs().max()), float(sH.abs().max()))
    for tag in ("float64", "float32"):
        rG, rH = outs[("invariant", tag)]
        result[f"max_rel_diff_vs_scipy_{tag}"] = max(float((rG - sG).abs().max()),
                                                     float((rH - sH).abs().max())) / scale
    pg64 = PairGeometry(G64, H64, "invariant")
    result["scipy_residual_rel"] = float(pg64.horizontal_residual(sG.to(dev), sH.to(dev)).norm()
                                         / pg64.horizontal_residual(xG64, xH64).norm())
    return result


# ---------------------------------------------------------------------------- reports
def machine_info(device: str) -> dict:
    info = dict(python=platform.python_version(), torch=torch.__version__,
                platform=platform.platform(), cores=os.cpu_count(),
                threads=torch.get_num_threads(), date=time.strftime("%Y-%m-%d %H:%M %Z"))
    try:
        with open("/proc/cpuinfo") as fh:
            names = [ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")]
        info["cpu"] = names[0] if names else platform.processor()
    except OSError:
        info["cpu"] = platform.processor()
    try:
        with open("/proc/meminfo") as fh:
            info["memory_gib"] = round(int(fh.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
        info["cuda"] = torch.version.cuda
    return info


def _mib(b: int) -> str:
    return f"{b / 2**20:.0f}"


def _ratio(a: float, b: float | None) -> str:
    return "–" if not b else f"{a / b:.2f}"


def _syncs(s: dict[str, int] | None, iters: int) -> str:
    if not s:
        return "–"
    return f"{s['hideseek'] / iters:.2f} + {s['other'] / iters:.2f}"


def results_table(results: list[Result]) -> str:
    """Markdown: one row per (model, measure) with times, memory and ratios."""
    lines = ["| model | batch | iters | measure | passes | time (s) | ×floor | ×adaptive | "
             "Auto-PGD loop (s) | loop / pass (s) | peak mem (MiB) | mem ×adaptive | "
             "host syncs / iter (ours + model's) | value |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    by_model: dict[str, dict[str, Result]] = {}
    for r in results:
        by_model.setdefault(r.task.model, {})[r.task.measure] = r
    for model, rows in by_model.items():
        fl, ad = rows.get("floor"), rows.get("adaptive")
        for name in MEASURES:
            r = rows.get(name)
            if r is None:
                continue
            t = r.task
            size = f"{t.batch_size}×{t.seq_len}" if MODELS[model].kind == "text" else str(t.batch_size)
            # Auto-PGD: n_iters + 1 per batch, less the first batch's start (the set-up pass)
            loop_evals = t.n_batches * t.n_iters + (0 if name == "floor" else t.n_batches - 1)
            if t.autocast:
                size += f" ({t.autocast})"
            lines.append(
                f"| {model} | {size} | {t.n_iters} | {name} | {r.n_evals} | {r.median:.3f} | "
                f"{_ratio(r.median, fl.median if fl else None)} | "
                f"{_ratio(r.median, ad.median if ad else None)} | {r.loop_median:.3f} | "
                f"{r.loop_median / loop_evals:.4f} | {_mib(r.peak_bytes)} | "
                f"{_ratio(r.peak_bytes, ad.peak_bytes if ad else None)} | "
                f"{_syncs(r.syncs, t.n_batches * t.n_iters)} | "
                f"{'–' if r.value is None else f'{r.value:.3g}'} |")
    return "\n".join(lines)


def attribution_table(results: list[Result]) -> str:
    """Markdown: share of the warm-up run's wall time by component."""
    head = "| model | measure | total (s) | " + " | ".join(ATTRIBUTION) + " |"
    lines = [head, "|---|---|---|" + "---|" * len(ATTRIBUTION)]
    for r in results:
        if not r.attribution or r.task.measure == "floor":
            continue
        tot = sum(r.attribution.values())
        cells = " | ".join(f"{100 * r.attribution[k] / tot:.0f} %" for k in ATTRIBUTION)
        lines.append(f"| {r.task.model} | {r.task.measure} | {tot:.2f} | {cells} |")
    return "\n".join(lines)


def projection_table(p: dict) -> str:
    rows = [
        "| method | dtype | one-off precomputation (s) | per projection (s) |",
        "|---|---|---|---|",
    ]
    for metric in ("invariant", "mixed"):
        for tag in ("float32", "float64"):
            rows.append(f"| PairGeometry.project, {metric}, batched | {tag} | "
                        f"{p[f'{metric}_{tag}_precompute_s']:.4f} | {p[f'{metric}_{tag}_project_s']:.5f} |")
    rows.append(f"| scipy.linalg.solve_sylvester, head by head (Grams, P, C, solve, apply) | float64 | – | "
                f"{p['scipy_full_s']:.4f} |")
    rows.append(f"| scipy, Gram matrices and P precomputed | float64 | – | "
                f"{p['scipy_with_grams_precomputed_s']:.4f} |")
    return "\n".join(rows)


# -------------------------------------------------------------------------------- CLI
def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_sharpness",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda if available)")
    ap.add_argument("--models", default="bert-base,vit-b32,small-bert,small-vit",
                    help=f"comma-separated, from {sorted(MODELS)}")
    ap.add_argument("--measures", default=",".join(MEASURES), help=f"from {list(MEASURES)}")
    ap.add_argument("--n-iters", type=int, default=None, help="Auto-PGD iterations (default: per model and device)")
    ap.add_argument("--batch-size", type=int, default=None, help="(default: per model and device)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence, text models")
    ap.add_argument("--n-batches", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=None, help="timed runs after the warm-up (median)")
    ap.add_argument("--rho", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--autocast", choices=("bfloat16", "float16"), default=None,
                    help="forward/backward passes (floor included) under torch.autocast in this dtype")
    ap.add_argument("--no-sync-count", action="store_true",
                    help="skip the extra untimed run that counts host syncs inside Auto-PGD")
    ap.add_argument("--no-attribute", action="store_true", help="do not instrument the warm-up run")
    ap.add_argument("--in-process", action="store_true",
                    help="no fresh process per measure (faster; memory numbers then unreliable)")
    ap.add_argument("--projection", choices=("yes", "no", "only"), default="yes",
                    help="time the 144-head projection against scipy (default yes)")
    ap.add_argument("--json", default=None, help="write results here (default benchmarks/results/<device>.json)")
    ap.add_argument("--markdown", default=None, help="also write the tables as markdown here")
    return ap.parse_args(argv)


def tasks_from_args(args) -> list[Task]:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dkey = "cuda" if device.startswith("cuda") else "cpu"
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    measures = [m.strip() for m in args.measures.split(",") if m.strip()]
    tasks = []
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"unknown model {m!r}; known: {sorted(MODELS)}")
        d = dict(MODELS[m].defaults[dkey])
        for key in ("n_iters", "batch_size", "seq_len", "repeats"):
            val = getattr(args, key)
            if val is not None:
                d[key] = val
        for meas in measures:
            if meas not in MEASURES:
                raise SystemExit(f"unknown measure {meas!r}; known: {list(MEASURES)}")
            tasks.append(Task(model=m, measure=meas, batch_size=d["batch_size"], n_iters=d["n_iters"],
                              seq_len=d.get("seq_len", 128), n_batches=args.n_batches,
                              repeats=d["repeats"], rho=args.rho, device=device, threads=args.threads,
                              seed=args.seed, attribute=not args.no_attribute, autocast=args.autocast,
                              count_syncs=not args.no_sync_count))
    return tasks


def _check_models_build(names: list[str]) -> None:
    """Fail before any measurement, in one line, when a model's package is missing (a GPU image
    without open_clip once lost a whole run's results at its second model)."""
    from .models import build
    for name in names:
        try:
            build(name)
        except ModuleNotFoundError as err:
            raise SystemExit(f"bench_sharpness: model {name!r} needs the package {err.name!r}, which is not "
                             f"installed here: install it, or leave {name} out of --models") from None


def main(argv: list[str] | None = None) -> int:
    from tqdm.auto import tqdm

    args = _parse(argv)
    tasks = tasks_from_args(args) if args.projection != "only" else []
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    info = machine_info(device)
    info["load_avg_start"] = os.getloadavg()
    _check_models_build(sorted({t.model for t in tasks}))
    runner: Callable[[Task], Result] = run_task if args.in_process else run_fresh
    results: list[Result] = []
    for task in (bar := tqdm(tasks, desc="benchmark", unit="measure")):
        bar.set_postfix_str(f"{task.model}/{task.measure}")
        results.append(runner(task))
        r = results[-1]
        tqdm.write(f"{task.model:>10} {task.measure:<19} median {r.median:8.3f} s  "
                   f"peak {_mib(r.peak_bytes):>6} MiB  value {r.value}")
    proj = None
    if args.projection != "no":
        tqdm.write("projection: 144 BERT-base query/key pairs vs scipy …")
        proj = bench_projection(device, threads=args.threads)
    info["load_avg_end"] = os.getloadavg()

    md = [f"Machine: {info.get('gpu', info['cpu'])}, {info['cores']} cores, torch {info['torch']}, "
          f"{info['threads']} threads; load average at start {info['load_avg_start'][0]:.2f}, "
          f"at end {info['load_avg_end'][0]:.2f}."]
    if results:
        md += ["", f"Memory: {results[0].memory_method}.", "", results_table(results)]
        if any(r.attribution for r in results):
            md += ["", "Where the time goes (warm-up run, share of its wall time):", "",
                   attribution_table(results)]
    if proj:
        md += ["", f"Horizontal projection, {proj['pairs']} pairs G, H of {proj['shape_G']} "
               f"({device}, {proj['threads']} threads):", "", projection_table(proj), "",
               f"Agreement with scipy (max |diff| / max |value|): float64 "
               f"{proj['max_rel_diff_vs_scipy_float64']:.2e}, float32 {proj['max_rel_diff_vs_scipy_float32']:.2e}; "
               f"horizontality residual after projection (relative): ours float64 "
               f"{proj['invariant_float64_residual_rel']:.2e}, float32 {proj['invariant_float32_residual_rel']:.2e}, "
               f"scipy {proj['scipy_residual_rel']:.2e}."]
    text = "\n".join(md)
    print("\n" + text)
    out = Path(args.json or f"benchmarks/results/{'cuda' if device.startswith('cuda') else 'cpu'}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = dict(machine=info, results=[dict(asdict(r), median=r.median, loop_median=r.loop_median)
                                          for r in results], projection=proj)
    out.write_text(json.dumps(payload, indent=1, default=str))
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    print(f"\nresults written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
