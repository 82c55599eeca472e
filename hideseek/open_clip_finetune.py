"""open_clip image classifiers saved in the model-soups format: the model-soups CLIP fine-tunes (Wortsman et al. 2022) as image classifiers.

Each ``model_{i}.pt`` of the model-soups release is the ``state_dict()`` of a
wrapper around OpenAI's CLIP ViT-B/32: the CLIP model under the prefix
``model.`` (with its text transformer deleted before saving, while the other
text parameters, ``token_embedding``, ``positional_embedding``, ``ln_final``,
``text_projection`` and ``logit_scale``, remain) and a linear head
``classification_head`` (1000 x 512). The classifier is

    logits = W f / |f| + b,   f = CLIP image features (512-dimensional).

:func:`load_clip_finetune` rebuilds the image tower with open_clip (quick-GELU,
as in OpenAI's CLIP; no weights are downloaded), loads it with strict key and
shape matching, and returns a :class:`ClipClassifier` that holds only the
image tower and the head: the unused text parameters are checked and dropped,
so they take no part in a perturbation or a gradient.

Key layout (OpenAI CLIP and open_clip agree): ``visual.conv1.weight``
(width, 3, patch, patch), ``visual.class_embedding`` (width,),
``visual.positional_embedding`` (grid^2 + 1, width), ``visual.ln_pre.*``,
``visual.transformer.resblocks.{l}.{ln_1, attn.in_proj_weight (3 width, width;
rows Q | K | V), attn.in_proj_bias, attn.out_proj.*, ln_2, mlp.c_fc, mlp.c_proj}``,
``visual.ln_post.*``, ``visual.proj`` (width, output).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import nn


class CheckpointError(ValueError):
    """A checkpoint file is not the format or the architecture it should be."""


#: OpenAI CLIP ViT-B/32 image tower, as found in every model-soups checkpoint.
VIT_B32 = {"image_size": 224, "patch_size": 32, "width": 768, "layers": 12, "heads": 12, "output_dim": 512}
NUM_CLASSES = 1000

#: keys of the CLIP text side that a checkpoint may hold; they are checked and dropped.
TEXT_KEYS = ("token_embedding.weight", "positional_embedding", "ln_final.weight", "ln_final.bias",
             "text_projection", "logit_scale", "attn_mask")
TEXT_PREFIXES = ("transformer.",)
META_KEYS = ("input_resolution", "context_length", "vocab_size")  # only in OpenAI's JIT archives
HEAD_W, HEAD_B = "classification_head.weight", "classification_head.bias"


class ClipClassifier(nn.Module):
    """CLIP image tower + linear head on L2-normalised features: images -> logits."""

    def __init__(self, visual: nn.Module, feature_dim: int, num_classes: int):
        super().__init__()
        self.visual = visual
        self.classification_head = nn.Linear(feature_dim, num_classes)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        f = self.visual(images)
        return f / f.norm(dim=-1, keepdim=True)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classification_head(self.features(images))


def infer_vision_config(visual_sd: dict[str, torch.Tensor]) -> dict:
    """Read the image tower's architecture off its state dict (keys without ``visual.``)."""
    try:
        conv = visual_sd["conv1.weight"]
        pos = visual_sd["positional_embedding"]
        proj = visual_sd["proj"]
    except KeyError as err:
        raise CheckpointError(f"not a CLIP ViT image tower: no visual.{err.args[0]}") from None
    width, patch = conv.shape[0], conv.shape[-1]
    layers = len({k.split(".")[2] for k in visual_sd if k.startswith("transformer.resblocks.")})
    grid = round((pos.shape[0] - 1) ** 0.5)
    if grid * grid + 1 != pos.shape[0]:
        raise CheckpointError(f"visual.positional_embedding has {pos.shape[0]} rows, not grid^2 + 1")
    if width % 64:
        raise CheckpointError(f"image tower width {width} is not a multiple of the head width 64")
    mlp = visual_sd.get("transformer.resblocks.0.mlp.c_fc.weight")
    return {
        "image_size": grid * patch,
        "patch_size": patch,
        "width": width,
        "layers": layers,
        "heads": width // 64,  # OpenAI CLIP: heads = width / 64
        "output_dim": proj.shape[1],
        "mlp_ratio": (mlp.shape[0] / width) if mlp is not None else 4.0,
    }


