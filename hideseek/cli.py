"""Command line: ``hideseek sharpness …`` and ``hideseek symmetries …``.

Models: a saved HuggingFace directory (``--hf DIR``, loaded offline) or a model-soups style
open_clip checkpoint (``--open-clip FILE``: CLIP image tower + linear head).  Data: a
``.pt`` file holding ``{"inputs": tensor or dict of tensors, "labels": tensor}`` (or an
``.npz`` with ``labels`` and either ``inputs`` or the keyword arrays), split along the first
dimension into batches.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from .measures import Measure
from .sharpness import SharpnessInputError, sharpness
from .symmetries.discover import UnsupportedAttentionError, find_symmetries


class CLIError(Exception):
    pass


def load_model(args) -> torch.nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if bool(args.hf) == bool(args.open_clip):
        raise CLIError("give exactly one of --hf DIR or --open-clip FILE")
    if args.hf:
        import transformers
        path = Path(args.hf)
        if not (path / "config.json").is_file():
            raise CLIError(f"--hf {path}: not a saved HuggingFace model directory (no config.json)")
        cfg = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        archs = " ".join(cfg.architectures or [])
        if "ImageClassification" in archs:
            cls = transformers.AutoModelForImageClassification
        elif "SequenceClassification" in archs:
            cls = transformers.AutoModelForSequenceClassification
        else:
            raise CLIError(f"--hf {path}: architectures {archs or '(none)'} is not a classifier; "
                           "use the Python API with your own loss_fn")
        model = cls.from_pretrained(path, local_files_only=True)
    else:
        from .open_clip_finetune import load_clip_finetune
        model = load_clip_finetune(args.open_clip, expect=None, num_classes=None)
    return model.to(args.device).eval()


def load_batches(path: str, batch_size: int, max_batches: int | None):
    p = Path(path)
    if not p.is_file():
        raise CLIError(f"--data {p}: no such file")
    if p.suffix == ".npz":
        import numpy as np
        arrays = dict(np.load(p))
        if "labels" not in arrays:
            raise CLIError(f"--data {p}: the .npz has no 'labels' array (keys: {sorted(arrays)})")
        labels = torch.from_numpy(arrays.pop("labels"))
        inputs = torch.from_numpy(arrays["inputs"]) if set(arrays) == {"inputs"} else \
            {k: torch.from_numpy(v) for k, v in arrays.items()}
    else:
        obj = torch.load(p, map_location="cpu", weights_only=True)
        if not isinstance(obj, dict) or "inputs" not in obj or "labels" not in obj:
            raise CLIError(f"--data {p}: expected a dict with 'inputs' and 'labels' (torch.save)")
        inputs, labels = obj["inputs"], obj["labels"]
    n = labels.shape[0]
    out = []
    for start in range(0, n, batch_size):
        sl = slice(start, min(n, start + batch_size))
        x = inputs[sl] if isinstance(inputs, torch.Tensor) else {k: v[sl] for k, v in inputs.items()}
        out.append((x, labels[sl]))
        if max_batches and len(out) >= max_batches:
            break
    return out


def _add_model_args(sp):
    sp.add_argument("--hf", metavar="DIR", help="saved HuggingFace classifier directory")
    sp.add_argument("--open-clip", metavar="FILE", help="model-soups style CLIP fine-tune state dict")
    sp.add_argument("--device", default="cpu")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hideseek", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("sharpness", help="geodesic or adaptive sharpness of a model on a data file")
    _add_model_args(sp)
    sp.add_argument("--data", required=True, help=".pt or .npz with inputs and labels")
    sp.add_argument("--batch-size", type=int, default=128)
    sp.add_argument("--max-batches", type=int, default=None)
    sp.add_argument("--measure", default="geodesic",
                    help="a measure name or alias: " + ", ".join(["geodesic", "adaptive"] + [
                        m.name for m in Measure.all()]) + " (default geodesic = geodesic_invariant); "
                    "--metric/--norm/--no-christoffel/--eps/--p change that measure's fields")
    sp.add_argument("--metric", default=None, choices=["invariant", "mixed"],
                    help="pair metric (geodesic measures only)")
    sp.add_argument("--rho", type=float, required=True)
    sp.add_argument("--n-iters", type=int, default=20)
    sp.add_argument("--norm", choices=["riemannian", "adaptive"], default=None)
    sp.add_argument("--no-christoffel", action="store_true", help="straight steps (ablation)")
    sp.add_argument("--eps", type=float, default=None, help="ε relaxation (geodesic measures only)")
    sp.add_argument("--p", default=None, choices=["l2", "linf"], help="l2 or linf (adaptive only)")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--autocast", choices=["bfloat16", "float16"], default=None,
                    help="forward/backward passes in this dtype (float32 models; geometry stays float32)")
    sp.add_argument("--out", help="write the result as JSON here")
    sy = sub.add_parser("symmetries", help="list the GL(h) pairs hideseek finds in a model")
    _add_model_args(sy)
    args = ap.parse_args(argv)
    try:
        # the measure first: a bad one is reported before any model is loaded
        measure = None if args.cmd != "sharpness" else Measure.from_keywords(
            args.measure, metric=args.metric, norm=args.norm,
            christoffel=False if args.no_christoffel else None, eps=args.eps, p=args.p)
        model = load_model(args)
        if args.cmd == "symmetries":
            for blk in find_symmetries(model):
                for d in blk.describe():
                    print(f"{d['module']:<60} {d['kind']:>3}  {d['heads']:>3} heads × GL({d['head_width']})  "
                          f"G {d['G_shape'][0]}×{d['G_shape'][1]}  H {d['H_shape'][0]}×{d['H_shape'][1]}")
            return 0
        batches = load_batches(args.data, args.batch_size, args.max_batches)
        res = sharpness(model, batches, measure, rho=args.rho, n_iters=args.n_iters, seed=args.seed,
                        autocast=args.autocast, progress=True)
    except (CLIError, SharpnessInputError, UnsupportedAttentionError, FileNotFoundError, ValueError) as err:
        print(f"hideseek: error: {err}", file=sys.stderr)
        return 2
    print(f"{res.name} (rho={args.rho}, {len(res.per_batch)} batches): {res.value:.6g}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res.to_dict(), indent=2, default=str))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
