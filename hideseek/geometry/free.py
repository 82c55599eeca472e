"""The free part of a perturbation space, and the one registry of free parts.

Every parameter outside a GL(h) pair lives in the *free part* of a
:class:`~hideseek.geometry.space.ProductGeometry`: a diagonal (elementwise) geometry of plain
tensors, the ball ``‖ξ ⊘ c‖_p ≤ ρ`` for a scale ``c`` (p = ℓ2 or ℓ∞) and the straight step
``θ + ξ``.  Two are registered:

* :class:`~hideseek.geometry.adaptive.AdaptiveGeometry` (``"adaptive"``): ``c = |θ|``,
  adaptive sharpness (docs/maths.md §6), the free part of the geodesic measures too;
* :class:`~hideseek.geometry.euclidean.EuclideanGeometry` (``"euclidean"``): ``c = 1``, SAM's
  plain ball.

They are siblings behind :class:`FreePart`, the interface below, as the pair metrics are behind
:class:`~hideseek.geometry.metrics.PairMetric`.  A free part answers the product geometry's and
the solvers' questions (the ball, the steepest-ascent direction, a random draw) and, for
:class:`~hideseek.curvature.RiemannianHessian`, those of its metric ``g = diag(1/c²)``: the
inverse metric, the inner product, whitening, and the two terms a non-constant metric adds to a
Hessian-vector product (docs/maths.md §14).

:data:`FREE_PARTS` maps a name to its class; :class:`~hideseek.measures.Measure` looks the
geometry's name up there (``Measure(geometry="euclidean")``), so adding a free part
(docs/architecture.md, "Adding a free part") is one module with a :func:`register_free_part`
class and its import in :mod:`hideseek.geometry`.
"""
from __future__ import annotations

from typing import ClassVar, Sequence

import torch
from torch import Tensor

from ..utils import register_named

Tangent = list[Tensor]


