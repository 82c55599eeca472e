"""Run one notebook stage of the report pipeline with papermill, atomically.

Every figure of the companion is a notebook ``notebooks/<stage>.ipynb`` with a
cell tagged ``parameters`` that defines three names:

``profile``
    the name of the parameter profile (``cpu``, ``gpu`` or ``paper``),
``params``
    a dict, the stage's resolved parameters (``params.yaml``'s ``stage.defaults``
    merged with ``stage.<profile>``, :func:`companion.params.stage_params`),
``out_dir``
    a folder the notebook writes into, and nowhere else:
    ``out_dir/figures/*.png|pdf``, ``out_dir/metrics/<stage>.json`` and,
    optionally, ``out_dir/data/*``.

``python -m companion.pipeline <stage> [--profile P] [--set key=value ...]``
executes the notebook into a fresh staging folder ``reports/.staging/...``
(git-ignored). Only when the notebook ran to the end *and* wrote its metrics
JSON are the results published:

========================================  =====================================
``out_dir/figures/*``                     ``reports/figures/<stage>/``
``out_dir/data/*``                        ``reports/data/<stage>/``
executed notebook                         ``reports/notebooks/<stage>.ipynb``
``out_dir/metrics/<stage>.json``          ``reports/metrics/<stage>.json``
its headline (Table 1 stages only)        ``reports/headline/<stage>.json``
``out_dir/timings/<stage>.json``          ``reports/timings/<stage>.json`` (git only)
========================================  =====================================

No DVC output holds a wall-clock time (its hash would change on every run): a stage writes its
timings to ``out_dir/timings/`` (published to ``reports/timings/``, which ``dvc.yaml`` does not
declare), and :func:`scrub_notebook` removes from the executed notebook what papermill records
of the clock (start and end times, durations, execution timestamps) and every stderr stream
(progress bars and warnings: the run's log, echoed to the terminal, not part of the report), and
writes every machine path as its canonical relative one (``reports/.staging/<stage>/out`` for the
``out_dir`` papermill passed, ``notebooks/<stage>.ipynb`` for the input) with cell ids ``<stage>-<index>``,
so that the same run in another folder or on another machine publishes the same bytes
(``python -m companion.pipeline --normalise reports/notebooks/*.ipynb`` applies the same to notebooks
already published). The
kernel runs with ``SOURCE_DATE_EPOCH=0`` (unless set), so matplotlib stamps no date into a PDF.

Progress during the run.  What the kernel writes to stderr — the progress bars of the library
and the companion (members or runs done, the measure, the time left) and warnings — reaches
the terminal as the kernel writes it (papermill's ``stderr_file``), so a long stage under
``dvc repro`` shows more than papermill's cell counter; it is still scrubbed from the published
notebook.  ``HIDESEEK_PROGRESS=0`` in the environment (or ``--no-progress``) switches that off:
the run's stderr is then echoed once, after the notebook has run, as before.

The headline (:func:`companion.metrics.headline`: τ per measure, intervals,
ρ, model counts) is the small file DVC declares as ``metrics:``; the full
metrics file is a plain output.

Publishing first removes the stage's old metrics file, then swaps the folders
and the notebook in with renames, and moves the metrics file in last, so the
metrics file doubles as the "this report is complete" marker. A failed or
interrupted run leaves ``reports/`` as it was and names the staging folder
that holds the partially executed notebook.

``--set`` values are parsed as YAML (``--set n_nets=10 --set rhos=[0.1,0.2]``)
and may address nested keys with dots (``--set apgd.n_iters=5``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from companion import metrics as _metrics
from companion import params as _params

REPO_ROOT = Path(__file__).resolve().parents[1]
PROFILES = _params.PROFILES


class PipelineError(RuntimeError):
    """A stage could not be resolved or did not complete."""


@dataclass
class StageResult:
    """What a successful :func:`run_stage` published."""

    stage: str
    profile: str
    params: dict
    notebook: Path
    metrics: Path
    figures: list[Path] = field(default_factory=list)
    data: list[Path] = field(default_factory=list)
    seconds: float = 0.0


# --------------------------------------------------------------------------- params
# The one reader is companion.params; these wrappers turn its errors into PipelineError.


def load_params(path: str | os.PathLike) -> dict:
    """Read ``params.yaml``; a missing or non-mapping file is an error."""
    try:
        return _params.load_params(path)
    except _params.ParamsError as exc:
        raise PipelineError(str(exc)) from None


def resolve_stage_params(all_params: Mapping, stage: str, profile: str | None = None) -> tuple[str, dict]:
    """``(profile, parameters)`` of ``stage``: :func:`companion.params.resolve`."""
    try:
        return _params.resolve(all_params, stage, profile)
    except _params.ParamsError as exc:
        raise PipelineError(str(exc)) from None


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """Parse ``key=value`` strings; values are YAML (numbers, lists, booleans)."""
    try:
        return _params.parse_overrides(items)
    except _params.ParamsError as exc:
        raise PipelineError(str(exc)) from None


apply_overrides = _params.apply_overrides


# --------------------------------------------------------------------------- running

#: the environment variable that switches the live stderr of a stage's kernel off (``0``)
PROGRESS_ENV = "HIDESEEK_PROGRESS"


def live_progress() -> bool:
    """Whether a stage's kernel stderr is streamed to the terminal while it runs: yes unless
    :data:`PROGRESS_ENV` is ``0`` (or ``false``, ``no``, ``off``)."""
    return os.environ.get(PROGRESS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _publish_dir(src: Path, dst: Path, trash: Path) -> list[Path]:
    """Replace folder ``dst`` by ``src`` with renames; returns the new files."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists():
        os.replace(dst, trash)
    os.replace(src, dst)
    return sorted(p for p in dst.rglob("*") if p.is_file())


