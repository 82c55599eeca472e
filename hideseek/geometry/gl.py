r"""Quotient geometry of GL(h) pairs, batched.

A *pair* is two matrices ``G`` (n × h) and ``H`` (m × h) of which a network uses only
``G Hᵀ``.  Every invertible ``A`` acts as ``(G, H)·A = (G A, H A⁻ᵀ)`` without changing the
function.  All functions here work on stacks: ``G`` of shape ``(B, n, h)``, ``H`` of shape
``(B, m, h)``, tangent vectors of the same shapes; ``B`` runs over heads and layers.

Two symmetry-compatible metrics (paper Eqs. 9 and 10; one class each in
:mod:`hideseek.geometry.metrics`, registered in its ``METRICS``), with ``S_G = GᵀG``, ``S_H = HᵀH``:

* ``"invariant"``: ``g(ξ, η) = tr(S_G⁻¹ ξ_Gᵀ η_G) + tr(S_H⁻¹ ξ_Hᵀ η_H)``
* ``"mixed"``:     ``g(ξ, η) = tr(S_H ξ_Gᵀ η_G) + tr(S_G ξ_Hᵀ η_H)``

ε relaxation (paper Appendix H.2): every inverted ``S`` becomes ``S + ε I``.  For the
invariant metric this is exactly the geometry of the relaxed metric (the projection then
solves a two-sided Sylvester equation); for the mixed metric, whose metric tensor has no
inverse, ε only regularises the gradient, the projection and the step, and at ε > 0 the
projection is horizontal up to O(ε).

The point is fixed during a sharpness computation, so :class:`PairGeometry` precomputes
everything that depends only on it (Gram matrices, inverses, the eigen-decompositions that
turn the Sylvester solve into matrix products), in float64, and then works in the dtype of
the inputs.  See docs/maths.md §1–5 for the formulas.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from . import geodesic as _geo
from .geodesic import exact_geodesic_gl1, exact_geodesic_gl1_mixed  # noqa: F401 (re-exported)
from .metrics import (METRICS, InvariantMetric, MixedMetric, PairMetric, _eye_like, _spd_inverse,  # noqa: F401
                      _t, get_metric)


@dataclass
class PairGeometry:
    """Everything about a stack of GL(h) pairs at a fixed point ``(G, H)``.

    Assembled from a metric object (:mod:`hideseek.geometry.metrics`), which owns the
    metric, the horizontal projection, the metric dual of a gradient and the Christoffel
    contraction; this class adds what every metric shares (vertical vectors, whitening,
    the step).

    Parameters
    ----------
    G, H:
        ``(B, n, h)`` and ``(B, m, h)``; each pair must have full column rank (or ε > 0).
    metric:
        A registered metric name (``"invariant"``, ``"mixed"``, … :data:`METRICS`), a
        :class:`~hideseek.geometry.metrics.PairMetric` subclass, or an instance of one
        built at this ``(G, H)`` (then used as it is; its ε wins).  After construction
        :attr:`metric` is the name and :attr:`impl` the metric object.
    eps:
        ε relaxation, ``S ↦ S + ε I`` wherever ``S`` is inverted.

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> gen = torch.Generator().manual_seed(0)
    >>> rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)
    >>> G, H = rand(1, 5, 2), rand(1, 4, 2)
    >>> geo = hs.PairGeometry(G, H, metric="invariant")
    >>> xi = geo.project(rand(1, 5, 2), rand(1, 4, 2))                  # a horizontal vector
    >>> Lam = rand(1, 2, 2)
    >>> vG, vH = G @ Lam, -H @ Lam.mT                                  # tangent to the orbit (G A, H A⁻ᵀ), by hand
    >>> abs(geo.inner(*xi, vG, vH).item()) < 1e-12                    # horizontal ⟂ vertical in the metric
    True
    >>> all(torch.allclose(a, b) for a, b in zip(geo.project(*xi), xi))   # the projection is idempotent
    True
    """

    G: Tensor
    H: Tensor
    metric: str = "invariant"
    eps: float = 0.0
    impl: PairMetric = field(init=False, repr=False)
    #: RK4 steps of the integrated geodesic (``step(…, "exact")`` without a closed form):
    #: ``None`` until chosen by :meth:`integrated_step` at the first nonzero velocity, then fixed
    geodesic_steps: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.G.dim() != 3 or self.H.dim() != 3 or self.G.shape[0] != self.H.shape[0] \
                or self.G.shape[-1] != self.H.shape[-1]:
            raise ValueError(f"G, H must be (B, n, h) and (B, m, h); got {tuple(self.G.shape)}, "
                             f"{tuple(self.H.shape)}")
        cls = get_metric(self.metric)
        if isinstance(self.metric, PairMetric):
            if self.metric.G is not self.G or self.metric.H is not self.H:
                raise ValueError("a metric object given to PairGeometry must be built at the same (G, H)")
            self.impl, self.eps = self.metric, self.metric.eps
        else:
            self.impl = cls(self.G, self.H, self.eps)
        self.metric = cls.name
        m = self.impl
        self.SG, self.SH, self.SGt, self.SHt, self.SGi, self.SHi = m.SG, m.SH, m.SGt, m.SHt, m.SGi, m.SHi

    # ------------------------------------------------------------------ metric
    def _metric_mats(self) -> tuple[Tensor, Tensor]:
        """Matrices ``(M_G, M_H)`` with ``g(ξ, η) = tr(M_G ξ_Gᵀ η_G) + tr(M_H ξ_Hᵀ η_H)``."""
        return self.impl.mats()

    def inner(self, xG: Tensor, xH: Tensor, yG: Tensor, yH: Tensor) -> Tensor:
        """Metric inner product, one value per pair: shape ``(B,)``."""
        return self.impl.inner(xG, xH, yG, yH)

    def sqnorm(self, xG: Tensor, xH: Tensor) -> Tensor:
        return self.impl.sqnorm(xG, xH)

    def whiten_inverse(self, zG: Tensor, zH: Tensor) -> tuple[Tensor, Tensor]:
        """Map isotropic coordinates to tangent vectors: ``‖ξ‖_g = ‖z‖_F``."""
        MG, MH = self._metric_mats()
        return zG @ _inv_sqrt_spd(MG), zH @ _inv_sqrt_spd(MH)

    # ------------------------------------------------------ vertical / horizontal
    def vertical(self, Lam: Tensor) -> tuple[Tensor, Tensor]:
        """The vertical vector ``(G Λ, −H Λᵀ)`` generated by ``Λ`` (B, h, h)."""
        return self.G @ Lam, -(self.H @ _t(Lam))

    def horizontal_residual(self, xG: Tensor, xH: Tensor) -> Tensor:
        """``g(ξ, (GΛ, −HΛᵀ))`` as a linear function of Λ: the (B, h, h) matrix ``R`` with
        ``g(ξ, vertical(Λ)) = ⟨R, Λ⟩_F``.  ξ is horizontal iff ``R = 0``."""
        MG, MH = self._metric_mats()
        # tr(M_G ξ_Gᵀ G Λ) − tr(M_H ξ_Hᵀ H Λᵀ)  →  R = (M_G ξ_Gᵀ G)ᵀ − M_H ξ_Hᵀ H
        return _t(MG @ _t(xG) @ self.G) - MH @ _t(xH) @ self.H

    def project(self, xG: Tensor, xH: Tensor) -> tuple[Tensor, Tensor]:
        """Orthogonal (in the metric) projection onto the horizontal space."""
        return self.impl.project(xG, xH)

    # --------------------------------------------------------------- gradient
    def egrad_to_rgrad(self, gG: Tensor, gH: Tensor, project: bool = True) -> tuple[Tensor, Tensor]:
        """Riemannian gradient from the Euclidean one (then projected to horizontal)."""
        rG, rH = self.impl.dual(gG, gH)
        return self.project(rG, rH) if project else (rG, rH)

    # --------------------------------------------------------------- geodesics
    def acceleration(self, xG: Tensor, xH: Tensor) -> tuple[Tensor, Tensor]:
        """Geodesic acceleration ``γ̈(0) = −Γ(ξ, ξ)`` for initial velocity ξ."""
        return self.impl.acceleration(xG, xH)

    def step(self, xG: Tensor, xH: Tensor, christoffel: bool | str = True,
             t: float = 1.0) -> tuple[Tensor, Tensor]:
        """Point reached at time ``t`` from ``(G, H)`` with velocity ξ.

        ``christoffel=True``: second-order geodesic ``θ + tξ + (t²/2) γ̈(0)``;
        ``False``: straight line ``θ + tξ``; ``"exact"``: the geodesic itself — the metric's
        closed form where it has one (GL(1), ε = 0: :func:`exact_geodesic_gl1` for the
        invariant metric, any n, m; :func:`exact_geodesic_gl1_mixed` for the mixed metric,
        n = m = 1, which raises where the geodesic ends at G = H = 0 before time t), else
        the integrated geodesic equation (:meth:`integrated_step`, docs/maths.md §5.6).
        """
        if christoffel == "exact":
            closed = self.impl.closed_form_geodesic(xG, xH, t)
            return closed if closed is not None else self.integrated_step(xG, xH, t)
        if christoffel:
            aG, aH = self.acceleration(xG, xH)
            return self.G + t * xG + 0.5 * t * t * aG, self.H + t * xH + 0.5 * t * t * aH
        return self.G + t * xG, self.H + t * xH

    # ------------------------------------------------------ integrated geodesics
    def _accel_at(self, G: Tensor, H: Tensor, vG: Tensor, vH: Tensor) -> tuple[Tensor, Tensor]:
        return self.impl.acceleration_at(G, H, vG, vH, self.eps)

    def _monitor(self):
        """A rank-loss monitor for metrics with incomplete geodesics (None for complete ones);
        the smallest Gram eigenvalues at the (fixed) start are computed once."""
        if self.impl.complete:
            return None
        if getattr(self, "_start_eigenvalues", None) is None:
            self._start_eigenvalues = _geo.gram_min_eigenvalues(self.G, self.H)
        return _geo.RankLossMonitor(self.G, self.H, start_eigenvalues=self._start_eigenvalues)

    def choose_geodesic_steps(self, xG: Tensor, xH: Tensor, t: float = 1.0, rtol: float | None = None) -> int | None:
        """RK4 step count for velocities like ξ: step doubling in float64 without autograd
        (:func:`hideseek.geometry.geodesic.choose_steps`; the end point moves by less than
        ``rtol ‖ξ‖``, default :data:`~hideseek.geometry.geodesic.GEODESIC_RTOL`, both in the
        metric at θ, so the choice is invariant under the group action).  ``None`` when ξ = 0."""
        with torch.no_grad():
            G64, H64, x64G, x64H = (a.detach().double() for a in (self.G, self.H, xG, xH))
            MG, MH = type(self.impl).blocks(G64, H64, self.eps)

            def sqnorm(a, b):
                return ((a @ MG) * a).sum((-1, -2)) + ((b @ MH) * b).sum((-1, -2))

            if not bool((sqnorm(x64G, x64H) > 0).any()):
                return None
            cls, eps = type(self.impl), self.eps
            return _geo.choose_steps(lambda g, h, vg, vh: cls.acceleration_at(g, h, vg, vh, eps),
                                     G64, H64, x64G, x64H, sqnorm, t, rtol,
                                     monitor_factory=self._monitor)

    def integrated_step(self, xG: Tensor, xH: Tensor, t: float = 1.0,
                        steps: int | None = None) -> tuple[Tensor, Tensor]:
        """``γ_ξ(t)`` by integrating ``(x, v)' = (v, −Γ_x(v, v))`` with classical RK4
        (docs/maths.md §5.6), Γ at the moving point with that point's Gram inverses
        (:meth:`~hideseek.geometry.metrics.PairMetric.acceleration_at`, batched).

        Step count: ``steps`` if given; else :attr:`geodesic_steps`, which the first call
        with a nonzero ξ sets once by step doubling (:meth:`choose_geodesic_steps`) and which
        then stays fixed, so that within one search ``ξ ↦ γ_ξ(t)`` is one smooth map that
        autograd differentiates (a call with ξ = 0 uses one step and fixes nothing; its
        derivative is the identity whatever the count).  In a sharpness search the first
        nonzero ξ is Auto-PGD's first step, on the sphere of radius ρ.  Metrics with
        incomplete geodesics (mixed) refuse in one line once a Gram matrix loses rank
        along the path (:class:`~hideseek.geometry.geodesic.RankLossMonitor`)."""
        n = steps if steps is not None else self.geodesic_steps
        if n is None:
            n = self.choose_geodesic_steps(xG, xH, t)
            if n is None:
                n = 1
            else:
                self.geodesic_steps = n
        monitor = self._monitor()
        if monitor is None:
            return _geo.rk4_geodesic(self._accel_at, self.G, self.H, xG, xH, n, t,
                                     first_accel=self.acceleration(xG, xH))[0]

        def accel(g, h, vg, vh):
            # the Gram matrices of every point where Γ is evaluated (each stage point, each
            # step's start) serve both Γ and the rank-loss monitor
            grams = (_t(g) @ g, _t(h) @ h)
            monitor.record(*grams)
            return self.impl.acceleration_at(g, h, vg, vh, self.eps, grams=grams)

        try:
            end = _geo.rk4_geodesic(accel, self.G, self.H, xG, xH, n, t,
                                    first_accel=self.acceleration(xG, xH))[0]
        except torch.linalg.LinAlgError:   # an exactly singular Gram matrix: the monitor's event, one line
            raise _geo.singular_gram_refusal(t) from None
        monitor(*end, t)          # and the end point
        monitor.check(t)
        return end


def _inv_sqrt_spd(M: Tensor) -> Tensor:
    w, U = torch.linalg.eigh(M.double())
    return ((U * w.clamp_min(torch.finfo(torch.float64).tiny).rsqrt().unsqueeze(-2)) @ _t(U)).to(M.dtype)


# ------------------------------------------------------------------ functional API
def metric_inner(G, H, xG, xH, yG, yH, metric="invariant", eps=0.0) -> Tensor:
    return PairGeometry(G, H, metric, eps).inner(xG, xH, yG, yH)


def horizontal_projection(G, H, xG, xH, metric="invariant", eps=0.0):
    return PairGeometry(G, H, metric, eps).project(xG, xH)


def riemannian_gradient(G, H, gG, gH, metric="invariant", eps=0.0):
    return PairGeometry(G, H, metric, eps).egrad_to_rgrad(gG, gH)


def geodesic_acceleration(G, H, xG, xH, metric="invariant", eps=0.0):
    return PairGeometry(G, H, metric, eps).acceleration(xG, xH)


def act(G: Tensor, H: Tensor, A: Tensor) -> tuple[Tensor, Tensor]:
    """The group action ``(G, H)·A = (G A, H A⁻ᵀ)``; also moves tangent vectors."""
    return G @ A, H @ _t(torch.linalg.inv(A))
