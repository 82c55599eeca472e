"""The Euclidean geometry of plain parameters: SAM's ball (Foret et al. 2021).

The ball is ``‖ξ‖_p ≤ ρ`` on the raw parameters (p = ℓ2 or ℓ∞), the step straight,
``θ + ξ``; the steepest ℓ2 ascent direction is the gradient itself.  It is the adaptive
geometry's (:class:`~hideseek.geometry.adaptive.AdaptiveGeometry`) sibling with every scale
``|θ|`` replaced by 1: the *free part* registered as ``"euclidean"``
(:class:`~hideseek.geometry.free.FreePart`) of a
:class:`~hideseek.geometry.space.ProductGeometry` (``free_part=EuclideanGeometry``); its
metric is the identity, so it adds nothing to a Hessian-vector product.  Nothing depends on
θ but the point itself.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .free import FreePart, Tangent, register_free_part


@register_free_part
class EuclideanGeometry(FreePart):
    """The Euclidean ball ``‖ξ‖_p ≤ ρ`` on ``theta`` (named ``names``), straight step; scale 1
    everywhere, so no coordinate is held fixed where θ happens to be zero."""

    name = "euclidean"
    measure_prefix = {"worst": "euclidean_", "average": "avg_euclidean_"}

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

    # ------------------------------------------------------------------ the metric: identity
    def inv_metric(self, g: Tangent) -> Tangent:
        """The gradient itself."""
        return list(g)

    def inner_terms(self, x: Tangent, y: Tangent) -> list[Tensor]:
        """``Σ x y`` per tensor."""
        return [(a * b).sum() for a, b in zip(x, y)]

    def whiten(self, x: Tangent) -> Tangent:
        return list(x)

    def unwhiten(self, w: Tangent) -> Tangent:
        return list(w)

    def hessian_terms(self, hv: Tangent, x: Tangent, egrad: Tangent) -> Tangent:
        """A constant metric: no derivative, no connection; ``hv`` itself."""
        return list(hv)
