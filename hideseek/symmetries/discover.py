"""Finding the GL(h) symmetries of attention in a model.

Supported (each gives one GL(d_k) pair per head for Q/K and one GL(d_v) per head for V/O):

* ``torch.nn.MultiheadAttention`` (packed ``in_proj_weight`` or separate q/k/v weights),
  which covers open_clip's default ``ResidualAttentionBlock`` (vision and text towers);
* open_clip's own ``Attention`` module (packed, without scaled-cosine / QK-norm / inner norm);
* HuggingFace attention with ``query``/``key``/``value`` linears and a sibling
  ``output.dense`` (BERT, RoBERTa, ELECTRA, MiniLM, older ViT), with ``q_proj``/``k_proj``/
  ``v_proj`` and ``o_proj``/``out_proj`` (ViT in transformers ≥ 5, CLIP, …), or
  ``q_lin``/``k_lin``/``v_lin``/``out_lin`` (DistilBERT).

Attention in which GL(h) does not hold (rotary or relative position embeddings, scaled
cosine attention, QK normalisation, normalisation between heads and output projection), and
modules that look like attention but that no adapter recognises, raise
:class:`UnsupportedAttentionError` unless ``on_unsupported="adaptive"`` is passed, in which
case their parameters are left to the elementwise (adaptive) geometry.
"""
from __future__ import annotations

import re
import sys

from torch import nn

from .base import AttentionBlock, LinearRef, SymmetryBlock


class UnsupportedAttentionError(ValueError):
    """The model has attention whose GL(h) symmetry is broken or unknown to hideseek."""


_NO_GL = "breaks the GL(h) symmetry of its query/key pairs"


def _linear(mod: nn.Module | None) -> bool:
    return isinstance(mod, nn.Linear)


def _num_heads(mod: nn.Module, model: nn.Module) -> int | None:
    for attr in ("num_heads", "num_attention_heads", "n_heads", "n_head"):
        val = getattr(mod, attr, None)
        if isinstance(val, int) and val > 0:
            return val
    cfg = getattr(mod, "config", None) or getattr(model, "config", None)
    for attr in ("num_attention_heads", "n_heads", "num_heads"):
        val = getattr(cfg, attr, None)
        if isinstance(val, int) and val > 0:
            return val
    return None


def _rope_reason(model: nn.Module) -> str | None:
    cfg = getattr(model, "config", None)
    if cfg is not None:
        pet = getattr(cfg, "position_embedding_type", None)
        if pet in ("rotary", "relative_key", "relative_key_query"):
            return f"config.position_embedding_type={pet!r} {_NO_GL}"
        for attr in ("rope_theta", "rotary_dim", "rotary_pct", "rope_scaling", "rope_parameters"):
            if getattr(cfg, attr, None) is not None:
                return f"config.{attr} is set: rotary position embeddings (RoPE) {_NO_GL}"
    for name, mod in model.named_modules():
        if "rotary" in type(mod).__name__.lower() or "rope" in type(mod).__name__.lower():
            return f"module {name!r} ({type(mod).__name__}) applies rotary embeddings, which {_NO_GL}"
    return None


