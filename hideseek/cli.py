"""Command line: hideseek sharpness ... and hideseek symmetries ...

Models: a saved Hugging Face directory (--hf DIR, loaded offline: a sequence or image
classifier, or a causal LM whose labels are the token ids) or a model-soups style open_clip
checkpoint (--open-clip FILE: CLIP image tower + linear head), upcast to --dtype on load.
Data: see the data file format in hideseek sharpness --help.  Every error (bad files,
arguments, and errors the model raises on the data) is reported as one line on stderr with
exit status 2; HIDESEEK_TRACEBACK=1 shows the traceback of an unexpected one instead.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from .geometry.metrics import metric_names
from .measures import Measure
from .rho import suggest_rho
from .sharpness import SharpnessInputError, sharpness
from .symmetries.discover import UnsupportedAttentionError, find_symmetries


DATA_FORMAT = """\
data file (--data):
  .pt   written by torch.save({'inputs': X, 'labels': y}, path), where y is a tensor of N
        labels (class indices; not a list) and X is a tensor with N rows (passed to the model
        positionally) or a dict of tensors with N rows each (passed as keyword arguments,
        e.g. {'input_ids': ..., 'attention_mask': ...} for a Hugging Face model).
  .npz  written by numpy.savez(path, labels=y, inputs=X) or numpy.savez(path, labels=y,
        input_ids=..., attention_mask=...) (every array but 'labels' is a keyword input).
  Rows are split into batches of --batch-size in file order; inputs and labels must have
  the same number of rows.
"""


class CLIError(Exception):
    pass


class _ArgumentError(CLIError):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line and status 2 from :func:`main` (no usage dump,
    no ``SystemExit`` when called in-process)."""

    def error(self, message):
        raise _ArgumentError(f"{self.prog}: {message} (see {self.prog} --help)")