def _kernel_env(root: Path) -> None:
    """Make the kernel papermill starts see the package and stay offline."""
    pp = os.environ.get("PYTHONPATH", "")
    parts = [p for p in pp.split(os.pathsep) if p]
    if str(root) not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(root), *parts])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("MPLBACKEND", "Agg")
    os.environ.setdefault("SOURCE_DATE_EPOCH", "0")   # matplotlib's PDF/SVG creation date: no clock in an output


def _stage_params(stage: str, profile: str | None, overrides, params, root: Path) -> tuple[str, dict]:
    if params is None:
        try:
            profile, stage_params = _params.stage_params(stage, profile, path=root / "params.yaml")
        except _params.ParamsError as exc:
            raise PipelineError(str(exc)) from None
    else:
        profile = profile or "cpu"
        if profile not in PROFILES:
            raise PipelineError(f"unknown profile {profile!r}; expected one of {PROFILES}")
        stage_params = dict(params)
    return profile, apply_overrides(stage_params, overrides or {})


def _finish_metrics(stage: str, profile: str, stage_params: dict, metrics_src: Path, staging: Path, nb_out: Path):
    """Complete the staged metrics file (stage, profile, params) and derive its headline."""
    if not metrics_src.is_file():
        raise PipelineError(
            f"stage {stage!r} ran but wrote no {metrics_src.relative_to(staging)}; "
            f"nothing published; executed notebook: {nb_out}"
        )
    with open(metrics_src) as fh:
        metrics = json.load(fh)
    if not isinstance(metrics, dict):
        raise PipelineError(f"stage {stage!r}: metrics JSON must be an object")
    metrics.setdefault("stage", stage)
    metrics.setdefault("profile", profile)
    metrics.setdefault("params", stage_params)
    with open(metrics_src, "w") as fh:
        json.dump(metrics, fh, indent=2, sort_keys=True)
        fh.write("\n")
    try:
        return _metrics.headline(metrics)
    except (KeyError, TypeError, AttributeError) as exc:
        raise PipelineError(f"stage {stage!r}: malformed table1 entry in its metrics ({exc!r}); "
                            f"nothing published; executed notebook: {nb_out}") from exc


#: where a published notebook says it was staged and read from (no machine path in a DVC output)
STAGING_NAME = "reports/.staging/{stage}"


def canonical_paths(stage: str) -> dict[str, str]:
    """The machine-independent paths a published notebook records: its input, its staging folder, the
    ``out_dir`` it wrote into and the staged notebook (relative to the repository root)."""
    staging = STAGING_NAME.format(stage=stage)
    return {"input": f"notebooks/{stage}.ipynb", "staging": staging, "out_dir": f"{staging}/out",
            "output": f"{staging}/{stage}.ipynb"}


def _replace_in(obj: Any, pairs: list[tuple[str, str]]) -> Any:
    """``obj`` (a notebook's JSON tree) with every ``old`` substring of its strings replaced by ``new``."""
    if isinstance(obj, str):
        for old, new in pairs:
            obj = obj.replace(old, new)
        return obj
    if isinstance(obj, list):
        return [_replace_in(v, pairs) for v in obj]
    if isinstance(obj, dict):
        return {k: _replace_in(v, pairs) for k, v in obj.items()}
    return obj


