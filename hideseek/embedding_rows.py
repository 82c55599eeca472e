"""Embedding rows that no token of a batch touches are left out of the search.

The loss of a batch depends on an ``nn.Embedding`` weight only through the rows the batch
looks up (its token ids, its positions, its token types): every other row has a gradient of
exactly 0 at every point of the ball.  In the search those rows never move — the adaptive
direction ``|θ|² ⊙ g`` (docs/maths.md §6) is 0 there, the ℓ∞ direction ``sign(g) ⊙ |θ|`` too,
the momentum and the ball projection are elementwise or scale the whole vector — and they add
0 to every norm, so the search on the rows the batch uses is the same search.  On a real
language model those rows are most of the model (MiniLM's 30 522 × 384 word embeddings are
half of its weights, and a batch of 8 × 64 tokens touches at most 512 of them), so each
batch's search is restricted to its rows: the tangent of such a weight is ``ξ[rows]`` and the
step writes ``θ.index_add(0, rows, ξ[rows])`` (the same additions as ``θ + ξ`` on those
rows; the others are θ exactly).  Values are unchanged up to the order in which a norm sums
its squares (the left-out terms are exact zeros); ``tests/hideseek/test_embedding_rows.py``
compares with and without.

Where the restriction is made, per batch (:func:`batch_geometry`):

* the weight is the ``weight`` of an ``nn.Embedding`` (no ``max_norm``, which rewrites the
  rows it looks up) among the adaptive (free) parameters of the geometry;
* the rows are those the module was called with, recorded by a forward pre-hook during the
  set-up pass (batch 0) or during one forward pass without gradient (later batches);
* on the set-up pass, the weight's gradient is checked to be exactly 0 outside the recorded
  rows — a weight used elsewhere as well (a language-model head tied to the embeddings, a
  functional use) is never restricted;
* the search starts from ξ = 0 (worst case, no random start, ``restarts=1``): a random start
  or an average-case draw would give the untouched rows a share of the ball;
* at least :data:`ROWS_FROM` elements are left out (below it the saving is smaller than the
  bookkeeping, and values stay bit-identical to the unrestricted search).
"""
from __future__ import annotations

import copy
from typing import Mapping

import torch
from torch import Tensor, nn

from .geometry.adaptive import AdaptiveGeometry
from .geometry.space import ProductGeometry

__all__ = ["ROWS_FROM", "RowRecorder", "RowsGeometry", "batch_geometry", "searched_elements"]

#: elements left out of a batch's search from which the restriction is made
ROWS_FROM = 1 << 18


def _candidates(model: nn.Module) -> dict[str, nn.Embedding]:
    """``parameter name -> module`` of the embedding weights that may be restricted."""
    out = {}
    for name, mod in model.named_modules():
        if type(mod) is nn.Embedding and mod.max_norm is None and mod.weight.requires_grad:
            out[f"{name}.weight" if name else "weight"] = mod
    return out


