"""Finding the GL symmetries of attention in a model.

Every attention module found gives, per key/value head, one query/key pair and one
value/output pair (``docs/maths.md`` §1.2; grouped-query attention stacks the query heads of
a group, §12).  Supported (``docs/model_support.md`` has the full table):

* ``torch.nn.MultiheadAttention`` (packed or separate q/k/v), which covers open_clip's
  default ``ResidualAttentionBlock``; open_clip's own ``Attention``; timm's ViT ``Attention``
  (packed ``qkv``, without QK-norm, scale-norm or gating);
* Hugging Face attention with ``query/key/value`` (BERT, RoBERTa, ELECTRA, ALBERT, older ViT),
  ``q_proj/k_proj/v_proj`` (ViT, CLIP, BART, Llama, Mistral, Qwen2, Phi, …), ``q_lin/k_lin/
  v_lin`` (DistilBERT), ``q/k/v/o`` (T5: its relative position bias keeps GL),
  ``query_proj/key_proj/value_proj`` (DeBERTa-v2, with its position projections stacked), and
  an output ``o_proj/out_proj/out_lin/dense/o`` or a sibling ``output.dense``;
* packed ``c_attn`` + ``c_proj`` (GPT-2, Conv1D weights stored (in, out); GPT-BigCode), per-head
  packed ``query_key_value`` + ``dense`` (GPT-NeoX, BLOOM: ALiBi is a score bias and keeps GL,
  Persimmon), Phi-3's ``qkv_proj`` and MPT's ``Wqkv`` (without ``clip_qkv``);
* grouped-query and multi-query attention (``num_key_value_heads``);
* rotary position embeddings (Llama, Mistral, Qwen2, GPT-NeoX, Phi, Phi-3, GPT-J, incl.
  partial rotary; ``docs/maths.md`` §12):
  their query/key pairs carry the rotary subgroup (:class:`PairGroup`, ``rotary``), read from
  the model's rotary module and its ``rotate_half``, value/output pairs keep full GL;
* anything declared by hand with :func:`~hideseek.symmetries.declare_attention`;
* peft LoRA adapters: one GL(r) pair per adapter and target module (:mod:`.lora`), and
  attention whose projections are LoRA-wrapped (its pairs on the base layers).

Attention whose symmetry is broken (QK-norm, scaled cosine attention, relative-key position
embeddings, norms or gates between heads and output, learned bias keys/values) or whose layout
no adapter knows raises :class:`UnsupportedAttentionError` with one line per module naming
what was found, unless ``on_unsupported="adaptive"``: then those parameters are left to the
elementwise (adaptive) geometry.
"""
from __future__ import annotations

import re
import sys

import torch
from torch import nn

from .base import AttentionBlock, LinearRef, SymmetryBlock, UnsupportedAttentionError
from .declare import AttentionSpec, is_conv1d, declared_spec
from .lora import adapter_params, base_of, lora_pairs

__all__ = ["UnsupportedAttentionError", "find_symmetries"]

_NO_GL = "breaks the GL(h) symmetry of its query/key pairs"


def _linear(mod: nn.Module | None) -> bool:
    return isinstance(mod, nn.Linear)


def _int_attr(objs, names) -> int | None:
    for obj in objs:
        for attr in names:
            val = getattr(obj, attr, None)
            if isinstance(val, int) and not isinstance(val, bool) and val > 0:
                return val
    return None


def _num_heads(mod: nn.Module, model: nn.Module) -> int | None:
    cfg = getattr(mod, "config", None) or getattr(model, "config", None)
    return (_int_attr([mod], ("num_heads", "num_attention_heads", "n_heads", "n_head"))
            or _int_attr([cfg], ("num_attention_heads", "n_heads", "num_heads", "n_head")))


def _num_kv_heads(mod: nn.Module, model: nn.Module, heads: int) -> int:
    kv = _int_attr([mod], ("num_key_value_heads", "num_kv_heads", "n_kv_heads"))
    if kv is None:
        groups = _int_attr([mod], ("num_key_value_groups", "num_kv_groups"))
        if groups is not None:
            kv = heads // groups
    if kv is None:
        cfg = getattr(mod, "config", None) or getattr(model, "config", None)
        kv = _int_attr([cfg], ("num_key_value_heads", "num_kv_heads", "n_kv_heads"))
    return kv or heads