def machine_paths(nb: Mapping, stage: str, root: str | os.PathLike | None = None) -> list[tuple[str, str]]:
    """``(machine path, canonical path)`` pairs of a notebook papermill executed, longest first: the staging
    folder, ``out_dir``, the staged and the input notebook as papermill recorded them (absolute), and the
    repository root (``root`` and the one the input path ``<root>/notebooks/<stage>.ipynb`` names)."""
    pm = nb.get("metadata", {}).get("papermill", {})
    canon = canonical_paths(stage)
    pairs: dict[str, str] = {}
    out_dir = (pm.get("parameters") or {}).get("out_dir")
    output, inp = pm.get("output_path"), pm.get("input_path")
    if isinstance(out_dir, str) and out_dir:
        pairs[out_dir.rstrip("/")] = canon["out_dir"]
        pairs[str(Path(out_dir).parent)] = canon["staging"]
    if isinstance(output, str) and output:
        pairs[output] = canon["output"]
        pairs.setdefault(str(Path(output).parent), canon["staging"])
    roots = [] if root is None else [Path(root)]
    if isinstance(inp, str) and inp:
        pairs[inp] = canon["input"]
        if Path(inp).is_absolute() and Path(inp).parent.name == "notebooks":
            roots.append(Path(inp).parent.parent)
    for r in roots:
        pairs[str(r) + os.sep] = ""
    pairs = {k: v for k, v in pairs.items() if k and k not in (".", "/") and k != v}
    return sorted(pairs.items(), key=lambda kv: -len(kv[0]))