def _check_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as err:
        raise CLIError(f"--device {device}: not a torch device ({err})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"--device {device}: no CUDA GPU is available here (torch.cuda.is_available() "
                       "is False); use --device cpu")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise CLIError(f"--device {device}: the MPS backend is not available here; use --device cpu")
    return dev


def load_model(args) -> torch.nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if bool(args.hf) == bool(args.open_clip):
        raise CLIError("give exactly one of --hf DIR or --open-clip FILE")
    device = _check_device(args.device)
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
        elif "CausalLM" in archs:
            cls = transformers.AutoModelForCausalLM
        elif getattr(args, "cmd", None) == "symmetries":
            cls = transformers.AutoModel
        else:
            raise CLIError(f"--hf {path}: architectures {archs or '(none)'} is neither a classifier nor a "
                           "causal LM; use the Python API with your own loss_fn")
        hf_log = transformers.utils.logging
        bar, verbosity = hf_log.is_progress_bar_enabled(), hf_log.get_verbosity()
        if getattr(args, "quiet", False):
            hf_log.disable_progress_bar()
            hf_log.set_verbosity_error()
        try:
            kw = {} if args.dtype == "auto" else {"dtype": _DTYPES[args.dtype]}
            model = cls.from_pretrained(path, local_files_only=True, **kw)
        finally:
            hf_log.set_verbosity(verbosity)
            hf_log.enable_progress_bar() if bar else hf_log.disable_progress_bar()
    else:
        from .open_clip_finetune import load_clip_finetune
        if not Path(args.open_clip).is_file():
            raise CLIError(f"--open-clip {args.open_clip}: no such file")
        try:
            model = load_clip_finetune(args.open_clip, expect=None, num_classes=None)
        except ValueError as err:   # CheckpointError: wrong or unreadable file
            raise CLIError(f"--open-clip {args.open_clip}: not a model-soups CLIP fine-tune: {err}") from None
        if args.dtype != "auto":
            model = model.to(_DTYPES[args.dtype])
    return model.to(device).eval()


_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _check_out(out: str | None) -> None:
    """--out must be writable: checked before any computation."""
    if not out:
        return
    path = Path(out)
    if path.is_dir():
        raise CLIError(f"--out {out}: is a directory; give a file name such as {path / 'result.json'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CLIError(f"--out {out}: cannot create its folder ({err.strerror or err})") from None
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise CLIError(f"--out {out}: not writable")


def _check_data_fits(model, batches) -> None:
    """Labels within a classifier's classes and integer token ids, before computing."""
    cfg = getattr(model, "config", None)
    n_labels = getattr(cfg, "num_labels", None)
    is_lm = "CausalLM" in " ".join(getattr(cfg, "architectures", None) or [])
    vocab = getattr(cfg, "vocab_size", None)
    for i, (x, y) in enumerate(batches):
        ids = x.get("input_ids") if isinstance(x, dict) else None
        if ids is not None and ids.is_floating_point():
            raise CLIError(f"--data: input_ids are {str(ids.dtype).removeprefix('torch.')}; token ids must be "
                           "integers (save them as torch.long / int64)")
        if isinstance(y, torch.Tensor) and not y.is_floating_point() and y.numel():
            hi, lo = int(y.max()), int(y[y != -100].min()) if bool((y != -100).any()) else 0
            limit = vocab if is_lm else n_labels
            if limit and (hi >= limit or lo < 0):
                what = "token ids (vocabulary size" if is_lm else "class indices (the model has num_labels="
                raise CLIError(f"--data: labels of batch {i} range over {lo} … {hi} but must be {what}"
                               f"{limit}: 0 … {limit - 1}, or -100 to ignore)")


def _rows(name: str, v) -> int:
    if not isinstance(v, torch.Tensor):
        raise CLIError(f"{name} is a {type(v).__name__}, not a tensor; save tensors "
                       f"(e.g. torch.tensor(...)) — see hideseek sharpness --help")
    if v.dim() == 0:
        raise CLIError(f"{name} is a 0-dimensional tensor; it needs one row per example")
    return v.shape[0]


def load_batches(path: str, batch_size: int, max_batches: int | None):
    """``[(inputs, labels), …]`` from a data file (format: :data:`DATA_FORMAT`)."""
    p = Path(path)
    if not p.is_file():
        raise CLIError(f"--data {p}: no such file")
    if batch_size < 1:
        raise CLIError(f"--batch-size must be at least 1, got {batch_size}")
    if max_batches is not None and max_batches < 1:
        raise CLIError(f"--max-batches must be at least 1, got {max_batches}")
    if p.suffix == ".npz":
        import numpy as np
        try:
            arrays = dict(np.load(p, allow_pickle=False))
        except Exception as err:  # noqa: BLE001 (any unreadable file is the same user error)
            raise CLIError(f"--data {p}: not a readable .npz file ({type(err).__name__}: {err})") from None
        if "labels" not in arrays:
            raise CLIError(f"--data {p}: the .npz has no 'labels' array (keys: {sorted(arrays)})")
        labels = torch.from_numpy(arrays.pop("labels"))
        inputs = torch.from_numpy(arrays["inputs"]) if set(arrays) == {"inputs"} else \
            {k: torch.from_numpy(v) for k, v in arrays.items()}
    else:
        try:
            obj = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 (pickle, zip, unpickling-policy errors alike)
            raise CLIError(f"--data {p}: torch.load(weights_only=True) cannot read it ({type(err).__name__}); "
                           "it must be written by torch.save and hold only tensors in a dict — see "
                           "hideseek sharpness --help for the format") from None
        if not isinstance(obj, dict) or "inputs" not in obj or "labels" not in obj:
            raise CLIError(f"--data {p}: expected a dict with 'inputs' and 'labels' (torch.save)")
        inputs, labels = obj["inputs"], obj["labels"]
    n = _rows(f"--data {p}: 'labels'", labels)
    if isinstance(inputs, dict):
        if not inputs:
            raise CLIError(f"--data {p}: 'inputs' is an empty dict")
        counts = {k: _rows(f"--data {p}: inputs[{k!r}]", v) for k, v in inputs.items()}
    else:
        counts = {"inputs": _rows(f"--data {p}: 'inputs'", inputs)}
    bad = {k: c for k, c in counts.items() if c != n}
    if bad:
        k, c = next(iter(bad.items()))
        raise CLIError(f"--data {p}: {c} inputs ({k}) but {n} labels; every input needs one label")
    if n == 0:
        raise CLIError(f"--data {p}: no examples (0 labels)")
    out = []
    for start in range(0, n, batch_size):
        sl = slice(start, min(n, start + batch_size))
        x = inputs[sl] if isinstance(inputs, torch.Tensor) else {k: v[sl] for k, v in inputs.items()}
        out.append((x, labels[sl]))
        if max_batches and len(out) >= max_batches:
            break
    return out


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; every optional flag's default shown (a flag whose default is
    None says in its help what not giving it means)."""

    def _get_help_string(self, action):
        help_ = action.help or ""
        if action.option_strings and not action.required and action.default not in (None, argparse.SUPPRESS) \
                and "%(default)" not in help_:
            help_ += " (default: %(default)s)"
        return help_


def _add_model_args(sp):
    sp.add_argument("--hf", metavar="DIR", default=None,
                    help="saved Hugging Face model directory (classifier or causal LM)")
    sp.add_argument("--open-clip", metavar="FILE", default=None, help="model-soups style CLIP fine-tune state dict")
    sp.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    sp.add_argument("--dtype", default="float32", choices=["float32", "float64", "auto"],
                    help="upcast the weights to this dtype on load (auto: keep the saved dtype; "
                    "half-precision weights cannot be perturbed)")


def _rho(text: str):
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: a positive number or 'auto'") from None


def _parser() -> _Parser:
    ap = _Parser(prog="hideseek", description=__doc__, formatter_class=_Formatter)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{sharpness,symmetries}")
    sp = sub.add_parser("sharpness", help="geodesic or adaptive sharpness of a model on a data file",
                        description="Geodesic or adaptive sharpness of a saved model on a data file.",
                        epilog=DATA_FORMAT + RHO_HELP, formatter_class=_Formatter)
    _add_model_args(sp)
    sp.add_argument("--data", required=True, help=".pt (torch.save) or .npz file with inputs and labels "
                    "(format below)")
    sp.add_argument("--batch-size", type=int, default=128, help="examples per batch")
    sp.add_argument("--max-batches", type=int, default=None, help="use at most this many batches (default: all)")
    sp.add_argument("--measure", default="geodesic",
                    help="a measure name or alias: " + ", ".join(["geodesic", "adaptive"] + [
                        m.name for m in Measure.all()]) + " (geodesic = geodesic_invariant); "
                    "--metric/--norm/--no-christoffel/--eps/--p change that measure's fields")
    sp.add_argument("--metric", default=None, choices=list(metric_names()),
                    help="pair metric (geodesic measures only; default: the measure's own)")
    sp.add_argument("--rho", type=_rho, required=True,
                    help="radius of the ball, or 'auto': suggested by --rho-rule (see 'choosing rho' below)")
    sp.add_argument("--rho-rule", default="loss", choices=["loss", "correction"],
                    help="rule of --rho auto: 'loss' (sharpness = --rho-increase x the loss) or 'correction' "
                    "(largest rho whose second-order correction stays below the warning bound)")
    sp.add_argument("--rho-increase", type=float, default=0.1,
                    help="--rho auto with --rho-rule loss: the loss increase to reach, as a fraction of the loss")
    sp.add_argument("--n-iters", type=int, default=20, help="Auto-PGD iterations per batch")
    sp.add_argument("--norm", choices=["riemannian", "adaptive"], default=None,
                    help="ball of a geodesic measure (adaptive: the Christoffel-only ablation; "
                    "default: the measure's own)")
    sp.add_argument("--no-christoffel", action="store_true", help="straight steps (ablation)")
    sp.add_argument("--eps", type=float, default=None,
                    help="epsilon relaxation (geodesic measures only; default: the measure's own)")
    sp.add_argument("--p", default=None, choices=["l2", "linf"],
                    help="l2 or linf (adaptive only; default: the measure's own)")
    sp.add_argument("--seed", type=int, default=0, help="seeds random starts and average-case draws")
    sp.add_argument("--autocast", choices=["bfloat16", "float16"], default=None,
                    help="forward/backward passes in this dtype (float32 models; geometry stays float32; "
                    "default: full precision)")
    sp.add_argument("--out", default=None, help="write the result as JSON here (checked before computing)")
    sp.add_argument("--quiet", action="store_true",
                    help="no progress bar and no messages: only the result line (errors still go to stderr)")
    sy = sub.add_parser("symmetries", help="list the GL(h) pairs hideseek finds in a model",
                        description="List the GL(h) attention pairs and GL(r) LoRA pairs hideseek finds.",
                        formatter_class=_Formatter)
    _add_model_args(sy)
    return ap


RHO_HELP = """
choosing rho:
  rho is not comparable across measures: adaptive l2 bounds the relative changes of all
  weights in squares (rms relative change rho/sqrt(d)), the invariant metric is scale-free
  in the same way per pair, the mixed metric scales with the weights' norms. --rho auto
  picks rho by --rho-rule on the first batch (hideseek.suggest_rho; docs/getting-started.md: Choosing ρ).
"""


def _symmetries(model) -> int:
    blocks = find_symmetries(model)
    if not blocks:
        print(f"no symmetry pairs found in {type(model).__name__}: it has no attention or LoRA adapter "
              "hideseek recognises (adaptive sharpness still applies; declare pairs with the Python API)")
        return 0
    for blk in blocks:
        for d in blk.describe():
            heads = f"{d['heads']:>3} heads × {d.get('group', 'GL(%d)' % d['head_width'])}"
            print(f"{d['module']:<60} {d['kind']:>4}  {heads}  "
                  f"G {d['G_shape'][0]}×{d['G_shape'][1]}  H {d['H_shape'][0]}×{d['H_shape'][1]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    try:
        args = ap.parse_args(argv)
    except _ArgumentError as err:
        return _fail(err)
    try:
        return _run(args)
    except (CLIError, SharpnessInputError, UnsupportedAttentionError, FileNotFoundError, ValueError) as err:
        return _fail(err)
    except Exception as err:  # noqa: BLE001 (the promise: one line, exit 2; the traceback on request)
        if os.environ.get("HIDESEEK_TRACEBACK"):
            raise
        return _fail(f"{type(err).__name__}: {err}")


def _run(args) -> int:
    # the measure, the data and --out first: reported before any (large) model is loaded
    measure = batches = None
    if args.cmd == "sharpness":
        if args.rho != "auto" and not args.rho > 0:
            raise CLIError(f"--rho must be a positive number or 'auto', got {args.rho}")
        if args.n_iters < 1:
            raise CLIError(f"--n-iters must be at least 1, got {args.n_iters}")
        measure = Measure.from_keywords(
            args.measure, metric=args.metric, norm=args.norm,
            christoffel=False if args.no_christoffel else None, eps=args.eps, p=args.p)
        batches = load_batches(args.data, args.batch_size, args.max_batches)
        _check_out(args.out)
    model = load_model(args)
    if args.cmd == "symmetries":
        return _symmetries(model)
    _check_data_fits(model, batches)
    rho = args.rho
    rho_choice: dict = {"rule": "given", "rho": rho}
    if rho == "auto":
        sug = suggest_rho(model, batches[:1], measure, rule=args.rho_rule, increase=args.rho_increase,
                          progress=not args.quiet)
        rho = sug.rho
        rho_choice = {"rule": sug.rule, "rho": rho, "target": sug.target, "achieved": sug.achieved,
                      "increase": args.rho_increase if sug.rule == "loss" else None, "batches": 1,
                      "trace": [list(t) for t in sug.trace]}
        if not args.quiet:
            print(f"rho={rho:.4g} chosen by suggest_rho (rule {args.rho_rule})")
    res = sharpness(model, batches, measure, rho=rho, n_iters=args.n_iters, seed=args.seed,
                    autocast=args.autocast, progress=not args.quiet)
    print(f"{res.name} (rho={rho:.6g}, {len(res.per_batch)} batches): {res.value:.6g}")
    if res.norm_share and not args.quiet:
        print("maximiser's squared norm by where it lies: "
              + ", ".join(f"{k} {v:.1%}" for k, v in res.norm_share.items()))
    if args.out:
        try:
            Path(args.out).write_text(json.dumps(_record(res, measure, rho_choice), indent=2, default=str))
        except OSError as err:
            raise CLIError(f"--out {args.out}: cannot write ({err.strerror or err})") from None
        if not args.quiet:
            print(f"wrote {args.out}")
    return 0


def _record(res, measure: Measure, rho_choice: dict) -> dict:
    """The JSON of ``--out``: the result, the library version, the measure and how ρ was
    chosen (``rho_choice``: ``rule`` ``"given"``, or suggest_rho's rule, target and trace)."""
    import hideseek
    return {**res.to_dict(), "hideseek_version": hideseek.__version__,
            "measure": {"name": measure.name, **measure.to_dict()}, "rho_choice": rho_choice}


def _fail(err) -> int:
    """One line on stderr, exit status 2."""
    msg = " ".join(str(err).split()) or type(err).__name__
    print(f"hideseek: error: {msg}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
