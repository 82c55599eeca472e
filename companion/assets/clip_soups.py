"""The model-soups release (Wortsman et al. 2022) as the paper used it: model ``i`` from
``<root>/clip_soups/model_{i}.pt``, checked against ``data/manifest.yaml``.  The format
itself is read by :mod:`hideseek.open_clip_finetune` (a library feature: the CLI loads such
files too)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from hideseek.open_clip_finetune import (NUM_CLASSES, VIT_B32, CheckpointError, ClipClassifier,  # noqa: F401
                                         build_clip_classifier, infer_vision_config,
                                         load_clip_finetune, split_state_dict)


def load_clip_soup(
    i: int,
    *,
    root: str | os.PathLike | None = None,
    manifest=None,
    dtype: torch.dtype = torch.float32,
) -> ClipClassifier:
    """Model ``i`` (0-71) of the model-soups release from ``<root>/clip_soups/model_{i}.pt``.

    Checks the file first (a :class:`~companion.assets.MissingAssetsError` names
    it and its origin when absent), then :func:`load_clip_finetune` with the
    ViT-B/32 and 1000-class expectations.
    """
    from .manifest import Manifest, check_assets, load_manifest

    man = manifest if isinstance(manifest, Manifest) else load_manifest(manifest)
    root = check_assets("clip_soups", root=root, manifest=man, select={"clip_soups": [int(i)]})
    return load_clip_finetune(Path(root) / "clip_soups" / f"model_{int(i)}.pt", dtype=dtype)
