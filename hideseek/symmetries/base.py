"""Symmetry blocks: views of a model's parameters as stacks of GL(h) pairs ``(G, H)``.

A :class:`SymmetryBlock` owns a set of parameters *entirely*.  ``split`` turns a mapping
``name -> tensor`` into one or more pair groups ``(G, H)`` of shape ``(B, n, h)`` and
``(B, m, h)``; ``merge`` is its exact inverse and is differentiable, so that a perturbed
``(G, H)`` can be written back into parameters for a functional forward pass.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Mapping

import torch
from torch import Tensor

from ..errors import UnsupportedAttentionError  # noqa: F401 (re-exported: its old place)


@dataclass(frozen=True)
class PairGroup:
    """One kind of pair inside a block: ``count`` pairs of shapes ``(n, h)`` and ``(m, h)``.

    The group acting on each pair is GL(h), ``(G, H) ↦ (G A, H A⁻ᵀ)``, unless ``rotary`` is
    non-empty: then only the subgroup that commutes with rotary position embeddings acts:
    one 2×2 block ``a I + c J`` per
    column pair ``(i, j)`` in ``rotary`` (the columns a rotary embedding rotates together),
    full GL on the columns in ``rotary_free``, zero elsewhere — GL(1, ℂ)^{r/2} × GL(h − r)
    (``docs/maths.md`` §12).

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> _ = torch.manual_seed(0)
    >>> attn = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()   # width 8, 2 heads of width 4
    >>> qk, vo = hs.find_symmetries(attn)[0].groups
    >>> qk
    PairGroup(kind='qk', count=2, n=9, m=9, h=4, rotary=(), rotary_free=(), group_size=1)
    >>> qk.n == 8 + 1 and vo.m == 8                                 # the bias is a row of G; W_O has none
    True
    >>> qk.group_name
    'GL(4)'
    """

    kind: str          # "qk", "vo", or a user label
    count: int
    n: int
    m: int
    h: int
    rotary: tuple[tuple[int, int], ...] = ()
    rotary_free: tuple[int, ...] = ()
    group_size: int = 1   # query heads per pair (grouped-query attention stacks them)

    def __post_init__(self) -> None:
        if self.rotary:
            cols = sorted([c for p in self.rotary for c in p] + list(self.rotary_free))
            if cols != list(range(self.h)):
                raise ValueError(f"rotary pairs {self.rotary} and free columns {self.rotary_free} "
                                 f"must partition the {self.h} columns of the pair")
        elif self.rotary_free:
            raise ValueError("rotary_free is only meaningful with rotary pairs")

    @property
    def shape_key(self) -> tuple:
        return (self.n, self.m, self.h, self.rotary, self.rotary_free)

    @property
    def group_name(self) -> str:
        """``"GL(h)"`` or, for rotary pairs, ``"GL(1,C)^{r/2} x GL(h-r)"``."""
        if not self.rotary:
            return f"GL({self.h})"
        name = f"GL(1,C)^{len(self.rotary)}"
        return name + (f" x GL({len(self.rotary_free)})" if self.rotary_free else "")

    def lie_algebra_mask(self) -> Tensor:
        """``(h, h)`` 0/1 mask of the entries a group element may have non-zero (all ones
        for GL(h)); with rotary pairs, the entries of the 2×2 blocks and of the free block."""
        mask = torch.zeros(self.h, self.h) if self.rotary else torch.ones(self.h, self.h)
        for i, j in self.rotary:
            mask[i, i] = mask[j, j] = mask[i, j] = mask[j, i] = 1
        f = torch.tensor(self.rotary_free, dtype=torch.long)
        if len(f):
            mask[f.unsqueeze(1), f.unsqueeze(0)] = 1
        return mask


class SymmetryBlock:
    """Base class; subclasses set ``module``, ``param_names``, ``groups``.

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> _ = torch.manual_seed(0)
    >>> attn = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()   # width 8, 2 heads of width 4
    >>> block, = hs.find_symmetries(attn)
    >>> isinstance(block, hs.SymmetryBlock)
    True
    >>> sorted(block.param_names)                                    # what the block owns
    ['in_proj_bias', 'in_proj_weight', 'out_proj.weight']
    >>> [d["group"] for d in block.describe()]
    ['GL(4)', 'GL(4)']
    """

    module: str
    param_names: tuple[str, ...]
    groups: tuple[PairGroup, ...]
    #: parameters outside the block that its action would also have to move (peft LoRA
    #: adapters on an attention block's projections); they must not be perturbed with it
    adapters: tuple[str, ...] = ()
    #: what found it: the name of the attention family (:mod:`hideseek.symmetries.families`),
    #: ``"declared"`` for a block declared by hand, ``""`` otherwise
    family: str = ""

    def split(self, params: Mapping[str, Tensor]) -> list[tuple[Tensor, Tensor]]:
        raise NotImplementedError

    def merge(self, pairs: list[tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
        raise NotImplementedError

    def describe(self) -> list[dict]:
        out = []
        for g in self.groups:
            d = dict(module=self.module, kind=g.kind, heads=g.count, head_width=g.h,
                     G_shape=(g.n, g.h), H_shape=(g.m, g.h), group=g.group_name)
            if g.group_size > 1:
                d["query_heads_per_pair"] = g.group_size
            if g.rotary:
                d["rotary"], d["rotary_free"] = g.rotary, g.rotary_free
            out.append(d)
        return out

    def __repr__(self) -> str:
        parts = ", ".join(f"{g.kind}: {g.count}×{g.group_name} G{g.n}×{g.h} H{g.m}×{g.h}"
                          + (f" ({g.group_size} query heads per pair)" if g.group_size > 1 else "")
                          for g in self.groups)
        return f"{type(self).__name__}({self.module!r}; {parts})"


# --------------------------------------------------------------------------- helpers
def heads_from_linear(weight: Tensor, bias: Tensor | None, heads: int) -> Tensor:
    """``(out, in)`` weight and ``(out,)`` bias → ``(heads, in[+1], out/heads)``:
    per head the maths-convention matrix ``[W⁽ⁱ⁾; b⁽ⁱ⁾ᵀ]``."""
    out, inp = weight.shape
    w = weight.reshape(heads, out // heads, inp).transpose(1, 2)
    if bias is None:
        return w
    return torch.cat([w, bias.reshape(heads, 1, out // heads)], dim=1)


def linear_from_heads(G: Tensor, has_bias: bool) -> tuple[Tensor, Tensor | None]:
    """Inverse of :func:`heads_from_linear`."""
    heads, rows, width = G.shape
    w = G[:, : rows - 1] if has_bias else G
    weight = w.transpose(1, 2).reshape(heads * width, w.shape[1])
    bias = G[:, rows - 1].reshape(heads * width) if has_bias else None
    return weight, bias


def heads_from_out_proj(weight: Tensor, heads: int) -> Tensor:
    """Output projection ``(out, heads·d_v)`` → ``(heads, out, d_v)``: per head ``W_O⁽ⁱ⁾ᵀ``."""
    out, inp = weight.shape
    return weight.reshape(out, heads, inp // heads).permute(1, 0, 2)


def out_proj_from_heads(H: Tensor) -> Tensor:
    heads, out, width = H.shape
    return H.permute(1, 0, 2).reshape(out, heads * width)


@functools.lru_cache(maxsize=None)
def _index_tensor(index: tuple, device: torch.device) -> Tensor:
    return torch.tensor(index, dtype=torch.long, device=device)


def _select(index, rows):
    if index is not None:
        return index
    if rows is not None:
        return slice(rows[0], rows[1])
    return None


def _take(t: Tensor, sel) -> Tensor:
    """``t[sel]`` for ``sel`` None, a slice, or a tuple of row indices."""
    if sel is None:
        return t
    return t[_index_tensor(sel, t.device)] if isinstance(sel, tuple) else t[sel]


@dataclass(frozen=True)
class LinearRef:
    """A linear map inside a model, possibly a row block of a packed projection.

    Read in the ``(out, in)`` convention of ``nn.Linear``: ``weight[rows]``, ``bias[rows]``.
    ``transposed=True`` for weights stored ``(in, out)`` (GPT-2's ``Conv1D``); ``rows`` then
    select columns of the stored tensor.  ``rows`` is a ``(start, stop)`` range; ``index``
    instead lists explicit rows (layouts interleaved per head, e.g. GPT-NeoX's
    ``query_key_value``).  ``bias_rows`` / ``bias_index`` likewise for the bias (default: the
    weight's rows)."""

    weight: str
    bias: str | None
    rows: tuple[int, int] | None = None        # rows of a packed weight
    bias_rows: tuple[int, int] | None = None   # rows of a packed bias
    transposed: bool = False
    index: tuple[int, ...] | None = None
    bias_index: tuple[int, ...] | None = None

    def weight_sel(self):
        return _select(self.index, self.rows)

    def bias_sel(self):
        if self.bias_index is not None or self.bias_rows is not None:
            return _select(self.bias_index, self.bias_rows)
        return self.weight_sel()

    def get(self, params: Mapping[str, Tensor]) -> tuple[Tensor, Tensor | None]:
        w = params[self.weight]
        w = w.T if self.transposed else w
        w = _take(w, self.weight_sel())
        b = _take(params[self.bias], self.bias_sel()) if self.bias is not None else None
        return w, b


class _Pieces:
    """Row pieces of (possibly packed) parameters, put back together by :meth:`assemble`.

    ``perms`` caches, per parameter, the row permutation that puts the concatenated pieces
    in place (``None``: already in order); it is computed, and the pieces checked to cover
    the parameter exactly once, on first use."""

    def __init__(self, perms: dict, totals: dict) -> None:
        self.items: dict[str, list[tuple[object, Tensor]]] = {}
        self.transposed: dict[str, bool] = {}
        self.perms, self.totals = perms, totals

    def add(self, name: str, sel, tensor: Tensor, transposed: bool = False) -> None:
        self.items.setdefault(name, []).append((sel, tensor))
        self.transposed[name] = transposed

    def _perm(self, name: str, items) -> Tensor | None:
        if name not in self.perms:
            total = self.totals[name]          # rows of the stored parameter (out-convention)
            pos = torch.cat([_take(torch.arange(total), s) for s, _ in items])
            if len(pos) != total or not torch.equal(torch.sort(pos).values, torch.arange(total)):
                raise UnsupportedAttentionError(f"{name}: the declared rows do not cover the packed "
                                                "parameter exactly once")
            self.perms[name] = None if torch.equal(pos, torch.arange(total)) else torch.argsort(pos)
        perm = self.perms[name]
        if perm is not None and perm.device != items[0][1].device:
            perm = self.perms[name] = perm.to(items[0][1].device)
        return perm

    def assemble(self) -> dict[str, Tensor]:
        out = {}
        for name, items in self.items.items():
            if len(items) == 1 and items[0][0] is None:
                t = items[0][1]
            else:
                t = torch.cat([t for _, t in items], dim=0)
                perm = self._perm(name, items)
                if perm is not None:
                    t = t[perm]
            out[name] = t.T if self.transposed[name] else t
        return out


@dataclass(repr=False, eq=False)
class AttentionBlock(SymmetryBlock):
    """Multi-head attention as GL pairs (``docs/maths.md`` §1.2 and §12).

    Per key/value head ``g`` with the ``k = heads / kv_heads`` query heads ``j`` of its group:

    * query/key: ``G = [W_Q⁽ʲ¹⁾; …; W_Q⁽ʲᵏ⁾]`` (each ``[W; bᵀ]``, stacked by rows, plus the rows of
      any ``q_extra`` projections of the same head), ``H = W_K⁽ᵍ⁾`` (plus ``k_extra`` rows);
    * value/output: ``G = [W_V⁽ᵍ⁾; b_V⁽ᵍ⁾ᵀ]``, ``H = [W_O⁽ʲ¹⁾ᵀ; …; W_O⁽ʲᵏ⁾ᵀ]``.

    The function uses only ``G Hᵀ`` per pair, so ``(G A, H A⁻ᵀ)`` leaves it unchanged; plain
    multi-head attention is ``kv_heads = heads``.  (§12 writes the query/key pair the other
    way round, ``(W_K, [W_Q…])``: the same group with ``A ↦ A⁻ᵀ``; queries stay in ``G`` here
    as in §1.2, so that ``k = 1`` is exactly multi-head attention.)  ``rotary`` /
    ``rotary_free`` restrict the query/key group to the rotary subgroup (:class:`PairGroup`).  ``q_extra`` / ``k_extra``:
    further projections whose outputs meet the keys / queries in scores (DeBERTa-v2's
    position projections ``pos_query_proj`` / ``pos_key_proj``).  The output bias is in no pair.

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> _ = torch.manual_seed(0)
    >>> attn = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()   # width 8, 2 heads of width 4
    >>> block, = hs.find_symmetries(attn)
    >>> block.heads, block.module, [g.kind for g in block.groups]
    (2, '', ['qk', 'vo'])
    >>> pairs = block.split(dict(attn.named_parameters()))           # the (G, H) stacks of each kind
    >>> merged = block.merge(pairs)                                  # and back to the parameters
    >>> all(torch.equal(merged[n], p) for n, p in attn.named_parameters() if n in merged)
    True
    """

    module: str
    heads: int
    q: LinearRef
    k: LinearRef
    v: LinearRef
    o_weight: str
    param_names: tuple[str, ...] = field(init=False)
    groups: tuple[PairGroup, ...] = field(init=False)
    kv_heads: int | None = None
    o_transposed: bool = False
    rotary: tuple[tuple[int, int], ...] = ()
    rotary_free: tuple[int, ...] = ()
    q_extra: tuple[LinearRef, ...] = ()
    k_extra: tuple[LinearRef, ...] = ()

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            self.kv_heads = self.heads
        names = []
        for ref in (self.q, self.k, self.v, *self.q_extra, *self.k_extra):
            names += [ref.weight] + ([ref.bias] if ref.bias else [])
        names.append(self.o_weight)
        self.param_names = tuple(dict.fromkeys(names))

    @property
    def group_size(self) -> int:
        return self.heads // self.kv_heads

    def _wo(self, params):
        wo = params[self.o_weight]
        return wo.T if self.o_transposed else wo

    def bind(self, params: Mapping[str, Tensor]) -> "AttentionBlock":
        """Read shapes from actual parameters; checks that the head split is consistent."""
        missing = [n for n in self.param_names if n not in params]
        if missing:
            raise UnsupportedAttentionError(f"{self.module}: no parameter(s) {missing} in the model")
        (wq, bq), (wk, bk), (wv, bv) = (r.get(params) for r in (self.q, self.k, self.v))
        wo = self._wo(params)
        H, KV = self.heads, self.kv_heads
        shapes = f"q {tuple(wq.shape)}, k {tuple(wk.shape)}, v {tuple(wv.shape)}, o {tuple(wo.shape)} (out, in)"
        if H <= 0 or KV <= 0 or H % KV:
            raise UnsupportedAttentionError(f"{self.module}: {H} query heads cannot be grouped over "
                                            f"{KV} key/value heads")
        dk = wq.shape[0] // H
        if wq.shape[0] != H * dk or wk.shape[0] != KV * dk or wv.shape[0] % KV \
                or wo.shape[1] != H * (wv.shape[0] // KV) or dk == 0:
            raise UnsupportedAttentionError(
                f"{self.module}: projection shapes {shapes} do not split into {H} query heads and "
                f"{KV} key/value heads (expected q rows = {H}·d_k, k rows = {KV}·d_k, v rows = "
                f"{KV}·d_v, o columns = {H}·d_v); check heads/kv_heads (and transposed weights)")
        for ref, rows in [(r, H * dk) for r in self.q_extra] + [(r, KV * dk) for r in self.k_extra]:
            w, _ = ref.get(params)
            if w.shape[0] != rows:
                raise UnsupportedAttentionError(f"{self.module}: extra projection {ref.weight} has "
                                                f"{w.shape[0]} rows, expected {rows}")
        dv = wv.shape[0] // KV
        k = H // KV
        nq = sum(r.get(params)[0].shape[1] + (r.bias is not None) for r in (self.q, *self.q_extra))
        nk = sum(r.get(params)[0].shape[1] + (r.bias is not None) for r in (self.k, *self.k_extra))
        self._in_rows = {r: r.get(params)[0].shape[1]
                         for r in (self.q, self.k, self.v, *self.q_extra, *self.k_extra)}
        self._perms: dict = {}
        self._totals = {}
        for r in (self.q, self.k, self.v, *self.q_extra, *self.k_extra):
            self._totals[r.weight] = params[r.weight].shape[1 if r.transposed else 0]
            if r.bias is not None:
                self._totals[r.bias] = params[r.bias].shape[0]
        self.groups = (
            PairGroup("qk", KV, k * nq, nk, dk, self.rotary, self.rotary_free, k),
            PairGroup("vo", KV, wv.shape[1] + (bv is not None), k * wo.shape[0], dv, (), (), k),
        )
        refs = (self.q, self.k, self.v, *self.q_extra, *self.k_extra)
        if any(r.weight_sel() is not None or (r.bias and r.bias_sel() is not None) for r in refs):
            with torch.no_grad():
                self.merge(self.split(params))     # checks packed rows are covered exactly once
        return self

    def split(self, params):
        KV, k = self.kv_heads, self.group_size
        Gq = torch.cat([heads_from_linear(*r.get(params), self.heads) for r in (self.q, *self.q_extra)], 1)
        Hk = torch.cat([heads_from_linear(*r.get(params), KV) for r in (self.k, *self.k_extra)], 1)
        (wv, bv) = self.v.get(params)
        Ho = heads_from_out_proj(self._wo(params), self.heads)
        return [
            (Gq.reshape(KV, k * Gq.shape[1], Gq.shape[2]), Hk),
            (heads_from_linear(wv, bv, KV), Ho.reshape(KV, k * Ho.shape[1], Ho.shape[2])),
        ]

    def merge(self, pairs):
        (Gq, Hk), (Gv, Ho) = pairs
        KV, H = self.kv_heads, self.heads
        pieces = _Pieces(self._perms, self._totals)
        Gq = Gq.reshape(H, Gq.shape[1] // self.group_size, Gq.shape[2])
        for M, refs, heads in ((Gq, (self.q, *self.q_extra), H), (Hk, (self.k, *self.k_extra), KV),
                               (Gv, (self.v,), KV)):
            start = 0
            for ref in refs:
                rows = self._in_rows[ref] + (ref.bias is not None)
                w, b = linear_from_heads(M[:, start:start + rows], ref.bias is not None)
                start += rows
                pieces.add(ref.weight, ref.weight_sel(), w, ref.transposed)
                if ref.bias is not None:
                    pieces.add(ref.bias, ref.bias_sel(), b)
        wo = out_proj_from_heads(Ho.reshape(H, Ho.shape[1] // self.group_size, Ho.shape[2]))
        pieces.add(self.o_weight, None, wo, self.o_transposed)
        return pieces.assemble()


def _drop_adapter_key(name: str) -> str:
    """``"….lora_B.default.weight"`` → ``"….lora_B.weight"`` (peft's adapter key left out)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.startswith("lora_") and i + 1 < len(parts) - 1:
            return ".".join(parts[:i + 1] + parts[i + 2:])
    return name


def _resolve_name(short: str, names: list[str], what: str) -> str:
    if short in names:
        return short
    hits = [n for n in names if n.endswith("." + short) or _drop_adapter_key(n) == short
            or _drop_adapter_key(n).endswith("." + short)]
    if len(hits) == 1:
        return hits[0]
    if not hits:
        near = [n for n in names if short.rsplit(".", 1)[0].split(".")[-1] in n][:3] or names[:3]
        raise ValueError(f"{what}: no parameter named {short!r} in the model (names look like {near}); "
                         "give a parameter name as model.named_parameters() shows it, or its unique ending")
    raise ValueError(f"{what}: {short!r} matches {len(hits)} parameters (e.g. {hits[:2]}); give a longer, "
                     "unique name. (peft LoRA adapters need no declaration: hideseek finds every one "
                     "as a GL(r) pair)")


@dataclass(repr=False, eq=False)
class _UserPair(SymmetryBlock):
    """A pair the user declares between two named parameters ``g`` and ``h``."""

    g: str
    h: str
    module: str = field(init=False)
    param_names: tuple[str, ...] = field(init=False)
    groups: tuple[PairGroup, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        self.module = f"{self.g}~{self.h}"
        self.param_names = (self.g, self.h)

    def resolve(self, names) -> "_UserPair":
        """This pair with ``g`` and ``h`` resolved against the model's parameter ``names``:
        a full name, or the end of exactly one name after a dot (``"lora_B.weight"`` when
        the model has one LoRA layer), where a peft adapter key may be left out
        (``"q_proj.lora_B.weight"`` for ``"….q_proj.lora_B.default.weight"``)."""
        names = list(names)
        g, h = (_resolve_name(n, names, type(self).__name__) for n in (self.g, self.h))
        if (g, h) == (self.g, self.h):
            return self
        new = replace(self, g=g, h=h)
        return new


@dataclass(repr=False, eq=False)
class DiagonalPair(_UserPair):
    """User-declared elementwise GL(1) pairs between two parameters of equal shape
    (a diagonal linear network ``β = u ⊙ v``: ``(u a, v / a)`` per coordinate).

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> class Diagonal(torch.nn.Module):                              # f(x) = x · (u ⊙ v)
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.u = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    ...         self.v = torch.nn.Parameter(torch.tensor([0.5, 1.0, 3.0]))
    ...     def forward(self, x):
    ...         return x @ (self.u * self.v)
    >>> model = Diagonal().eval()
    >>> batch = (torch.randn(16, 3, generator=torch.Generator().manual_seed(0)), torch.zeros(16))
    >>> kw = dict(rho=0.1, n_iters=5, loss_fn=torch.nn.functional.mse_loss, pairs=[hs.DiagonalPair("u", "v")],
    ...           progress=False)
    >>> before = hs.sharpness(model, [batch], "geodesic_invariant", **kw).value
    >>> with torch.no_grad():                                         # (u, v) ↦ (a ⊙ u, v ⊘ a): same function
    ...     _ = model.u.mul_(torch.tensor([4.0, 0.5, 2.0]))
    ...     _ = model.v.div_(torch.tensor([4.0, 0.5, 2.0]))
    >>> abs(hs.sharpness(model, [batch], "geodesic_invariant", **kw).value - before) < 1e-5 * before
    True
    """

    def bind(self, params):
        u, v = params[self.g], params[self.h]
        if u.shape != v.shape:
            raise ValueError(f"DiagonalPair needs equal shapes, got {self.g}{tuple(u.shape)} "
                             f"and {self.h}{tuple(v.shape)}")
        self._shape = u.shape
        self.groups = (PairGroup("diag", u.numel(), 1, 1, 1),)
        return self

    def split(self, params):
        return [(params[self.g].reshape(-1, 1, 1), params[self.h].reshape(-1, 1, 1))]

    def merge(self, pairs):
        (G, H), = pairs
        return {self.g: G.reshape(self._shape), self.h: H.reshape(self._shape)}


@dataclass(repr=False, eq=False)
class FactorPair(_UserPair):
    """User-declared GL(r) pair of two factor matrices (e.g. LoRA ``ΔW = B A``).

    ``G`` is the parameter ``g`` (transposed if ``transpose_g``), ``H`` likewise, such that
    the model uses only ``G Hᵀ``.  For peft's LoRA, ``lora_B.weight`` (out × r) and
    ``lora_A.weight`` (r × in): ``FactorPair("…lora_B…weight", "…lora_A…weight",
    transpose_h=True)``.

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False), torch.nn.Linear(2, 2, bias=False)).eval()
    >>> pair = hs.FactorPair("1.weight", "0.weight", transpose_h=True)    # W₁W₀ = G Hᵀ, G = W₁, H = W₀ᵀ
    >>> batch, mse = (torch.randn(16, 3), torch.randn(16, 2)), torch.nn.functional.mse_loss
    >>> block = pair.bind(dict(model.named_parameters()))
    >>> block                                                         # G = W₁ (2 × 2), H = W₀ᵀ (3 × 2)
    FactorPair('1.weight~0.weight'; factor: 1×GL(2) G2×2 H3×2)
    >>> G, H = block.split(dict(model.named_parameters()))[0]
    >>> torch.allclose(G[0] @ H[0].T, model[1].weight @ model[0].weight)   # the product the model uses
    True
    """

    transpose_g: bool = False
    transpose_h: bool = False

    def _mats(self, params):
        G, H = params[self.g], params[self.h]
        if G.dim() != 2 or H.dim() != 2:
            raise ValueError("FactorPair parameters must be matrices")
        return (G.T if self.transpose_g else G), (H.T if self.transpose_h else H)

    def bind(self, params):
        G, H = self._mats(params)
        if G.shape[1] != H.shape[1]:
            raise ValueError(f"FactorPair: G {tuple(G.shape)} and H {tuple(H.shape)} must share "
                             "their second dimension (the rank); check transpose_g/transpose_h")
        self.groups = (PairGroup("factor", 1, G.shape[0], H.shape[0], G.shape[1]),)
        return self

    def split(self, params):
        G, H = self._mats(params)
        return [(G.unsqueeze(0), H.unsqueeze(0))]

    def merge(self, pairs):
        (G, H), = pairs
        G, H = G[0], H[0]
        return {self.g: G.T if self.transpose_g else G, self.h: H.T if self.transpose_h else H}