def scrub_notebook(path: str | os.PathLike, stage: str | None = None, root: str | os.PathLike | None = None) -> str:
    """Make the executed notebook at ``path`` a reproducible output (in place); returns the removed stderr text.

    * the wall clock: papermill's ``start_time``, ``end_time`` and ``duration`` (notebook and cells), the
      cells' ``execution`` timestamps, and every stderr stream output (the run's log);
    * with ``stage``, every machine path (:func:`machine_paths`: staging folder, ``out_dir``, the input and
      staged notebook, the repository root) becomes its canonical relative path (:func:`canonical_paths`), in
      the metadata, the sources and the outputs alike, and the cell ids become ``<stage>-<index>`` (papermill
      gives the cell it injects a random one).

    Idempotent: scrubbing a scrubbed notebook changes nothing (so it also normalises notebooks published
    before it existed, to the bytes a re-run gives)."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    clock = ("start_time", "end_time", "duration")
    removed = []
    for meta in [nb.metadata, *(c.metadata for c in nb.cells)]:
        meta.pop("execution", None)
        for k in clock:
            meta.get("papermill", {}).pop(k, None)
    for cell in nb.cells:
        stderr = [o for o in cell.get("outputs", []) if o.output_type == "stream" and o.name == "stderr"]
        removed += [o.text for o in stderr]
        if stderr:
            cell.outputs = [o for o in cell.outputs if not any(o is e for e in stderr)]
    if stage is not None:
        pairs = machine_paths(nb, stage, root)
        nb = nbformat.from_dict(_replace_in(nb, pairs))
        for i, cell in enumerate(nb.cells):
            cell["id"] = f"{stage}-{i:02d}"
    nbformat.write(nb, path)
    return "".join(removed)


def _stage_timing(out_dir: Path, stage: str, seconds: float) -> None:
    """Add the stage's own wall time (``stage_wall_s``: the notebook's execution, as ``make repro`` spends it) to
    its timings file ``out_dir/timings/<stage>.json`` (created if the notebook wrote none); git only, read by
    :mod:`companion.budget`."""
    path = out_dir / "timings" / f"{stage}.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data["stage_wall_s"] = round(float(seconds), 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def _publish(stage: str, reports: Path, staging: Path, out_dir: Path, nb_out: Path, head) -> tuple:
    """Old marker out, folders and notebook in, the metrics file (the marker) in last."""
    metrics_src = out_dir / "metrics" / f"{stage}.json"
    metrics_dst = reports / "metrics" / f"{stage}.json"
    metrics_dst.parent.mkdir(parents=True, exist_ok=True)
    if metrics_dst.exists():
        metrics_dst.unlink()
    trash = staging / "old"
    trash.mkdir()
    published = {}
    for kind in ("figures", "data"):
        src, dst = out_dir / kind, reports / kind / stage
        published[kind] = []
        if src.is_dir():
            published[kind] = _publish_dir(src, dst, trash / kind)
        elif dst.exists():
            os.replace(dst, trash / kind)
    nb_dst = reports / "notebooks" / f"{stage}.ipynb"
    nb_dst.parent.mkdir(parents=True, exist_ok=True)
    os.replace(nb_out, nb_dst)
    timings = out_dir / "timings" / f"{stage}.json"
    if timings.is_file():   # git only: the one place a stage's wall clock goes
        (reports / "timings").mkdir(parents=True, exist_ok=True)
        os.replace(timings, reports / "timings" / timings.name)
    # the DVC headline (reports/headline/<stage>.json), derived from the full metrics
    head_dst = reports / "headline" / f"{stage}.json"
    if head is not None:
        _metrics.write_json(head_dst, head)
    elif head_dst.exists():
        os.replace(head_dst, trash / "headline.json")
    os.replace(metrics_src, metrics_dst)
    return nb_dst, metrics_dst, published["figures"], published["data"]


def run_stage(
    stage: str,
    *,
    profile: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    params: Mapping | None = None,
    root: str | os.PathLike = REPO_ROOT,
    reports_dir: str | os.PathLike | None = None,
    notebook: str | os.PathLike | None = None,
    kernel_name: str = "python3",
    progress_bar: bool = True,
    live: bool | None = None,
) -> StageResult:
    """Execute ``notebooks/<stage>.ipynb`` and publish its outputs atomically.

    ``params`` replaces the parameters read from ``root/params.yaml`` (tests
    pass tiny ones); ``overrides`` (dotted keys) are applied on top.
    ``reports_dir`` defaults to ``root/reports``.  ``live``: stream the kernel's
    stderr (progress, warnings) to this process's stderr as it comes (``None``:
    :func:`live_progress`), else echo it once after the run.
    """
    import papermill as pm  # heavy import, only when running

    root = Path(root).resolve()
    reports = Path(reports_dir).resolve() if reports_dir is not None else root / "reports"
    nb_in = Path(notebook) if notebook is not None else root / "notebooks" / f"{stage}.ipynb"
    if not nb_in.is_file():
        raise PipelineError(f"stage {stage!r}: notebook {nb_in} does not exist")
    profile, stage_params = _stage_params(stage, profile, overrides, params, root)

    staging_root = reports / ".staging"
    staging_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{stage}-", dir=staging_root))
    out_dir = staging / "out"
    out_dir.mkdir()
    nb_out = staging / f"{stage}.ipynb"

    _kernel_env(root)
    live = live_progress() if live is None else bool(live)
    t0 = time.perf_counter()
    try:
        pm.execute_notebook(
            str(nb_in),
            str(nb_out),
            parameters={"profile": profile, "params": stage_params, "out_dir": str(out_dir)},
            kernel_name=kernel_name,
            cwd=str(root),
            progress_bar=progress_bar,
            stderr_file=sys.stderr if live else None,
        )
    except BaseException as exc:  # KeyboardInterrupt included: nothing is published
        raise PipelineError(
            f"stage {stage!r} failed ({type(exc).__name__}); reports/ left untouched; "
            f"partially executed notebook: {nb_out}"
        ) from exc
    seconds = time.perf_counter() - t0
    log = scrub_notebook(nb_out, stage, root)   # the run's log, not the report
    if not live:
        sys.stderr.write(log)                    # (streamed already when live)

    head = _finish_metrics(stage, profile, stage_params, out_dir / "metrics" / f"{stage}.json", staging, nb_out)
    _stage_timing(out_dir, stage, seconds)
    nb_dst, metrics_dst, figures, data = _publish(stage, reports, staging, out_dir, nb_out, head)
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging_root.rmdir()  # only if empty
    except OSError:
        pass
    return StageResult(stage, profile, stage_params, nb_dst, metrics_dst, figures, data, seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m companion.pipeline",
        description="Run notebooks/<stage>.ipynb with papermill and publish into reports/ atomically.",
    )
    parser.add_argument("stage", nargs="?", help="the stage to run (notebooks/<stage>.ipynb)")
    parser.add_argument("--normalise", nargs="+", metavar="NOTEBOOK", default=None,
                        help="instead of running a stage: scrub these published notebooks in place (no clock, "
                             "no machine path, cell ids <stage>-<index>; the stage is the file's name)")
    parser.add_argument("--profile", choices=PROFILES, default=None,
                        help="parameter profile (default: params.yaml's top-level 'profile')")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a stage parameter (YAML value, dotted keys for nesting)")
    parser.add_argument("--root", default=str(REPO_ROOT), help="repository root (default: this checkout)")
    parser.add_argument("--reports-dir", default=None, help="where to publish (default: <root>/reports)")
    parser.add_argument("--no-progress", action="store_true",
                        help=f"do not stream the kernel's stderr (progress, warnings) while it runs; echo it once "
                             f"at the end (also: {PROGRESS_ENV}=0)")
    args = parser.parse_args(argv)
    if args.normalise:
        for nb in args.normalise:
            scrub_notebook(nb, Path(nb).stem, args.root)
            print(f"normalised {nb}")
        return 0
    if not args.stage:
        parser.error("name a stage to run (or --normalise NOTEBOOK ...)")
    try:
        res = run_stage(args.stage, profile=args.profile, overrides=parse_overrides(args.overrides),
                        root=args.root, reports_dir=args.reports_dir, live=False if args.no_progress else None)
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"stage {res.stage} ({res.profile}) done in {res.seconds:.1f}s")
    print(f"  notebook: {res.notebook}")
    print(f"  metrics:  {res.metrics}")
    for f in res.figures:
        print(f"  figure:   {f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