class RowRecorder:
    """Records the rows each candidate embedding of ``model`` looks up during the passes run
    inside :meth:`recording` (forward pre-hooks, removed afterwards)."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = _candidates(model)
        self.rows: dict[str, list[Tensor]] = {}
        self.failed = False
        #: names whose set-up gradient was checked to vanish outside the recorded rows
        self.verified: set[str] | None = None
        #: rows of batch 0 from the set-up pass (handed to the first batch's search)
        self.setup_rows: dict[str, Tensor] | None = None

    def __bool__(self) -> bool:
        return bool(self.modules)

    def _hook(self, name: str):
        def hook(mod, args):
            try:
                idx = args[0]
                if not isinstance(idx, Tensor) or idx.is_floating_point():
                    raise TypeError("not an index tensor")
                self.rows.setdefault(name, []).append(idx.detach().reshape(-1))
            except Exception:  # noqa: BLE001 (vmapped or unusual inputs: no restriction)
                self.failed = True
        return hook

    def start(self):
        self.rows, self.failed = {}, False
        return [mod.register_forward_pre_hook(self._hook(n)) for n, mod in self.modules.items()]

    def stop(self, handles) -> dict[str, Tensor] | None:
        """The sorted unique rows per weight looked up since :meth:`start` (``None`` when
        they could not be recorded)."""
        for h in handles:
            h.remove()
        if self.failed:
            return None
        try:
            return {n: torch.unique(torch.cat(r)) for n, r in self.rows.items()}
        except Exception:  # noqa: BLE001
            return None

    def verify(self, rows: Mapping[str, Tensor] | None, grads: Mapping[str, Tensor]) -> None:
        """Keep the weights whose gradient (the set-up pass's, batch 0) is exactly 0 outside
        the rows they looked up: the loss depends on them only through those rows."""
        self.setup_rows = rows
        self.verified = set()
        if rows is None:
            return
        for n, r in rows.items():
            g = grads.get(n)
            if g is None or g.dim() != 2 or r.numel() == 0 or r.numel() >= g.shape[0]:
                continue
            if not bool(g.index_fill(0, r, 0).count_nonzero() == 0):
                continue     # used elsewhere too (a tied head): never restricted
            self.verified.add(n)


class RowsAdaptive(AdaptiveGeometry):
    """The adaptive geometry with some weights restricted to rows: their tangent is
    ``ξ[rows]`` and the step writes ``θ.index_add(0, rows, ξ[rows])``."""

    def __init__(self, full: AdaptiveGeometry, rows: Mapping[int, Tensor]) -> None:
        theta = [t.index_select(0, rows[i]) if i in rows else t for i, t in enumerate(full.theta)]
        super().__init__(full.names, theta, full.p)
        self.full_theta, self.rows = full.theta, dict(rows)

    def point(self, x, out: dict[str, Tensor]) -> None:
        for i, (name, t, xi) in enumerate(zip(self.names, self.theta, x)):
            r = self.rows.get(i)
            out[name] = t + xi if r is None else self.full_theta[i].index_add(0, r, xi)


class RowsGeometry(ProductGeometry):
    """A :class:`ProductGeometry` whose adaptive part is restricted to rows (it shares the
    pair part of the full geometry it is made from, :meth:`restrict`)."""

    rows_by_name: dict[str, Tensor]
    n_left_out: int

    @classmethod
    def restrict(cls, full: ProductGeometry, rows: Mapping[str, Tensor]) -> "RowsGeometry":
        g = copy.copy(full)
        g.__class__ = cls
        index = {n: i for i, n in enumerate(full.adaptive.names)}
        by_index = {index[n]: r for n, r in rows.items()}
        g.with_free_part(lambda free: RowsAdaptive(free, by_index))
        g.rows_by_name = dict(rows)
        g.n_left_out = sum((full.adaptive.theta[i].shape[0] - r.numel()) * full.adaptive.theta[i][0].numel()
                           for i, r in by_index.items())
        return g

    def pullback(self, grads: Mapping[str, Tensor]):
        grads = {n: g.index_select(0, self.rows_by_name[n]) if n in self.rows_by_name else g
                 for n, g in grads.items()}
        return super().pullback(grads)

    def expand(self, x: list[Tensor]) -> list[Tensor]:
        """``x`` as a tangent of the full geometry (zero on the left-out rows)."""
        a = self.adaptive
        start = self.n_pair_tensors
        out = list(x[:start])
        for i, xi in enumerate(x[start:]):
            r = a.rows.get(i)
            out.append(xi if r is None else torch.zeros_like(a.full_theta[i]).index_copy_(0, r, xi))
        return out


def searched_elements(geometry: ProductGeometry, n_perturbed: int) -> int:
    """Elements of the tangent the search holds: ``n_perturbed`` less the left-out rows."""
    return n_perturbed - getattr(geometry, "n_left_out", 0)


def batch_geometry(geometry: ProductGeometry, loss, i: int, x, y, *, from_zero: bool,
                   setup_grads: Mapping[str, Tensor] | None = None) -> ProductGeometry:
    """The geometry of batch ``i``'s search: ``geometry`` restricted to the rows of the
    batch's embedding lookups where the module docstring allows it, else ``geometry``.
    ``loss`` is the batch's :class:`hideseek.inputs.Loss` (its recorder holds the set-up
    pass's rows); ``setup_grads`` the set-up gradient (batch 0, checked once);
    ``from_zero``: the search starts from ξ = 0 and draws nothing at random."""
    rec: RowRecorder | None = getattr(loss, "rows", None)
    if not rec or not from_zero or type(geometry.adaptive) is not AdaptiveGeometry:
        return geometry
    if rec.verified is None:
        if setup_grads is None:
            return geometry
        rec.verify(rec.setup_rows, setup_grads)
    names = [n for n in geometry.adaptive.names if n in rec.verified]
    if not names:
        return geometry
    if i == 0 and rec.setup_rows is not None:
        rows = rec.setup_rows
    else:
        handles = rec.start()
        try:
            with torch.no_grad():
                loss.checked({}, x, y, i)      # the model's own errors as one line naming the batch
        finally:
            rows = rec.stop(handles)
    if rows is None:
        return geometry
    rows = {n: rows[n] for n in names if n in rows}
    theta = dict(zip(geometry.adaptive.names, geometry.adaptive.theta))
    left = sum((theta[n].shape[0] - r.numel()) * theta[n][0].numel() for n, r in rows.items())
    if left < ROWS_FROM:
        return geometry
    return RowsGeometry.restrict(geometry, rows)
