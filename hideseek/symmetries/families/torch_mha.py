"""``torch.nn.MultiheadAttention`` (packed or separate q/k/v), which covers open_clip's default
``ResidualAttentionBlock`` and ``nn.Transformer*``."""
from __future__ import annotations

from torch import nn

from ..base import AttentionBlock, LinearRef, UnsupportedAttentionError
from .common import qualified
from .registry import Family, register_family


def _mha_block(name: str, mod: nn.MultiheadAttention) -> AttentionBlock:
    if mod.bias_k is not None or mod.bias_v is not None:
        raise UnsupportedAttentionError(
            f"{name}: nn.MultiheadAttention(add_bias_kv=True) appends learned keys/values that "
            "are not part of a GL(h) pair; hideseek does not support it")
    E = mod.embed_dim
    has_b = mod.in_proj_bias is not None
    bias = qualified(name, "in_proj_bias") if has_b else None
    if mod._qkv_same_embed_dim:
        w = qualified(name, "in_proj_weight")
        q, k, v = (LinearRef(w, bias, (i * E, (i + 1) * E), (i * E, (i + 1) * E)) for i in range(3))
    else:
        q, k, v = (LinearRef(qualified(name, f"{c}_proj_weight"), bias, None, (i * E, (i + 1) * E))
                   for i, c in enumerate("qkv"))
    return AttentionBlock(name, mod.num_heads, q, k, v, qualified(name, "out_proj.weight"))


register_family(Family("torch_mha", priority=60, match=lambda mod: isinstance(mod, nn.MultiheadAttention),
                       build=lambda name, mod, info: _mha_block(name, mod).bind(info.params)))