def build_clip_classifier(vision: dict, num_classes: int, device: str | torch.device = "cpu") -> ClipClassifier:
    """An open_clip image tower of the given shape (random weights, nothing downloaded) + head.

    ``device="meta"`` builds it without allocating or initialising weights
    (for loading a checkpoint into it with ``load_state_dict(..., assign=True)``).
    """
    import open_clip

    vision_cfg = {
        "image_size": vision["image_size"],
        "patch_size": vision["patch_size"],
        "width": vision["width"],
        "layers": vision["layers"],
        "head_width": vision["width"] // vision["heads"],
        "mlp_ratio": vision.get("mlp_ratio", 4.0),
    }
    # The text tower is discarded below, so build a tiny one instead of CLIP's 38M-parameter one.
    tiny_text = {"context_length": 4, "vocab_size": 8, "width": 64, "heads": 1, "layers": 1}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    log = logging.getLogger()
    level = log.level
    log.setLevel(logging.ERROR)  # silence "No pretrained weights loaded" (intended)
    try:
        with torch.device(device):
            clip = open_clip.create_model(
                "ViT-B-32-quickgelu", pretrained=None, embed_dim=vision["output_dim"],
                vision_cfg=vision_cfg, text_cfg=tiny_text, device=device,
            )
            return ClipClassifier(clip.visual, vision["output_dim"], num_classes)
    finally:
        log.setLevel(level)


def split_state_dict(sd: dict) -> tuple[dict, dict, list[str]]:
    """(visual keys without ``visual.``, head keys, unknown keys) of a model-soups state dict."""
    visual, head, unknown = {}, {}, []
    for key, value in sd.items():
        k = key
        for prefix in ("module.", "model."):  # DataParallel, then the model-soups wrapper
            if k.startswith(prefix):
                k = k[len(prefix):]
        if k.startswith("visual."):
            visual[k[len("visual."):]] = value
        elif k in (HEAD_W, HEAD_B):
            head[k] = value
        elif k in TEXT_KEYS or k in META_KEYS or k.startswith(TEXT_PREFIXES):
            continue
        else:
            unknown.append(key)
    return visual, head, unknown


def load_clip_finetune(
    path: str | os.PathLike | dict,
    *,
    expect: dict | None = VIT_B32,
    num_classes: int | None = NUM_CLASSES,
    dtype: torch.dtype = torch.float32,
) -> ClipClassifier:
    """Load one model-soups checkpoint into a :class:`ClipClassifier` (eval mode).

    ``path``: a ``model_{i}.pt`` file (or its already-loaded state dict).
    ``expect``: the architecture the file must have (default ViT-B/32, the
    paper's); ``None`` accepts any CLIP ViT layout (used for small stand-ins).
    ``num_classes``: the head's expected number of classes (``None``: any).

    Raises :class:`CheckpointError` naming what does not match
    (missing, unexpected or mis-shaped keys, a different architecture).
    """
    name = "<state dict>" if isinstance(path, dict) else str(path)
    if isinstance(path, dict):
        sd = path
    else:
        if not Path(path).is_file():
            raise FileNotFoundError(f"no CLIP fine-tune at {path}")
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as err:  # a JIT archive, a pickled module, a truncated download, ...
            raise CheckpointError(f"{name}: cannot be read as a torch state dict ({type(err).__name__}: {err})") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{name}: expected a state dict of tensors, got {type(sd).__name__}")
    visual, head, unknown = split_state_dict(sd)
    if HEAD_W not in head or HEAD_B not in head:
        raise CheckpointError(
            f"{name}: not a model-soups fine-tune: no {HEAD_W} / {HEAD_B} "
            f"(first keys: {', '.join(list(sd)[:5])})"
        )
    if unknown:
        raise CheckpointError(f"{name}: unexpected keys {unknown[:10]}{' ...' if len(unknown) > 10 else ''}")
    vision = infer_vision_config(visual)
    feat = head[HEAD_W].shape[1]
    if feat != vision["output_dim"] or head[HEAD_B].shape != head[HEAD_W].shape[:1]:
        raise CheckpointError(
            f"{name}: head {tuple(head[HEAD_W].shape)} / {tuple(head[HEAD_B].shape)} does not fit "
            f"image features of size {vision['output_dim']}"
        )
    if expect is not None:
        diff = {k: (vision[k], v) for k, v in expect.items() if vision.get(k) != v}
        if diff:
            raise CheckpointError(f"{name}: not the expected architecture; (found, expected): {diff}")
    if num_classes is not None and head[HEAD_W].shape[0] != num_classes:
        raise CheckpointError(f"{name}: head has {head[HEAD_W].shape[0]} classes, expected {num_classes}")

    # Built on the meta device (no random initialisation of 88M weights), then given the file's tensors.
    model = build_clip_classifier(vision, head[HEAD_W].shape[0], device="meta")
    want = {f"visual.{k}": v for k, v in visual.items()} | head
    own = model.state_dict()
    missing = sorted(set(own) - set(want))
    extra = sorted(set(want) - set(own))
    shapes = [f"{k}: file {tuple(want[k].shape)} vs model {tuple(own[k].shape)}"
              for k in sorted(set(own) & set(want)) if own[k].shape != want[k].shape]
    if missing or extra or shapes:
        raise CheckpointError(
            f"{name}: does not match open_clip's image tower; missing {missing[:8]}, "
            f"unexpected {extra[:8]}, shape mismatches {shapes[:8]}"
        )
    model.load_state_dict({k: v.to(dtype).clone() for k, v in want.items()}, strict=True, assign=True)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise CheckpointError(f"{name}: tensors left without values after loading: {left[:8]}")
    return model.eval()
