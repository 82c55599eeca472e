"""Loaders for the paper's own checkpoints and data (the ``paper`` profile).

* :mod:`.manifest` — ``data/manifest.yaml``: which files, where, from where;
  :func:`check_assets` raises one :class:`MissingAssetsError` listing all that is missing.
* :mod:`.clip_soups` — model-soups CLIP ViT-B/32 fine-tunes -> ``nn.Module`` images -> logits.
* :mod:`.imagenet` — ImageNet folders, CLIP preprocessing, the 98 % / 2 % split, batches.
* :mod:`.tf_checkpoint` — a TensorFlow-free reader of TF checkpoints (tensor bundles).
* :mod:`.bert_mcoy` — McCoy et al.'s TF1 BERT checkpoints -> ``BertForSequenceClassification``.
* :mod:`.mnli` — MNLI pairs from GLUE TSV or MultiNLI JSONL, tokenised batches.

The loaders import open_clip / transformers only when first used, so
``python -m companion.assets check`` takes about 2 s (the ``hideseek`` package itself
imports torch).
"""
from __future__ import annotations

import importlib

from .manifest import (
    AssetError,
    MissingAsset,
    MissingAssetsError,
    check_assets,
    describe_manifest,
    find_missing,
    fingerprint,
    load_manifest,
    paper_settings,
)

_LAZY = {
    "load_clip_finetune": "clip_soups",
    "load_clip_soup": "clip_soups",
    "ClipClassifier": "clip_soups",
    "clip_preprocess": "imagenet",
    "ImageNetAssets": "imagenet",
    "read_tf_checkpoint": "tf_checkpoint",
    "TFCheckpointReader": "tf_checkpoint",
    "load_mccoy_bert": "bert_mcoy",
    "mccoy_tokenizer": "bert_mcoy",
    "bert_tokenizer": "bert_mcoy",
    "load_mnli": "mnli",
    "mnli_sharpness_batches": "mnli",
}

__all__ = [
    "AssetError",
    "MissingAsset",
    "MissingAssetsError",
    "check_assets",
    "describe_manifest",
    "find_missing",
    "fingerprint",
    "load_manifest",
    "paper_settings",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