class FreePart:
    """The geometry of the free parameters ``theta`` (named ``names``): an elementwise ball
    ``‖ξ ⊘ c‖_p ≤ ρ`` and the straight step ``θ + ξ``.

    A subclass sets :attr:`name` and :attr:`measure_prefix` and defines the methods that raise
    ``NotImplementedError`` here.

    Parameters
    ----------
    names, theta:
        Parameter names and their values at θ (one tangent tensor each).
    p:
        ``"l2"`` or ``"linf"``.
    """

    #: the registered name, also the :attr:`hideseek.measures.Measure.geometry` that selects it
    name: ClassVar[str] = ""
    #: the prefix of the measure names of each kind (``"worst"``, ``"average"``) before the ``p``
    measure_prefix: ClassVar[dict[str, str]] = {}

    def __init__(self, names: Sequence[str], theta: Sequence[Tensor], p: str = "l2") -> None:
        if p not in ("l2", "linf"):
            raise ValueError(f"p must be 'l2' or 'linf', got {p!r}")
        self.p = p
        self.names = list(names)
        self.theta = [t.detach() for t in theta]

    @classmethod
    def measure_name(cls, p: str, kind: str) -> str:
        """The name of the measure of this ball (``m_apgd_l2``, ``avg_euclidean_linf`` …)."""
        return cls.measure_prefix[kind] + p

    # ------------------------------------------------------------------ layout
    @property
    def n_tensors(self) -> int:
        return len(self.theta)

    def zeros(self) -> Tangent:
        return [torch.zeros_like(t) for t in self.theta]

    def point(self, x: Tangent, out: dict[str, Tensor]) -> None:
        """Write ``θ + ξ`` into ``out`` (name → tensor)."""
        for name, t, xi in zip(self.names, self.theta, x):
            out[name] = t + xi

    # ------------------------------------------------------------------ the ball (solvers)
    @property
    def scale(self) -> list[Tensor]:
        """The scale ``c`` per tensor (broadcastable to it)."""
        raise NotImplementedError

    def sqnorm_terms(self, x: Tangent) -> list[Tensor]:
        """Scalars whose sum is ``‖ξ ⊘ c‖₂²``."""
        raise NotImplementedError

    def linf_terms(self, x: Tangent) -> list[Tensor]:
        """``max |ξ ⊘ c|`` per (non-empty) tensor."""
        raise NotImplementedError

    def project(self, x: Tangent) -> Tangent:
        """Onto the allowed perturbations (zero where the scale vanishes)."""
        raise NotImplementedError

    def rgrad(self, egrad: Tangent, inplace: bool = False) -> Tangent:
        """Steepest ℓ2 ascent direction ``c² ⊙ g`` (not normalised); ``inplace``: may
        overwrite ``egrad``."""
        raise NotImplementedError

    def linf_direction(self, egrad: Tangent, inplace: bool = False) -> Tangent:
        """Steepest ℓ∞ ascent direction ``sign(g) ⊙ c`` (unit norm)."""
        raise NotImplementedError

    def linf_ball(self, x: Tangent, rho: float, inplace: bool = False) -> Tangent:
        """Projection onto the box ``‖ξ ⊘ c‖_∞ ≤ ρ``."""
        raise NotImplementedError

    def draw(self, randn) -> Tangent:
        """A random tangent before normalisation: ``c ⊙ z`` (ℓ2) or ``c ⊙ sign(z)`` (ℓ∞, the
        box's corners), ``z`` standard normal from ``randn(like)``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the metric (curvature)
    def inv_metric(self, g: Tangent) -> Tangent:
        """``g⁻¹∇ = c² ⊙ ∇``: the metric dual of a Euclidean gradient."""
        raise NotImplementedError

    def inner_terms(self, x: Tangent, y: Tangent) -> list[Tensor]:
        """Scalars whose sum is ``⟨x, y⟩_g = Σ x y / c²`` (one per tensor)."""
        raise NotImplementedError

    def whiten(self, x: Tangent) -> Tangent:
        """``w = g^{1/2} ξ = ξ ⊘ c`` (zero where the scale vanishes)."""
        raise NotImplementedError

    def unwhiten(self, w: Tangent) -> Tangent:
        """``ξ = g^{-1/2} w = c ⊙ w``."""
        raise NotImplementedError

    def hessian_terms(self, hv: Tangent, x: Tangent, egrad: Tangent) -> Tangent:
        """``g⁻¹∇²f ξ + (D_ξ g⁻¹)∇f + Γ(ξ, g⁻¹∇f)`` from ``hv = g⁻¹∇²f ξ``, ``x = ξ`` and
        ``egrad = ∇f`` (docs/maths.md §14): the covariant derivative of the gradient field."""
        raise NotImplementedError


#: the free parts by name (registration order)
FREE_PARTS: dict[str, type[FreePart]] = {}


def register_free_part(cls: type[FreePart]) -> type[FreePart]:
    """Add a :class:`FreePart` subclass to :data:`FREE_PARTS` under ``cls.name`` (usable as a
    class decorator); a name already taken by another class is an error."""
    if not (isinstance(cls, type) and issubclass(cls, FreePart)) or not cls.name:
        raise TypeError(f"register_free_part needs a FreePart subclass with a name, got {cls!r}")
    return register_named(FREE_PARTS, cls.name, cls, "free part")


def free_part_names() -> tuple[str, ...]:
    """The registered free-part names, in registration order."""
    return tuple(FREE_PARTS)


def get_free_part(part: "str | type[FreePart]") -> type[FreePart]:
    """The free-part class for a registered name or a :class:`FreePart` subclass."""
    if isinstance(part, type) and issubclass(part, FreePart):
        return part
    if isinstance(part, str) and part in FREE_PARTS:
        return FREE_PARTS[part]
    raise ValueError(f"free part must be one of {free_part_names()} (or a FreePart subclass), got {part!r}")