def _p(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _not_identity(mod) -> bool:
    return isinstance(mod, nn.Module) and not isinstance(mod, nn.Identity)


# ----------------------------------------------------------------------------- rotary
_ROPE_CONFIG = ("rope_theta", "rotary_dim", "rotary_pct", "rope_scaling", "rope_parameters",
                "partial_rotary_factor", "rotary_emb_base")


class _Model:
    """What discovery needs to know about the whole model, computed once."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.modules = dict(model.named_modules())
        self.params = dict(model.named_parameters())
        self.config = getattr(model, "config", None)
        self.rotary_sizes = {}
        for name, mod in self.modules.items():
            inv = getattr(mod, "inv_freq", None)
            if isinstance(inv, torch.Tensor) and "rot" in type(mod).__name__.lower():
                self.rotary_sizes[name] = 2 * inv.numel()

    def rope_in_config(self) -> str | None:
        cfg = self.config
        if cfg is None:
            return None
        if getattr(cfg, "position_embedding_type", None) == "rotary":
            return "config.position_embedding_type='rotary'"
        for attr in _ROPE_CONFIG:
            if getattr(cfg, attr, None) not in (None, {}, 0):
                return f"config.{attr} is set"
        return None


_ROTATE_FNS = ("rotate_half", "rotate_every_two")


def _rotate_fn(mod: nn.Module):
    """The column-rotating helper of ``mod``'s Python module (Hugging Face defines one next to
    every rotary attention: ``rotate_half``, GPT-J's ``rotate_every_two``)."""
    pymod = sys.modules.get(type(mod).__module__)
    for fn_name in _ROTATE_FNS:
        fn = getattr(pymod, fn_name, None)
        if callable(fn):
            return fn_name, fn
    return None, None


_ROTARY_NAME = re.compile(r"rotary|(^|_)rope(_|$)|rotate_half|rotate_every_two", re.I)


def _rotary_hint(mod: nn.Module) -> str | None:
    """Evidence that ``mod`` applies rotary embeddings although no width was found: a
    rotary-named method of its class (RoFormer's ``apply_rotary_position_embeddings``) or
    function of its Python module (``apply_rotary_pos_emb``, ``rotate_half``)."""
    for attr in dir(type(mod)):
        if _ROTARY_NAME.search(attr) and not hasattr(nn.Module, attr):
            return f"{type(mod).__name__} defines {attr}"
    pymod = sys.modules.get(type(mod).__module__)
    for attr in vars(pymod) if pymod is not None else ():
        if _ROTARY_NAME.search(attr):
            return f"{type(mod).__module__} defines {attr}"
    return None


def _rotary_pairs(name: str, mod: nn.Module, r: int):
    """Column pairs the rotary helper rotates together, found by applying it to the unit
    vectors: it must be a signed permutation ``P`` with ``P² = −I`` (a 90° rotation in each
    pair's plane; Hugging Face's ``rotate_half`` pairs i with i + r/2, ``rotate_every_two``
    2i with 2i + 1)."""
    fn_name, fn = _rotate_fn(mod)
    if fn is None:
        raise UnsupportedAttentionError(
            f"{name}: rotary position embeddings (RoPE) are applied, but {type(mod).__module__} "
            f"has no {' / '.join(_ROTATE_FNS)} to read which columns they pair; declare the block "
            "with hideseek.symmetries.declare_attention(..., rotary_dims=..., rotary_pairing=...)")
    eye = torch.eye(r, dtype=torch.float64)
    try:
        P = fn(eye.reshape(1, 1, r, r))[0, 0]
        ok = P.shape == (r, r) and bool(((P != 0).sum(1) == 1).all()) and bool((P.abs().sum(1) == 1).all()) \
            and torch.equal(P @ P, -eye)
    except Exception:       # noqa: BLE001 - any failure means: not a readable rotation
        ok = False
    if not ok:
        raise UnsupportedAttentionError(
            f"{name}: rotary position embeddings (RoPE) whose {fn_name} is not a pairwise 90° "
            "rotation of columns; hideseek cannot read its symmetry group; declare the block with "
            "hideseek.symmetries.declare_attention(..., rotary_dims=..., rotary_pairing=...)")
    partner = P.abs().argmax(1).tolist()
    return tuple((i, partner[i]) for i in range(r) if i < partner[i])


def _rotary(name: str, mod: nn.Module, info: _Model, dk: int):
    """``(rotary_dims, pairing)`` of the rotary embedding applied in ``mod``, ``(0, "half")``
    if none; refuses when the model has rotary embeddings that cannot be read.

    The width is the module's ``rotary_ndims``/``rotary_dim``, else the model's rotary module
    (``2·len(inv_freq)``) provided ``mod``'s own code mentions rotary embeddings
    (:func:`_rotary_hint`); the pairing is probed from its ``rotate_half``."""
    r = _int_attr([mod], ("rotary_ndims", "rotary_dim"))
    if r is None:
        hint = _rotary_hint(mod)
        if info.rotary_sizes and hint is None:
            return 0, "half"    # its code never mentions rotary: e.g. a vision tower beside a rotary LM
        if info.rotary_sizes:
            sizes = set(info.rotary_sizes.values())
            if len(sizes) > 1:
                raise UnsupportedAttentionError(
                    f"{name}: the model has rotary embeddings of different widths "
                    f"{sorted(info.rotary_sizes.items())}; hideseek cannot tell which this attention "
                    "uses; declare it with hideseek.symmetries.declare_attention(..., rotary_dims=...)")
            r = sizes.pop()
        else:
            reason = hint or info.rope_in_config()
            if reason:
                raise UnsupportedAttentionError(
                    f"{name}: {reason}: rotary position embeddings (RoPE) leave only a subgroup of GL(h) "
                    "on its query/key pairs, and hideseek finds no rotary width (a rotary module with "
                    "inv_freq, or rotary_ndims/rotary_dim) to read which dims they rotate; declare the "
                    "block with hideseek.symmetries.declare_attention(..., rotary_dims=..., "
                    "rotary_pairing=...)")
            return 0, "half"
    if r > dk:
        raise UnsupportedAttentionError(f"{name}: rotary embeddings of width {r} exceed the head "
                                        f"width {dk}")
    return r, _rotary_pairs(name, mod, r)


# ----------------------------------------------------------------------------- refusals
_QK_NORMS = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm", "key_layernorm",
             "qk_norm", "ln_q", "ln_k")


