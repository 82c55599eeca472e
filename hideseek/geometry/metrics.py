r"""Pair metrics as objects, and the one registry of them (docs/maths.md §2–5, §13).

A *pair metric* is a GL(h)-invariant Riemannian metric on pairs ``(G, H)`` (``G`` n × h,
``H`` m × h) of the *block* form

    g(ξ, η) = tr(M_G ξ_Gᵀ η_G) + tr(M_H ξ_Hᵀ η_H),

with ``M_G``, ``M_H`` symmetric positive (semi)definite h × h matrices that depend on the
point (``S_G = GᵀG``, ``S_H = HᵀH``):

* :class:`InvariantMetric` (paper Eq. 9): ``M_G = S_G⁻¹``, ``M_H = S_H⁻¹``;
* :class:`MixedMetric` (paper Eq. 10):   ``M_G = S_H``,   ``M_H = S_G``.

ε relaxation (paper Appendix H.2): every inverted ``S`` becomes ``S̃ = S + ε I``.

One instance of a metric class is the metric *at a fixed point* of a batched stack of
pairs, ``G`` (B, n, h) and ``H`` (B, m, h): it precomputes in float64 everything that
depends only on the point (Gram matrices, inverses, eigen-decompositions) and then works in
the dtype of the inputs.  It owns

* the metric: :meth:`PairMetric.inner`, :meth:`~PairMetric.sqnorm`, :meth:`~PairMetric.mats`;
* the horizontal projection (full GL(h)): :meth:`~PairMetric.project`;
* the metric dual of a Euclidean gradient: :meth:`~PairMetric.dual`;
* the Christoffel contraction at the point, ``γ̈(0) = −Γ(ξ, ξ)``:
  :meth:`~PairMetric.acceleration`; and at any other point (a moving point of an
  integrated geodesic, docs/maths.md §13): :meth:`~PairMetric.acceleration_at`;
* the normal equations of projections onto smaller symmetry groups (rotary, §12):
  :meth:`~PairMetric.normal_operators`.

Adding a metric (docs/architecture.md, "Adding a metric") is one subclass that sets
``name`` and defines :meth:`PairMetric.blocks` (the definition ``(M_G, M_H)`` as a
differentiable function of ``(G, H)``) and one :func:`register_metric` line.  Everything
else has a generic default that follows from the definition: the projection solves the
generalised Sylvester equation of the normal equations, the dual multiplies by ``M⁻¹`` and
the Christoffel contraction is ``g⁻¹ [Dg[ξ] ξ − ½ ∇(ξᵀ g ξ)]`` with the derivatives of
``blocks`` by autograd.  :class:`InvariantMetric` and :class:`MixedMetric` override them
with their closed forms (same values, fewer operations).  The property suite
(``tests/hideseek/geometry/test_properties.py``) runs over :data:`METRICS`.
"""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from ..utils import register_named
from .geodesic import exact_geodesic_gl1, exact_geodesic_gl1_mixed


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


def _generalised_eigh(A: Tensor, B: Tensor) -> tuple[Tensor, Tensor]:
    """``A V = B V diag(w)`` with ``Vᵀ B V = I`` (A symmetric, B SPD), batched."""
    L = torch.linalg.cholesky(B)
    Li = torch.linalg.solve_triangular(L, _eye_like(L), upper=False)
    w, U = torch.linalg.eigh(Li @ A @ _t(Li))
    return w, _t(Li) @ U


def _inv_moving(S: Tensor) -> Tensor:
    """Inverse of a batch of small SPD matrices at a moving point (differentiable), in the
    working dtype: the Gram matrix itself is formed in that dtype, so a float64 inverse
    would add two conversions (and their backward) per call without more accuracy."""
    return torch.linalg.inv(S)


