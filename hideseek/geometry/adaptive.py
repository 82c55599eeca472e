"""The elementwise (adaptive) geometry of plain parameters (docs/maths.md §6).

The ball is ``‖ξ ⊘ |θ|‖_p ≤ ρ`` (Andriushchenko et al. 2023), p = ℓ2 or ℓ∞, the step is
straight, ``θ + ξ``.  Where ``θ`` is exactly zero the scale ``|θ|`` vanishes and the
perturbation is held at zero (those coordinates are not allowed to move).

This is one *part* of a :class:`~hideseek.geometry.space.ProductGeometry`: it owns one tensor
of the tangent list per parameter and answers the product's questions about them.  It is the
free part registered as ``"adaptive"`` (:class:`~hideseek.geometry.free.FreePart`,
:data:`~hideseek.geometry.free.FREE_PARTS`), a sibling of the Euclidean one.  Terms
of the squared norm are returned as a list so that the product sums all parts' terms in
one ``stack().sum()``.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .free import FreePart, Tangent, register_free_part

_CHUNK = 1 << 22   # elements per fused temporary of the norm (16 MiB in float32)


def _slices(*ts: Tensor):
    """Matching slices of at most ``_CHUNK`` elements of tensors of one shape (the whole
    tensors when they are small or not all contiguous), for elementwise work whose
    temporaries should stay small: elementwise results do not depend on the slicing."""
    if ts[0].numel() <= _CHUNK or not all(t.is_contiguous() for t in ts):
        return [ts]
    flat = [t.view(-1) for t in ts]
    return [tuple(f[a:a + _CHUNK] for f in flat) for a in range(0, flat[0].numel(), _CHUNK)]


@register_free_part
class AdaptiveGeometry(FreePart):
    """Elementwise geometry ``‖ξ ⊘ |θ|‖_p`` of the parameters ``theta`` (named ``names``).

    Parameters
    ----------
    names, theta:
        Parameter names and their values at θ (one tangent tensor each).
    p:
        ``"l2"`` or ``"linf"``.

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> geo = hs.AdaptiveGeometry(["w"], [torch.tensor([1.0, -2.0, 4.0])])
    >>> geo.sqnorm_terms([torch.tensor([1.0, 1.0, 1.0])])              # ‖ξ ⊘ |θ|‖² = 1 + 1/4 + 1/16
    [tensor(1.3125)]
    """

    name = "adaptive"
    measure_prefix = {"worst": "m_apgd_", "average": "avg_"}

    def __init__(self, names: Sequence[str], theta: Sequence[Tensor], p: str = "l2") -> None:
        super().__init__(names, theta, p)
        # No copy of |θ| is kept (it would be a copy of the parameters): products and
        # quotients use θ itself where only magnitudes matter — IEEE rounding is symmetric
        # under negation, so (g·θ)·θ = (g·|θ|)·|θ| and ‖ξ ⊘ θ‖ = ‖ξ ⊘ |θ|‖ bit for bit —
        # and |θ| is formed one tensor at a time elsewhere.
        # exact zeros (vanishing scale) are rare: remember where, handle them apart
        self._zero = [bool((t == 0).any()) for t in self.theta]
        self._nz = [i for i, z in enumerate(self._zero) if not z]
        self._z = [i for i, z in enumerate(self._zero) if z]
        # the tensors without zeros in runs of at most _CHUNK elements (a large tensor alone):
        # the temporaries of a fused norm stay that small instead of a copy of all of them
        self._chunks: list[list[int]] = []
        size = 0
        for i in self._nz:
            n = self.theta[i].numel()
            if not self._chunks or size + n > _CHUNK:
                self._chunks.append([])
                size = 0
            self._chunks[-1].append(i)
            size += n

    @property
    def scale(self) -> list[Tensor]:
        """``|θ|`` per tensor (computed when asked, not stored)."""
        return [t.abs() for t in self.theta]

    def sqnorm_terms(self, x: Tangent) -> list[Tensor]:
        """Squared ℓ2 norms of ``ξ ⊘ |θ|``, one scalar per tensor (tensors without zeros
        first, in one fused division and one fused norm)."""
        terms = []
        for chunk in self._chunks:
            q = torch._foreach_div([x[i] for i in chunk], [self.theta[i] for i in chunk])
            terms += [n.square() for n in torch._foreach_norm(q)]
            del q
        for i in self._z:   # ξ/θ, zero where θ is: the same bits with two temporaries fewer
            t = self.theta[i]
            q = torch.div(x[i], t).masked_fill_(t == 0, 0)
            terms.append(q.square_().sum())
            del q
        return terms

    def linf_terms(self, x: Tangent) -> list[Tensor]:
        """``max |ξ ⊘ |θ||`` per (non-empty) tensor."""
        out = []
        for xi, t in zip(x, self.theta):
            if xi.numel():
                c = t.abs()
                out.append(torch.where(c > 0, xi.abs() / torch.where(c > 0, c, 1), 0).amax())
        return out

    def project(self, x: Tangent) -> Tangent:
        """Zero where θ is exactly zero."""
        return [torch.where(t != 0, xi, 0) if z else xi for xi, t, z in zip(x, self.theta, self._zero)]

    def rgrad(self, egrad: Tangent, inplace: bool = False) -> Tangent:
        """Steepest ℓ2 ascent direction ``|θ|² ⊙ g`` (not normalised; computed as
        ``(g ⊙ θ) ⊙ θ``, the same bits); ``inplace``: overwrite ``egrad``."""
        if not egrad:
            return []
        r = list(egrad) if inplace else list(torch._foreach_mul(egrad, self.theta))
        if inplace:
            torch._foreach_mul_(r, self.theta)
        torch._foreach_mul_(r, self.theta)
        return r

    def linf_direction(self, egrad: Tangent, inplace: bool = False) -> Tangent:
        """Steepest ℓ∞ ascent direction ``sign(g) ⊙ |θ|`` (unit norm); ``inplace``: overwrite
        ``egrad``."""
        out = []
        for g, t in zip(egrad, self.theta):
            d = torch.sign(g, out=g) if inplace else torch.sign(g)
            for ds, ts in _slices(d, t):
                ds.mul_(ts.abs())
            out.append(d)
        return out

    def linf_ball(self, x: Tangent, rho: float, inplace: bool = False) -> Tangent:
        """Projection onto ``‖ξ ⊘ |θ|‖_∞ ≤ ρ`` (a box); ``inplace``: overwrite ``x``."""
        out = []
        for xi, t in zip(x, self.theta):
            o = xi if inplace else torch.empty_like(xi)
            for xs, ts, os_ in _slices(xi, t, o):
                c = ts.abs()
                torch.minimum(xs, rho * c, out=os_)
                torch.maximum(os_, -rho * c, out=os_)
            out.append(o)
        return out

    def draw(self, randn) -> Tangent:
        """A random tangent before normalisation: ``|θ| ⊙ z`` (ℓ2) or ``|θ| ⊙ sign(z)``
        (ℓ∞, corners of the box), ``z`` standard normal from ``randn(like)``."""
        out = []
        for t in self.theta:
            z = randn(t)
            out.append(t.abs() * (torch.sign(z) if self.p == "linf" else z))
        return out

    # ------------------------------------------------------------------ the metric diag(1/θ²)
    def inv_metric(self, g: Tangent) -> Tangent:
        """``θ² ⊙ ∇`` (computed as ``(θ·θ)·∇``)."""
        return [t * t * gi for t, gi in zip(self.theta, g)]

    def inner_terms(self, x: Tangent, y: Tangent) -> list[Tensor]:
        """``Σ x y / θ²`` per tensor, 0 where θ is exactly 0."""
        out = []
        for t, a, b in zip(self.theta, x, y):
            c = t.abs()
            out.append(torch.where(c > 0, a * b / torch.where(c > 0, c * c, 1), 0).sum())
        return out

    def whiten(self, x: Tangent) -> Tangent:
        """``ξ ⊘ |θ|``, 0 where θ is exactly 0."""
        out = []
        for t, xi in zip(self.theta, x):
            c = t.abs()
            out.append(torch.where(c > 0, xi / torch.where(c > 0, c, 1), 0))
        return out

    def unwhiten(self, w: Tangent) -> Tangent:
        """``|θ| ⊙ w``."""
        return [t.abs() * wi for t, wi in zip(self.theta, w)]

    def hessian_terms(self, hv: Tangent, x: Tangent, egrad: Tangent) -> Tangent:
        """For ``g = diag(1/θ²)``: ``(D_ξ g⁻¹)∇f = 2θξ∇f`` and ``Γ(ξ, V) = −ξV/θ`` with
        ``V = θ²∇f``, so the sum is ``hv + θ ξ ∇f``."""
        return [h + t * xi * g for t, h, xi, g in zip(self.theta, hv, x, egrad)]
