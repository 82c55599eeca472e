r"""Quotient geometry of GL(h) pairs, batched.

A *pair* is two matrices ``G`` (n × h) and ``H`` (m × h) of which a network uses only
``G Hᵀ``.  Every invertible ``A`` acts as ``(G, H)·A = (G A, H A⁻ᵀ)`` without changing the
function.  All functions here work on stacks: ``G`` of shape ``(B, n, h)``, ``H`` of shape
``(B, m, h)``, tangent vectors of the same shapes; ``B`` runs over heads and layers.

Two symmetry-compatible metrics (paper Eqs. 9 and 10), with ``S_G = GᵀG``, ``S_H = HᵀH``:

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

from dataclasses import dataclass

import torch
from torch import Tensor

METRICS = ("invariant", "mixed")


def _t(x: Tensor) -> Tensor:
    return x.transpose(-1, -2)


def _eye_like(S: Tensor) -> Tensor:
    return torch.eye(S.shape[-1], dtype=S.dtype, device=S.device).expand_as(S)


def _spd_inverse(S: Tensor) -> Tensor:
    """Inverse of a batch of symmetric positive definite matrices via Cholesky."""
    L, info = torch.linalg.cholesky_ex(S)
    if bool((info != 0).any()):
        bad = int((info != 0).nonzero()[0])
        raise ValueError(
            f"a Gram matrix GᵀG or HᵀH is singular (pair {bad} of the stack): the weights of "
            "an attention head are rank deficient. Use the ε relaxation (eps > 0) or the "
            "adaptive measure for this model."
        )
    return torch.cholesky_inverse(L)


def _check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")


@dataclass
class PairGeometry:
    """Everything about a stack of GL(h) pairs at a fixed point ``(G, H)``.

    Parameters
    ----------
    G, H:
        ``(B, n, h)`` and ``(B, m, h)``; each pair must have full column rank (or ε > 0).
    metric:
        ``"invariant"`` or ``"mixed"``.
    eps:
        ε relaxation, ``S ↦ S + ε I`` wherever ``S`` is inverted.
    """

    G: Tensor
    H: Tensor
    metric: str = "invariant"
    eps: float = 0.0

    def __post_init__(self) -> None:
        _check_metric(self.metric)
        if self.G.dim() != 3 or self.H.dim() != 3 or self.G.shape[0] != self.H.shape[0] \
                or self.G.shape[-1] != self.H.shape[-1]:
            raise ValueError(f"G, H must be (B, n, h) and (B, m, h); got {tuple(self.G.shape)}, "
                             f"{tuple(self.H.shape)}")
        dt = self.G.dtype
        G64, H64 = self.G.double(), self.H.double()
        SG, SH = _t(G64) @ G64, _t(H64) @ H64
        SGt = SG + self.eps * _eye_like(SG)
        SHt = SH + self.eps * _eye_like(SH)
        SGi, SHi = _spd_inverse(SGt), _spd_inverse(SHt)
        cast = lambda x: x.to(dt)  # noqa: E731
        self.SG, self.SH = cast(SG), cast(SH)
        self.SGt, self.SHt = cast(SGt), cast(SHt)
        self.SGi, self.SHi = cast(SGi), cast(SHi)
        if self.metric == "invariant":
            # A X + X B = C with A = S̃_G S_H, B = S_G S̃_H (A = B = S_G S_H when ε = 0).
            L = torch.linalg.cholesky(SGt)
            d, Q = torch.linalg.eigh(_t(L) @ SH @ L)
            VA = L @ Q                                               # A = VA diag(d) VA⁻¹
            VAi = _t(Q) @ torch.linalg.solve_triangular(L, _eye_like(L), upper=False)
            M = torch.linalg.cholesky(SHt)
            e, R = torch.linalg.eigh(_t(M) @ SG @ M)
            VB = torch.linalg.solve_triangular(_t(M), R, upper=True)  # B = VB diag(e) VB⁻¹
            VBi = _t(R) @ _t(M)
            denom = d.unsqueeze(-1) + e.unsqueeze(-2)
            # Precomputed products so that a projection costs a few matmuls.
            self._VAi = cast(VAi)
            self._Gp = cast(G64 @ SHt @ VB)          # G S̃_H V_B
            self._Hp = cast(H64 @ SGt @ _t(VAi))     # H S̃_G V_A⁻ᵀ
            self._VB = cast(VB)
            self._inv_denom = cast(1.0 / denom)
            self._GVBit = cast(G64 @ _t(VBi))        # G V_B⁻ᵀ
            self._HVA = cast(H64 @ VA)               # H V_A
            self._VBi = cast(VBi)
            self._VAt = cast(_t(VA))
        else:
            self._GSGi = cast(G64 @ SGi)
            self._HSHi = cast(H64 @ SHi)

    # ------------------------------------------------------------------ metric
    def _metric_mats(self) -> tuple[Tensor, Tensor]:
        """Matrices ``(M_G, M_H)`` with ``g(ξ, η) = tr(M_G ξ_Gᵀ η_G) + tr(M_H ξ_Hᵀ η_H)``."""
        if self.metric == "invariant":
            return self.SGi, self.SHi
        return self.SH, self.SG

    def inner(self, xG: Tensor, xH: Tensor, yG: Tensor, yH: Tensor) -> Tensor:
        """Metric inner product, one value per pair: shape ``(B,)``."""
        MG, MH = self._metric_mats()
        return ((xG @ MG) * yG).sum((-1, -2)) + ((xH @ MH) * yH).sum((-1, -2))

    def sqnorm(self, xG: Tensor, xH: Tensor) -> Tensor:
        return self.inner(xG, xH, xG, xH)

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
        if self.metric == "invariant":
            # X = Λᵀ solves (S̃_G S_H) X + X (S_G S̃_H) = ξ_Gᵀ G S̃_H − S̃_G Hᵀ ξ_H.
            # (products ordered so that every n×h factor meets an h×h one)
            Y = (self._VAi @ (_t(xG) @ self._Gp) - (_t(self._Hp) @ xH) @ self._VB) * self._inv_denom
            # ξ_G − G Xᵀ = ξ_G − G V_B⁻ᵀ Yᵀ V_Aᵀ ;  ξ_H + H X = ξ_H + H V_A Y V_B⁻¹
            return xG - self._GVBit @ (_t(Y) @ self._VAt), xH + self._HVA @ (Y @ self._VBi)
        # mixed: X = Λᵀ = ½ (ξ_Gᵀ G S̃_G⁻¹ − S̃_H⁻¹ Hᵀ ξ_H), explicit.
        X = 0.5 * (_t(xG) @ self._GSGi - _t(self._HSHi) @ xH)
        return xG - self.G @ _t(X), xH + self.H @ X

    # --------------------------------------------------------------- gradient
    def egrad_to_rgrad(self, gG: Tensor, gH: Tensor, project: bool = True) -> tuple[Tensor, Tensor]:
        """Riemannian gradient from the Euclidean one (then projected to horizontal)."""
        if self.metric == "invariant":
            rG, rH = gG @ self.SGt, gH @ self.SHt
        else:
            rG, rH = gG @ self.SHi, gH @ self.SGi
        return self.project(rG, rH) if project else (rG, rH)

    # --------------------------------------------------------------- geodesics
    def acceleration(self, xG: Tensor, xH: Tensor) -> tuple[Tensor, Tensor]:
        """Geodesic acceleration ``γ̈(0) = −Γ(ξ, ξ)`` for initial velocity ξ."""
        G, H = self.G, self.H
        # h×h pieces first: M = ξ_Gᵀ G (so Gᵀ ξ_G = Mᵀ), N = ξ_Hᵀ H
        M, N = _t(xG) @ G, _t(xH) @ H
        if self.metric == "invariant":
            aG = xG @ (self.SGi @ (M + _t(M))) - G @ (self.SGi @ (_t(xG) @ xG))
            aH = xH @ (self.SHi @ (N + _t(N))) - H @ (self.SHi @ (_t(xH) @ xH))
            return aG, aH
        aG = G @ ((_t(xH) @ xH) @ self.SHi) - xG @ ((N + _t(N)) @ self.SHi)
        aH = H @ ((_t(xG) @ xG) @ self.SGi) - xH @ ((M + _t(M)) @ self.SGi)
        return aG, aH

    def step(self, xG: Tensor, xH: Tensor, christoffel: bool | str = True,
             t: float = 1.0) -> tuple[Tensor, Tensor]:
        """Point reached at time ``t`` from ``(G, H)`` with velocity ξ.

        ``christoffel=True``: second-order geodesic ``θ + tξ + (t²/2) γ̈(0)``;
        ``False``: straight line ``θ + tξ``; ``"exact"``: the closed-form geodesic for h = 1
        (ε = 0): :func:`exact_geodesic_gl1` (invariant, any n, m) or
        :func:`exact_geodesic_gl1_mixed` (mixed, n = m = 1; raises where the geodesic ends
        at G = H = 0 before time t).
        """
        if christoffel == "exact":
            if self.eps != 0.0 or self.G.shape[-1] != 1:
                raise ValueError("exact geodesics are available for h = 1 and eps = 0 only")
            if self.metric == "mixed":
                return exact_geodesic_gl1_mixed(self.G, self.H, xG, xH, t)
            return exact_geodesic_gl1(self.G, xG, t), exact_geodesic_gl1(self.H, xH, t)
        if christoffel:
            aG, aH = self.acceleration(xG, xH)
            return self.G + t * xG + 0.5 * t * t * aG, self.H + t * xH + 0.5 * t * t * aH
        return self.G + t * xG, self.H + t * xH


def _inv_sqrt_spd(M: Tensor) -> Tensor:
    w, U = torch.linalg.eigh(M.double())
    return ((U * w.clamp_min(torch.finfo(torch.float64).tiny).rsqrt().unsqueeze(-2)) @ _t(U)).to(M.dtype)


def exact_geodesic_gl1(G: Tensor, xi: Tensor, t: float = 1.0) -> Tensor:
    r"""Exact geodesic of the metric ``|ξ|² / |g|²`` on ``Rⁿ \ {0}`` (one factor of the
    invariant metric when h = 1), batched over ``(B, n, 1)``.

    With ``g = r ω`` the metric is ``d(log r)² + |dω|²``: a flat line in ``log r`` times a
    great circle on the sphere.  For n = 1 this is ``g e^{t ξ/g}``.
    """
    g, x = G.squeeze(-1), xi.squeeze(-1)
    r = g.norm(dim=-1, keepdim=True)
    w = g / r
    radial = (w * x).sum(-1, keepdim=True) / r          # d(log r)/dt
    tang = x / r - radial * w                            # dω/dt
    speed = tang.norm(dim=-1, keepdim=True)
    safe = torch.where(speed > 0, speed, torch.ones_like(speed))
    direction = torch.where(speed > 0, tang / safe, torch.zeros_like(tang))
    omega = w * torch.cos(speed * t) + direction * torch.sin(speed * t)
    return (r * torch.exp(radial * t) * omega).unsqueeze(-1)


def exact_geodesic_gl1_mixed(G: Tensor, H: Tensor, xG: Tensor, xH: Tensor,
                             t: float = 1.0) -> tuple[Tensor, Tensor]:
    r"""Exact geodesic of the mixed metric ``H² dG² + G² dH²`` for scalar pairs
    (n = m = h = 1), batched over ``(B, 1, 1)``; ``G, H ≠ 0`` (docs/maths.md §5.4).

    With ``β̃ = |G H|`` and ``s = log |G / H|`` the metric is ``½ (dβ̃² + β̃² ds²)``: half the
    flat metric of the plane in polar coordinates, the angle ``s`` unbounded (a flat cone
    over the real line).  In the complex coordinate ``P = β̃ e^{i s}`` geodesics are straight
    lines, ``P(t) = P₀ (1 + t w)`` with ``w = a + i c``, ``a = ξ_G/G + ξ_H/H``,
    ``c = ξ_G/G − ξ_H/H``.  Writing ``z = 1 + t w`` (``θ = arg z ∈ (−π, π)``):

        |G(t)| = |G| √|z| e^{θ/2},   |H(t)| = |H| √|z| e^{−θ/2},   signs unchanged.

    Horizontal velocities (``ξ_G/G = ξ_H/H = b``) give ``c = 0`` and
    ``(G, H)(t) = (G, H) √(1 + 2 b t)``: the geodesic is **incomplete**, it reaches
    ``G = H = 0`` (where the metric degenerates) at ``t = −1/(2b)`` when ``b < 0``.  Every
    other geodesic (``c ≠ 0``) misses the tip and is defined for all t.  Reaching the tip
    exactly at ``t`` is allowed (the end point ``(0, 0)``); asking for a time past the end
    raises ``ValueError``.
    """
    if G.shape[-2:] != (1, 1) or H.shape[-2:] != (1, 1):
        raise ValueError("exact_geodesic_gl1_mixed needs scalar pairs, G and H of shape (B, 1, 1); "
                         f"got {tuple(G.shape)} and {tuple(H.shape)}")
    if bool((G == 0).any()) or bool((H == 0).any()):
        raise ValueError("the mixed-metric geodesic needs G != 0 and H != 0 (full column rank)")
    bg, bh = xG / G, xH / H
    a, c = bg + bh, bg - bh
    re, im = 1.0 + t * a, t * c
    # a velocity meant to end exactly at the tip (b = −1/(2t)) may land a few ulps past it
    tol = 8 * torch.finfo(re.dtype).eps * (1.0 + (t * a).abs())
    at_tip = (im == 0) & (re < 0) & (re >= -tol)
    re = torch.where(at_tip, torch.zeros_like(re), re)
    ended = (im == 0) & (re < 0)
    if bool(ended.any()):
        raise ValueError(
            f"{int(ended.sum())} geodesic(s) of the mixed metric end at G = H = 0 before t = {t}: "
            "a horizontal velocity with ξ_G/G = ξ_H/H < −1/(2t) leaves the domain. Keep "
            "perturbations inside the geodesic ball (ξ_G/G ≥ −1/(2t)) or use a smaller radius.")
    mod = torch.hypot(re, im)
    theta = torch.atan2(im, re)
    half = torch.exp(0.5 * theta)
    root = mod.sqrt()
    return G * root * half, H * root / half


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
