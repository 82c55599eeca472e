"""Models and batches for the benchmarks: random weights, float32, eval mode.

The cost of a sharpness measurement does not depend on what the weights are, only on the
architecture, the batch and the number of iterations, so every model here is freshly
initialised from a seed (nothing is downloaded).

=============  ============================================================================
name           architecture
=============  ============================================================================
``bert-base``  ``transformers.BertForSequenceClassification(BertConfig(num_labels=3))``:
               12 layers, width 768, 12 heads of 64 (the MNLI models of the paper)
``vit-b32``    open_clip ``ViT-B-32`` image tower (``pretrained=None``) + a linear head on
               the L2-normalised features, 1000 classes (the CLIP fine-tunes of the paper)
``minilm-shape`` a BERT of all-MiniLM-L6-v2's shape: 6 layers, width 384, 12 heads of 32,
               intermediate 1536 (22.7 M parameters; the memory benchmark)
``small-bert`` the ``cpu`` language zoo's BERT: 2 layers, width 64, 4 heads of 16,
               intermediate 256 (``companion.experiments.language_zoo.ModelSpec`` defaults)
``small-vit``  the ``cpu`` vision zoo's ViT: open_clip ``VisionTransformer`` on 1×8×8
               images, patch 2, width 32, 2 layers, 4 heads, then normalised features, a
               fixed logit scale and a 10-class head (``vision_zoo.DigitsViT`` defaults)
``glyph-vit``  the ``cpu`` vision zoo's model as it is now: ``vision_zoo.GlyphViT`` built from
               ``params.yaml`` (``vision_train``, cpu profile: 1×16×16 glyphs, patch 8, 2×32,
               4 heads), sharpness batches of 256 images
``nli-bert``   the ``cpu`` language zoo's model as it is now: ``language_zoo.bert_config`` from
               ``params.yaml`` (``language_train``, cpu profile: 4×64, 4 heads, intermediate
               128, vocabulary 51, 40 tokens), sharpness batches of 128 pairs
``tiny-bert``  2 layers, width 16, 4 heads: for the smoke test only
``tiny-vit``   open_clip ViT, width 16, 1 layer, 2 heads on 8×8: for the smoke test only
=============  ============================================================================

``small-bert`` and ``small-vit`` are built here and mirror the zoos' earlier architectures (the
benchmark history is measured on them); ``glyph-vit`` and ``nli-bert`` come from the companion's
own builders and settings (no trained zoo is needed), so they follow the zoos.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@dataclass(frozen=True)
class ModelSpec:
    """How to build one benchmark model and its default sizes per device."""

    name: str
    kind: str                      # "text" (batch × seq_len tokens) or "image"
    build: Callable[[], nn.Module]
    input_size: int                # vocabulary (text) or image side (image)
    channels: int = 3
    n_classes: int = 3
    # defaults: {"cpu": dict(batch_size=…, seq_len=…, n_iters=…, repeats=…), "cuda": {...}}
    defaults: dict | None = None
    description: str = ""


# ------------------------------------------------------------------------------- text
def _bert(**cfg) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(**cfg)
    config.num_labels = cfg.get("num_labels", 3)
    return BertForSequenceClassification(config)


def bert_base() -> nn.Module:
    return _bert(num_labels=3)


def small_bert() -> nn.Module:
    return _bert(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=256, max_position_embeddings=64, type_vocab_size=2,
                 pad_token_id=0, num_labels=3)


def minilm_shape() -> nn.Module:
    return _bert(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                 intermediate_size=1536, max_position_embeddings=512, num_labels=3)


def tiny_bert() -> nn.Module:
    return _bert(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=32, max_position_embeddings=16, num_labels=3)


# ------------------------------------------------------------------------------- LoRA
class LoraLinear(nn.Module):
    """peft's ``lora.Linear`` in miniature, ``base(x) + s · B A x``, with what hideseek
    recognises a peft layer by (``base_layer``, ``lora_A`` / ``lora_B`` ModuleDicts of
    bias-free Linears, a ``scaling`` dict): the adapter computes in its own dtype (float32 on
    a half-precision base, as peft's ``autocast_adapter_dtype`` makes it) and the sum is cast
    back to the base's dtype.  ``fresh``: B = 0, peft's default initialisation."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: float = 12.0, fresh: bool = False):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base.out_features, bias=False)})
        self.scaling = {"default": alpha / r}
        if fresh:
            nn.init.zeros_(self.lora_B["default"].weight)

    def forward(self, x):
        result = self.base_layer(x)
        a, b = self.lora_A["default"], self.lora_B["default"]
        return (result + b(a(x.to(a.weight.dtype))) * self.scaling["default"]).to(result.dtype)


def lora_llama(dtype: torch.dtype, fresh: bool = False, seed: int = 0, use_peft: bool | None = None) -> nn.Module:
    """A tiny grouped-query Llama (vocabulary 50, 2 layers of width 32, 4 query and 2
    key/value heads) with rank-4 LoRA adapters on its attention projections: the base frozen
    in ``dtype``, the adapters trainable in float32.  peft's own layers when peft is
    installed (``use_peft=None``), else :class:`LoraLinear`."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg).to(dtype).requires_grad_(False)
    torch.manual_seed(seed + 1)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    if use_peft is None:
        try:
            import peft  # noqa: F401
            use_peft = True
        except ImportError:
            use_peft = False
    if use_peft:
        import peft
        # init_lora_weights=True: B = 0 (peft's default); False: A and B random
        lcfg = peft.LoraConfig(r=4, lora_alpha=12, target_modules=list(targets), init_lora_weights=bool(fresh))
        return peft.get_peft_model(model, lcfg).eval()
    for layer in model.model.layers:
        att = layer.self_attn
        for name in targets:
            setattr(att, name, LoraLinear(getattr(att, name), fresh=fresh))
    return model.eval()


# ------------------------------------------------------------------------------ image
class ClipClassifier(nn.Module):
    """An open_clip image tower followed, as in CLIP classifiers, by L2-normalised features,
    a fixed logit scale and a linear head."""

    def __init__(self, visual: nn.Module, n_classes: int, logit_scale: float = 10.0):
        super().__init__()
        self.visual = visual
        self.head = nn.Linear(visual.output_dim, n_classes)
        self.register_buffer("logit_scale", torch.tensor(float(logit_scale)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logit_scale * self.head(F.normalize(self.visual(x), dim=-1))


def vit_b32() -> nn.Module:
    import open_clip

    clip = open_clip.create_model("ViT-B-32", pretrained=None)
    return ClipClassifier(clip.visual, 1000)


def _small_visual(width: int, layers: int, heads: int, embed_dim: int) -> nn.Module:
    from open_clip.transformer import VisionTransformer

    visual = VisionTransformer(image_size=8, patch_size=2, width=width, layers=layers,
                               heads=heads, mlp_ratio=2.0, output_dim=embed_dim)
    visual.conv1 = nn.Conv2d(1, width, kernel_size=2, stride=2, bias=False)  # greyscale
    return visual


def small_vit() -> nn.Module:
    return ClipClassifier(_small_visual(32, 2, 4, 32), 10)


def tiny_vit() -> nn.Module:
    return ClipClassifier(_small_visual(16, 1, 2, 8), 3)


def glyph_vit() -> nn.Module:
    from companion.experiments import vision_zoo

    return vision_zoo.build_model(vision_zoo.load_settings("cpu"))


#: words of the cpu language corpus's vocabulary (data/zoos/language/corpus/vocab.txt)
NLI_VOCAB = 51


def nli_bert() -> nn.Module:
    from transformers import BertForSequenceClassification

    from companion import params
    from companion.experiments import language_zoo

    spec = language_zoo.ZooSpec.from_params(params.stage_params("language_train", "cpu")[1])
    return BertForSequenceClassification(language_zoo.bert_config(spec, NLI_VOCAB, num_labels=3))


# ----------------------------------------------------------------------------- registry
# The paper's GPU protocol: BERT sharpness on 1024 MNLI pairs in batches of 128 (max
# length 128), CLIP on 2048 images in batches of 256, 20 Auto-PGD iterations.
MODELS: dict[str, ModelSpec] = {
    "bert-base": ModelSpec(
        "bert-base", "text", bert_base, 30522, n_classes=3,
        defaults={"cpu": dict(batch_size=2, seq_len=128, n_iters=2, repeats=1),
                  "cuda": dict(batch_size=128, seq_len=128, n_iters=20, repeats=3)},
        description="BertForSequenceClassification, BertConfig() defaults (12×768, 12 heads)"),
    "vit-b32": ModelSpec(
        "vit-b32", "image", vit_b32, 224, channels=3, n_classes=1000,
        defaults={"cpu": dict(batch_size=4, n_iters=2, repeats=1),
                  "cuda": dict(batch_size=256, n_iters=20, repeats=3)},
        description="open_clip ViT-B-32 image tower + linear head (12×768, 12 heads, 224², patch 32)"),
    "minilm-shape": ModelSpec(
        "minilm-shape", "text", minilm_shape, 30522, n_classes=3,
        defaults={"cpu": dict(batch_size=4, seq_len=32, n_iters=5, repeats=1),
                  "cuda": dict(batch_size=128, seq_len=128, n_iters=20, repeats=3)},
        description="random BERT of all-MiniLM-L6-v2's shape (6×384, 12 heads of 32), 22.7 M parameters"),
    "small-bert": ModelSpec(
        "small-bert", "text", small_bert, 512, n_classes=3,
        defaults={"cpu": dict(batch_size=64, seq_len=40, n_iters=20, repeats=3),
                  "cuda": dict(batch_size=128, seq_len=40, n_iters=20, repeats=5)},
        description="cpu language-zoo BERT (2×64, 4 heads of 16, intermediate 256)"),
    "small-vit": ModelSpec(
        "small-vit", "image", small_vit, 8, channels=1, n_classes=10,
        defaults={"cpu": dict(batch_size=64, n_iters=20, repeats=3),
                  "cuda": dict(batch_size=256, n_iters=20, repeats=5)},
        description="cpu vision-zoo ViT (open_clip blocks, 1×8×8, patch 2, 2×32, 4 heads of 8)"),
    "glyph-vit": ModelSpec(
        "glyph-vit", "image", glyph_vit, 16, channels=1, n_classes=10,
        defaults={"cpu": dict(batch_size=256, n_iters=20, repeats=3),
                  "cuda": dict(batch_size=256, n_iters=20, repeats=5)},
        description="the cpu vision zoo's GlyphViT (open_clip blocks, 1×16×16, patch 8, 2×32, 4 heads of 8)"),
    "nli-bert": ModelSpec(
        "nli-bert", "text", nli_bert, NLI_VOCAB, n_classes=3,
        defaults={"cpu": dict(batch_size=128, seq_len=40, n_iters=20, repeats=3),
                  "cuda": dict(batch_size=128, seq_len=40, n_iters=20, repeats=5)},
        description="the cpu language zoo's BERT (4×64, 4 heads of 16, intermediate 128, vocabulary 51)"),
    "tiny-bert": ModelSpec(
        "tiny-bert", "text", tiny_bert, 40, n_classes=3,
        defaults={"cpu": dict(batch_size=4, seq_len=6, n_iters=2, repeats=1),
                  "cuda": dict(batch_size=4, seq_len=6, n_iters=2, repeats=1)},
        description="smoke-test BERT (2×16, 4 heads of 4)"),
    "tiny-vit": ModelSpec(
        "tiny-vit", "image", tiny_vit, 8, channels=1, n_classes=3,
        defaults={"cpu": dict(batch_size=4, n_iters=2, repeats=1),
                  "cuda": dict(batch_size=4, n_iters=2, repeats=1)},
        description="smoke-test ViT (open_clip blocks, 1×16, 2 heads of 8)"),
}


def make_batches(spec: ModelSpec, batch_size: int, n_batches: int = 1, seq_len: int = 128,
                 seed: int = 0) -> list[tuple[Any, torch.Tensor]]:
    """Random ``(inputs, labels)`` batches of the right shape (seeded).  Text inputs are dicts
    with ``input_ids``, ``attention_mask`` (all ones: every token is real, the costly case) and
    ``token_type_ids``; images are standard normal."""
    if batch_size < 1 or n_batches < 1:
        raise ValueError("batch_size and n_batches must be >= 1")
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        y = torch.randint(0, spec.n_classes, (batch_size,), generator=g)
        if spec.kind == "text":
            ids = torch.randint(1, spec.input_size, (batch_size, seq_len), generator=g)
            x = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                 "token_type_ids": torch.zeros_like(ids)}
        else:
            s = spec.input_size
            x = torch.randn(batch_size, spec.channels, s, s, generator=g)
        out.append((x, y))
    return out


def build(name: str, seed: int = 0) -> nn.Module:
    """Model ``name`` with random weights drawn from ``seed``, float32, eval mode."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    torch.manual_seed(seed)
    return MODELS[name].build().float().eval()
