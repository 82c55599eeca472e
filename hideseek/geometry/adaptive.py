"""The elementwise (adaptive) geometry of plain parameters (docs/maths.md §6).

The ball is ``‖ξ ⊘ |θ|‖_p ≤ ρ`` (Andriushchenko et al. 2023), p = ℓ2 or ℓ∞, the step is
straight, ``θ + ξ``.  Where ``θ`` is exactly zero the scale ``|θ|`` vanishes and the
perturbation is held at zero (those coordinates are not allowed to move).

This is one *part* of a :class:`~hideseek.geometry.space.ProductGeometry`: it owns one tensor
of the tangent list per parameter and answers the product's questions about them.  Terms
of the squared norm are returned as a list so that the product sums all parts' terms in
one ``stack().sum()``.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

Tangent = list[Tensor]


class AdaptiveGeometry:
    """Elementwise geometry ``‖ξ ⊘ |θ|‖_p`` of the parameters ``theta`` (named ``names``).

    Parameters
    ----------
    names, theta:
        Parameter names and their values at θ (one tangent tensor each).
    p:
        ``"l2"`` or ``"linf"``.
    """

    def __init__(self, names: Sequence[str], theta: Sequence[Tensor], p: str = "l2") -> None:
        if p not in ("l2", "linf"):
            raise ValueError(f"p must be 'l2' or 'linf', got {p!r}")
        self.p = p
        self.names = list(names)
        self.theta = [t.detach() for t in theta]
        self._set_scale()

    def _set_scale(self) -> None:
        """The elementwise scales ``|θ|`` and where they vanish."""
        self.scale = [t.abs() for t in self.theta]
        # exact zeros (vanishing scale) are rare: remember where, handle them apart
        self._zero = [bool((c == 0).any()) for c in self.scale]
        self._nz = [i for i, z in enumerate(self._zero) if not z]
        self._z = [i for i, z in enumerate(self._zero) if z]

    @property
    def n_tensors(self) -> int:
        return len(self.theta)

    def zeros(self) -> Tangent:
        return [torch.zeros_like(t) for t in self.theta]

    def point(self, x: Tangent, out: dict[str, Tensor]) -> None:
        """Write ``θ + ξ`` into ``out`` (name → tensor)."""
        for name, t, xi in zip(self.names, self.theta, x):
            out[name] = t + xi

    def sqnorm_terms(self, x: Tangent) -> list[Tensor]:
        """Squared ℓ2 norms of ``ξ ⊘ |θ|``, one scalar per tensor (tensors without zeros
        first, in one fused division and one fused norm)."""
        terms = []
        if self._nz:
            q = torch._foreach_div([x[i] for i in self._nz], [self.scale[i] for i in self._nz])
            terms += [n.square() for n in torch._foreach_norm(q)]
        for i in self._z:
            c = self.scale[i]
            terms.append(torch.where(c > 0, x[i] / torch.where(c > 0, c, 1), 0).square().sum())
        return terms

    def linf_terms(self, x: Tangent) -> list[Tensor]:
        """``max |ξ ⊘ |θ||`` per (non-empty) tensor."""
        return [torch.where(c > 0, xi.abs() / torch.where(c > 0, c, 1), 0).amax()
                for xi, c in zip(x, self.scale) if xi.numel()]

    def project(self, x: Tangent) -> Tangent:
        """Zero where θ is exactly zero."""
        return [torch.where(c > 0, xi, 0) if z else xi for xi, c, z in zip(x, self.scale, self._zero)]

    def rgrad(self, egrad: Tangent) -> Tangent:
        """Steepest ℓ2 ascent direction ``|θ|² ⊙ g`` (not normalised)."""
        if not egrad:
            return []
        r = list(torch._foreach_mul(egrad, self.scale))
        torch._foreach_mul_(r, self.scale)
        return r

    def linf_direction(self, egrad: Tangent) -> Tangent:
        """Steepest ℓ∞ ascent direction ``sign(g) ⊙ |θ|`` (unit norm)."""
        return [torch.sign(g) * c for g, c in zip(egrad, self.scale)]

    def linf_ball(self, x: Tangent, rho: float) -> Tangent:
        """Projection onto ``‖ξ ⊘ |θ|‖_∞ ≤ ρ`` (a box)."""
        return [torch.maximum(torch.minimum(xi, rho * c), -rho * c) for xi, c in zip(x, self.scale)]

    def draw(self, randn) -> Tangent:
        """A random tangent before normalisation: ``|θ| ⊙ z`` (ℓ2) or ``|θ| ⊙ sign(z)``
        (ℓ∞, corners of the box), ``z`` standard normal from ``randn(like)``."""
        out = []
        for t, c in zip(self.theta, self.scale):
            z = randn(t)
            out.append(c * (torch.sign(z) if self.p == "linf" else z))
        return out
