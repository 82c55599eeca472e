"""Measuring sharpness over a zoo of trained models, shared by the vision and language zoos.

:func:`measure_zoo` evaluates several sharpness measures, each over a grid of radii
``rho``, on every model of a zoo, always on the same batches and with the same seed,
and returns a tidy :class:`pandas.DataFrame` with one row per (model, measure, rho).

The helpers below it turn such a frame plus each model's generalisation gap into the
quantities the figures show: Kendall tau against the gap for every ``rho`` (the
"tau vs rho" curves), and a split-half protocol in which each measure's ``rho`` is
chosen on one half of the zoo and tau is reported, with a bootstrap interval, on the
other half (statistics from :mod:`companion.experiments.correlation`).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from companion.analysis import gap_vector, kendall, tau_curve, value_table
from companion.pool import check_picklable, run_pool
from hideseek.measures import Measure

ModelOrLoader = nn.Module | Callable[[], nn.Module]

#: The three measures of Figures 4 and 5 and Table 1 (worst case; the rho is supplied per
#: grid point).  The one place they are described.
STANDARD: dict[str, Measure] = {
    "adaptive": Measure(geometry="adaptive", p="l2"),
    "geodesic_invariant": Measure(metric="invariant"),
    "geodesic_mixed": Measure(metric="mixed"),
}
#: The same, as keyword arguments for :func:`hideseek.sharpness` (:meth:`Measure.to_keywords`).
STANDARD_MEASURES: dict[str, dict[str, Any]] = {k: m.to_keywords() for k, m in STANDARD.items()}

_RESERVED = ("rho", "n_iters", "seed")


def _model_items(models) -> list[tuple[str, ModelOrLoader]]:
    if isinstance(models, Mapping):
        items = list(models.items())
    else:
        items = list(models)
    out = []
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(
                "models must be a mapping name -> model or a sequence of (name, model) pairs, "
                f"where model is an nn.Module or a zero-argument loader; got item {item!r}"
            )
        name, model = item
        if not (isinstance(model, nn.Module) or callable(model)):
            raise TypeError(f"model {name!r}: expected nn.Module or loader callable, got {type(model)}")
        out.append((str(name), model))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"model names must be unique, got {names}")
    if not out:
        raise ValueError("models is empty")
    return out


def _rho_grids(measures: Mapping[str, Mapping], rho_grid) -> dict[str, list[float]]:
    if isinstance(rho_grid, Mapping):
        missing = set(measures) - set(rho_grid)
        if missing:
            raise ValueError(f"rho_grid has no grid for measures {sorted(missing)}")
        grids = {m: [float(r) for r in rho_grid[m]] for m in measures}
    else:
        shared = [float(r) for r in rho_grid]
        grids = {m: list(shared) for m in measures}
    for m, g in grids.items():
        if not g:
            raise ValueError(f"empty rho grid for measure {m!r}")
        if any(not (r > 0) for r in g):
            raise ValueError(f"rho must be positive, got {g} for measure {m!r}")
    return grids


def measure_zoo(
    models: Mapping[str, ModelOrLoader] | Iterable[tuple[str, ModelOrLoader]],
    batches: Sequence,
    measures: Mapping[str, Mapping[str, Any]],
    rho_grid: Sequence[float] | Mapping[str, Sequence[float]],
    *,
    seed: int,
    n_iters: int,
    progress: bool = True,
    common: Mapping[str, Any] | None = None,
    sharpness_fn: Callable | None = None,
    workers: int = 1,
) -> pd.DataFrame:
    """Sharpness of every model under every measure and every rho of the grid.

    Parameters
    ----------
    models:
        ``(name, model)`` pairs (or a mapping ``name -> model``), where ``model`` is an
        ``nn.Module`` or a zero-argument callable returning one; a loader is called once
        per model and its result dropped afterwards, so a large zoo need not sit in memory.
    batches:
        ``(inputs, labels)`` batches, materialised once and used unchanged for every
        model, measure and rho.
    measures:
        ``name -> keyword arguments`` for :func:`hideseek.sharpness`, e.g.
        :data:`STANDARD_MEASURES`. ``rho``, ``n_iters`` and ``seed`` are set here.
    rho_grid:
        radii, shared by all measures, or a mapping ``measure name -> radii``.
    seed, n_iters:
        passed to every call; the same seed for every model (common random numbers).
    common:
        extra keyword arguments for every call (e.g. ``loss_fn``).
    sharpness_fn:
        the function called, :func:`hideseek.sharpness` by default.
    workers:
        models measured in this many spawned processes (one model per task, each process
        with this process's number of intra-op threads, the models' order kept). Every
        value equals the one ``workers=1`` gives at the same thread count (each call is
        seeded by itself and sees the same batches; tested bit for bit), so on a CPU with
        one thread per process it only divides the wall time. Models and loaders must
        then be picklable: an ``nn.Module`` or e.g. a :func:`functools.partial` of a
        module-level function, not a lambda. For CPU runs; keep 1 on a GPU.

    Returns
    -------
    DataFrame with columns ``model, measure, rho, value, per_batch, base_loss, seconds``,
    one row per (model, measure, rho) in the order models x measures x rho; ``per_batch``
    holds the list of per-batch values whose mean is ``value``, ``base_loss`` the
    unperturbed loss of each batch (when the result object reports it).
    """
    common = dict(common or {})
    if sharpness_fn is None:
        from hideseek import sharpness as sharpness_fn  # noqa: PLC0415 (core imported lazily)

        common.setdefault("progress", False)  # one bar for the whole zoo, not one per call
    items = _model_items(models)
    batches = list(batches)
    if not batches:
        raise ValueError("batches is empty")
    if not measures:
        raise ValueError("measures is empty")
    for name, kw in measures.items():
        clash = [k for k in _RESERVED if k in kw]
        if clash:
            raise ValueError(f"measure {name!r}: {clash} are set by measure_zoo, not per measure")
    clash = [k for k in _RESERVED if k in common]
    if clash:
        raise ValueError(f"common: {clash} are set by measure_zoo")
    if n_iters < 1:
        raise ValueError(f"n_iters must be >= 1, got {n_iters}")
    grids = _rho_grids(measures, rho_grid)

    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    total = len(items) * sum(len(g) for g in grids.values())
    task = dict(batches=batches, measures=dict(measures), grids=grids, seed=seed, n_iters=n_iters,
                common=common, sharpness_fn=sharpness_fn)
    rows: list[dict] = []
    bar = tqdm(total=total, desc="sharpness", unit="run", disable=not progress)
    try:
        if workers == 1 or len(items) == 1:
            for name, model in items:
                rows.extend(_measure_model(name, model, bar=bar, **task))
        else:
            rows = _measure_parallel(items, task, workers, bar)
    finally:
        bar.close()
    return pd.DataFrame(rows, columns=["model", "measure", "rho", "value", "per_batch", "base_loss", "seconds"])


def _load(name: str, model: ModelOrLoader) -> nn.Module:
    if not isinstance(model, nn.Module):
        model = model()
        if not isinstance(model, nn.Module):
            raise TypeError(f"loader for {name!r} returned {type(model)}, not an nn.Module")
    return model.eval()


def _measure_model(name: str, model: ModelOrLoader, *, batches, measures, grids, seed, n_iters, common,
                   sharpness_fn, bar=None) -> list[dict]:
    """The rows of one model: every measure at every radius of its grid, each call seeded alike."""
    model = _load(name, model)
    rows = []
    for mname, kw in measures.items():
        for rho in grids[mname]:
            if bar is not None:
                bar.set_postfix_str(f"{name} {mname} rho={rho:g}", refresh=False)
            torch.manual_seed(seed)
            t0 = time.perf_counter()
            res = sharpness_fn(model, batches, rho=rho, n_iters=n_iters, seed=seed, **common, **kw)
            seconds = time.perf_counter() - t0
            rows.append(
                dict(
                    model=name,
                    measure=mname,
                    rho=rho,
                    value=float(res.value),
                    per_batch=[float(v) for v in res.per_batch],
                    base_loss=[float(v) for v in getattr(res, "base_losses", [])],
                    seconds=seconds,
                )
            )
            if bar is not None:
                bar.update(1)
    return rows


def _measure_parallel(items, task: dict, workers: int, bar) -> list[dict]:
    """The rows of every model, one model per task in ``workers`` spawned processes with this process's
    thread count (:func:`companion.pool.run_pool`), in the models' order."""
    name, model = items[0]
    check_picklable({f"model {name!r}": model, "sharpness_fn": task["sharpness_fn"], "common": task["common"]},
                    needs=f"workers={workers} needs picklable models, loaders, sharpness_fn and common (an "
                          "nn.Module or a functools.partial of a module-level function, not a lambda)",
                    fix="use workers=1")

    def arrived(i: int, rows: list[dict]) -> None:
        bar.set_postfix_str(items[i][0], refresh=False)
        bar.update(len(rows))

    results = run_pool(_measure_model, items, task, workers=workers, progress=False, on_result=arrived)
    return [row for part in results for row in part]


