"""Symmetry blocks: views of a model's parameters as stacks of GL(h) pairs ``(G, H)``.

A :class:`SymmetryBlock` owns a set of parameters *entirely*.  ``split`` turns a mapping
``name -> tensor`` into one or more pair groups ``(G, H)`` of shape ``(B, n, h)`` and
``(B, m, h)``; ``merge`` is its exact inverse and is differentiable, so that a perturbed
``(G, H)`` can be written back into parameters for a functional forward pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch import Tensor


@dataclass(frozen=True)
class PairGroup:
    """One kind of pair inside a block: ``count`` pairs of shapes ``(n, h)`` and ``(m, h)``."""

    kind: str          # "qk", "vo", or a user label
    count: int
    n: int
    m: int
    h: int

    @property
    def shape_key(self) -> tuple[int, int, int]:
        return (self.n, self.m, self.h)


class SymmetryBlock:
    """Base class; subclasses set ``module``, ``param_names``, ``groups``."""

    module: str
    param_names: tuple[str, ...]
    groups: tuple[PairGroup, ...]

    def split(self, params: Mapping[str, Tensor]) -> list[tuple[Tensor, Tensor]]:
        raise NotImplementedError

    def merge(self, pairs: list[tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
        raise NotImplementedError

    def describe(self) -> list[dict]:
        return [dict(module=self.module, kind=g.kind, heads=g.count, head_width=g.h,
                      G_shape=(g.n, g.h), H_shape=(g.m, g.h)) for g in self.groups]

    def __repr__(self) -> str:
        parts = ", ".join(f"{g.kind}: {g.count}×GL({g.h}) G{g.n}×{g.h} H{g.m}×{g.h}"
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


@dataclass(frozen=True)
class LinearRef:
    """A (possibly row-sliced) linear map inside a model: ``weight[rows]``, ``bias[rows]``."""

    weight: str
    bias: str | None
    rows: tuple[int, int] | None = None        # rows of a packed weight
    bias_rows: tuple[int, int] | None = None   # rows of a packed bias

    def get(self, params: Mapping[str, Tensor]) -> tuple[Tensor, Tensor | None]:
        w = params[self.weight]
        b = params[self.bias] if self.bias is not None else None
        if self.rows is not None:
            w = w[self.rows[0]:self.rows[1]]
        if b is not None and self.bias_rows is not None:
            b = b[self.bias_rows[0]:self.bias_rows[1]]
        return w, b


def _assemble(pieces: dict[str, list[tuple[int, Tensor]]]) -> dict[str, Tensor]:
    """Concatenate row pieces ``(start, tensor)`` of packed parameters in order."""
    out = {}
    for name, items in pieces.items():
        items = sorted(items, key=lambda it: it[0])
        out[name] = items[0][1] if len(items) == 1 else torch.cat([t for _, t in items], dim=0)
    return out


@dataclass(repr=False, eq=False)
class AttentionBlock(SymmetryBlock):
    """Multi-head attention: one GL(d_k) pair per head for Q/K and one GL(d_v) per head for
    V/O, biases appended as an extra row (MATH.md §1).  The output bias is not in a pair."""

    module: str
    heads: int
    q: LinearRef
    k: LinearRef
    v: LinearRef
    o_weight: str
    param_names: tuple[str, ...] = field(init=False)
    groups: tuple[PairGroup, ...] = field(init=False)
    shapes: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = []
        for ref in (self.q, self.k, self.v):
            names += [ref.weight] + ([ref.bias] if ref.bias else [])
        names.append(self.o_weight)
        self.param_names = tuple(dict.fromkeys(names))

    def bind(self, params: Mapping[str, Tensor]) -> "AttentionBlock":
        """Read shapes from actual parameters; checks that the head split is consistent."""
        (wq, bq), (wk, bk), (wv, bv) = (r.get(params) for r in (self.q, self.k, self.v))
        wo = params[self.o_weight]
        hq = wq.shape[0]
        if hq % self.heads or wk.shape[0] != hq or wv.shape[0] % self.heads \
                or wo.shape[1] != wv.shape[0]:
            raise ValueError(f"{self.module}: projection shapes {tuple(wq.shape)}, "
                             f"{tuple(wk.shape)}, {tuple(wv.shape)}, {tuple(wo.shape)} do not "
                             f"split into {self.heads} heads")
        dk, dv = hq // self.heads, wv.shape[0] // self.heads
        self.groups = (
            PairGroup("qk", self.heads, wq.shape[1] + (bq is not None), wk.shape[1] + (bk is not None), dk),
            PairGroup("vo", self.heads, wv.shape[1] + (bv is not None), wo.shape[0], dv),
        )
        return self

    def split(self, params):
        (wq, bq), (wk, bk), (wv, bv) = (r.get(params) for r in (self.q, self.k, self.v))
        wo = params[self.o_weight]
        return [
            (heads_from_linear(wq, bq, self.heads), heads_from_linear(wk, bk, self.heads)),
            (heads_from_linear(wv, bv, self.heads), heads_from_out_proj(wo, self.heads)),
        ]

    def merge(self, pairs):
        (Gq, Gk), (Gv, Ho) = pairs
        pieces: dict[str, list[tuple[int, Tensor]]] = {}
        for ref, G in ((self.q, Gq), (self.k, Gk), (self.v, Gv)):
            w, b = linear_from_heads(G, ref.bias is not None)
            pieces.setdefault(ref.weight, []).append((ref.rows[0] if ref.rows else 0, w))
            if ref.bias is not None:
                pieces.setdefault(ref.bias, []).append((ref.bias_rows[0] if ref.bias_rows else 0, b))
        pieces.setdefault(self.o_weight, []).append((0, out_proj_from_heads(Ho)))
        return _assemble(pieces)


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


@dataclass(repr=False, eq=False)
class DiagonalPair(_UserPair):
    """User-declared elementwise GL(1) pairs between two parameters of equal shape
    (a diagonal linear network ``β = u ⊙ v``: ``(u a, v / a)`` per coordinate)."""

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
