"""Geodesic SAM in practice (issue 19): fine-tuning the vision stand-in's pre-trained start with
AdamW, SAM, ASAM and geodesic SAM (invariant and mixed metric), compared honestly.

* **Start and data** (:func:`pretrained_start` and :meth:`Start.model`, the only code that
  knows the vision stand-in): the ``vision_train`` settings of the same profile (the glyph
  data, the open_clip ViT's config, the contrastive pre-training recipe and seed), the
  zoo's pre-training (:func:`companion.experiments.vision_zoo.pretrain`) run on the training
  part of the pool only; the last ``n_val`` pool images are the validation split (no
  pre-training, no fine-tuning touches them), the test set is the zoo's glyph test set.
* **Fine-tuning** (:func:`finetune`): the same budget for every method — ``steps`` AdamW
  steps of ``batch_size`` images drawn by the seed, cosine learning rate — with, for the SAM
  family, :class:`hideseek.optim.SAM` around the AdamW (one extra forward and backward per
  step).  Seeds change the order of the batches only.
* **Choice of ρ**: per method, from ``rho_grid`` (fixed in ``params.yaml`` before any run),
  the ρ with the lowest mean validation error over the seeds (ties: the smaller ρ).  The
  test set is read only for the chosen runs' report.
* **Report**: test error, mean over seeds, with a bootstrap interval that resamples seeds
  and test images; its difference to AdamW (paired: the same draws); geodesic sharpness of the
  resulting models (fixed measures and radii, a fixed batch of training images). Wall-clock per
  step and its ratio to SAM's are :attr:`SAMResults.timings`, published to
  ``reports/timings/sam.json`` (git, not DVC: no DVC output holds a time).
"""
from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

import hideseek as hs
from companion.experiments import vision_zoo as vz
from companion.params import ParamsError, from_mapping

#: the methods and their measures (None: AdamW alone)
METHODS: dict[str, str | None] = {"adamw": None, "sam": "euclidean", "asam": "adaptive",
                                  "geodesic_invariant": "geodesic_invariant", "geodesic_mixed": "geodesic_mixed"}
LABELS = {"adamw": "AdamW", "sam": "SAM", "asam": "ASAM", "geodesic_invariant": "geodesic SAM (invariant)",
          "geodesic_mixed": "geodesic SAM (mixed)"}


@dataclass(frozen=True)
class Sharpness:
    """Geodesic sharpness of the resulting models: ``{measure: ρ}``, on the first ``n_images``
    training images (one batch), ``n_iters`` Auto-PGD iterations."""

    measures: dict[str, float]
    n_images: int
    n_iters: int


@dataclass(frozen=True)
class Settings:
    """The ``sam`` stage's parameters (``params.yaml`` section ``sam``; every key required)."""

    seed: int                      # bootstrap seed
    vision_profile: str | None     # profile of the vision_train settings (null: the stage's own)
    vision_overrides: list[str]    # dotted overrides of those settings (tests: a tiny stand-in)
    n_val: int                     # the last n_val pool images: the validation split
    threads: int | None
    steps: int
    batch_size: int
    lr: float
    weight_decay: float
    seeds: list[int]
    rho_grid: dict[str, list[float]]
    selection: Literal["min_mean_val_error"]
    sharpness: Sharpness
    n_boot: int
    cpu_kernels: str | None        # CPU kernels pinned to this level (companion.kernels), checked before anything runs

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | "Settings") -> "Settings":
        if isinstance(params, cls):
            return params
        s = from_mapping(cls, params, "params.yaml sam")
        if set(s.rho_grid) != set(METHODS) - {"adamw"}:
            raise ParamsError(f"params.yaml sam.rho_grid must name exactly {sorted(set(METHODS) - {'adamw'})}, "
                              f"got {sorted(s.rho_grid)}")
        return s


@dataclass
class Start:
    """A pre-trained start and the three splits (tensors on the CPU)."""

    vision: vz.VisionTrain
    state: dict
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    record: dict

    def model(self) -> torch.nn.Module:
        m = vz.build_model(self.vision)
        m.load_state_dict(self.state)
        return m