# --------------------------------------------------------------------------- tau tables


# the tau-vs-rho curve and the test-retest table live in companion.analysis (the one
# tau implementation); tau_vs_rho is kept for the stages and notebooks that import it from here.
tau_vs_rho = tau_curve


def split_half_taus(frame: pd.DataFrame, gaps, *, seed: int, n_boot: int,
                    criterion: str = "abs", paper: Mapping[str, float] | None = None) -> tuple[pd.DataFrame, dict]:
    """Each measure's rho chosen on one half of the zoo, tau reported on the other half.

    The same random halves (drawn from ``seed``) are used for every measure. Also reports,
    at the chosen rho, tau over the whole zoo with its bootstrap interval (for the figure
    panels, which show all models). Returns ``(table, halves)`` where ``table`` has one row
    per measure (``measure, rho, tau_select, tau, ci_low, ci_high, pvalue, n_eval,
    tau_all, ci_low_all, ci_high_all, n_all`` and ``paper`` when given) and ``halves``
    maps ``"select"``/``"eval"`` to the model names of each half.
    """
    from companion.experiments.correlation import tau_split_half

    names, g = gap_vector(frame, gaps)
    rows, halves = [], None
    for measure in dict.fromkeys(frame["measure"]):
        table = value_table(frame, measure)
        res = tau_split_half({float(r): table[r].to_numpy() for r in table.columns}, g,
                             seed=seed, n_boot=n_boot, criterion=criterion)
        halves = {"select": [names[i] for i in res.select_idx], "eval": [names[i] for i in res.eval_idx]}
        full = kendall(table[res.chosen].to_numpy(), g, n_boot=n_boot, seed=seed)
        row = dict(measure=measure, rho=res.chosen, tau_select=res.tau_select, tau=res.held_out.tau,
                   ci_low=res.held_out.ci_low, ci_high=res.held_out.ci_high, pvalue=res.held_out.pvalue,
                   n_eval=res.held_out.n, tau_all=full.tau, ci_low_all=full.ci_low, ci_high_all=full.ci_high,
                   n_all=full.n)
        if paper is not None:
            row["paper"] = paper.get(measure, float("nan"))
        rows.append(row)
    return pd.DataFrame(rows), halves


