"""One packed ``query_key_value`` / ``qkv_proj`` / ``Wqkv`` projection of a known class: per head
``[q k v]`` (GPT-NeoX, BLOOM: ALiBi is a score bias and keeps GL, Persimmon) or ``[Q; K; V]``
with grouped keys/values (Phi-3, MPT without ``clip_qkv``)."""
from __future__ import annotations

from torch import nn

from ..base import AttentionBlock, UnsupportedAttentionError
from ..declare import AttentionSpec
from .common import ATTN_LIKE, ModelInfo, check_norms, check_qk_norm, child, linear, num_heads, num_kv_heads, rotary
from .registry import Family, register_family


_PACKED = {"GPTNeoXAttention": ("query_key_value", "dense", "per_head"),
           "BloomAttention": ("query_key_value", "dense", "per_head"),
           "PersimmonAttention": ("query_key_value", "dense", "per_head"),
           "Phi3Attention": ("qkv_proj", "o_proj", "blocks"),
           "MptAttention": ("Wqkv", "out_proj", "blocks")}
_PACKED_NAMES = ("query_key_value", "qkv_proj", "Wqkv", "qkv")


def _packed_block(name: str, mod: nn.Module, info: ModelInfo) -> AttentionBlock | None:
    """One packed ``query_key_value``/``qkv_proj`` projection of a known class: per head
    ``[q k v]`` (GPT-NeoX, BLOOM) or ``[Q; K; V]`` with grouped keys/values (Phi-3)."""
    packed = [c for c in _PACKED_NAMES if linear(child(mod, c))]
    if not packed:
        return None
    cls = type(mod).__name__
    if cls not in _PACKED:
        if not ATTN_LIKE.search(cls):
            return None
        raise UnsupportedAttentionError(
            f"{name}: {cls} packs {packed[0]} in a layout hideseek does not know (it knows "
            f"{', '.join(sorted(_PACKED))}); declare it with hideseek.symmetries.declare_attention(..., "
            f"qkv={packed[0]!r}, layout='blocks' or 'per_head', kv_heads=..., ...)")
    qkv, out, layout = _PACKED[cls]
    if getattr(mod, "clip_qkv", None):
        raise UnsupportedAttentionError(
            f"{name}: clip_qkv={mod.clip_qkv} clamps queries, keys and values elementwise, which "
            "breaks the GL(h) symmetry of both its query/key and value/output pairs")
    heads = num_heads(mod, info.model)
    if heads is None:
        raise UnsupportedAttentionError(f"{name}: cannot tell the number of heads")
    kv_heads = num_kv_heads(mod, info.model, heads) if layout == "blocks" else heads
    dk = child(mod, qkv).out_features // (heads + 2 * kv_heads)
    check_qk_norm(name, mod)
    check_norms(name, mod)
    r, pairing = rotary(name, mod, info, dk)
    return AttentionSpec(name, heads, o=out, qkv=qkv, kv_heads=kv_heads, layout=layout,
                         rotary_dims=r, rotary_pairing=pairing).bind(info.params)


register_family(Family("hf_packed", priority=20,
                       match=lambda mod: any(linear(child(mod, c)) for c in _PACKED_NAMES),
                       build=_packed_block, adapters_inside=True))
