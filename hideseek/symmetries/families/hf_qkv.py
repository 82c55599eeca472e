"""Hugging Face attention with separate query/key/value projections: ``query/key/value`` (BERT,
RoBERTa, ELECTRA, ALBERT, older ViT), ``q_proj/k_proj/v_proj`` (ViT, CLIP, BART, Llama, Mistral,
Qwen2, Phi, …), ``q_lin/k_lin/v_lin`` (DistilBERT), ``q/k/v/o`` (T5: its relative position bias
keeps GL), ``query_proj/key_proj/value_proj`` (DeBERTa-v2, with its position projections
stacked), and an output ``o_proj/out_proj/out_lin/dense/o`` or a sibling ``output.dense``."""
from __future__ import annotations

from torch import nn

from ..base import AttentionBlock, UnsupportedAttentionError
from ..declare import AttentionSpec
from ..lora import adapter_params, base_of
from .common import (NO_GL, ModelInfo, check_norms, check_qk_norm, child, int_attr, linear, num_heads,
                     num_kv_heads, qualified, rotary)
from .registry import Family, register_family


_HF_QKV = (("query", "key", "value"), ("q_proj", "k_proj", "v_proj"), ("q_lin", "k_lin", "v_lin"),
           ("query_proj", "key_proj", "value_proj"), ("q", "k", "v"))
_HF_OUT = ("o_proj", "out_proj", "out_lin", "dense", "o")


def _hf_block(name: str, mod: nn.Module, info: ModelInfo) -> AttentionBlock | None:
    for qn, kn, vn in _HF_QKV:
        if all(linear(child(mod, c)) for c in (qn, kn, vn)):
            break
    else:
        return None
    out = None
    for on in _HF_OUT:
        if linear(child(mod, on)):
            out = on
            break
    root, rel = name, (lambda c: c)
    if out is None:  # BERT layout: <parent>.self.{query,key,value} + <parent>.output.dense
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        if not linear(base_of(info.modules.get(qualified(parent, "output.dense")))):
            raise UnsupportedAttentionError(
                f"{name}: found {qn}/{kn}/{vn} projections but no output projection "
                f"({'/'.join(_HF_OUT)} or a sibling output.dense)")
        own = name[len(parent) + 1:] if parent else name
        root, rel, out = parent, (lambda c: f"{own}.{c}"), "output.dense"
    check_qk_norm(name, mod)
    check_norms(name, mod)
    q_extra, k_extra = _deberta_extras(name, mod)
    known = {qn, kn, vn, out, *q_extra, *k_extra}
    others = [c for c, m in mod.named_children() if linear(m) and c not in known]
    if others:
        raise UnsupportedAttentionError(
            f"{name}: {type(mod).__name__} has linear projections besides {qn}/{kn}/{vn}/{out} "
            f"({', '.join(others)}; e.g. global-attention projections) whose outputs may meet the "
            "pairs; hideseek does not know their role. If they do not touch queries, keys, values "
            "or the output projection, declare the block with hideseek.symmetries.declare_attention(...)")
    pet = getattr(mod, "position_embedding_type", None) or getattr(info.config, "position_embedding_type", None)
    if getattr(mod, "distance_embedding", None) is not None or pet in ("relative_key", "relative_key_query"):
        raise UnsupportedAttentionError(
            f"{name}: relative-key position embeddings (position_embedding_type={pet!r}) add "
            f"query·position and key·position terms with one table shared by all heads, which {NO_GL}")
    heads = num_heads(mod, info.model)
    wq, wk = child(mod, qn).weight, child(mod, kn).weight
    head_dim = int_attr([mod], ("head_dim", "attention_head_size", "key_value_proj_dim"))
    if head_dim is not None and wq.shape[0] % head_dim == 0:
        heads = wq.shape[0] // head_dim       # the module's own head width beats a shared config
    if heads is None:
        raise UnsupportedAttentionError(f"{name}: cannot tell the number of heads")
    kv_heads = num_kv_heads(mod, info.model, heads)
    if head_dim is not None and wk.shape[0] % head_dim == 0:
        kv_heads = wk.shape[0] // head_dim
    r, pairing = rotary(name, mod, info, wq.shape[0] // heads)
    spec = AttentionSpec(root, heads, o=rel(out) if out != "output.dense" else out,
                         q=rel(qn), k=rel(kn), v=rel(vn), kv_heads=kv_heads, rotary_dims=r,
                         rotary_pairing=pairing, q_extra=tuple(map(rel, q_extra)),
                         k_extra=tuple(map(rel, k_extra)))
    blk = spec.bind(info.params)
    blk.module = name
    if out == "output.dense":        # the sibling output projection's adapters (inside ones: adapters_inside)
        blk.adapters = adapter_params(qualified(root, out), info.modules.get(qualified(root, out)))
    return blk


def _deberta_extras(name: str, mod: nn.Module) -> tuple[tuple, tuple]:
    """DeBERTa-v2 relative attention: c2p scores ``Q_c K_rᵀ`` and p2c scores ``K_c Q_rᵀ`` with
    ``Q_r``, ``K_r`` projections of the relative embeddings.  With ``share_att_key`` these are
    the block's own ``query_proj``/``key_proj`` (GL acts on them already); otherwise
    ``pos_query_proj`` joins the queries (G) and ``pos_key_proj`` the keys (H) of each head."""
    if not getattr(mod, "relative_attention", False) or getattr(mod, "share_att_key", True):
        return (), ()
    types = set(getattr(mod, "pos_att_type", ()) or ())
    unknown = types - {"c2p", "p2c"}
    if unknown:
        raise UnsupportedAttentionError(f"{name}: DeBERTa relative attention of types {sorted(unknown)} "
                                        "is not supported (only c2p and p2c)")
    q_extra = ("pos_query_proj",) if "p2c" in types and linear(getattr(mod, "pos_query_proj", None)) else ()
    k_extra = ("pos_key_proj",) if "c2p" in types and linear(getattr(mod, "pos_key_proj", None)) else ()
    return q_extra, k_extra


register_family(Family("hf_qkv", priority=10,
                       match=lambda mod: any(all(linear(child(mod, c)) for c in qkv) for qkv in _HF_QKV),
                       build=_hf_block, adapters_inside=True))
