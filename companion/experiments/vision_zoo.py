"""Vision zoo (Figure 4, Table 1 row "ImageNet" analogue): small open_clip ViTs on 8x8 digits.

The paper measures 72 CLIP ViT-B/32 fine-tunes on ImageNet (model soups, Wortsman et al.,
2022): one contrastively pre-trained CLIP, fine-tuned on all of the same training data with
randomly drawn learning rate, weight decay, epochs, label smoothing, data augmentation and
mixup. The ``cpu`` analogue here follows that shape:

* **Data.** scikit-learn's 8x8 digits (1797 images, shipped inside the package, no
  download), split once by a fixed seed into a training pool and a test set. Pixels are
  scaled to [0, 1] and standardised with the pool's mean and standard deviation.
* **Model.** :class:`DigitsViT`, open_clip's own :class:`open_clip.transformer.VisionTransformer`
  (class token, learnable position embedding, ``ln_pre``, residual attention blocks with
  packed ``nn.MultiheadAttention``, ``ln_post``, projection ``proj``) with a one-channel
  patch embedding, followed, as in CLIP classifiers, by L2-normalised features, a fixed
  logit scale and a linear head.
* **Shared pre-trained start.** One seeded random initialisation, pre-trained once
  *contrastively* (SimCLR-style: two augmented views of every pool image, InfoNCE on the
  normalised image embeddings; no labels), as CLIP was pre-trained by a contrastive
  objective and not by the fine-tuning task. The classifier head then starts as the
  normalised class centroids of the pre-trained embeddings over the pool (a stand-in for
  CLIP's zero-shot text head). ``pretrain.objective: supervised`` keeps the older,
  labelled pre-training on a fixed part of the pool instead. Every member is fine-tuned
  from this one checkpoint.
* **Fine-tuning.** Every member trains on the *whole* pool (no subsets, no label noise)
  and draws learning rate, weight decay, epochs, batch size, label smoothing,
  augmentation (random pixel shifts, Gaussian input noise) and mixup (with probability
  ``p_mixup``, Beta(alpha, alpha) mixing with ``alpha`` drawn from its range); AdamW with
  a cosine schedule.
* **Sharpness set.** The first ``n_sharpness`` pool images (of the fixed permutation):
  training images with their labels, the same for every member.
* **Gap.** test error - train error, the train error over the whole pool (unaugmented,
  unmixed).

``python -m companion.experiments.vision_zoo train --out data/zoos/vision`` trains a zoo
from the ``vision_train`` section of ``params.yaml`` and writes ``init.pt`` (the shared
checkpoint), ``model_XXX.pt`` (one state dict per member) and ``zoo.json``; with a
``stability`` block it also trains ``stability.n_zoos`` smaller zoos into
``stability/zoo_J`` (their own pre-training and fine-tuning seeds, the same recipe), for
the spread of tau over zoo seeds.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from open_clip.transformer import VisionTransformer
from torch import nn
from tqdm.auto import tqdm

from companion import paper

STAGE = "vision_train"
IMAGE_SIZE = 8
N_CLASSES = 10


# --------------------------------------------------------------------------- data


@dataclass
class DigitsData:
    """Fixed split of the digits: pool (training candidates) and test set, standardised."""

    x_pool: torch.Tensor  # (N_pool, 1, 8, 8) float32
    y_pool: torch.Tensor  # (N_pool,) int64
    x_test: torch.Tensor
    y_test: torch.Tensor
    mean: float
    std: float

    @property
    def background(self) -> float:
        """Standardised value of a blank (zero) pixel, used to pad shifted images."""
        return (0.0 - self.mean) / self.std


def load_digits_split(split_seed: int = 0, n_test: int = 497) -> DigitsData:
    """The 1797 digits, permuted by ``split_seed``; the last ``n_test`` are the test set."""
    from sklearn.datasets import load_digits

    d = load_digits()
    n = len(d.target)
    if not 0 < n_test < n:
        raise ValueError(f"n_test must be in (0, {n}), got {n_test}")
    perm = np.random.default_rng(split_seed).permutation(n)
    images = d.images[perm].astype(np.float64) / 16.0
    labels = d.target[perm].astype(np.int64)
    pool, test = slice(0, n - n_test), slice(n - n_test, n)
    mean, std = float(images[pool].mean()), float(images[pool].std())
    x = torch.tensor((images - mean) / std, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(labels)
    return DigitsData(x[pool], y[pool], x[test], y[test], mean, std)


def sharpness_batches(data: DigitsData, n_images: int, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed sharpness set (first ``n_images`` of the pool, true labels) in batches."""
    if n_images > len(data.y_pool):
        raise ValueError(f"n_images={n_images} exceeds the pool of {len(data.y_pool)} images")
    if n_images % batch_size:
        raise ValueError(f"n_images={n_images} is not a multiple of batch_size={batch_size}")
    return [
        (data.x_pool[i : i + batch_size].clone(), data.y_pool[i : i + batch_size].clone())
        for i in range(0, n_images, batch_size)
    ]