def _p(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


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
    if not isinstance(getattr(mod, "ln_q", nn.Identity()), nn.Identity):
        raise UnsupportedAttentionError(f"{name}: QK normalisation {_NO_GL}")
    if not isinstance(getattr(mod, "ln_inner", nn.Identity()), nn.Identity):
        raise UnsupportedAttentionError(f"{name}: a norm between the heads and the output "
                                        "projection breaks the GL(h) symmetry of value/output pairs")
    if getattr(mod, "head_scale", None) is not None:
        raise UnsupportedAttentionError(f"{name}: per-head output scaling (scale_heads) is not supported")
    E = mod.in_proj_weight.shape[1]
    bias = _p(name, "in_proj_bias") if mod.in_proj_bias is not None else None
    w = _p(name, "in_proj_weight")
    q, k, v = (LinearRef(w, bias, (i * E, (i + 1) * E), (i * E, (i + 1) * E)) for i in range(3))
    return AttentionBlock(name, mod.num_heads, q, k, v, _p(name, "out_proj.weight"))


_HF_QKV = (("query", "key", "value"), ("q_proj", "k_proj", "v_proj"), ("q_lin", "k_lin", "v_lin"))
_HF_OUT = ("o_proj", "out_proj", "out_lin")


def _hf_block(name: str, mod: nn.Module, modules: dict, model: nn.Module) -> AttentionBlock | None:
    for qn, kn, vn in _HF_QKV:
        if all(_linear(getattr(mod, c, None)) for c in (qn, kn, vn)):
            break
    else:
        return None
    out = None
    for on in _HF_OUT:
        if _linear(getattr(mod, on, None)):
            out = _p(name, on)
            break
    if out is None:  # BERT layout: <parent>.self.{query,key,value} + <parent>.output.dense
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        cand = _p(parent, "output.dense")
        if _linear(modules.get(cand)):
            out = cand
    if out is None:
        raise UnsupportedAttentionError(f"{name}: found query/key/value projections but no output "
                                        "projection (o_proj/out_proj/out_lin or a sibling output.dense)")
    heads = _num_heads(mod, model)
    if heads is None:
        raise UnsupportedAttentionError(f"{name}: cannot tell the number of heads")
    refs = []
    for c in (qn, kn, vn):
        lin = getattr(mod, c)
        refs.append(LinearRef(_p(_p(name, c), "weight"),
                              _p(_p(name, c), "bias") if lin.bias is not None else None))
    return AttentionBlock(name, heads, *refs, _p(out, "weight"))


_ATTN_LIKE = re.compile(r"attention|attn|selfatt", re.I)


def find_symmetries(model: nn.Module, on_unsupported: str = "raise") -> list[SymmetryBlock]:
    """The GL(h) attention blocks of ``model``, in module order.

    Each block is readable (``print(block)``, ``block.describe()``): module path, kind
    (``qk`` or ``vo``), number of heads and head width.

    ``on_unsupported``: ``"raise"`` (default) for attention whose symmetry is broken or
    unknown, or ``"adaptive"`` to leave those parameters to the elementwise geometry.
    """
    if on_unsupported not in ("raise", "adaptive"):
        raise ValueError("on_unsupported must be 'raise' or 'adaptive'")
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    blocks: list[SymmetryBlock] = []
    problems: list[str] = []
    rope = _rope_reason(model)
    # open_clip's Attention, only if open_clip is already loaded: a model cannot hold an
    # instance of a class whose module was never imported, and importing open_clip (with
    # torchvision) costs seconds and ~200 MiB for every other model
    open_clip_attention = getattr(sys.modules.get("open_clip.transformer"), "Attention", None)
    for name, mod in modules.items():
        try:
            if isinstance(mod, nn.MultiheadAttention):
                blk = _mha_block(name, mod)
            elif open_clip_attention is not None and isinstance(mod, open_clip_attention):
                blk = _openclip_block(name, mod)
            else:
                blk = _hf_block(name, mod, modules, model)
        except UnsupportedAttentionError as err:
            problems.append(str(err))
            continue
        if blk is not None:
            blocks.append(blk.bind(params))
    if rope and blocks:
        problems.insert(0, rope)
        blocks = []
    covered = [b.module for b in blocks]
    for name, mod in modules.items():
        if not name or not _ATTN_LIKE.search(type(mod).__name__):
            continue
        if not any(p.startswith(name) and p != name for p in params):
            continue  # parameter-free helper (e.g. a softmax wrapper)
        if any(c == name or c.startswith(name + ".") or name.startswith(c + ".") for c in covered):
            continue
        if any(name in msg for msg in problems):
            continue
        problems.append(f"{name}: {type(mod).__name__} looks like attention but no hideseek adapter "
                        "recognises it")
    if problems and on_unsupported == "raise":
        raise UnsupportedAttentionError(
            "cannot apply the GL(h) attention geometry to this model:\n  - " + "\n  - ".join(problems)
            + "\nPass on_unsupported='adaptive' to treat these parameters elementwise (adaptive "
            "geometry), or declare the pairs yourself with pairs=[...].")
    return blocks
