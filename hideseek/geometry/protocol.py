"""What a solver needs of a geometry: the typed interface of :mod:`hideseek.solvers.apgd`.

A solver maximises an objective of a tangent vector ``ξ`` (a list of tensors) over the ball
``{ξ allowed, ‖ξ‖ ≤ ρ}`` and never looks inside a tangent vector: everything it does
with one goes through these methods.  :class:`~hideseek.geometry.space.ProductGeometry`
implements it; so can any other perturbation space (a test double, a new kind of ball).
The protocol is ``runtime_checkable``: ``isinstance(g, SolverGeometry)`` checks the
method names (not their signatures).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

Tangent = list[Tensor]


@runtime_checkable
class SolverGeometry(Protocol):
    """The methods :func:`~hideseek.solvers.apgd.apgd`, :func:`~hideseek.solvers.apgd.random_search`
    and :func:`~hideseek.solvers.apgd.average_case` call on their ``geometry``."""

    def zeros(self) -> Tangent:
        """The tangent vector ξ = 0 (fresh tensors)."""
        ...

    def direction(self, egrad: Tangent, inplace: bool = False) -> Tangent:
        """Unit steepest-ascent direction (in the ball's norm, allowed subspace) from the
        Euclidean gradient; ``inplace``: ``egrad`` may be overwritten."""
        ...

    def ball(self, x: Tangent, rho: float, project: bool = True) -> Tangent:
        """Projection of ``x`` onto the ball of radius ``rho`` of allowed perturbations."""
        ...

    def shrink_(self, x: Tangent, rho: float) -> Tangent:
        """:meth:`ball` without the projection onto the allowed subspace, in place."""
        ...

    def random_direction(self, generator: torch.Generator) -> Tangent:
        """A random unit vector of the allowed subspace (uniform on the sphere for ℓ2)."""
        ...