def _check_qk_norm(name: str, mod: nn.Module) -> None:
    found = [c for c in _QK_NORMS if _not_identity(getattr(mod, c, None))]
    if found:
        raise UnsupportedAttentionError(
            f"{name}: QK normalisation ({', '.join(found)}: {type(getattr(mod, found[0])).__name__}) "
            f"normalises each query/key vector, which breaks the GL(h) symmetry of its query/key "
            "pairs; the value/output pairs alone are not offered")


def _check_norms(name: str, mod: nn.Module) -> None:
    """Any other normalisation inside the attention module (e.g. BitNet's ``attn_sub_norm``
    or Gemma-3n's ``v_norm`` between the heads and the output projection) is refused: hideseek
    cannot tell where it acts.  Hugging Face's ``LayerNorm`` child (ALBERT) is the norm after
    the residual sum, outside the pairs."""
    found = [f"{c}: {type(m).__name__}" for c, m in mod.named_children()
             if "norm" in type(m).__name__.lower() and _not_identity(m) and c != "LayerNorm"]
    if found:
        raise UnsupportedAttentionError(
            f"{name}: a normalisation inside the attention module ({', '.join(found)}); between the "
            "heads and the output projection it breaks the GL(d_v) symmetry of value/output pairs, "
            "and hideseek cannot tell where it acts; declare the block by hand if it is outside the pairs")


# ----------------------------------------------------------------------------- adapters
def _mha_block(name: str, mod: nn.MultiheadAttention) -> AttentionBlock:
    if mod.bias_k is not None or mod.bias_v is not None:
        raise UnsupportedAttentionError(
            f"{name}: nn.MultiheadAttention(add_bias_kv=True) appends learned keys/values that "
            "are not part of a GL(h) pair; hideseek does not support it")
    E = mod.embed_dim
    has_b = mod.in_proj_bias is not None
    bias = _p(name, "in_proj_bias") if has_b else None
    if mod._qkv_same_embed_dim:
        w = _p(name, "in_proj_weight")
        q, k, v = (LinearRef(w, bias, (i * E, (i + 1) * E), (i * E, (i + 1) * E)) for i in range(3))
    else:
        q, k, v = (LinearRef(_p(name, f"{c}_proj_weight"), bias, None, (i * E, (i + 1) * E))
                   for i, c in enumerate("qkv"))
    return AttentionBlock(name, mod.num_heads, q, k, v, _p(name, "out_proj.weight"))


