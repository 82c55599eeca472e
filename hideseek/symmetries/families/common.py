"""What the attention families share: the model as discovery sees it (:class:`ModelInfo`),
reading heads and rotary embeddings from a module and its model, and the refusals of features
that break the GL(h) symmetry (QK norms, norms inside the attention)."""
from __future__ import annotations

import re
import sys

import torch
from torch import nn

from ..base import UnsupportedAttentionError
from ..lora import base_of

NO_GL = "breaks the GL(h) symmetry of its query/key pairs"


def linear(mod: nn.Module | None) -> bool:
    return isinstance(mod, nn.Linear)


def int_attr(objs, names) -> int | None:
    for obj in objs:
        for attr in names:
            val = getattr(obj, attr, None)
            if isinstance(val, int) and not isinstance(val, bool) and val > 0:
                return val
    return None


def num_heads(mod: nn.Module, model: nn.Module) -> int | None:
    cfg = getattr(mod, "config", None) or getattr(model, "config", None)
    return (int_attr([mod], ("num_heads", "num_attention_heads", "n_heads", "n_head"))
            or int_attr([cfg], ("num_attention_heads", "n_heads", "num_heads", "n_head")))


def num_kv_heads(mod: nn.Module, model: nn.Module, heads: int) -> int:
    kv = int_attr([mod], ("num_key_value_heads", "num_kv_heads", "n_kv_heads"))
    if kv is None:
        groups = int_attr([mod], ("num_key_value_groups", "num_kv_groups"))
        if groups is not None:
            kv = heads // groups
    if kv is None:
        cfg = getattr(mod, "config", None) or getattr(model, "config", None)
        kv = int_attr([cfg], ("num_key_value_heads", "num_kv_heads", "n_kv_heads"))
    return kv or heads


def qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def not_identity(mod) -> bool:
    return isinstance(mod, nn.Module) and not isinstance(mod, nn.Identity)


# ----------------------------------------------------------------------------- rotary
_ROPE_CONFIG = ("rope_theta", "rotary_dim", "rotary_pct", "rope_scaling", "rope_parameters",
                "partial_rotary_factor", "rotary_emb_base")


class ModelInfo:
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


def rotary(name: str, mod: nn.Module, info: ModelInfo, dk: int):
    """``(rotary_dims, pairing)`` of the rotary embedding applied in ``mod``, ``(0, "half")``
    if none; refuses when the model has rotary embeddings that cannot be read.

    The width is the module's ``rotary_ndims``/``rotary_dim``, else the model's rotary module
    (``2·len(inv_freq)``) provided ``mod``'s own code mentions rotary embeddings
    (:func:`_rotary_hint`); the pairing is probed from its ``rotate_half``."""
    r = int_attr([mod], ("rotary_ndims", "rotary_dim"))
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


def check_qk_norm(name: str, mod: nn.Module) -> None:
    found = [c for c in _QK_NORMS if not_identity(getattr(mod, c, None))]
    if found:
        raise UnsupportedAttentionError(
            f"{name}: QK normalisation ({', '.join(found)}: {type(getattr(mod, found[0])).__name__}) "
            f"normalises each query/key vector, which breaks the GL(h) symmetry of its query/key "
            "pairs; the value/output pairs alone are not offered")


def check_norms(name: str, mod: nn.Module) -> None:
    """Any other normalisation inside the attention module (e.g. BitNet's ``attn_sub_norm``
    or Gemma-3n's ``v_norm`` between the heads and the output projection) is refused: hideseek
    cannot tell where it acts.  Hugging Face's ``LayerNorm`` child (ALBERT) is the norm after
    the residual sum, outside the pairs."""
    found = [f"{c}: {type(m).__name__}" for c, m in mod.named_children()
             if "norm" in type(m).__name__.lower() and not_identity(m) and c != "LayerNorm"]
    if found:
        raise UnsupportedAttentionError(
            f"{name}: a normalisation inside the attention module ({', '.join(found)}); between the "
            "heads and the output projection it breaks the GL(d_v) symmetry of value/output pairs, "
            "and hideseek cannot tell where it acts; declare the block by hand if it is outside the pairs")


# ----------------------------------------------------------------------------- adapters


def child(mod: nn.Module, c: str):
    """Child ``c`` of ``mod``, through a peft LoRA wrapper (its base layer)."""
    return base_of(getattr(mod, c, None))


ATTN_LIKE = re.compile(r"attention|attn|selfatt", re.I)


def class_in(mod: nn.Module, module_name: str, cls_name: str) -> bool:
    cls = getattr(sys.modules.get(module_name), cls_name, None)
    return cls is not None and isinstance(mod, cls)