def gram(G: Tensor, H: Tensor, eps: float = 0.0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(S_G, S_H, S̃_G, S̃_H)`` with ``S̃ = S + ε I``, batched (dtype of the inputs)."""
    SG, SH = _t(G) @ G, _t(H) @ H
    return SG, SH, SG + eps * _eye_like(SG), SH + eps * _eye_like(SH)


def _relaxed_gram_inverses(G: Tensor, H: Tensor, eps: float,
                           grams: "tuple[Tensor, Tensor] | None" = None) -> tuple[Tensor, Tensor]:
    """``(S̃_G⁻¹, S̃_H⁻¹)`` at a moving point, with as few tensor operations as possible (the
    integrated geodesic calls this four times per RK4 step, forward and backward);
    ``grams``: ``(GᵀG, HᵀH)`` when the caller has formed them."""
    SG, SH = (_t(G) @ G, _t(H) @ H) if grams is None else grams
    if eps:
        eye = torch.eye(SG.shape[-1], dtype=SG.dtype, device=SG.device)
        SG, SH = SG + eps * eye, SH + eps * eye
    return _inv_moving(SG), _inv_moving(SH)


class PairMetric:
    """A pair metric at a fixed point of a stack of pairs (module docstring).

    Parameters
    ----------
    G, H:
        ``(B, n, h)`` and ``(B, m, h)``; each pair of full column rank (or ε > 0 where the
        metric inverts a Gram matrix).
    eps:
        ε relaxation, ``S ↦ S + ε I`` wherever ``S`` is inverted.

    Attributes (dtype of the inputs, float64 versions with suffix ``64``): ``SG, SH``
    (Gram matrices), ``SGt, SHt`` (ε-relaxed), ``SGi, SHi`` (their inverses), ``MG, MH``
    (the blocks of the metric at the point).
    """

    #: registry name (``Measure(metric=name)``); set by every registered subclass
    name: ClassVar[str] = ""
    #: whether the methods at ε > 0 are exactly the geometry of the ε-relaxed metric
    #: (``blocks(G, H, eps)``); False where ε only regularises inverses (mixed: O(ε) off)
    eps_exact: ClassVar[bool] = True
    #: whether every geodesic is defined for all t (False: integrated geodesics watch for a
    #: Gram matrix losing rank and refuse, docs/maths.md §5.6)
    complete: ClassVar[bool] = True

    def __init__(self, G: Tensor, H: Tensor, eps: float = 0.0) -> None:
        if G.dim() != 3 or H.dim() != 3 or G.shape[0] != H.shape[0] or G.shape[-1] != H.shape[-1]:
            raise ValueError(f"G, H must be (B, n, h) and (B, m, h); got {tuple(G.shape)}, {tuple(H.shape)}")
        if isinstance(eps, bool) or not eps >= 0:
            raise ValueError(f"eps must be a number >= 0, got {eps!r}")
        self.G, self.H, self.eps = G, H, float(eps)
        self.dtype = G.dtype
        self.G64, self.H64 = G.double(), H.double()
        self.SG64, self.SH64, self.SGt64, self.SHt64 = gram(self.G64, self.H64, self.eps)
        self.SGi64, self.SHi64 = _spd_inverse(self.SGt64), _spd_inverse(self.SHt64)
        self.SG, self.SH = self.cast(self.SG64), self.cast(self.SH64)
        self.SGt, self.SHt = self.cast(self.SGt64), self.cast(self.SHt64)
        self.SGi, self.SHi = self.cast(self.SGi64), self.cast(self.SHi64)
        self.setup()

    def cast(self, x: Tensor) -> Tensor:
        """A float64 set-up quantity in the working dtype."""
        return x.to(self.dtype)

    # ------------------------------------------------------------ definition
    @classmethod
    def blocks(cls, G: Tensor, H: Tensor, eps: float = 0.0) -> tuple[Tensor, Tensor]:
        """The definition: ``(M_G, M_H)`` at ``(G, H)`` (batched, differentiable), with
        ``g(ξ, η) = tr(M_G ξ_Gᵀ η_G) + tr(M_H ξ_Hᵀ η_H)``.  Every subclass defines it."""
        raise NotImplementedError(f"{cls.__name__} must define blocks(G, H, eps)")

    def setup(self) -> None:
        """Precompute what the methods need at the point (float64, then cast).  The generic
        version: the blocks and the generalised eigen-decompositions of the projection."""
        MG, MH = type(self).blocks(self.G64, self.H64, self.eps)
        self.MG64, self.MH64 = MG, MH
        self.MG, self.MH = self.cast(MG), self.cast(MH)
        ops, _ = self.normal_operators()
        A1, B1, A2, B2 = ops
        d, V = _generalised_eigh(A1, A2)
        e, Z = _generalised_eigh(B2, B1)
        self._gV, self._gZ = self.cast(V), self.cast(Z)
        self._gden = self.cast(1.0 / (d.unsqueeze(-1) + e.unsqueeze(-2)))
        self._gN = tuple(self.cast(N) for N in self.normal_operators()[1])

    # ------------------------------------------------------------ metric
    def mats(self) -> tuple[Tensor, Tensor]:
        """``(M_G, M_H)`` at the point, working dtype."""
        return self.MG, self.MH

    def inner(self, xG: Tensor, xH: Tensor, yG: Tensor, yH: Tensor) -> Tensor:
        """Metric inner product, one value per pair: shape ``(B,)``."""
        MG, MH = self.mats()
        return ((xG @ MG) * yG).sum((-1, -2)) + ((xH @ MH) * yH).sum((-1, -2))

    def sqnorm(self, xG: Tensor, xH: Tensor) -> Tensor:
        return self.inner(xG, xH, xG, xH)

    # ------------------------------------------------------------ projection
    def normal_operators(self) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]:
        """float64 ``((A₁, B₁, A₂, B₂), (N_G, N_H))`` of the projection's normal equations
        ``⟨E, A₁ΛB₁ + A₂ΛB₂⟩ = ⟨E, Gᵀξ_G N_G − N_H ξ_Hᵀ H⟩`` for every ``E`` in the Lie
        algebra of the symmetry group (docs/maths.md §12).  Generic: from the blocks,
        ``g(ξ, (GΛ, −HΛᵀ)) = ⟨Gᵀξ_G M_G − M_H ξ_Hᵀ H, Λ⟩`` and ``𝒜(Λ) = S_G Λ M_G + M_H Λ S_H``."""
        return (self.SG64, self.MG64, self.MH64, self.SH64), (self.MG64, self.MH64)

    def project(self, xG: Tensor, xH: Tensor) -> tuple[Tensor, Tensor]:
        """Orthogonal (in the metric) projection onto the horizontal space of GL(h):
        ``ξ − (GΛ, −HΛᵀ)`` with Λ solving the normal equations (generic: two generalised
        eigen-decompositions turn the Sylvester equation into matrix products)."""
        NG, NH = self._gN
        C = _t(self.G) @ xG @ NG - NH @ _t(xH) @ self.H
        V, Z = self._gV, self._gZ
        Lam = V @ ((_t(V) @ C @ Z) * self._gden) @ _t(Z)
        return xG - self.G @ Lam, xH + self.H @ _t(Lam)

    # ------------------------------------------------------------ gradient
    def dual(self, gG: Tensor, gH: Tensor) -> tuple[Tensor, Tensor]:
        """Metric dual of a Euclidean gradient, ``(g_G M_G⁻¹, g_H M_H⁻¹)`` (not projected)."""
        return (torch.linalg.solve(self.MG, _t(gG)).transpose(-1, -2),
                torch.linalg.solve(self.MH, _t(gH)).transpose(-1, -2))

    # ------------------------------------------------------------ Christoffel
    def acceleration(self, xG: Tensor, xH: Tensor) -> tuple[Tensor, Tensor]:
        """Geodesic acceleration ``γ̈(0) = −Γ(ξ, ξ)`` at the point for velocity ξ."""
        return self.acceleration_at(self.G, self.H, xG, xH, self.eps)

    @classmethod
    def acceleration_at(cls, G: Tensor, H: Tensor, xG: Tensor, xH: Tensor,
                        eps: float = 0.0, grams: "tuple[Tensor, Tensor] | None" = None) -> tuple[Tensor, Tensor]:
        """``−Γ_{(G,H)}(ξ, ξ)`` at any point (batched, differentiable in all arguments; the
        Gram inverses of *that* point; ``grams = (GᵀG, HᵀH)`` if the caller has them, a hint
        that closed forms may use).  Generic: the geodesic equation of a block metric,
        ``−Γ(ξ, ξ) = g⁻¹[½ ∇(ξᵀ g ξ) − Dg[ξ] ξ]``, with the derivatives of :meth:`blocks`
        by forward- and reverse-mode autograd."""
        def quad(Gp, Hp):
            MG, MH = cls.blocks(Gp, Hp, eps)
            return ((xG @ MG) * xG).sum() + ((xH @ MH) * xH).sum()

        qG, qH = torch.func.grad(quad, argnums=(0, 1))(G, H)
        (MG, MH), (dMG, dMH) = torch.func.jvp(lambda a, b: cls.blocks(a, b, eps), (G, H), (xG, xH))
        rG = 0.5 * qG - xG @ dMG
        rH = 0.5 * qH - xH @ dMH
        return (torch.linalg.solve(MG, _t(rG)).transpose(-1, -2),
                torch.linalg.solve(MH, _t(rH)).transpose(-1, -2))

    # ------------------------------------------------------------ closed-form geodesic
    def closed_form_geodesic(self, xG: Tensor, xH: Tensor, t: float = 1.0) -> "tuple[Tensor, Tensor] | None":
        """``γ_ξ(t)`` in closed form where the metric has one at this point's shapes and ε,
        else ``None`` (the geodesic is then integrated, docs/maths.md §5.6)."""
        return None


class _GramAccelerationMetric(PairMetric):
    """A metric whose Christoffel contraction is a closed form in the relaxed Gram inverses
    ``S̃_G⁻¹, S̃_H⁻¹`` (``_accel``): the fixed point's precomputed ones, or a moving point's."""

    @staticmethod
    def _accel(G, H, SGi, SHi, xG, xH):
        raise NotImplementedError

    def acceleration(self, xG, xH):
        return self._accel(self.G, self.H, self.SGi, self.SHi, xG, xH)

    @classmethod
    def acceleration_at(cls, G, H, xG, xH, eps=0.0, grams=None):
        return cls._accel(G, H, *_relaxed_gram_inverses(G, H, eps, grams), xG, xH)


class InvariantMetric(_GramAccelerationMetric):
    """``g(ξ, η) = tr(S̃_G⁻¹ ξ_Gᵀ η_G) + tr(S̃_H⁻¹ ξ_Hᵀ η_H)`` (paper Eq. 9; docs/maths.md §2).

    Invariant under the whole of GL(h) and complete; at ε > 0 everything here (projection:
    a two-sided Sylvester equation) is the exact geometry of the relaxed metric."""

    name = "invariant"

    @classmethod
    def blocks(cls, G, H, eps=0.0):
        _, _, SGt, SHt = gram(G, H, eps)
        return torch.linalg.inv(SGt), torch.linalg.inv(SHt)

    def setup(self) -> None:
        SG, SH, SGt, SHt = self.SG64, self.SH64, self.SGt64, self.SHt64
        G64, H64 = self.G64, self.H64
        self.MG, self.MH = self.SGi, self.SHi
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
        cast = self.cast
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

    def normal_operators(self):
        return (self.SG64, self.SGi64, self.SHi64, self.SH64), (self.SGi64, self.SHi64)

    def project(self, xG, xH):
        # X = Λᵀ solves (S̃_G S_H) X + X (S_G S̃_H) = ξ_Gᵀ G S̃_H − S̃_G Hᵀ ξ_H.
        # (products ordered so that every n×h factor meets an h×h one)
        Y = (self._VAi @ (_t(xG) @ self._Gp) - (_t(self._Hp) @ xH) @ self._VB) * self._inv_denom
        # ξ_G − G Xᵀ = ξ_G − G V_B⁻ᵀ Yᵀ V_Aᵀ ;  ξ_H + H X = ξ_H + H V_A Y V_B⁻¹
        return xG - self._GVBit @ (_t(Y) @ self._VAt), xH + self._HVA @ (Y @ self._VBi)

    def dual(self, gG, gH):
        return gG @ self.SGt, gH @ self.SHt

    def closed_form_geodesic(self, xG, xH, t=1.0):
        """GL(1), ε = 0: a flat line in log-radius times a great circle, for each factor."""
        if self.G.shape[-1] != 1 or self.eps != 0.0:
            return None
        return exact_geodesic_gl1(self.G, xG, t), exact_geodesic_gl1(self.H, xH, t)

    @staticmethod
    def _accel(G, H, SGi, SHi, xG, xH):
        # h×h pieces first: M = ξ_Gᵀ G (so Gᵀ ξ_G = Mᵀ), N = ξ_Hᵀ H   (docs/maths.md §4)
        M, N = _t(xG) @ G, _t(xH) @ H
        aG = xG @ (SGi @ (M + _t(M))) - G @ (SGi @ (_t(xG) @ xG))
        aH = xH @ (SHi @ (N + _t(N))) - H @ (SHi @ (_t(xH) @ xH))
        return aG, aH


class MixedMetric(_GramAccelerationMetric):
    """``g(ξ, η) = tr(S_H ξ_Gᵀ η_G) + tr(S_G ξ_Hᵀ η_H)`` (paper Eq. 10; docs/maths.md §2).

    Its metric tensor needs no inverse, so ε only regularises the inverses of the dual, the
    projection and the Christoffel contraction (``S̃``); at ε > 0 the projection is
    horizontal up to O(ε).  Its geodesics are incomplete (they can reach a rank-deficient
    pair in finite time, docs/maths.md §5.4)."""

    name = "mixed"
    eps_exact = False
    complete = False

    @classmethod
    def blocks(cls, G, H, eps=0.0):
        SG, SH, _, _ = gram(G, H, eps)
        return SH, SG

    def setup(self) -> None:
        self.MG, self.MH = self.SH, self.SG
        self._GSGi = self.cast(self.G64 @ self.SGi64)
        self._HSHi = self.cast(self.H64 @ self.SHi64)

    def normal_operators(self):
        return (self.SGt64, self.SHt64, self.SGt64, self.SHt64), (self.SHt64, self.SGt64)

    def project(self, xG, xH):
        # X = Λᵀ = ½ (ξ_Gᵀ G S̃_G⁻¹ − S̃_H⁻¹ Hᵀ ξ_H), explicit.
        X = 0.5 * (_t(xG) @ self._GSGi - _t(self._HSHi) @ xH)
        return xG - self.G @ _t(X), xH + self.H @ X

    def dual(self, gG, gH):
        return gG @ self.SHi, gH @ self.SGi

    def closed_form_geodesic(self, xG, xH, t=1.0):
        """Scalar pairs (n = m = h = 1), ε = 0: straight lines of a flat cone (ends at the tip)."""
        if tuple(self.G.shape[-2:]) != (1, 1) or tuple(self.H.shape[-2:]) != (1, 1) or self.eps != 0.0:
            return None
        return exact_geodesic_gl1_mixed(self.G, self.H, xG, xH, t)

    @staticmethod
    def _accel(G, H, SGi, SHi, xG, xH):
        M, N = _t(xG) @ G, _t(xH) @ H
        aG = G @ ((_t(xH) @ xH) @ SHi) - xG @ ((N + _t(N)) @ SHi)
        aH = H @ ((_t(xG) @ xG) @ SGi) - xH @ ((M + _t(M)) @ SGi)
        return aG, aH


# ------------------------------------------------------------------ the registry
#: every pair metric by name: ``Measure``, the CLI, :mod:`hideseek.reference` and the
#: property suite read this (and nothing else spells the names)
METRICS: dict[str, type[PairMetric]] = {}


def register_metric(cls: type[PairMetric]) -> type[PairMetric]:
    """Add a :class:`PairMetric` subclass to :data:`METRICS` under ``cls.name`` (usable as
    a class decorator); a name already taken by another class is an error."""
    if not (isinstance(cls, type) and issubclass(cls, PairMetric)) or not cls.name:
        raise TypeError(f"register_metric needs a PairMetric subclass with a name, got {cls!r}")
    return register_named(METRICS, cls.name, cls, "metric")


def metric_names() -> tuple[str, ...]:
    """The registered metric names, in registration order."""
    return tuple(METRICS)


def get_metric(metric: "str | type[PairMetric] | PairMetric") -> type[PairMetric]:
    """The metric class for a registered name, a :class:`PairMetric` subclass or instance."""
    if isinstance(metric, PairMetric):
        return type(metric)
    if isinstance(metric, type) and issubclass(metric, PairMetric):
        return metric
    if isinstance(metric, str) and metric in METRICS:
        return METRICS[metric]
    raise ValueError(f"metric must be one of {metric_names()} (or a PairMetric), got {metric!r}")


register_metric(InvariantMetric)
register_metric(MixedMetric)