def pretrained_start(s: Settings, profile: str) -> Start:
    """The vision stand-in's contrastively pre-trained start and its train / validation / test
    splits: the ``vision_train`` settings of ``s.vision_profile`` (default ``profile``) with
    ``s.vision_overrides``; pre-training (:func:`~companion.experiments.vision_zoo.pretrain`, its
    seed and recipe) on the pool without its last ``s.n_val`` images, which are the validation
    split; the zoo's glyph test set. Pixels are standardised as the zoo does (the whole pool's
    mean and standard deviation: two numbers, no labels)."""
    vision = vz.load_settings(s.vision_profile or profile, s.vision_overrides)
    data = vz.load_data(vision.data)
    if not 0 < s.n_val < len(data.y_pool):
        raise ParamsError(f"params.yaml sam.n_val must be in (0, {len(data.y_pool)}) (the vision_train pool), "
                          f"got {s.n_val}")
    train = vz.ZooData(data.x_pool[:-s.n_val], data.y_pool[:-s.n_val], data.x_test, data.y_test, data.mean, data.std)
    model, record = vz.pretrain(vision, train)
    return Start(vision, {k: v.clone() for k, v in model.state_dict().items()}, train.x_pool, train.y_pool,
                 data.x_pool[-s.n_val:], data.y_pool[-s.n_val:], data.x_test, data.y_test, record)


