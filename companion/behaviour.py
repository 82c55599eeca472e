"""The library's behaviour as the pipeline's dependency: its numbers on small fixed problems.

A report stage needs the *values* :mod:`hideseek` gives on the paths it calls, not the library's
source text. This module computes those values on tiny, fixed, seeded problems (float32, as the
stages compute, one intra-op thread) and writes one JSON file per path into ``reports/behaviour/``.
Every stage of ``dvc.yaml`` depends on the files of the paths it uses instead of on ``hideseek/``:

* a comment, a docstring, a refactor or a feature a stage does not call leaves every file
  byte-identical, so no stage re-runs;
* an edit that moves a value the library gives changes the file of that path, so exactly the
  stages that list it re-run.

Values are written at full float precision (``float.hex`` is not needed: ``repr`` of a Python
float round-trips), so a change in the last bit of a float32 result counts as a change: the
stages' own outputs would move by that much too.

The stage ``behaviour`` (``python -m companion.behaviour write``) is ``always_changed`` in
``dvc.yaml``: it runs first in every ``dvc repro`` (about half a minute), and DVC re-runs a later
stage only when one of the files it depends on changed. :data:`USES` maps the library names a
stage's code refers to onto the paths it depends on; ``tests/test_dvc_deps.py`` checks every
stage lists the files its code needs.

``python -m companion.behaviour write [--out DIR] [--only PATH ...]``; ``... list`` prints the paths.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Callable

OUT = Path("reports/behaviour")

#: library name a stage's code refers to -> the behaviour paths it depends on
SHARPNESS_PATHS = ("sharpness_adaptive", "sharpness_invariant", "sharpness_mixed", "sharpness_ablations",
                   "sharpness_exact", "symmetries", "measures")
USES: dict[str, tuple[str, ...]] = {
    "sharpness": SHARPNESS_PATHS,
    "SharpnessProblem": SHARPNESS_PATHS,
    "sharpness_zoo": SHARPNESS_PATHS + ("zoo",),
    "Measure": ("measures",),
    "find_symmetries": ("symmetries",),
    "RiemannianHessian": ("hessian", "measures"),
    "EuclideanHessian": ("hessian",),
    "DiagonalPair": ("pair_geometry",),
    "PairGeometry": ("pair_geometry",),
    "InvariantMetric": ("pair_geometry",),
    "MixedMetric": ("pair_geometry",),
    "apgd_checkpoints": ("apgd",),
    "optim": ("sam", "symmetries", "measures"),
    "relative_flatness": ("relative_flatness",),
    "set_threads": ("runtime",),
    "resolve_device": ("runtime",),
    "open_clip_finetune": ("open_clip_finetune",),
}


# ---------------------------------------------------------------------------------------------
# The fixed problems

def _torch():
    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    return torch


class _TinyViT:
    """A two-layer pre-norm transformer over 4 tokens with ``nn.MultiheadAttention`` (the vision
    stand-ins' attention), 2 heads of 4, a linear head of 3 classes."""

    @staticmethod
    def build(seed: int = 0):
        torch = _torch()
        from torch import nn

        class Block(nn.Module):
            def __init__(self, d: int, heads: int):
                super().__init__()
                self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
                self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
                self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

            def forward(self, x):
                h = self.ln1(x)
                x = x + self.attn(h, h, h, need_weights=False)[0]
                return x + self.mlp(self.ln2(x))

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Linear(5, 8)
                self.blocks = nn.Sequential(Block(8, 2), Block(8, 2))
                self.norm = nn.LayerNorm(8)
                self.classifier = nn.Linear(8, 3)

            def forward(self, x):
                return self.classifier(self.norm(self.blocks(self.embed(x))).mean(1))

        torch.manual_seed(seed)
        return Net().eval()

    @staticmethod
    def batches(n: int = 2, seed: int = 1):
        torch = _torch()
        g = torch.Generator().manual_seed(seed)
        return [(torch.randn(6, 4, 5, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(n)]


def _tiny_bert(seed: int = 0):
    """A tiny Hugging Face BERT classifier (the MiniLM row's family), random weights."""
    torch = _torch()
    from transformers import BertConfig, BertForSequenceClassification
    from transformers.utils import logging

    logging.set_verbosity_error()
    cfg = BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=16, max_position_embeddings=16, num_labels=3,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(seed)
    model = BertForSequenceClassification(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    batches = [{"input_ids": torch.randint(0, 30, (4, 6), generator=g),
                "attention_mask": torch.ones(4, 6, dtype=torch.long),
                "labels": torch.randint(0, 3, (4,), generator=g)} for _ in range(2)]
    return model, batches


def _num(x) -> float | list:
    """A JSON-safe number (or nested list) at full precision."""
    import torch

    if isinstance(x, torch.Tensor):
        x = x.detach().double().tolist()
    if isinstance(x, (list, tuple)):
        return [_num(v) for v in x]
    x = float(x)
    return x if math.isfinite(x) else repr(x)


def _result(res) -> dict:
    return {"value": _num(res.value), "per_batch": _num(res.per_batch)}


def _measure_values(measures: dict, *, n_iters: int = 3, **kw) -> dict:
    import hideseek as hs

    out = {}
    for fam, (model, batches) in {"mha": (_TinyViT.build(), _TinyViT.batches()), "bert": _tiny_bert()}.items():
        for key, (m, rho, extra) in measures.items():
            res = hs.sharpness(model, batches, m, rho=rho, n_iters=n_iters, progress=False, **{**kw, **extra})
            out[f"{fam}/{key}"] = _result(res)
    return out


# ---------------------------------------------------------------------------------------------
# The paths

def sharpness_adaptive() -> dict:
    from hideseek import Measure

    return _measure_values({
        "m_apgd_l2": (Measure(geometry="adaptive", p="l2"), 0.1, {}),
        "m_apgd_linf": (Measure(geometry="adaptive", p="linf"), 0.01, {}),
        "m_apgd_l2/restarts2": (Measure(geometry="adaptive", p="l2"), 0.1, {"restarts": 2}),
        "avg_m_apgd_l2": (Measure(geometry="adaptive", p="l2", kind="average"), 0.1, {"n_samples": 3}),
        "euclidean_l2": (Measure(geometry="euclidean"), 0.05, {}),
    })


def _geodesic(metric: str, rho: float) -> dict:
    from hideseek import Measure

    return _measure_values({
        "full": (Measure(metric=metric), rho, {}),
        "restarts2": (Measure(metric=metric), rho, {"restarts": 2}),
        "random_start": (Measure(metric=metric), rho, {"random_start": True}),
        "average": (Measure(metric=metric, kind="average"), rho, {"n_samples": 3}),
    })


def sharpness_invariant() -> dict:
    return _geodesic("invariant", 0.2)


def sharpness_mixed() -> dict:
    return _geodesic("mixed", 0.1)


def sharpness_ablations() -> dict:
    from hideseek import Measure

    return _measure_values({
        "invariant_no_christoffel": (Measure(metric="invariant", step="straight"), 0.2, {}),
        "invariant_christoffel_only": (Measure(metric="invariant", ball="adaptive"), 0.1, {}),
        "mixed_no_christoffel": (Measure(metric="mixed", step="straight"), 0.1, {}),
        "mixed_christoffel_only": (Measure(metric="mixed", ball="adaptive"), 0.1, {}),
        "invariant_eps0.01": (Measure(metric="invariant", eps=0.01), 0.2, {}),
        "invariant_eps0.1": (Measure(metric="invariant", eps=0.1), 0.2, {}),
    })


def sharpness_exact() -> dict:
    from hideseek import Measure

    return _measure_values({"invariant": (Measure(metric="invariant", step="exact"), 0.2, {}),
                            "mixed": (Measure(metric="mixed", step="exact"), 0.002, {})}, n_iters=2)


def measures() -> dict:
    """Names, labels and parsing of the measures (what reports print and group by)."""
    from hideseek import Measure

    from hideseek.measures import _by_name

    names = sorted(_by_name())
    out = {}
    for n in names:
        m = Measure.parse(n)
        out[n] = {"name": m.name, "label": m.label, "repr": repr(m)}
    out["eps"] = {"name": Measure(metric="invariant", eps=0.1).name, "label": Measure(metric="invariant", eps=0.1).label}
    return out


def symmetries() -> dict:
    import hideseek as hs

    out = {}
    for fam, model in {"mha": _TinyViT.build(), "bert": _tiny_bert()[0]}.items():
        out[fam] = [d for block in hs.find_symmetries(model) for d in block.describe()]
    return json.loads(json.dumps(out, default=str))


def pair_geometry() -> dict:
    """The GL(1) pair geometry of a diagonal network (the diagonal stage's own use): metric,
    projection, Riemannian gradient, second-order and straight steps."""
    torch = _torch()
    from hideseek.geometry.gl import PairGeometry
    from hideseek.geometry.metrics import InvariantMetric, MixedMetric

    g = torch.Generator().manual_seed(3)
    u, v = torch.randn(5, 1, 1, generator=g) + 1.5, torch.randn(5, 1, 1, generator=g) - 0.5
    gu, gv = torch.randn(5, 1, 1, generator=g), torch.randn(5, 1, 1, generator=g)
    out = {}
    for name in (InvariantMetric.name, MixedMetric.name):
        geo = PairGeometry(u, v, metric=name)
        xi = geo.project(*geo.egrad_to_rgrad(gu, gv))
        rec = {"rgrad": _num(torch.cat([t.flatten() for t in xi])), "sqnorm": _num(geo.sqnorm(*xi))}
        for key, christoffel in (("second_order", True), ("straight", False), ("exact", "exact")):
            pt = geo.step(0.1 * xi[0], 0.1 * xi[1], christoffel=christoffel)
            rec[key] = _num(torch.cat([t.flatten() for t in pt]))
        out[name] = rec
    return out


def apgd() -> dict:
    from hideseek.solvers.apgd import apgd_checkpoints

    return {str(n): [int(c) for c in apgd_checkpoints(n)] for n in (3, 5, 10, 20, 50, 100)}


def hessian() -> dict:
    torch = _torch()
    import hideseek as hs

    model, batches = _TinyViT.build(), _TinyViT.batches(1)
    out = {}
    ops = {"euclidean": hs.EuclideanHessian(model, batches),
           "invariant": hs.RiemannianHessian(model, batches, hs.Measure(metric="invariant")),
           "mixed": hs.RiemannianHessian(model, batches, hs.Measure(metric="mixed"))}
    for name, op in ops.items():
        n = op.shape[0] if hasattr(op, "shape") else op.dim
        g = torch.Generator().manual_seed(7)
        v = torch.randn(n, generator=g)
        mv = op.matvec(v) if not isinstance(v, list) else op.matvec(v)
        out[name] = {"dim": int(n), "matvec": _num(mv.flatten()[:64]), "matvec_norm": _num(mv.norm()),
                     "trace_hutchinson": _num(op.trace("hutchinson", n_probes=4, seed=0).value)}
    # the diagonal networks' exact traces (geometry_lines' diagonal row, the toy figure)
    g = torch.Generator().manual_seed(5)

    class Diag(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.u = torch.nn.Parameter(torch.randn(4, generator=g) + 1.0)
            self.v = torch.nn.Parameter(torch.randn(4, generator=g))

        def forward(self, x):
            return x @ (self.u * self.v)

    diag = Diag().eval()
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, generator=g)

    def half_mse(out, yb):
        return 0.5 * ((out - yb) ** 2).mean()

    for k in ("invariant", "mixed"):
        op = hs.RiemannianHessian(diag, [(x, y)], hs.Measure(metric=k), loss_fn=half_mse,
                                  pairs=[hs.DiagonalPair("u", "v")], chunk=8)
        out[f"diagonal/{k}"] = {"trace_exact": _num(op.trace("exact").value)}
    op = hs.EuclideanHessian(diag, [(x, y)], loss_fn=half_mse)
    out["diagonal/euclidean"] = {"trace_exact": _num(op.trace("exact").value)}
    return out


def sam() -> dict:
    """Three steps of SAM, ASAM and geodesic SAM (invariant, mixed) from one start: the losses and
    the parameters' sums and norms after each step."""
    torch = _torch()
    import hideseek as hs

    batches = _TinyViT.batches(3, seed=11)
    out = {}
    for name, measure, rho in (("sam", hs.Measure(geometry="euclidean"), 0.05),
                               ("asam", hs.Measure(geometry="adaptive"), 0.5),
                               ("geodesic_invariant", hs.Measure(metric="invariant"), 0.2),
                               ("geodesic_mixed", hs.Measure(metric="mixed"), 0.1)):
        model = _TinyViT.build(seed=2).train()
        base = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
        opt = hs.optim.SAM(model, base, measure, rho=rho)
        rec = []
        for x, y in batches:        # the sam stage's loop: gradient at theta, ascent, gradient there, step
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.first_step(zero_grad=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.second_step(zero_grad=True)
            flat = torch.cat([p.detach().flatten() for p in model.parameters()])
            rec.append({"loss": _num(loss), "sum": _num(flat.sum()), "norm": _num(flat.norm())})
        out[name] = rec
    return out


def relative_flatness() -> dict:
    import hideseek as hs

    model, batches = _TinyViT.build(), _TinyViT.batches()
    out = {}
    for method in ("closed_form", "autograd"):
        try:
            res = hs.relative_flatness(model, batches, "classifier.weight", method=method)
        except ValueError as e:     # a method the library refuses for this loss: the refusal is its behaviour
            out[method] = {"refused": str(e)}
            continue
        out[method] = {k: _num(v) for k, v in vars(res).items()
                       if isinstance(v, (int, float)) and k != "seconds"}   # a timing is no behaviour
    return out


def zoo() -> dict:
    import hideseek as hs

    import copy

    first = _TinyViT.build(seed=0)
    second = copy.deepcopy(first)
    second.load_state_dict(_TinyViT.build(seed=1).state_dict())
    models = [first, second]
    res = hs.sharpness_zoo(models, _TinyViT.batches(), hs.Measure(metric="invariant"), rho=0.2, n_iters=3,
                           progress=False)
    return {"values": [_num(r.value) for r in res]}


def runtime() -> dict:
    from hideseek.utils import resolve_device, set_threads

    return {"set_threads(1)": set_threads(1), "resolve_device(cpu)": str(resolve_device("cpu"))}


def open_clip_finetune() -> dict:
    """Reading a CLIP checkpoint's vision tower (the paper profile's loader) on a synthetic state dict."""
    from hideseek import open_clip_finetune as ocf

    out = {"NUM_CLASSES": ocf.NUM_CLASSES, "VIT_B32": json.loads(json.dumps(ocf.VIT_B32, default=str))}
    try:
        ocf.split_state_dict({})
    except ocf.CheckpointError as e:
        out["empty_refused"] = str(e)
    return out


PATHS: dict[str, Callable[[], dict]] = {f.__name__: f for f in (
    sharpness_adaptive, sharpness_invariant, sharpness_mixed, sharpness_ablations, sharpness_exact, measures,
    symmetries, pair_geometry, apgd, hessian, sam, relative_flatness, zoo, runtime, open_clip_finetune)}


def dumps(values: dict) -> str:
    return json.dumps(values, indent=1, sort_keys=True) + "\n"


def write(out: Path = OUT, only: list[str] | None = None, *, verbose: bool = True) -> list[Path]:
    """Compute every path (or ``only`` those) and write ``out/<path>.json``; a file whose content
    did not change is not rewritten."""
    unknown = sorted(set(only or ()) - set(PATHS))
    if unknown:
        raise SystemExit(f"companion.behaviour: unknown path(s) {unknown}; known: {sorted(PATHS)}")
    import warnings

    warnings.filterwarnings("ignore")       # the tiny problems trip the library's advisory warnings
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in only or PATHS:
        text = dumps(PATHS[name]())
        path = out / f"{name}.json"
        changed = not path.exists() or path.read_text() != text
        if changed:
            path.write_text(text)
        written.append(path)
        if verbose:
            print(f"behaviour {name:22s} {'changed' if changed else 'same'}", file=sys.stderr, flush=True)
    stale = sorted(p for p in out.glob("*.json") if p.stem not in PATHS)
    if only is None:
        for p in stale:
            p.unlink()
    return written


def paths_for(names) -> list[str]:
    """The behaviour paths the library names ``names`` depend on (sorted, unique)."""
    return sorted({p for n in names for p in USES.get(n, ())})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m companion.behaviour", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="compute the paths and write one JSON file each")
    w.add_argument("--out", type=Path, default=OUT)
    w.add_argument("--only", nargs="+", metavar="PATH")
    w.add_argument("--quiet", action="store_true")
    sub.add_parser("list", help="print the paths")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        print("\n".join(PATHS))
        return 0
    write(args.out, args.only, verbose=not args.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