def _openclip_block(name: str, mod: nn.Module) -> AttentionBlock:
    if getattr(mod, "logit_scale", None) is not None:
        raise UnsupportedAttentionError(f"{name}: scaled cosine attention normalises q and k, which {_NO_GL}")
    if _not_identity(getattr(mod, "ln_q", None)):
        raise UnsupportedAttentionError(f"{name}: QK normalisation {_NO_GL}")
    if _not_identity(getattr(mod, "ln_inner", None)):
        raise UnsupportedAttentionError(f"{name}: a norm between the heads and the output "
                                        "projection breaks the GL(h) symmetry of value/output pairs")
    if getattr(mod, "head_scale", None) is not None:
        raise UnsupportedAttentionError(f"{name}: per-head output scaling (scale_heads) is not supported")
    E = mod.in_proj_weight.shape[1]
    bias = _p(name, "in_proj_bias") if mod.in_proj_bias is not None else None
    w = _p(name, "in_proj_weight")
    q, k, v = (LinearRef(w, bias, (i * E, (i + 1) * E), (i * E, (i + 1) * E)) for i in range(3))
    return AttentionBlock(name, mod.num_heads, q, k, v, _p(name, "out_proj.weight"))


def _timm_block(name: str, mod: nn.Module, info: _Model) -> AttentionBlock:
    _check_qk_norm(name, mod)
    if _not_identity(getattr(mod, "norm", None)):
        raise UnsupportedAttentionError(f"{name}: timm Attention(scale_norm=True) normalises the "
                                        "heads before the output projection, which breaks the GL(h) "
                                        "symmetry of its value/output pairs")
    if getattr(mod, "gate", None) is not None:
        raise UnsupportedAttentionError(f"{name}: timm Attention(gated=True) multiplies each head "
                                        "output elementwise by a gate, which breaks the GL(h) symmetry "
                                        "of its value/output pairs")
    return AttentionSpec(name, mod.num_heads, qkv="qkv", o="proj").bind(info.params)


def _gpt2_block(name: str, mod: nn.Module, info: _Model) -> AttentionBlock | None:
    """``c_attn`` (+ ``q_attn`` for cross-attention) and ``c_proj``: GPT-2 (Conv1D, packed
    ``[Q; K; V]``) and GPT-BigCode (Linear; multi-query ``[Q; k; v]``, else per head)."""
    c_attn, c_proj = _child(mod, "c_attn"), _child(mod, "c_proj")
    if not ((is_conv1d(c_attn) or _linear(c_attn)) and (is_conv1d(c_proj) or _linear(c_proj))):
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
    heads = _num_heads(mod, info.model)
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
_PACKED = {"GPTNeoXAttention": ("query_key_value", "dense", "per_head"),
           "BloomAttention": ("query_key_value", "dense", "per_head"),
           "PersimmonAttention": ("query_key_value", "dense", "per_head"),
           "Phi3Attention": ("qkv_proj", "o_proj", "blocks"),
           "MptAttention": ("Wqkv", "out_proj", "blocks")}
_PACKED_NAMES = ("query_key_value", "qkv_proj", "Wqkv", "qkv")


def _packed_block(name: str, mod: nn.Module, info: _Model) -> AttentionBlock | None:
    """One packed ``query_key_value``/``qkv_proj`` projection of a known class: per head
    ``[q k v]`` (GPT-NeoX, BLOOM) or ``[Q; K; V]`` with grouped keys/values (Phi-3)."""
    packed = [c for c in _PACKED_NAMES if _linear(_child(mod, c))]
    if not packed:
        return None
    cls = type(mod).__name__
    if cls not in _PACKED:
        if not _ATTN_LIKE.search(cls):
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
    heads = _num_heads(mod, info.model)
    if heads is None:
        raise UnsupportedAttentionError(f"{name}: cannot tell the number of heads")
    kv_heads = _num_kv_heads(mod, info.model, heads) if layout == "blocks" else heads
    dk = _child(mod, qkv).out_features // (heads + 2 * kv_heads)
    _check_qk_norm(name, mod)
    _check_norms(name, mod)
    r, pairing = _rotary(name, mod, info, dk)
    return AttentionSpec(name, heads, o=out, qkv=qkv, kv_heads=kv_heads, layout=layout,
                         rotary_dims=r, rotary_pairing=pairing).bind(info.params)


