"""MNLI (Williams et al. 2018): training pairs and the matched development set.

Two file formats are read, whichever is present below ``data/paper/mnli``:

* GLUE's TSV files ``train.tsv`` and ``dev_matched.tsv`` (what McCoy et al.
  fine-tuned on): tab-separated with a header row, no quoting; the columns
  ``sentence1``, ``sentence2`` and the last one (``gold_label``) are used, as
  in google-research/bert's ``MnliProcessor``;
* MultiNLI 1.0's ``multinli_1.0_train.jsonl`` and
  ``multinli_1.0_dev_matched.jsonl``: one JSON object per line with
  ``sentence1``, ``sentence2``, ``gold_label``; pairs without a gold label
  (``"-"``, no annotator majority) are skipped, as GLUE did.

Labels are mapped to McCoy et al.'s order: 0 contradiction, 1 entailment,
2 neutral. Sharpness uses ``n_pairs`` (1024 in the paper) training pairs drawn
without replacement with a fixed seed, in batches of ``batch_size`` (128),
tokenised like run_classifier.py: ``[CLS] premise [SEP] hypothesis [SEP]``,
the longer sequence truncated first, padded to ``max_seq_length`` (128).
"""
from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from .manifest import AssetError, Manifest, check_assets, load_manifest

LABELS = ("contradiction", "entailment", "neutral")  # McCoy et al. / run_classifier.py order
LABEL2ID = {l: i for i, l in enumerate(LABELS)}
NO_LABEL = "-"

FILES = {
    "tsv": {"train": "train.tsv", "dev_matched": "dev_matched.tsv"},
    "jsonl": {"train": "multinli_1.0_train.jsonl", "dev_matched": "multinli_1.0_dev_matched.jsonl"},
}


@dataclass(frozen=True)
class NLIPair:
    premise: str
    hypothesis: str
    label: int          # index into LABELS
    pair_id: str = ""


def _label(raw: str, where: str) -> int | None:
    raw = raw.strip()
    if raw == NO_LABEL:
        return None
    if raw not in LABEL2ID:
        raise AssetError(f"{where}: unknown label {raw!r} (expected one of {LABELS} or '-')")
    return LABEL2ID[raw]


def read_glue_tsv(path: str | os.PathLike) -> list[NLIPair]:
    """Pairs of a GLUE MNLI TSV file (header row; sentence1, sentence2, label in the last column)."""
    csv.field_size_limit(1 << 24)
    pairs = []
    with open(path, encoding="utf-8", newline="") as f:
        rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(rows, None)
        if header is None:
            raise AssetError(f"{path}: empty file")
        try:
            s1, s2 = header.index("sentence1"), header.index("sentence2")
        except ValueError:
            raise AssetError(f"{path}: no sentence1/sentence2 columns in the header {header[:12]}") from None
        pid = header.index("pairID") if "pairID" in header else None
        for n, row in enumerate(rows, start=2):
            if len(row) != len(header):
                raise AssetError(f"{path}:{n}: {len(row)} columns, the header has {len(header)}")
            label = _label(row[-1], f"{path}:{n}")
            if label is not None:
                pairs.append(NLIPair(row[s1], row[s2], label, row[pid] if pid is not None else str(n)))
    return pairs


def read_multinli_jsonl(path: str | os.PathLike) -> list[NLIPair]:
    """Pairs of a MultiNLI 1.0 JSONL file (skipping those whose gold_label is '-')."""
    pairs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                label = _label(obj["gold_label"], f"{path}:{n}")
                if label is not None:
                    pairs.append(NLIPair(obj["sentence1"], obj["sentence2"], label, str(obj.get("pairID", n))))
            except (json.JSONDecodeError, KeyError) as err:
                raise AssetError(f"{path}:{n}: not a MultiNLI record ({type(err).__name__}: {err})") from None
    return pairs


def read_pairs(path: str | os.PathLike) -> list[NLIPair]:
    """Pairs of one MNLI file, by its suffix (``.tsv`` or ``.jsonl``)."""
    p = Path(path)
    if p.suffix == ".tsv":
        return read_glue_tsv(p)
    if p.suffix == ".jsonl":
        return read_multinli_jsonl(p)
    raise AssetError(f"{p}: expected a .tsv (GLUE) or .jsonl (MultiNLI) file")


@dataclass
class MNLIData:
    train: list[NLIPair]
    dev_matched: list[NLIPair]
    source: str  # "tsv" or "jsonl"


def load_mnli(
    root: str | os.PathLike | None = None,
    *,
    manifest: Manifest | str | os.PathLike | None = None,
    prefer: str = "tsv",
) -> MNLIData:
    """Training pairs and the matched development set, from whichever format is present."""
    man = manifest if isinstance(manifest, Manifest) else load_manifest(manifest)
    root = check_assets("mnli", root=root, manifest=man)
    folder = Path(root) / "mnli"
    order = [prefer] + [k for k in FILES if k != prefer]
    for fmt in order:
        paths = {split: folder / name for split, name in FILES[fmt].items()}
        if all(p.is_file() for p in paths.values()):
            return MNLIData(read_pairs(paths["train"]), read_pairs(paths["dev_matched"]), fmt)
    raise AssetError(f"{folder}: found neither {FILES['tsv']} nor {FILES['jsonl']}")  # unreachable after the check


def sharpness_indices(n_total: int, n_pairs: int = 1024, seed: int = 0) -> np.ndarray:
    """``n_pairs`` distinct indices into the training pairs, fixed by ``seed``."""
    if not 0 < n_pairs <= n_total:
        raise ValueError(f"n_pairs={n_pairs}: must be between 1 and {n_total}")
    return np.random.default_rng(seed).choice(n_total, size=n_pairs, replace=False)


def encode(pairs: Sequence[NLIPair], tokenizer, max_seq_length: int = 128) -> tuple[dict, torch.Tensor]:
    """One batch: ``({input_ids, token_type_ids, attention_mask}, labels)``, padded to ``max_seq_length``."""
    enc = tokenizer(
        [p.premise for p in pairs], [p.hypothesis for p in pairs],
        max_length=max_seq_length, padding="max_length", truncation="longest_first",
        return_tensors="pt", return_token_type_ids=True, return_attention_mask=True,
    )
    inputs = {k: enc[k] for k in ("input_ids", "token_type_ids", "attention_mask")}
    return inputs, torch.tensor([p.label for p in pairs], dtype=torch.long)


def mnli_sharpness_batches(
    train: Sequence[NLIPair], tokenizer, *, n_pairs: int = 1024, batch_size: int = 128,
    seed: int = 0, max_seq_length: int = 128,
) -> list[tuple[dict, torch.Tensor]]:
    """The sharpness data of the paper: ``n_pairs`` training pairs in batches of ``batch_size``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    idx = sharpness_indices(len(train), n_pairs, seed)
    return [encode([train[int(i)] for i in idx[s:s + batch_size]], tokenizer, max_seq_length)
            for s in range(0, len(idx), batch_size)]


def iter_batches(
    pairs: Sequence[NLIPair], tokenizer, *, batch_size: int = 128, max_seq_length: int = 128,
    indices: Sequence[int] | None = None,
) -> Iterator[tuple[dict, torch.Tensor]]:
    """All pairs (or ``indices`` of them) in order, tokenised batch by batch (for error rates)."""
    idx = range(len(pairs)) if indices is None else indices
    idx = list(idx)
    for s in range(0, len(idx), batch_size):
        yield encode([pairs[int(i)] for i in idx[s:s + batch_size]], tokenizer, max_seq_length)
