"""The Euclidean geometry of plain parameters: SAM's ball (Foret et al. 2021).

The ball is ``‖ξ‖_p ≤ ρ`` on the raw parameters (p = ℓ2 or ℓ∞), the step straight,
``θ + ξ``; the steepest ℓ2 ascent direction is the gradient itself.  It is the adaptive
geometry (:class:`~hideseek.geometry.adaptive.AdaptiveGeometry`) with every scale ``|θ|``
replaced by 1, so it is a drop-in *free part* of a
:class:`~hideseek.geometry.space.ProductGeometry` (``free_part=EuclideanGeometry``); the
scales are stored as 0-dimensional ones, so the inherited ℓ∞ methods and the norm
accounting broadcast them for free.  Nothing depends on θ but the point itself.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .adaptive import AdaptiveGeometry, Tangent


class EuclideanGeometry(AdaptiveGeometry):
    """The Euclidean ball ``‖ξ‖_p ≤ ρ`` on ``theta`` (named ``names``), straight step."""

    def __init__(self, names, theta, p: str = "l2") -> None:
        super().__init__(names, theta, p)
        # scale 1 everywhere: no coordinate is held fixed where θ happens to be zero
        self._zero = [False] * len(self.theta)
        self._nz, self._z = list(range(len(self.theta))), []

    @property
    def scale(self) -> list[Tensor]:
        """Scale 1 everywhere (0-dimensional ones, broadcast)."""
        return [torch.ones((), dtype=t.dtype, device=t.device) for t in self.theta]

    def sqnorm_terms(self, x: Tangent) -> list[Tensor]:
        """Squared ℓ2 norm of each tensor of ``ξ`` (one fused norm)."""
        return [n.square() for n in torch._foreach_norm(list(x))] if x else []

    def project(self, x: Tangent) -> Tangent:
        """Every perturbation is allowed."""
        return list(x)

    def rgrad(self, egrad: Tangent, inplace: bool = False) -> Tangent:
        """Steepest ℓ2 ascent direction: the gradient (not normalised); ``inplace``: ``egrad`` itself."""
        return list(egrad) if inplace else [g.clone() for g in egrad]

    def linf_terms(self, x: Tangent) -> list[Tensor]:
        """``max |ξ|`` per (non-empty) tensor."""
        return [xi.abs().amax() for xi in x if xi.numel()]

    def linf_direction(self, egrad: Tangent, inplace: bool = False) -> Tangent:
        """Steepest ℓ∞ ascent direction ``sign(g)`` (unit norm); ``inplace``: overwrite ``egrad``."""
        return [torch.sign(g, out=g) if inplace else torch.sign(g) for g in egrad]

    def linf_ball(self, x: Tangent, rho: float, inplace: bool = False) -> Tangent:
        """Projection onto the box ``‖ξ‖_∞ ≤ ρ``; ``inplace``: overwrite ``x``."""
        return [xi.clamp_(-rho, rho) if inplace else xi.clamp(-rho, rho) for xi in x]

    def draw(self, randn) -> Tangent:
        """``z`` (ℓ2) or ``sign(z)`` (ℓ∞, corners of the box), ``z`` standard normal."""
        return [torch.sign(randn(t)) if self.p == "linf" else randn(t) for t in self.theta]
