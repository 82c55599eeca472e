"""open_clip's own ``Attention`` (packed ``in_proj``), without scaled cosine attention, QK norm,
an inner norm or head scaling.  Matched only when open_clip is already imported: a model cannot
hold an instance of a class whose module was never imported (and importing it costs seconds)."""
from __future__ import annotations

from torch import nn

from ..base import AttentionBlock, LinearRef, UnsupportedAttentionError
from .common import NO_GL, class_in, not_identity, qualified
from .registry import Family, register_family


def _openclip_block(name: str, mod: nn.Module) -> AttentionBlock:
    if getattr(mod, "logit_scale", None) is not None:
        raise UnsupportedAttentionError(f"{name}: scaled cosine attention normalises q and k, which {NO_GL}")
    if not_identity(getattr(mod, "ln_q", None)):
        raise UnsupportedAttentionError(f"{name}: QK normalisation {NO_GL}")
    if not_identity(getattr(mod, "ln_inner", None)):
        raise UnsupportedAttentionError(f"{name}: a norm between the heads and the output "
                                        "projection breaks the GL(h) symmetry of value/output pairs")
    if getattr(mod, "head_scale", None) is not None:
        raise UnsupportedAttentionError(f"{name}: per-head output scaling (scale_heads) is not supported")
    E = mod.in_proj_weight.shape[1]
    bias = qualified(name, "in_proj_bias") if mod.in_proj_bias is not None else None
    w = qualified(name, "in_proj_weight")
    q, k, v = (LinearRef(w, bias, (i * E, (i + 1) * E), (i * E, (i + 1) * E)) for i in range(3))
    return AttentionBlock(name, mod.num_heads, q, k, v, qualified(name, "out_proj.weight"))


register_family(Family("open_clip", priority=50,
                       match=lambda mod: class_in(mod, "open_clip.transformer", "Attention"),
                       build=lambda name, mod, info: _openclip_block(name, mod).bind(info.params)))