_HF_QKV = (("query", "key", "value"), ("q_proj", "k_proj", "v_proj"), ("q_lin", "k_lin", "v_lin"),
           ("query_proj", "key_proj", "value_proj"), ("q", "k", "v"))
_HF_OUT = ("o_proj", "out_proj", "out_lin", "dense", "o")


def _child(mod: nn.Module, c: str):
    """Child ``c`` of ``mod``, through a peft LoRA wrapper (its base layer)."""
    return base_of(getattr(mod, c, None))


def _hf_block(name: str, mod: nn.Module, info: _Model) -> AttentionBlock | None:
    for qn, kn, vn in _HF_QKV:
        if all(_linear(_child(mod, c)) for c in (qn, kn, vn)):
            break
    else:
        return None
    out = None
    for on in _HF_OUT:
        if _linear(_child(mod, on)):
            out = on
            break
    root, rel = name, (lambda c: c)
    if out is None:  # BERT layout: <parent>.self.{query,key,value} + <parent>.output.dense
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        if not _linear(base_of(info.modules.get(_p(parent, "output.dense")))):
            raise UnsupportedAttentionError(
                f"{name}: found {qn}/{kn}/{vn} projections but no output projection "
                f"({'/'.join(_HF_OUT)} or a sibling output.dense)")
        own = name[len(parent) + 1:] if parent else name
        root, rel, out = parent, (lambda c: f"{own}.{c}"), "output.dense"
    _check_qk_norm(name, mod)
    _check_norms(name, mod)
    q_extra, k_extra = _deberta_extras(name, mod)
    known = {qn, kn, vn, out, *q_extra, *k_extra}
    others = [c for c, m in mod.named_children() if _linear(m) and c not in known]
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
            f"query·position and key·position terms with one table shared by all heads, which {_NO_GL}")
    heads = _num_heads(mod, info.model)
    wq, wk = _child(mod, qn).weight, _child(mod, kn).weight
    head_dim = _int_attr([mod], ("head_dim", "attention_head_size", "key_value_proj_dim"))
    if head_dim is not None and wq.shape[0] % head_dim == 0:
        heads = wq.shape[0] // head_dim       # the module's own head width beats a shared config
    if heads is None:
        raise UnsupportedAttentionError(f"{name}: cannot tell the number of heads")
    kv_heads = _num_kv_heads(mod, info.model, heads)
    if head_dim is not None and wk.shape[0] % head_dim == 0:
        kv_heads = wk.shape[0] // head_dim
    r, pairing = _rotary(name, mod, info, wq.shape[0] // heads)
    spec = AttentionSpec(root, heads, o=rel(out) if out != "output.dense" else out,
                         q=rel(qn), k=rel(kn), v=rel(vn), kv_heads=kv_heads, rotary_dims=r,
                         rotary_pairing=pairing, q_extra=tuple(map(rel, q_extra)),
                         k_extra=tuple(map(rel, k_extra)))
    blk = spec.bind(info.params)
    blk.module = name
    if out == "output.dense":        # the sibling output projection's adapters (inside ones: _block_for)
        blk.adapters = adapter_params(_p(root, out), info.modules.get(_p(root, out)))
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
    q_extra = ("pos_query_proj",) if "p2c" in types and _linear(getattr(mod, "pos_query_proj", None)) else ()
    k_extra = ("pos_key_proj",) if "c2p" in types and _linear(getattr(mod, "pos_key_proj", None)) else ()
    return q_extra, k_extra


_ATTN_LIKE = re.compile(r"attention|attn|selfatt", re.I)


def _class_in(mod: nn.Module, module_name: str, cls_name: str) -> bool:
    cls = getattr(sys.modules.get(module_name), cls_name, None)
    return cls is not None and isinstance(mod, cls)


def _block_for(name: str, mod: nn.Module, info: _Model) -> SymmetryBlock | None:
    spec = declared_spec(name, mod)
    if spec is not None:
        return spec.bind(info.params)
    if isinstance(mod, nn.MultiheadAttention):
        return _mha_block(name, mod).bind(info.params)
    # open_clip / timm classes, only if their packages are already loaded: a model cannot hold
    # an instance of a class whose module was never imported (and importing them costs seconds)
    if _class_in(mod, "open_clip.transformer", "Attention"):
        return _openclip_block(name, mod).bind(info.params)
    if _class_in(mod, "timm.layers.attention", "Attention"):
        return _timm_block(name, mod, info)
    for adapter in (_gpt2_block, _packed_block, _hf_block):
        blk = adapter(name, mod, info)
        if blk is not None:
            # peft LoRA layers on the block's projections: their adapters are not in the block
            blk.adapters = tuple(blk.adapters) + tuple(
                n for sub, m in mod.named_modules() for n in adapter_params(_p(name, sub), m))
            return blk
    return None


def _inside(a: str, b: str) -> bool:
    """Module/parameter path ``a`` is ``b`` or below it (``""`` is the model itself)."""
    return b == "" or a == b or a.startswith(b + ".")


def find_symmetries(model: nn.Module, on_unsupported: str = "raise") -> list[SymmetryBlock]:
    """The attention symmetry blocks of ``model``, in module order, then one
    :class:`~hideseek.symmetries.lora.LoRAPair` per peft LoRA adapter and target module.

    Each block is readable (``print(block)``, ``block.describe()``): module path, kind
    (``qk`` or ``vo``), number of pairs, head width, group (``GL(h)`` or the rotary subgroup)
    and, for grouped-query attention, the query heads per pair.

    ``on_unsupported``: ``"raise"`` (default) for attention whose symmetry is broken or
    unknown, or ``"adaptive"`` to leave those parameters to the elementwise geometry.

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> _ = torch.manual_seed(0)
    >>> attn = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()   # width 8, 2 heads of width 4
    >>> hs.find_symmetries(attn)
    [AttentionBlock(''; qk: 2×GL(4) G9×4 H9×4, vo: 2×GL(4) G9×4 H8×4)]
    >>> from hideseek.symmetries import apply_random_action
    >>> x = torch.randn(2, 5, 8)
    >>> before, w = attn(x, x, x)[0], attn.in_proj_weight.detach().clone()
    >>> _ = apply_random_action(attn, generator=torch.Generator().manual_seed(1))   # a random group element
    >>> torch.allclose(attn(x, x, x)[0], before, atol=1e-5), torch.allclose(attn.in_proj_weight, w)
    (True, False)
    """
    if on_unsupported not in ("raise", "adaptive"):
        raise ValueError("on_unsupported must be 'raise' or 'adaptive'")
    info = _Model(model)
    blocks: list[SymmetryBlock] = []
    problems: list[str] = []
    handled: list[str] = []
    for name, mod in info.modules.items():
        if any(_inside(name, h) and name != h for h in handled):
            continue          # inside an attention module already found or refused
        try:
            blk = _block_for(name, mod, info)
        except UnsupportedAttentionError as err:
            problems.append(str(err))
            handled.append(name)
            continue
        if blk is not None:
            blocks.append(blk)
            handled.append(name)
    for name, mod in info.modules.items():
        if not _ATTN_LIKE.search(type(mod).__name__):
            continue
        if not any(_inside(p, name) for p in info.params):
            continue  # parameter-free helper (e.g. a softmax wrapper)
        if any(_inside(h, name) or _inside(name, h) for h in handled):
            continue
        problems.append(f"{name or '<the model>'}: {type(mod).__name__} looks like attention but no hideseek adapter "
                        "recognises its projections; declare it with hideseek.symmetries.declare_attention(...)")
        handled.append(name)
    if problems and on_unsupported == "raise":
        raise UnsupportedAttentionError(
            "cannot apply the GL(h) attention geometry to this model:\n  - " + "\n  - ".join(problems)
            + "\nPass on_unsupported='adaptive' to treat these parameters elementwise (adaptive "
            "geometry), or declare the blocks yourself (hideseek.symmetries.declare_attention).")
    return blocks + [p.bind(info.params) for p in lora_pairs(model)]
