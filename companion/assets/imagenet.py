"""ImageNet for the model-soups CLIP fine-tunes.

Layout below the assets root (``data/paper``)::

    imagenet/train/<wnid>/*.JPEG       1,281,167 training images, 1000 classes
    imagenet/val/<wnid>/*.JPEG         50,000 validation images sorted into class folders
    imagenet/imagenet_98_idxs.npy      model soups' split mask over the training images

Images are indexed in torchvision ``ImageFolder`` order (class folders sorted,
files sorted within each), which is the order that ``imagenet_98_idxs.npy``
refers to: entry ``j`` is 1 when training image ``j`` is among the 2 % that
model soups held out, 0 when the models were fine-tuned on it.

* sharpness uses images the models were trained on: ``n_images`` (2048 in the
  paper) drawn without replacement, with a fixed seed, from the 98 % split,
  cut into batches of ``batch_size`` (256), every model seeing the same ones;
* the test error uses the validation set; the training error the 98 % split
  (or a seeded subset of it, :meth:`ImageNetAssets.error_indices`).

Preprocessing is CLIP's evaluation transform (:func:`clip_preprocess`):
bicubic resize of the shorter side to 224, centre crop 224 x 224, RGB,
normalisation with OpenAI's CLIP mean and standard deviation.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .manifest import AssetError, Manifest, check_assets, load_manifest

#: OpenAI CLIP's normalisation constants (also open_clip.OPENAI_DATASET_MEAN / _STD).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def clip_preprocess(image_size: int = 224):
    """CLIP's evaluation transform (PIL image -> normalised float tensor (3, size, size))."""
    import open_clip

    return open_clip.image_transform(image_size, is_train=False, mean=CLIP_MEAN, std=CLIP_STD)


class ImageNetAssets:
    """The ImageNet folders and the model-soups split.

    ``root``: the assets root (default ``data/paper`` from the manifest).
    ``manifest``: the manifest whose ``imagenet`` group is checked on construction
    (a :class:`~companion.assets.MissingAssetsError` lists what is missing).
    """

    def __init__(
        self,
        root: str | os.PathLike | None = None,
        *,
        image_size: int = 224,
        transform=None,
        manifest: Manifest | str | os.PathLike | None = None,
    ):
        man = manifest if isinstance(manifest, Manifest) else load_manifest(manifest)
        self.root = check_assets("imagenet", root=root, manifest=man)
        self.settings = man.settings.get("imagenet", {})
        self.train_dir = self.root / "imagenet" / "train"
        self.val_dir = self.root / "imagenet" / "val"
        self.mask_path = self.root / "imagenet" / "imagenet_98_idxs.npy"
        self.transform = transform if transform is not None else clip_preprocess(image_size)
        self._train = self._val = self._mask = None

    # ---------------------------------------------------------------- datasets
    @property
    def train(self):
        """``ImageFolder`` over the training images (built on first use: lists 1.28M files)."""
        if self._train is None:
            from torchvision.datasets import ImageFolder

            self._train = ImageFolder(str(self.train_dir), transform=self.transform)
        return self._train

    @property
    def val(self):
        if self._val is None:
            from torchvision.datasets import ImageFolder

            self._val = ImageFolder(str(self.val_dir), transform=self.transform)
            if self._val.classes != self.train.classes:
                raise AssetError(
                    f"{self.val_dir}: class folders differ from {self.train_dir} "
                    f"({len(self._val.classes)} vs {len(self.train.classes)} classes)"
                )
        return self._val

    # ---------------------------------------------------------------- the 98 % / 2 % split
    @property
    def heldout_mask(self) -> np.ndarray:
        """Boolean mask over the training images: True = held out by model soups (2 %)."""
        if self._mask is None:
            try:
                raw = np.load(self.mask_path, allow_pickle=False)
            except Exception as err:
                raise AssetError(f"{self.mask_path}: not a numpy array file ({err})") from None
            raw = np.asarray(raw).reshape(-1)
            if not np.isin(raw, (0, 1)).all():
                raise AssetError(f"{self.mask_path}: expected only 0/1 entries, found {np.unique(raw)[:10]}")
            n = len(self.train)
            if raw.shape[0] != n:
                raise AssetError(
                    f"{self.mask_path} has {raw.shape[0]} entries but {self.train_dir} holds {n} images; "
                    "the mask indexes the full ILSVRC 2012 training set in ImageFolder order"
                )
            self._mask = raw.astype(bool)
        return self._mask

    def fit_indices(self) -> np.ndarray:
        """Indices of the 98 % of training images the models were fine-tuned on."""
        return np.flatnonzero(~self.heldout_mask)

    def heldout_indices(self) -> np.ndarray:
        """Indices of the 2 % held out (model soups' "ImageNet2p" minival)."""
        return np.flatnonzero(self.heldout_mask)

    def sharpness_indices(self, n_images: int | None = None, seed: int = 0) -> np.ndarray:
        """``n_images`` (default 2048) distinct indices from the 98 % split, fixed by ``seed``."""
        n = int(n_images if n_images is not None else self.settings.get("n_images", 2048))
        pool = self.fit_indices()
        if not 0 < n <= len(pool):
            raise ValueError(f"n_images={n}: must be between 1 and {len(pool)} (training images available)")
        return np.random.default_rng(seed).choice(pool, size=n, replace=False)

    def error_indices(self, split: str = "train", n_images: int | None = None, seed: int = 0) -> np.ndarray:
        """Images for an error estimate: ``train`` (the 98 %) or ``val``; all, or ``n_images`` of them."""
        if split == "train":
            pool = self.fit_indices()
        elif split == "val":
            pool = np.arange(len(self.val))
        else:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if n_images is None or n_images >= len(pool):
            return pool
        return np.sort(np.random.default_rng(seed).choice(pool, size=int(n_images), replace=False))

    # ---------------------------------------------------------------- batches
    def sharpness_batches(
        self, n_images: int | None = None, batch_size: int | None = None, seed: int = 0,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The sharpness data: a list of ``(images, labels)`` batches, loaded into memory.

        2048 images at 224 x 224 take 1.2 GB as float32; every model is
        evaluated on exactly these batches.
        """
        bs = int(batch_size if batch_size is not None else self.settings.get("batch_size", 256))
        idx = self.sharpness_indices(n_images, seed)
        return load_batches(self.train, idx, bs)

    def loader(self, split: str, indices: Sequence[int] | None = None, batch_size: int = 256,
               num_workers: int = 8, **kwargs):
        """A ``DataLoader`` over ``train``/``val`` (optionally a subset), in a fixed order."""
        from torch.utils.data import DataLoader, Subset

        ds = self.train if split == "train" else self.val if split == "val" else None
        if ds is None:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if indices is not None:
            ds = Subset(ds, [int(i) for i in indices])
        return DataLoader(ds, batch_size=batch_size, shuffle=False, num_workers=num_workers, **kwargs)


def load_batches(dataset, indices: Sequence[int], batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Read ``dataset[i]`` for ``i`` in ``indices`` (in that order) into stacked batches."""
    from tqdm.auto import tqdm

    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    batches = []
    for start in tqdm(range(0, len(indices), batch_size), desc="loading images", leave=False):
        items = [dataset[int(i)] for i in indices[start:start + batch_size]]
        x = torch.stack([it[0] for it in items])
        y = torch.tensor([int(it[1]) for it in items], dtype=torch.long)
        batches.append((x, y))
    return batches