# --------------------------------------------------------------------------- test-retest


def per_batch_halves(frame: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Two measurements from one: each row's value on the first half of its batches and on the
    second half (``per_batch`` means), for a test-retest check on disjoint data without new runs.
    Needs at least 2 batches per row; with an odd number the first half has one batch fewer."""
    n = frame["per_batch"].map(len)
    if (n < 2).any():
        raise ValueError("per_batch_halves needs at least 2 batches per row (one batch gives no second measurement)")
    k = n // 2
    first = [float(np.mean(pb[:h])) for pb, h in zip(frame["per_batch"], k)]
    second = [float(np.mean(pb[h:])) for pb, h in zip(frame["per_batch"], k)]
    cols = ["model", "measure", "rho"]
    return frame[cols].assign(value=first), frame[cols].assign(value=second)


# --------------------------------------------------------------------------- zoo sources


@runtime_checkable
class ZooSource(Protocol):
    """A zoo as the stages read it, whoever made it: the generated zoos
    (:class:`companion.experiments.language_zoo.GeneratedNLIZoo`,
    :class:`companion.experiments.vision_zoo.GlyphZoo`) and the paper's
    (:class:`companion.experiments.paper_zoos.McCoyZoo`, :class:`companion.experiments.paper_zoos.ClipSoupsZoo`).
    A stage gets one from :func:`open_source` and never asks which kind it holds."""

    kind: str              # zoo.json's kind ("generated_nli" for the generated language zoo, which records none)
    zoo_dir: Path
    meta: dict             # zoo.json

    def description(self) -> str:
        """One line naming the zoo for reports."""

    def loaders(self, names: Sequence[str] | None = None,
                device: str | None = "cpu") -> list[tuple[str, Callable[[], nn.Module]]]:
        """``[(name, loader)]`` of the members ``names`` (all, in the zoo's order, when None); a loader
        returns the model in eval mode on ``device`` (picklable for :func:`measure_zoo`'s workers)."""

    def sharpness_batches(self, n_points: int, batch_size: int, seed: int) -> list:
        """The fixed training examples on which every member's sharpness is measured."""

    def retest_batches(self, n_points: int, batch_size: int, seed: int) -> list:
        """A second set, disjoint from :meth:`sharpness_batches`, for a test–retest; a zoo that can draw
        only one refuses (ValueError saying what to set instead)."""

    def member_table(self) -> pd.DataFrame:
        """One row per member (index: its name): errors, gap and what else ``zoo.json`` records."""

    def eval_errors(self, names: Sequence[str]) -> np.ndarray | None:
        """Per-example errors ``[members, examples]`` (0/1) of ``names`` on the shared evaluation set of the
        gap; None for a zoo that does not keep them (the paper's)."""


def open_source(zoo_dir: str | Path, meta: Mapping[str, Any], sources: Mapping[str, Callable[..., ZooSource]],
                default_kind: str | None = None) -> ZooSource:
    """The registry: the :class:`ZooSource` of the zoo in ``zoo_dir`` (``meta``: its ``zoo.json``) chosen once
    from its ``kind`` among ``sources`` (kind -> class called as ``cls(zoo_dir, meta)``; a zoo.json without
    ``kind`` is ``default_kind``). Each modality passes its table (:data:`companion.experiments.language_zoo.SOURCES`,
    :data:`companion.experiments.vision_zoo.SOURCES`), so a stage imports only its own modality's code."""
    kind = meta["kind"] if "kind" in meta else default_kind
    if kind not in sources:
        raise ValueError(f"{zoo_dir}: a zoo of kind {kind!r}; this stage reads {sorted(map(str, sources))} "
                         "(is zoo_dir the right zoo?)")
    return sources[kind](Path(zoo_dir), dict(meta))
