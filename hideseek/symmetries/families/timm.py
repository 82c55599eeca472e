"""timm's ViT ``Attention`` (packed ``qkv``), without QK-norm, scale-norm or gating.  Matched only
when timm is already imported."""
from __future__ import annotations

from torch import nn

from ..base import AttentionBlock, UnsupportedAttentionError
from ..declare import AttentionSpec
from .common import ModelInfo, check_qk_norm, class_in, not_identity
from .registry import Family, register_family


def _timm_block(name: str, mod: nn.Module, info: ModelInfo) -> AttentionBlock:
    check_qk_norm(name, mod)
    if not_identity(getattr(mod, "norm", None)):
        raise UnsupportedAttentionError(f"{name}: timm Attention(scale_norm=True) normalises the "
                                        "heads before the output projection, which breaks the GL(h) "
                                        "symmetry of its value/output pairs")
    if getattr(mod, "gate", None) is not None:
        raise UnsupportedAttentionError(f"{name}: timm Attention(gated=True) multiplies each head "
                                        "output elementwise by a gate, which breaks the GL(h) symmetry "
                                        "of its value/output pairs")
    return AttentionSpec(name, mod.num_heads, qkv="qkv", o="proj").bind(info.params)


register_family(Family("timm", priority=40, match=lambda mod: class_in(mod, "timm.layers.attention", "Attention"),
                       build=_timm_block))