# --------------------------------------------------------------------------- model


class DigitsViT(nn.Module):
    """open_clip ``VisionTransformer`` for 1x8x8 images + CLIP-style classifier head.

    ``logits = logit_scale * head(normalize(visual(x)))``; ``logit_scale`` is a fixed
    buffer (not a parameter), so all parameters sit in the transformer or the head.
    """

    def __init__(self, width: int = 32, layers: int = 2, heads: int = 4, patch_size: int = 2,
                 mlp_ratio: float = 2.0, embed_dim: int = 32, logit_scale: float = 10.0):
        super().__init__()
        if IMAGE_SIZE % patch_size:
            raise ValueError(f"patch_size {patch_size} does not divide {IMAGE_SIZE}")
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}")
        self.config = dict(width=width, layers=layers, heads=heads, patch_size=patch_size,
                           mlp_ratio=mlp_ratio, embed_dim=embed_dim, logit_scale=logit_scale)
        self.visual = VisionTransformer(
            image_size=IMAGE_SIZE, patch_size=patch_size, width=width, layers=layers, heads=heads,
            mlp_ratio=mlp_ratio, output_dim=embed_dim,
        )
        # digits are greyscale: a one-channel patch embedding (open_clip's is RGB)
        self.visual.conv1 = nn.Conv2d(1, width, kernel_size=patch_size, stride=patch_size, bias=False)
        self.head = nn.Linear(embed_dim, N_CLASSES)
        self.register_buffer("logit_scale", torch.tensor(float(logit_scale)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = F.normalize(self.visual(x), dim=-1)
        return self.logit_scale * self.head(features)


def build_model(config: Mapping[str, Any], seed: int) -> DigitsViT:
    """A :class:`DigitsViT` with its random initialisation drawn from ``seed``."""
    torch.manual_seed(seed)
    return DigitsViT(**config)


# --------------------------------------------------------------------------- training


def augment(x: torch.Tensor, shift: int, noise_std: float, background: float, gen: torch.Generator) -> torch.Tensor:
    """Random integer shifts of up to ``shift`` pixels per axis (blank-padded) and Gaussian noise."""
    if shift > 0:
        b = x.shape[0]
        padded = F.pad(x, (shift, shift, shift, shift), value=background)
        dy = torch.randint(0, 2 * shift + 1, (b,), generator=gen)
        dx = torch.randint(0, 2 * shift + 1, (b,), generator=gen)
        ar = torch.arange(IMAGE_SIZE)
        rows = (dy[:, None] + ar)[:, :, None].to(x.device)
        cols = (dx[:, None] + ar)[:, None, :].to(x.device)
        x = padded[torch.arange(b, device=x.device)[:, None, None], 0, rows, cols].unsqueeze(1)
    if noise_std > 0:
        x = x + noise_std * torch.randn(x.shape, generator=gen).to(x.device)
    return x


@torch.no_grad()
def error_rate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> float:
    model.eval()
    wrong = 0
    for i in range(0, len(y), batch_size):
        wrong += (model(x[i : i + batch_size]).argmax(-1) != y[i : i + batch_size]).sum().item()
    return wrong / len(y)


def mixup_batch(x: torch.Tensor, y: torch.Tensor, lam: float, perm: torch.Tensor):
    """Mixup (Zhang et al., 2018): ``lam * x + (1 - lam) * x[perm]``; returns ``(x_mixed, y, y[perm])``."""
    return lam * x + (1.0 - lam) * x[perm], y, y[perm]


def mixup_loss(logits: torch.Tensor, y_a: torch.Tensor, y_b: torch.Tensor, lam: float,
               label_smoothing: float = 0.0) -> torch.Tensor:
    """Cross-entropy against the mixed (and smoothed) targets: ``lam * CE(y_a) + (1 - lam) * CE(y_b)``."""
    return (lam * F.cross_entropy(logits, y_a, label_smoothing=label_smoothing)
            + (1.0 - lam) * F.cross_entropy(logits, y_b, label_smoothing=label_smoothing))


def fit(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, lr: float, weight_decay: float, epochs: int,
        batch_size: int, label_smoothing: float = 0.0, shift: int = 0, noise_std: float = 0.0,
        mixup_alpha: float = 0.0, background: float = 0.0, seed: int = 0) -> nn.Module:
    """AdamW with a cosine learning-rate decay over all steps; deterministic given ``seed``.

    ``mixup_alpha > 0``: every batch is mixed with a permutation of itself, the weight
    drawn from Beta(alpha, alpha) (:func:`mixup_batch`, :func:`mixup_loss`).
    """
    gen = torch.Generator().manual_seed(seed)
    beta = np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    n = len(y)
    steps_per_epoch = math.ceil(n / batch_size)
    total = max(1, epochs * steps_per_epoch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n, batch_size):
            idx = perm[i : i + batch_size].to(x.device)
            xb = augment(x[idx], shift, noise_std, background, gen)
            if mixup_alpha > 0:
                lam = float(beta.beta(mixup_alpha, mixup_alpha))
                xb, ya, yb = mixup_batch(xb, y[idx], lam, torch.randperm(len(idx), generator=gen).to(x.device))
                loss = mixup_loss(model(xb), ya, yb, lam, label_smoothing)
            else:
                loss = F.cross_entropy(model(xb), y[idx], label_smoothing=label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    model.eval()
    return model


def _loguniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


#: Fine-tuning ranges that belong to the older label-noise / subset design, rejected now.
_DROPPED = ("subset_size", "label_noise", "p_label_noise")


def sample_hparams(rng: np.random.Generator, ranges: Mapping[str, Any]) -> dict:
    """One member's fine-tuning hyperparameters drawn from ``ranges`` (see ``params.yaml``).

    lr and weight decay log-uniform; epochs uniform integers; batch size and shift a choice;
    label smoothing uniform; input noise with probability ``p_input_noise`` (std uniform in
    ``noise_std``), mixup with probability ``p_mixup`` (alpha uniform in ``mixup_alpha``).
    """
    old = [k for k in _DROPPED if k in ranges]
    if old:
        raise ValueError(f"ranges {old} are no longer supported: every member trains on the whole pool, "
                         "without label noise (model-soups design)")
    missing = [k for k in ("lr", "weight_decay", "epochs", "batch_size", "label_smoothing", "shift", "noise_std")
               if k not in ranges]
    if missing:
        raise ValueError(f"ranges lack {missing}")
    noise_p = float(ranges.get("p_input_noise", 0.5))
    mixup_p = float(ranges.get("p_mixup", 0.0))
    hp = dict(
        lr=_loguniform(rng, *ranges["lr"]),
        weight_decay=_loguniform(rng, *ranges["weight_decay"]),
        epochs=int(rng.integers(ranges["epochs"][0], ranges["epochs"][1] + 1)),
        batch_size=int(rng.choice(ranges["batch_size"])),
        label_smoothing=float(rng.uniform(*ranges["label_smoothing"])),
        shift=int(rng.choice(ranges["shift"])),
        noise_std=float(rng.uniform(*ranges["noise_std"])) if rng.uniform() < noise_p else 0.0,
        mixup_alpha=float(rng.uniform(*ranges["mixup_alpha"])) if rng.uniform() < mixup_p else 0.0,
    )
    return hp


def _on(data: DigitsData, device: str) -> DigitsData:
    return DigitsData(data.x_pool.to(device), data.y_pool.to(device), data.x_test.to(device),
                      data.y_test.to(device), data.mean, data.std)


def train_member(init_state: Mapping[str, torch.Tensor], config: Mapping[str, Any], data: DigitsData,
                 hp: Mapping[str, Any], n_sharpness: int, seed: int, device: str = "cpu") -> tuple[DigitsViT, dict]:
    """Fine-tune one member from the shared checkpoint on the whole pool; returns the model (on the CPU) and its record."""
    model = DigitsViT(**config)
    model.load_state_dict(init_state)
    model.to(device)
    data = _on(data, device)
    t0 = time.perf_counter()
    fit(model, data.x_pool, data.y_pool, lr=hp["lr"], weight_decay=hp["weight_decay"], epochs=hp["epochs"],
        batch_size=hp["batch_size"], label_smoothing=hp["label_smoothing"], shift=hp["shift"],
        noise_std=hp["noise_std"], mixup_alpha=hp.get("mixup_alpha", 0.0), background=data.background, seed=seed)
    seconds = time.perf_counter() - t0
    train_error = error_rate(model, data.x_pool, data.y_pool)
    test_error = error_rate(model, data.x_test, data.y_test)
    record = dict(
        hparams=dict(hp), seed=seed, n_train=len(data.y_pool),
        train_error=train_error,
        sharpness_set_error=error_rate(model, data.x_pool[:n_sharpness], data.y_pool[:n_sharpness]),
        test_error=test_error,
        gap=test_error - train_error,
        train_seconds=seconds,
    )
    return model.cpu(), record


def info_nce(z1: torch.Tensor, z2: torch.Tensor, temperature: float) -> torch.Tensor:
    """SimCLR's NT-Xent: each of the 2B normalised embeddings must pick its other view among the other 2B - 1."""
    z = F.normalize(torch.cat([z1, z2]), dim=-1)
    b = len(z1)
    sim = z @ z.T / temperature
    sim = sim.masked_fill(torch.eye(2 * b, dtype=torch.bool, device=z.device), float("-inf"))
    target = torch.cat([torch.arange(b, 2 * b), torch.arange(0, b)]).to(z.device)
    return F.cross_entropy(sim, target)


@torch.no_grad()
def centroid_head(model: DigitsViT, x: torch.Tensor, y: torch.Tensor) -> None:
    """Set the head to the normalised class centroids of the normalised embeddings, bias 0."""
    model.eval()
    feats = F.normalize(model.visual(x), dim=-1)
    cents = torch.stack([feats[y == c].mean(0) for c in range(N_CLASSES)])
    model.head.weight.copy_(F.normalize(cents, dim=-1))
    model.head.bias.zero_()


def pretrain_contrastive(model: DigitsViT, x: torch.Tensor, *, epochs: int, lr: float, weight_decay: float,
                         batch_size: int, temperature: float, shift: int, noise_std: float, background: float,
                         seed: int) -> list[float]:
    """SimCLR-style pre-training of ``model.visual`` on unlabelled images; returns the mean loss per epoch."""
    gen = torch.Generator().manual_seed(seed)
    params = list(model.visual.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    n = len(x)
    total = max(1, epochs * math.ceil(n / batch_size))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    losses = []
    model.train()
    for _ in range(epochs):
        perm, run = torch.randperm(n, generator=gen), []
        for i in range(0, n - 1, batch_size):
            xb = x[perm[i : i + batch_size].to(x.device)]
            if len(xb) < 2:
                continue
            v1 = augment(xb, shift, noise_std, background, gen)
            v2 = augment(xb, shift, noise_std, background, gen)
            loss = info_nce(model.visual(v1), model.visual(v2), temperature)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            run.append(loss.item())
        losses.append(float(np.mean(run)))
    model.eval()
    return losses


def pretrain(config: Mapping[str, Any], data: DigitsData, pre: Mapping[str, Any], seed: int,
             device: str = "cpu") -> tuple[DigitsViT, dict]:
    """The shared checkpoint from a seeded random init.

    ``pre["objective"]`` ``"contrastive"`` (default): :func:`pretrain_contrastive` on the
    whole pool without labels, then :func:`centroid_head`. ``"supervised"``: cross-entropy
    on a fixed part of the pool (``n_images``) with the labels (the older design).
    """
    model = build_model(config, seed).to(device)
    data = _on(data, device)
    objective = str(pre.get("objective", "contrastive"))
    epochs = int(pre.get("epochs", 0))
    record: dict[str, Any] = dict(objective=objective, epochs=epochs)
    if objective == "contrastive":
        if epochs > 0:
            record["loss"] = pretrain_contrastive(
                model, data.x_pool, epochs=epochs, lr=float(pre["lr"]), weight_decay=float(pre["weight_decay"]),
                batch_size=int(pre["batch_size"]), temperature=float(pre.get("temperature", 0.2)),
                shift=int(pre.get("shift", 1)), noise_std=float(pre.get("noise_std", 0.3)),
                background=data.background, seed=seed)
        record["n_images"] = len(data.y_pool)
        centroid_head(model, data.x_pool, data.y_pool)
    elif objective == "supervised":
        n = int(pre.get("n_images", 0))
        record["n_images"] = n
        if n > 0 and epochs > 0:
            idx = np.sort(np.random.default_rng(seed).permutation(len(data.y_pool))[:n])
            sel = torch.as_tensor(idx, device=device)
            fit(model, data.x_pool[sel], data.y_pool[sel], lr=float(pre["lr"]), weight_decay=float(pre["weight_decay"]),
                epochs=epochs, batch_size=int(pre["batch_size"]), seed=seed)
            record["indices"] = idx.tolist()
    else:
        raise ValueError(f"pretrain.objective must be 'contrastive' or 'supervised', got {objective!r}")
    record["test_error"] = error_rate(model, data.x_test, data.y_test)
    record["pool_error"] = error_rate(model, data.x_pool, data.y_pool)
    return model.cpu(), record


# --------------------------------------------------------------------------- zoo


def train_zoo(out: str | Path, params: Mapping[str, Any], *, progress: bool = True, desc: str = "vision zoo") -> dict:
    """Train the zoo described by ``params`` (a resolved ``vision_train`` section) into ``out``.

    The pre-training seed is ``seed``, member ``i``'s fine-tuning seed ``seed * 100003 + i + 1``
    and the hyperparameters are drawn from ``numpy.random.default_rng(seed)``. A
    ``stability`` block (``n_zoos``, ``n_models``, ``seeds``) is trained by
    :func:`train_stability`, not here.
    """
    from hideseek.utils import set_threads

    set_threads(params.get("threads"))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    seed = int(params["seed"])
    config = dict(params["model"])
    n_sharp = int(params["n_sharpness"])
    data = load_digits_split(int(params.get("split_seed", 0)), int(params["n_test"]))
    if n_sharp > len(data.y_pool):
        raise ValueError(f"n_sharpness={n_sharp} exceeds the pool of {len(data.y_pool)} images")
    t0 = time.perf_counter()
    device = str(params.get("device", "cpu"))
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} requested but CUDA is not available; use the cpu profile")
    init_model, pre_record = pretrain(config, data, params.get("pretrain", {}), seed, device)
    pre_record["seconds"] = time.perf_counter() - t0
    init_state = {k: v.clone() for k, v in init_model.state_dict().items()}
    torch.save(init_state, out / "init.pt")

    rng = np.random.default_rng(seed)
    n_models = int(params["n_models"])
    members = []
    bar = tqdm(range(n_models), desc=desc, unit="model", disable=not progress)
    for i in bar:
        hp = sample_hparams(rng, params["ranges"])
        model, record = train_member(init_state, config, data, hp, n_sharp, seed=seed * 100_003 + i + 1, device=device)
        name = f"model_{i:03d}"
        torch.save(model.state_dict(), out / f"{name}.pt")
        members.append(dict(name=name, file=f"{name}.pt", **record))
        bar.set_postfix(train=f"{record['train_error']:.3f}", test=f"{record['test_error']:.3f}")
    params = {k: v for k, v in params.items() if k != "stability"}
    meta = dict(
        kind="vision", model=config, n_sharpness=n_sharp, split_seed=int(params.get("split_seed", 0)),
        n_test=int(params["n_test"]), n_pool=len(data.y_pool), seed=seed, params=json.loads(json.dumps(params)),
        pretrain=pre_record, init="init.pt", members=members,
        seconds=time.perf_counter() - t0,
    )
    with open(out / "zoo.json", "w") as fh:
        json.dump(meta, fh, indent=1)
    return meta


STABILITY_DIR = "stability"


def stability_specs(params: Mapping[str, Any]) -> list[tuple[str, dict]]:
    """``[(folder name, vision_train params), ...]`` of the stability zoos of ``params``.

    Each is the main recipe with ``n_models = stability.n_models`` and its own ``seed``
    (pre-training, fine-tuning and hyperparameter draws all follow it); the seeds must
    differ from each other and from the main zoo's.
    """
    st = params.get("stability")
    if not st:
        return []
    seeds = [int(s) for s in st["seeds"]]
    if len(set(seeds)) != len(seeds) or int(params["seed"]) in seeds:
        raise ValueError(f"stability seeds {seeds} must be distinct and differ from the main seed {params['seed']}")
    base = {k: v for k, v in params.items() if k != "stability"}
    return [(f"zoo_{s}", dict(base, seed=s, n_models=int(st["n_models"]))) for s in seeds]


def train_stability(out: str | Path, params: Mapping[str, Any], *, progress: bool = True) -> list[dict]:
    """Train the stability zoos of ``params`` (:func:`stability_specs`) into ``out/stability/zoo_<seed>``."""
    metas = []
    for name, p in stability_specs(params):
        metas.append(train_zoo(Path(out) / STABILITY_DIR / name, p, progress=progress, desc=f"stability {name}"))
    return metas


def load_zoo(path: str | Path, device: str = "cpu") -> tuple[dict, list[tuple[str, Any]]]:
    """``(meta, [(name, loader), ...])`` for a zoo folder; each loader returns an eval-mode model on ``device``."""
    path = Path(path)
    meta_file = path / "zoo.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{meta_file} not found; train the zoo first "
                                f"(python -m companion.experiments.vision_zoo train --out {path})")
    with open(meta_file) as fh:
        meta = json.load(fh)
    if meta.get("kind") == "clip_soups":  # the paper's model-soups CLIP fine-tunes (profile paper)
        from companion.experiments.paper_zoos import clip_soups_loaders

        return meta, clip_soups_loaders(meta, device)

    return meta, [(m["name"], functools.partial(load_member, dict(meta["model"]), str(path / m["file"]), device))
                  for m in meta["members"]]


def load_member(config: Mapping[str, Any], file: str | Path, device: str = "cpu") -> "DigitsViT":
    """One member's eval-mode model (module level, so that its partial pickles for measure_zoo's workers)."""
    model = DigitsViT(**config)
    model.load_state_dict(torch.load(file, map_location="cpu", weights_only=True))
    return model.to(device).eval()


def zoo_data(meta: Mapping[str, Any]) -> DigitsData:
    """The data split a zoo was trained on."""
    return load_digits_split(int(meta["split_seed"]), int(meta["n_test"]))


def members_frame(meta: Mapping[str, Any]):
    """One row per member: name, errors, gap and the hyperparameters as columns."""
    import pandas as pd

    rows = []
    for m in meta["members"]:
        row = {k: v for k, v in m.items() if k != "hparams"}
        row.update(m.get("hparams", {}))
        rows.append(row)
    return pd.DataFrame(rows).set_index("name")


# --------------------------------------------------------------------------- sharpness

#: Kendall tau of Figure 4 / Table 1 row "ImageNet" (72 CLIP ViT-B/32 fine-tunes).
PAPER_TAU = paper.table1_tau("vision")

#: The paper's protocol for the ImageNet zoo (Section 6.2.1), for the notebook's comparison.
PAPER_PROTOCOL = dict(paper.VISION_PROTOCOL)


@dataclass
class VisionResults:
    """Everything Figure 4 and Table 1 need from one vision zoo."""

    members: Any  # DataFrame, one row per model: errors, gap, hyperparameters
    frame: Any  # measure_zoo frame: model, measure, rho, value, per_batch, base_loss, seconds
    curves: Any  # tau vs rho over all models (and per half)
    table: Any  # split-half taus, one row per measure
    halves: dict  # model names of the selection and evaluation halves
    protocol: dict  # what was measured, how
    meta: dict  # zoo.json


def measure_vision_zoo(params: Mapping[str, Any], *, progress: bool = True) -> VisionResults:
    """Sharpness of every member of the zoo in ``params["zoo_dir"]`` and its tau tables.

    ``params`` (the ``vision`` section of ``params.yaml``): ``zoo_dir``, ``n_images`` and
    ``batch_size`` (the sharpness set), ``n_iters`` (Auto-PGD), ``rho_grid`` (a grid per
    measure), ``measures`` (optional subset of the standard three), ``seed`` (solver),
    ``split_seed`` (the halves), ``n_boot``, ``criterion`` and optionally ``threads`` and
    ``device`` (the batches follow the model's device).
    """
    import pandas as pd

    from companion.experiments.zoo import STANDARD_MEASURES, measure_zoo, split_half_taus, tau_vs_rho
    from hideseek.utils import set_threads

    set_threads(params.get("threads"))
    meta, models = load_zoo(params["zoo_dir"], device=str(params.get("device", "cpu")))
    n_images, batch_size = int(params["n_images"]), int(params["batch_size"])
    if meta.get("kind") == "clip_soups":  # the paper's zoo: ImageNet images of the 98 % training split
        from companion.experiments.paper_zoos import clip_soups_sharpness_batches

        batches = clip_soups_sharpness_batches(meta, n_images, batch_size, int(params.get("data_seed", 0)))
        n_parameters = int(meta["n_parameters"])
    elif n_images > meta["n_sharpness"]:
        raise ValueError(f"n_images={n_images} exceeds the zoo's sharpness set of {meta['n_sharpness']} images "
                         "(training images of every member); retrain with a larger n_sharpness")
    else:
        batches = sharpness_batches(zoo_data(meta), n_images, batch_size)
        n_parameters = sum(p.numel() for p in DigitsViT(**meta["model"]).parameters())
    names = params.get("measures") or list(STANDARD_MEASURES)
    unknown = [n for n in names if n not in STANDARD_MEASURES]
    if unknown:
        raise ValueError(f"unknown measures {unknown}; known: {list(STANDARD_MEASURES)}")
    measures = {n: STANDARD_MEASURES[n] for n in names}
    grid = params["rho_grid"]
    grid = {n: grid[n] for n in names} if isinstance(grid, Mapping) else grid
    t0 = time.perf_counter()
    frame = measure_zoo(models, batches, measures, grid, seed=int(params["seed"]),
                        n_iters=int(params["n_iters"]), progress=progress, workers=int(params.get("workers") or 1))
    seconds = time.perf_counter() - t0
    members = members_frame(meta)
    gaps = members["gap"]
    n_boot, split_seed = int(params.get("n_boot", 2000)), int(params.get("split_seed", 0))
    table, halves = split_half_taus(frame, gaps, seed=split_seed, n_boot=n_boot,
                                    criterion=params.get("criterion", "abs"), paper=PAPER_TAU)
    curves = pd.concat([
        tau_vs_rho(frame, gaps, n_boot=n_boot, seed=split_seed).assign(models="all"),
        tau_vs_rho(frame, gaps, n_boot=0, seed=split_seed, models=halves["select"]).assign(models="select"),
        tau_vs_rho(frame, gaps, n_boot=0, seed=split_seed, models=halves["eval"]).assign(models="eval"),
    ], ignore_index=True)
    timing = frame.groupby("measure", sort=False)["seconds"].agg(["mean", "sum"]).to_dict(orient="index")
    protocol = dict(n_models=len(members), n_images=n_images, batch_size=batch_size, n_batches=len(batches),
                    n_iters=int(params["n_iters"]), rho_grid=grid, seed=int(params["seed"]), split_seed=split_seed,
                    n_boot=n_boot, n_parameters=n_parameters,
                    model=meta["model"], seconds=seconds, seconds_per_measure=timing)
    return VisionResults(members, frame, curves, table, halves, protocol, meta)


def measure_stability(params: Mapping[str, Any], rho: Mapping[str, float], *, progress: bool = True):
    """Tau over the independently seeded stability zoos, each measure at a radius fixed in advance.

    ``params``: the ``vision`` section (``zoo_dir``, ``n_images``, ``batch_size``, ``n_iters``,
    ``seed``, ``n_boot``, ``split_seed``); ``rho``: one radius per measure (the vision stage
    passes the radius chosen on the main zoo's selection half, so nothing is selected on
    the stability zoos). Every zoo is measured on the same sharpness batches.

    Returns ``(taus, members, seconds)`` or ``None`` when ``zoo_dir`` has no stability zoos:
    ``taus`` one row per (zoo, measure) with ``zoo, seed, measure, rho, tau, ci_low,
    ci_high, pvalue, n``; ``members`` every member's errors, gap and sharpness
    (``sharpness_<measure>``) with its zoo.
    """
    import pandas as pd

    from companion.experiments.correlation import kendall_tau
    from companion.experiments.zoo import STANDARD_MEASURES, measure_zoo

    root = Path(params["zoo_dir"]) / STABILITY_DIR
    dirs = sorted(d for d in root.glob("zoo_*") if (d / "zoo.json").is_file()) if root.is_dir() else []
    if not dirs:
        return None
    unknown = set(rho) - set(STANDARD_MEASURES)
    if unknown:
        raise ValueError(f"unknown measures {sorted(unknown)}; known: {list(STANDARD_MEASURES)}")
    n_images, batch_size = int(params["n_images"]), int(params["batch_size"])
    n_boot, seed = int(params.get("n_boot", 2000)), int(params.get("split_seed", 0))
    rows, members, seconds = [], [], {}
    t_all = time.perf_counter()
    for d in dirs:
        meta, models = load_zoo(d, device=str(params.get("device", "cpu")))
        if n_images > meta["n_sharpness"]:
            raise ValueError(f"n_images={n_images} exceeds the sharpness set of {d} ({meta['n_sharpness']} images)")
        batches = sharpness_batches(zoo_data(meta), n_images, batch_size)
        t0 = time.perf_counter()
        frame = measure_zoo(models, batches, {m: STANDARD_MEASURES[m] for m in rho},
                            {m: [float(r)] for m, r in rho.items()}, seed=int(params["seed"]),
                            n_iters=int(params["n_iters"]), progress=progress,
                            workers=int(params.get("workers") or 1))
        seconds[d.name] = time.perf_counter() - t0
        mem = members_frame(meta)
        for m in rho:
            vals = frame[frame["measure"] == m].set_index("model")["value"].loc[mem.index]
            mem[f"sharpness_{m}"] = vals
            t = kendall_tau(vals.to_numpy(), mem["gap"].to_numpy(), n_boot=n_boot, seed=seed)
            rows.append(dict(zoo=d.name, seed=int(meta["seed"]), measure=m, rho=float(rho[m]), tau=t.tau,
                             ci_low=t.ci_low, ci_high=t.ci_high, pvalue=t.pvalue, n=t.n))
        members.append(mem.reset_index().assign(zoo=d.name, zoo_seed=int(meta["seed"]),
                                                zoo_training_seconds=meta["seconds"]))
    seconds["total"] = time.perf_counter() - t_all
    return pd.DataFrame(rows), pd.concat(members, ignore_index=True), seconds


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m companion.experiments.vision_zoo", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="train the zoo described by params.yaml's vision_train section")
    tr.add_argument("--out", default="data/zoos/vision", help="output folder (default: data/zoos/vision)")
    tr.add_argument("--params", default="params.yaml", help="parameter file (default: params.yaml)")
    tr.add_argument("--profile", default=None, help="profile (default: params.yaml's top-level profile)")
    tr.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a parameter (YAML value, dotted keys), e.g. --set n_models=3")
    tr.add_argument("--no-progress", action="store_true")
    tr.add_argument("--part", choices=("all", "main", "stability"), default="all",
                    help="train the main zoo, the stability zoos, or both (default; two processes may split the work)")
    args = parser.parse_args(argv)

    from companion.params import ParamsError, stage_params

    try:
        profile, params = stage_params(STAGE, args.profile, path=args.params)
        if not params:
            parser.error(f"{args.params} has no {STAGE}.{profile} section")
        params = stage_params(STAGE, profile, args.overrides, path=args.params)[1]
    except ParamsError as exc:
        parser.error(str(exc))
    if params.get("source") == "clip_soups":  # profile paper: describe the model-soups release, train nothing
        from companion.experiments.paper_zoos import cli_build

        return cli_build("clip_soups", args.out, params, progress=not args.no_progress)
    workers = int(params.pop("workers", None) or 1)  # not recorded in zoo.json: members do not depend on it
    child = None
    if workers >= 2 and args.part == "all" and stability_specs(params):
        # the stability zoos in a second process while this one trains the main zoo (each zoo is
        # trained exactly as alone: its own seeds, one thread); both must succeed
        import subprocess

        cmd = [sys.executable, "-m", "companion.experiments.vision_zoo", "train", "--out", str(args.out),
               "--params", str(args.params), "--part", "stability", "--no-progress"]
        cmd += ["--profile", profile] + [a for o in args.overrides for a in ("--set", o)]
        print("stability zoos in a second process:", " ".join(cmd), flush=True)
        child = subprocess.Popen(cmd)
        args.part = "main"
    try:
        if args.part in ("all", "main"):
            meta = train_zoo(args.out, params, progress=not args.no_progress)
            gaps = [m["gap"] for m in meta["members"]]
            train = [m["train_error"] for m in meta["members"]]
            print(f"trained {len(gaps)} models ({profile} profile) into {args.out} in {meta['seconds']:.0f} s; "
                  f"train error [{min(train):.3f}, {max(train):.3f}], gap [{min(gaps):.3f}, {max(gaps):.3f}]")
        if args.part in ("all", "stability"):
            for meta in train_stability(args.out, params, progress=not args.no_progress):
                print(f"stability zoo seed {meta['seed']}: {len(meta['members'])} models in {meta['seconds']:.0f} s")
    except BaseException:
        if child is not None:
            child.kill()
        raise
    if child is not None and child.wait() != 0:
        print(f"error: the stability zoos' process failed (exit {child.returncode})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