def correct(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    """Per-example correctness of the eval-mode model."""
    return (vz.predictions(model, x) == y).numpy()


def finetune(start: Start, method: str, rho: float, seed: int, params: Mapping[str, Any] | Settings,
             pairs: list | None = None) -> tuple[torch.nn.Module, dict]:
    """Fine-tune the start with ``method`` at radius ``rho``; returns the model and its record."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known: {list(METHODS)}")
    s = Settings.from_params(params)
    steps, bs = s.steps, s.batch_size
    model = start.model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 * (1 + math.cos(math.pi * min(k, steps) / steps)))
    sam = None if METHODS[method] is None else hs.optim.SAM(model, opt, METHODS[method], rho=rho, pairs=pairs)
    gen = torch.Generator().manual_seed(int(seed))
    n = len(start.y_train)
    order = torch.cat([torch.randperm(n, generator=gen) for _ in range(math.ceil(steps * bs / n))])
    t0 = time.perf_counter()
    for k in range(steps):
        idx = order[k * bs:(k + 1) * bs]
        x, y = start.x_train[idx], start.y_train[idx]
        F.cross_entropy(model(x), y).backward()
        if sam is None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            sam.first_step(zero_grad=True)
            F.cross_entropy(model(x), y).backward()
            sam.second_step(zero_grad=True)
        sched.step()
    seconds = (time.perf_counter() - t0) / steps
    model.eval()
    return model, dict(method=method, rho=rho, seed=int(seed), seconds_per_step=seconds,
                       train_error=1 - correct(model, start.x_train, start.y_train).mean(),
                       val_error=1 - correct(model, start.x_val, start.y_val).mean())


def choose_rho(runs: pd.DataFrame) -> dict[str, float]:
    """Per method, the ρ of lowest mean validation error over seeds (ties: the smaller ρ)."""
    mean = runs.groupby(["method", "rho"], as_index=False)["val_error"].mean()
    mean = mean.sort_values(["method", "val_error", "rho"], kind="mergesort")
    return {m: float(g["rho"].iloc[0]) for m, g in mean.groupby("method", sort=False)}


def bootstrap_error(correct_by_seed: np.ndarray, n_boot: int, rng: np.random.Generator,
                    seeds: np.ndarray | None = None, images: np.ndarray | None = None) -> np.ndarray:
    """Bootstrap draws of the mean error of a ``(seeds, images)`` correctness table: seeds and
    images resampled with replacement (pass ``seeds``/``images``, ``(n_boot, ·)`` index arrays,
    to share the draws between methods)."""
    s, n = correct_by_seed.shape
    seeds = rng.integers(0, s, (n_boot, s)) if seeds is None else seeds
    images = rng.integers(0, n, (n_boot, n)) if images is None else images
    err = 1.0 - correct_by_seed.astype(float)
    return np.array([err[np.ix_(a, b)].mean() for a, b in zip(seeds, images)])


def _interval(draws: np.ndarray) -> list[float]:
    return [float(np.quantile(draws, 0.025)), float(np.quantile(draws, 0.975))]


def sharpness_of(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                 spec: Sharpness) -> dict[str, float]:
    """Geodesic sharpness of the eval-mode ``model`` on one batch, per measure at its fixed ρ."""
    return {m: hs.sharpness(model.eval(), [batch], m, rho=r, n_iters=spec.n_iters, progress=False).value
            for m, r in spec.measures.items()}


@dataclass
class SAMResults:
    runs: pd.DataFrame        # every fine-tune: method, rho, seed, errors
    chosen: dict[str, float]  # method -> rho
    summary: pd.DataFrame     # one row per method at its chosen rho
    chosen_runs: pd.DataFrame # the chosen runs: method, seed, rho, test error, sharpness per measure
    metrics: dict
    start: Start
    timings: dict             # wall clock: seconds per step (median per method), ratio to SAM's, total


def run_report(profile: str, params: Mapping[str, Any] | Settings, out_dir: str | Path, *,
               progress: bool = True) -> SAMResults:
    """The stage's one computing call, the whole experiment (see the module docstring), with the entry
    signature every stage module shares (``tests/companion/test_contract.py``). ``profile`` picks the
    ``vision_train`` settings of the start (unless ``vision_profile`` names one); ``progress``: a bar over
    the fine-tunes on stderr. ``out_dir`` is accepted and unused: ``notebooks/sam.ipynb`` writes the
    stage's tables, timings and metrics under it from the returned :class:`SAMResults`."""
    from hideseek.utils import set_threads
    from tqdm.auto import tqdm

    from companion import kernels

    st = Settings.from_params(params)
    kernels.check(st.cpu_kernels, "sam")   # the stage's command pins them (python -m companion.kernels sam -- ...)
    set_threads(st.threads)
    t0 = time.perf_counter()
    start = pretrained_start(st, profile)
    pairs = hs.find_symmetries(start.model())            # discovered once, re-used by every SAM
    grid = {"adamw": [0.0], **{m: list(st.rho_grid[m]) for m in METHODS if m != "adamw"}}
    jobs = [(seed, m, r) for seed in st.seeds for m in METHODS for r in grid[m]]
    records, models, test_correct = [], {}, {}
    for seed, m, r in tqdm(jobs, desc="sam fine-tunes", disable=not progress):
        model, rec = finetune(start, m, r, seed, st, pairs)
        records.append(rec)
        models[m, r, seed] = copy.deepcopy(model.state_dict())
    runs = pd.DataFrame(records)
    per_step = runs.groupby("method", sort=False).seconds_per_step.median()
    runs = runs.drop(columns="seconds_per_step")
    chosen = choose_rho(runs)
    seeds, spec = list(st.seeds), st.sharpness
    batch = (start.x_train[:spec.n_images], start.y_train[:spec.n_images])
    rows, sharp_rows = [], []
    for m in METHODS:
        corr = []
        for seed in seeds:
            model = start.model()
            model.load_state_dict(models[m, chosen[m], seed])
            corr.append(correct(model, start.x_test, start.y_test))
            sharp_rows.append(dict(method=m, seed=seed, rho=chosen[m], test_error=float(1 - corr[-1].mean()),
                                   **sharpness_of(model, batch, spec)))
        test_correct[m] = np.stack(corr)
    sharp = pd.DataFrame(sharp_rows)
    rng = np.random.default_rng(st.seed)
    n_boot = st.n_boot
    idx_s = rng.integers(0, len(seeds), (n_boot, len(seeds)))
    idx_i = rng.integers(0, len(start.y_test), (n_boot, len(start.y_test)))
    draws = {m: bootstrap_error(test_correct[m], n_boot, rng, idx_s, idx_i) for m in METHODS}
    at = runs.merge(pd.DataFrame({"method": list(chosen), "rho": list(chosen.values())}))
    for m in METHODS:
        r = at[at.method == m]
        diff = draws["adamw"] - draws[m]
        rows.append(dict(method=m, label=LABELS[m], rho=chosen[m], n_seeds=len(r),
                         test_error=float(1 - test_correct[m].mean()), test_ci=_interval(draws[m]),
                         diff_vs_adamw=float(test_correct[m].mean() - test_correct["adamw"].mean()),
                         diff_ci=_interval(diff), val_error=float(r.val_error.mean()),
                         train_error=float(r.train_error.mean()),
                         **{f"sharpness_{k}": float(sharp[sharp.method == m][k].mean()) for k in spec.measures}))
    summary = pd.DataFrame(rows)
    metrics = _metrics(st, start, runs, summary, rows, grid, chosen, seeds)
    timings = dict(per_step={m: float(per_step[m]) for m in METHODS},
                   step_vs_sam={m: float(per_step[m] / per_step["sam"]) for m in METHODS},
                   total=time.perf_counter() - t0)
    return SAMResults(runs, chosen, summary, sharp, metrics, start, timings)


def _metrics(st: Settings, start: Start, runs: pd.DataFrame, summary: pd.DataFrame, rows: list[dict],
             grid: dict, chosen: dict, seeds: list[int]) -> dict:
    """``reports/metrics/sam.json``'s content (no wall clock: see :attr:`SAMResults.timings`)."""
    spec = st.sharpness
    metrics = dict(
        chosen_rho=chosen, rho_grid=grid,
        methods={r["method"]: {k: r[k] for k in ("rho", "test_error", "test_ci", "diff_vs_adamw", "diff_ci",
                                                 "val_error", "train_error")
                               } | {"sharpness": {k: r[f"sharpness_{k}"] for k in spec.measures}}
                 for r in rows},
        protocol=dict(n_train=len(start.y_train), n_val=len(start.y_val), n_test=len(start.y_test),
                      steps=st.steps, batch_size=st.batch_size, seeds=seeds,
                      n_runs=len(runs), n_parameters=sum(p.numel() for p in start.model().parameters()),
                      pretrain_test_error=start.record["test_error"],
                      pretrain_train_error=start.record["pool_error"], n_boot=st.n_boot,
                      sharpness=asdict(spec), vision_train=json.loads(json.dumps(asdict(start.vision)))),
    )
    metrics["findings"] = findings(summary, grid)
    return metrics


def findings(summary: pd.DataFrame, grid: Mapping[str, list[float]]) -> str:
    """The findings paragraph, written from the numbers."""
    s = summary.set_index("method")
    base = s.loc["adamw"]
    lines = [f"AdamW alone reaches a test error of {base.test_error:.3f} "
             f"[{base.test_ci[0]:.3f}, {base.test_ci[1]:.3f}] (mean over {int(base.n_seeds)} seeds, "
             "95% bootstrap interval over seeds and test images)."]
    for m in [m for m in s.index if m != "adamw"]:
        r = s.loc[m]
        lo, hi = r.diff_ci
        verdict = ("lower than AdamW's (the interval of the difference excludes 0)" if lo > 0 else
                   "higher than AdamW's (the interval of the difference excludes 0)" if hi < 0 else
                   "not distinguishable from AdamW's (the interval of the difference contains 0)")
        lines.append(f"{r.label} at the chosen ρ = {r.rho:g}: test error {r.test_error:.3f} "
                     f"[{r.test_ci[0]:.3f}, {r.test_ci[1]:.3f}], {verdict}: AdamW − method = "
                     f"{r.diff_vs_adamw:+.3f} [{lo:+.3f}, {hi:+.3f}].")
    sam_family = [m for m in s.index if m != "adamw"]
    edge = [s.loc[m, "label"] for m in sam_family if len(grid[m]) > 1 and s.loc[m, "rho"] == min(grid[m])]
    if edge:
        lines.append(f"The validation split chose the smallest ρ of the grid for {', '.join(edge)}: the weakest "
                     "perturbation tried did best there, so a still smaller ρ (closer to AdamW) was not ruled out.")
    for col in [c for c in s.columns if c.startswith("sharpness_")]:
        order = s[col].sort_values()
        lines.append(f"Geodesic sharpness ({col.removeprefix('sharpness_geodesic_')} metric) of the resulting "
                     f"models, lowest to highest: " + ", ".join(f"{s.loc[m, 'label']} {v:.3g}"
                                                                for m, v in order.items()) + ".")
    best = s.drop(index="adamw").test_error.idxmin()
    lines.append(f"Lowest mean test error among the SAM family: {s.loc[best, 'label']}. "
                 "With this few seeds and a test set of this size, differences below the intervals' width are noise.")
    return "\n\n".join(lines)


def results_markdown(metrics: Mapping[str, Any], timings: Mapping[str, Any]) -> str:
    """The results table (method, ρ, test error with interval, difference to AdamW, time per
    step and its ratio to SAM's) from a published ``reports/metrics/sam.json`` and the same run's
    ``reports/timings/sam.json``; the README's table is this function's output."""
    lines = ["| method | ρ (chosen on val) | test error [95% CI] | AdamW − method [95% CI] | ms / step | × SAM |",
             "|---|---|---|---|---|---|"]
    sec = timings
    for m in METHODS:
        r = metrics["methods"][m]
        rho = "–" if m == "adamw" else f"{r['rho']:g}"
        lines.append(f"| {LABELS[m]} | {rho} | {r['test_error']:.3f} [{r['test_ci'][0]:.3f}, {r['test_ci'][1]:.3f}] | "
                     f"{r['diff_vs_adamw']:+.3f} [{r['diff_ci'][0]:+.3f}, {r['diff_ci'][1]:+.3f}] | "
                     f"{1e3 * sec['per_step'][m]:.1f} | {sec['step_vs_sam'][m]:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":   # python -m companion.experiments.sam [metrics.json [timings.json]]: the results table
    import sys

    given, defaults = sys.argv[1:3], ["reports/metrics/sam.json", "reports/timings/sam.json"]
    files = given + defaults[len(given):]
    print(results_markdown(*(json.loads(Path(f).read_text()) for f in files)))
