"""Declaring attention blocks by hand, for models no adapter of :func:`find_symmetries` knows.

>>> spec = hs.declare_attention(model, "transformer.h.0.attn", heads=12, qkv="c_attn",
...                             o="c_proj", transposed=True)            # doctest: +SKIP

registers the block on that module, so that :func:`find_symmetries` and ``hs.sharpness``
use it; or, without touching the model, pass ``AttentionSpec(...)`` objects to
``hs.sharpness(..., pairs=[...], on_unsupported="adaptive")`` (names then are full parameter
paths below ``module``).  See ``docs/model_support.md``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Union

from torch import Tensor, nn

from .base import AttentionBlock, LinearRef, UnsupportedAttentionError

#: a projection: the name (below the attention module) of a submodule with ``.weight`` (and
#: optional ``.bias``), of a weight parameter, or a ``(weight, bias)`` pair of parameter names
Proj = Union[str, tuple]

_ATTR = "_hideseek_attention"
LAYOUTS = ("blocks", "per_head")


def _p(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@dataclass(frozen=True)
class AttentionSpec:
    """One attention block declared by hand; :meth:`bind` turns it into an
    :class:`~hideseek.symmetries.AttentionBlock` (one GL(d_k) query/key pair and one GL(d_v)
    value/output pair per key/value head, ``docs/maths.md`` §1).

    module:      path of the attention module in the model (``""`` for the model itself);
                 all other names are relative to it.
    heads:       number of query heads.
    q, k, v:     separate projections, or
    qkv:         one packed projection holding queries, keys and values (``layout`` says how),
    kv:          or ``q`` plus a packed key/value projection (GPT-2 cross-attention).
    o:           the output projection (its bias is in no pair).
    kv_heads:    key/value heads (grouped-query attention; 1 = multi-query); default ``heads``.
    layout:      for packed projections: ``"blocks"`` = all queries, then all keys, then all
                 values (``nn.MultiheadAttention``, GPT-2, timm); ``"per_head"`` = per head its
                 query, key and value rows (GPT-NeoX, BLOOM).
    transposed:  weights stored ``(in, out)`` (GPT-2's ``Conv1D``) instead of ``(out, in)``.
    rotary_dims: head columns rotated by rotary position embeddings (the first ones; 0 = none).
    rotary_pairing: ``"half"`` (Hugging Face ``rotate_half``: column i with i + r/2),
                 ``"adjacent"`` (2i with 2i + 1, GPT-J style) or explicit column pairs.
    q_extra, k_extra: projections whose outputs also meet the keys / queries in scores
                 (DeBERTa-v2's ``pos_query_proj`` / ``pos_key_proj``), stacked with the
                 queries / keys of the same head.

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> attn = torch.nn.MultiheadAttention(8, 2, bias=False)            # width 8, 2 heads, no biases
    >>> found = hs.find_symmetries(attn)[0].describe()                  # what the built-in adapter finds
    >>> spec = hs.AttentionSpec(module="", heads=2, qkv="in_proj_weight", o="out_proj")
    >>> spec.bind(dict(attn.named_parameters())).describe() == found   # pass it as sharpness(pairs=[spec])
    True
    """

    module: str
    heads: int
    o: Proj
    q: Proj | None = None
    k: Proj | None = None
    v: Proj | None = None
    qkv: Proj | None = None
    kv: Proj | None = None
    kv_heads: int | None = None
    layout: str = "blocks"
    transposed: bool = False
    rotary_dims: int = 0
    rotary_pairing: str | tuple = "half"
    q_extra: tuple = ()
    k_extra: tuple = ()

    def __post_init__(self) -> None:
        """Inconsistent declarations raise :class:`UnsupportedAttentionError` (a ``ValueError``)."""
        where = f"attention {self.module!r}"
        if not isinstance(self.heads, int) or self.heads <= 0:
            raise UnsupportedAttentionError(f"{where}: heads must be a positive int, got {self.heads!r}")
        if self.kv_heads is not None and (self.kv_heads <= 0 or self.heads % self.kv_heads):
            raise UnsupportedAttentionError(f"{where}: kv_heads={self.kv_heads} must divide heads={self.heads}")
        separate = (self.q is not None, self.k is not None, self.v is not None)
        if self.qkv is not None:
            ok = not any(separate) and self.kv is None
        elif self.kv is not None:
            ok = separate == (True, False, False)
        else:
            ok = all(separate)
        if not ok:
            raise UnsupportedAttentionError(f"{where}: give either q, k and v, or qkv (packed), or q and kv")
        if self.layout not in LAYOUTS:
            raise UnsupportedAttentionError(f"{where}: layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == "per_head" and self.kv_heads not in (None, self.heads):
            raise UnsupportedAttentionError(f"{where}: layout='per_head' is only defined without grouped keys/values")
        if self.rotary_dims < 0 or self.rotary_dims % 2:
            raise UnsupportedAttentionError(f"{where}: rotary_dims must be even and ≥ 0, got {self.rotary_dims}")
        if isinstance(self.rotary_pairing, str) and self.rotary_pairing not in ("half", "adjacent"):
            raise UnsupportedAttentionError(f"{where}: rotary_pairing must be 'half', 'adjacent' or explicit "
                             f"column pairs, got {self.rotary_pairing!r}")

    # ------------------------------------------------------------------ resolving names
    def _names(self, proj: Proj, params: Mapping[str, Tensor]) -> tuple[str, str | None]:
        if isinstance(proj, tuple):
            w, b = proj
            return _p(self.module, w), (_p(self.module, b) if b is not None else None)
        full = _p(self.module, proj)
        if full + ".weight" in params:
            return full + ".weight", (full + ".bias" if full + ".bias" in params else None)
        if full + ".base_layer.weight" in params:      # a peft LoRA wrapper: the pair is on its base layer
            base = full + ".base_layer"
            return base + ".weight", (base + ".bias" if base + ".bias" in params else None)
        if full in params:
            return full, None
        raise UnsupportedAttentionError(
            f"attention {self.module!r}: no projection {proj!r} (neither a submodule with a "
            f"weight, {full + '.weight'!r}, nor a parameter {full!r})")

    def _ref(self, proj: Proj, params, **kw) -> LinearRef:
        w, b = self._names(proj, params)
        return LinearRef(w, b, transposed=self.transposed, **kw)

    def _out_rows(self, proj: Proj, params) -> int:
        w, _ = self._names(proj, params)
        return params[w].shape[1 if self.transposed else 0]

    def _packed(self, proj: Proj, params, parts: int, kv_only: bool = False) -> list[LinearRef]:
        H = self.heads
        KV = self.kv_heads or H
        rows = self._out_rows(proj, params)
        units = 2 * KV if kv_only else H + 2 * KV      # head widths in the packed rows
        if rows % units:
            raise UnsupportedAttentionError(
                f"attention {self.module!r}: packed projection {proj!r} has {rows} output rows, "
                f"not a multiple of {units} head widths ({H} query, {KV} key/value heads); check "
                "heads/kv_heads/transposed")
        d = rows // units
        if self.layout == "per_head":
            k = 2 if kv_only else 3
            idx = [tuple(h * k * d + j * d + c for h in range(KV) for c in range(d)) for j in range(k)]
            return [self._ref(proj, params, index=i) for i in idx]
        sizes = [KV * d, KV * d] if kv_only else [H * d, KV * d, KV * d]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [self._ref(proj, params, rows=(s, s + n)) for s, n in zip(starts, sizes)]

    # ------------------------------------------------------------------ binding
    def bind(self, params: Mapping[str, Tensor]) -> AttentionBlock:
        """The :class:`AttentionBlock` for ``params`` (a model's ``named_parameters()``)."""
        if self.qkv is not None:
            q, k, v = self._packed(self.qkv, params, 3)
        elif self.kv is not None:
            q = self._ref(self.q, params)
            k, v = self._packed(self.kv, params, 2, kv_only=True)
        else:
            q, k, v = (self._ref(p, params) for p in (self.q, self.k, self.v))
        o_w, _ = self._names(self.o, params)
        rotary, free = (), ()
        if self.rotary_dims:
            dk = q.get(params)[0].shape[0] // self.heads
            rotary, free = rotary_columns(self.rotary_dims, dk, self.rotary_pairing, self.module)
        blk = AttentionBlock(self.module, self.heads, q, k, v, o_w, kv_heads=self.kv_heads or self.heads,
                             o_transposed=self.transposed, rotary=rotary, rotary_free=free,
                             q_extra=tuple(self._ref(p, params) for p in self.q_extra),
                             k_extra=tuple(self._ref(p, params) for p in self.k_extra))
        return blk.bind(params)


def rotary_columns(r: int, dk: int, pairing, where: str = "") -> tuple[tuple, tuple]:
    """Column pairs rotated together and the free columns, for the first ``r`` of ``dk``
    head columns rotated with ``pairing`` (``"half"``, ``"adjacent"`` or explicit pairs)."""
    if r > dk or r % 2:
        raise UnsupportedAttentionError(f"attention {where!r}: {r} rotary dims do not fit a head "
                                        f"of width {dk} (need an even number ≤ {dk})")
    if pairing == "half":
        pairs = tuple((i, i + r // 2) for i in range(r // 2))
    elif pairing == "adjacent":
        pairs = tuple((2 * i, 2 * i + 1) for i in range(r // 2))
    else:
        pairs = tuple(tuple(int(c) for c in p) for p in pairing)
        if sorted(c for p in pairs for c in p) != list(range(r)):
            raise UnsupportedAttentionError(f"attention {where!r}: rotary column pairs {pairs} do "
                                            f"not partition the first {r} columns")
    return pairs, tuple(range(r, dk))


def is_conv1d(mod: nn.Module | None) -> bool:
    """transformers' ``Conv1D`` (GPT-2 family): a linear map with weight stored (in, out)."""
    return mod is not None and type(mod).__name__ == "Conv1D" and hasattr(mod, "nf")


def declare_attention(model: nn.Module, module: str, *, heads: int, o: Proj, q: Proj | None = None,
                      k: Proj | None = None, v: Proj | None = None, qkv: Proj | None = None,
                      kv: Proj | None = None, kv_heads: int | None = None, layout: str = "blocks",
                      transposed: bool | None = None, rotary_dims: int = 0,
                      rotary_pairing: str | tuple = "half", register: bool = True) -> AttentionSpec:
    """Declare the attention module ``module`` of ``model`` by hand (arguments: see
    :class:`AttentionSpec`; ``transposed=None`` detects transformers' ``Conv1D``).

    The declaration is checked against the model's parameters at once (shapes must split
    into the heads), and, with ``register=True``, stored on the module so that
    :func:`find_symmetries` and ``hs.sharpness`` use it instead of any adapter.  Returns the
    :class:`AttentionSpec`; do not also pass it in ``pairs=`` when registered.

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> attn = torch.nn.MultiheadAttention(8, 2, bias=False)            # width 8, 2 heads, no biases
    >>> found = hs.find_symmetries(attn)[0].describe()                  # what the built-in adapter finds
    >>> spec = hs.declare_attention(attn, "", heads=2, qkv="in_proj_weight", o="out_proj")   # by hand
    >>> hs.find_symmetries(attn)                                        # the declaration is used from now on
    [AttentionBlock(''; qk: 2×GL(4) G8×4 H8×4, vo: 2×GL(4) G8×4 H8×4)]
    >>> hs.find_symmetries(attn)[0].describe() == found                 # the same pairs as the adapter's
    True
    """
    modules = dict(model.named_modules())
    if module not in modules:
        raise ValueError(f"declare_attention: the model has no module {module!r}")
    if transposed is None:
        projs = [modules[_p(module, p)] for p in (q, k, v, qkv, kv, o)
                 if isinstance(p, str) and _p(module, p) in modules]
        convs = [is_conv1d(m) for m in projs]
        if any(convs) and not all(convs):
            raise ValueError(f"declare_attention({module!r}): some projections are Conv1D and some "
                             "not; pass transposed= explicitly")
        transposed = bool(convs) and all(convs)
    spec = AttentionSpec(module, heads, o, q, k, v, qkv, kv, kv_heads, layout, transposed,
                         rotary_dims, rotary_pairing)
    spec.bind(dict(model.named_parameters()))     # fails now, not later, if it does not fit
    if register:
        object.__setattr__(modules[module], _ATTR, spec)
    return spec


def declared_spec(name: str, mod: nn.Module) -> AttentionSpec | None:
    """The spec registered on ``mod`` by :func:`declare_attention`, re-rooted at ``name``."""
    spec = getattr(mod, _ATTR, None)
    return None if spec is None else replace(spec, module=name)
