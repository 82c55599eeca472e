"""Packed ``c_attn`` + ``c_proj``: GPT-2 (Conv1D weights stored (in, out)) and GPT-BigCode."""
from __future__ import annotations

from torch import nn

from ..base import AttentionBlock, UnsupportedAttentionError
from ..declare import AttentionSpec, is_conv1d
from .common import ModelInfo, child, linear, num_heads
from .registry import Family, register_family


def _gpt2_block(name: str, mod: nn.Module, info: ModelInfo) -> AttentionBlock | None:
    """``c_attn`` (+ ``q_attn`` for cross-attention) and ``c_proj``: GPT-2 (Conv1D, packed
    ``[Q; K; V]``) and GPT-BigCode (Linear; multi-query ``[Q; k; v]``, else per head)."""
    c_attn, c_proj = child(mod, "c_attn"), child(mod, "c_proj")
    if not ((is_conv1d(c_attn) or linear(c_attn)) and (is_conv1d(c_proj) or linear(c_proj))):
        return None
    cls = type(mod).__name__
    if cls.endswith("GPT2Attention"):
        layout, kv_heads = "blocks", None
    elif cls == "GPTBigCodeAttention":
        multi = bool(getattr(mod, "multi_query", False))
        layout, kv_heads = ("blocks", 1) if multi else ("per_head", None)
    else:
        raise UnsupportedAttentionError(
            f"{name}: {cls} packs c_attn in a layout hideseek does not know (it knows GPT-2's and "
            "GPT-BigCode's); declare it with hideseek.symmetries.declare_attention(..., qkv='c_attn', o='c_proj', "
            "layout=..., kv_heads=...)")
    heads = num_heads(mod, info.model)
    if heads is None:
        raise UnsupportedAttentionError(f"{name}: cannot tell the number of heads")
    transposed = is_conv1d(c_attn)
    if is_conv1d(c_proj) != transposed:
        raise UnsupportedAttentionError(f"{name}: c_attn and c_proj mix Conv1D and Linear")
    if getattr(mod, "is_cross_attention", False):
        if layout == "per_head" or getattr(mod, "q_attn", None) is None:
            raise UnsupportedAttentionError(f"{name}: this cross-attention layout is not supported; "
                                            "declare it with hideseek.symmetries.declare_attention(...)")
        spec = AttentionSpec(name, heads, o="c_proj", q="q_attn", kv="c_attn", kv_heads=kv_heads,
                             transposed=transposed)
    else:
        spec = AttentionSpec(name, heads, o="c_proj", qkv="c_attn", kv_heads=kv_heads,
                             layout=layout, transposed=transposed)
    return spec.bind(info.params)


#: packed attention classes: class name -> (packed projection, output projection, layout)


def _match(mod: nn.Module) -> bool:
    c_attn, c_proj = child(mod, "c_attn"), child(mod, "c_proj")
    return (is_conv1d(c_attn) or linear(c_attn)) and (is_conv1d(c_proj) or linear(c_proj))


register_family(Family("hf_gpt2", priority=30, match=_match, build=_gpt2_block, adapters_inside=True))
