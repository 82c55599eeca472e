"""The perturbation space of a whole model at a fixed point θ, as a product of parts.

Parameters inside GL(h) pairs (attention, user-declared pairs) get the quotient geometry
of :mod:`hideseek.geometry.gl`, stacked over heads and layers that share a shape (a
:class:`PairStack` part); every other parameter gets the elementwise adaptive geometry
(:class:`~hideseek.geometry.adaptive.AdaptiveGeometry`, docs/maths.md §6, adaptive
sharpness).  :class:`ProductGeometry` composes the parts (like geoopt's ``ProductManifold``):
a tangent vector is a plain list of tensors, each part owning a consecutive run of it —
``[ξ_G, ξ_H]`` per stacked pair group, then one tensor per free parameter — and the norm
of the product is the ℓ2 norm of the parts' norms.  All state that depends only on θ is
computed once, when the parts are built.

A part answers: ``n_tensors``, ``zeros()``, ``point(x, out)`` (write the stepped
parameters into ``out``), ``sqnorm_terms(x)`` (scalars whose sum is its squared norm),
``project(x)`` (onto its allowed subspace), ``rgrad(egrad)`` (metric dual of the
Euclidean gradient, in the allowed subspace), ``draw(randn)`` (a Gaussian tangent in
metric-whitened coordinates, before projection) and ``correction_ratio(x)``.  The ball's
``p`` is a norm object (:class:`L2Norm`, :class:`LinfNorm` in :data:`P_NORMS`) that owns
the norm, the steepest-ascent direction and the projection onto the ball.  The pairs'
metric is a registered :class:`~hideseek.geometry.metrics.PairMetric`, given by name or
as a class.  A new kind of
pair part (say, pairs under a smaller symmetry group) is one subclass of :class:`PairStack`
that overrides :meth:`PairStack.make_pair` and, if its ball differs, the norm methods.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from torch import Tensor

from ..symmetries.base import SymmetryBlock
from .adaptive import AdaptiveGeometry
from .free import FreePart, get_free_part
from .gl import PairGeometry
from .metrics import PairMetric
from .rotary import RotaryPairGeometry

Tangent = list[Tensor]
NORMS = ("riemannian", "adaptive")


def _floor_scale(x: Tensor) -> Tensor:
    """Elementwise scale ``|x|``, floored far below the typical magnitude so that the
    adaptive norm stays finite on exact zeros inside a pair."""
    c = x.abs()
    return c.clamp_min(1e-8 * float(c.mean()) + torch.finfo(x.dtype).tiny)


@dataclass
class _Slot:
    group: int   # index into the stacked groups
    start: int
    stop: int


# ---------------------------------------------------------------------------- pair parts
class PairStack:
    """The GL(h) pairs of ``blocks`` under the pair metric, perturbations horizontal.

    Pairs of equal shape are stacked over blocks (heads, layers) into one
    :class:`~hideseek.geometry.gl.PairGeometry` each; the part owns ``[ξ_G, ξ_H]`` per
    stack.  The step is the metric's geodesic: second order (``christoffel=True``),
    straight (``False``) or the geodesic itself (``"exact"``: closed form for GL(1), else
    integrated, docs/maths.md §5.6).
    """

    def __init__(self, params: Mapping[str, Tensor], blocks: Sequence[SymmetryBlock], *,
                 metric: "str | type[PairMetric]" = "invariant", eps: float = 0.0,
                 christoffel: bool | str = True) -> None:
        self.blocks = list(blocks)
        self.christoffel = christoffel
        stacks: dict[tuple, list[tuple[Tensor, Tensor]]] = {}
        self.slots: list[list[_Slot]] = []
        keys: list[tuple] = []
        for blk in self.blocks:
            slots = []
            for grp, (G, H) in zip(blk.groups, blk.split({n: params[n].detach() for n in blk.param_names})):
                key = grp.shape_key
                if key not in stacks:
                    stacks[key] = []
                    keys.append(key)
                start = sum(g.shape[0] for g, _ in stacks[key])
                stacks[key].append((G, H))
                slots.append(_Slot(keys.index(key), start, start + G.shape[0]))
            self.slots.append(slots)
        self.pairs: list[PairGeometry] = [
            self.make_pair(torch.cat([g for g, _ in stacks[key]]), torch.cat([h for _, h in stacks[key]]),
                           key, metric, eps) for key in keys]

    def make_pair(self, G: Tensor, H: Tensor, key: tuple, metric: "str | type[PairMetric]",
                  eps: float) -> PairGeometry:
        """The geometry of one stack of pairs: GL(h), or the rotary subgroup
        (:class:`~hideseek.geometry.rotary.RotaryPairGeometry`) when the stack's
        :class:`~hideseek.symmetries.base.PairGroup` has rotary column pairs
        (``key = PairGroup.shape_key = (n, m, h, rotary, rotary_free)``)."""
        rotary, rotary_free = (key[3], key[4]) if len(key) > 3 else ((), ())
        if rotary:
            return RotaryPairGeometry(G, H, metric, eps, rotary=rotary, rotary_free=rotary_free)
        return PairGeometry(G, H, metric, eps)

    @property
    def n_tensors(self) -> int:
        return 2 * len(self.pairs)

    def _pairs(self, x: Tangent):
        return [(x[2 * i], x[2 * i + 1]) for i in range(len(self.pairs))]

    def zeros(self) -> Tangent:
        out = []
        for pg in self.pairs:
            out += [torch.zeros_like(pg.G), torch.zeros_like(pg.H)]
        return out

    def point(self, x: Tangent, out: dict[str, Tensor]) -> None:
        stepped = [pg.step(xG, xH, self.christoffel) for pg, (xG, xH) in zip(self.pairs, self._pairs(x))]
        for blk, slots in zip(self.blocks, self.slots):
            out.update(blk.merge([(stepped[s.group][0][s.start:s.stop], stepped[s.group][1][s.start:s.stop])
                                  for s in slots]))

    def sqnorm_terms(self, x: Tangent) -> list[Tensor]:
        return [pg.sqnorm(xG, xH).sum() for pg, (xG, xH) in zip(self.pairs, self._pairs(x))]

    def pair_sqnorms(self, x: Tangent) -> list[Tensor]:
        """Squared norm of each pair, ``(B,)`` per stack (the terms of :meth:`sqnorm_terms`)."""
        return [pg.sqnorm(xG, xH) for pg, (xG, xH) in zip(self.pairs, self._pairs(x))]

    def sqnorm_by_kind(self, x: Tangent) -> dict[str, Tensor]:
        """Squared norm of ``x`` summed per kind of pair (:attr:`PairGroup.kind`, with
        ``"_rotary"`` appended for pairs under the rotary subgroup), in this part's norm."""
        per_pair = self.pair_sqnorms(x)
        out: dict[str, Tensor] = {}
        for blk, slots in zip(self.blocks, self.slots):
            for grp, s in zip(blk.groups, slots):
                kind = grp.kind + ("_rotary" if grp.rotary else "")
                term = per_pair[s.group][s.start:s.stop].sum()
                out[kind] = out[kind] + term if kind in out else term
        return out

    def project(self, x: Tangent) -> Tangent:
        out = []
        for pg, (xG, xH) in zip(self.pairs, self._pairs(x)):
            out += list(pg.project(xG, xH))
        return out

    def rgrad(self, egrad: Tangent) -> Tangent:
        out = []
        for pg, (gG, gH) in zip(self.pairs, self._pairs(egrad)):
            out += list(pg.egrad_to_rgrad(gG, gH))
        return out

    def draw(self, randn: Callable[[Tensor], Tensor]) -> Tangent:
        out = []
        for pg in self.pairs:
            zG, zH = randn(pg.G), randn(pg.H)
            out += list(pg.whiten_inverse(zG, zH))
        return out

    def correction_ratio(self, x: Tangent) -> float:
        """Largest ``‖½ γ̈(0)‖ / ‖ξ‖`` (Frobenius, per pair) over the pairs."""
        worst = 0.0
        for pg, (xG, xH) in zip(self.pairs, self._pairs(x)):
            aG, aH = pg.acceleration(xG, xH)
            num = 0.5 * (aG.square().sum((-1, -2)) + aH.square().sum((-1, -2))).sqrt()
            den = (xG.square().sum((-1, -2)) + xH.square().sum((-1, -2))).sqrt()
            ok = den > 0
            if bool(ok.any()):
                worst = max(worst, float((num[ok] / den[ok]).max()))
        return worst


class AdaptiveBallPairStack(PairStack):
    """The pairs with adaptive sharpness's elementwise ball ``‖ξ ⊘ |θ|‖₂`` and no horizontal
    restriction, the step still the metric's geodesic: the Christoffel-only ablation
    (paper Appendix G).  The horizontal space is orthogonal to the orbits in the *metric*,
    not in the adaptive inner product, so restricting this ball to it would make the ball
    projection oblique and the search degenerate; the ablation isolates the step alone.
    Exact zeros inside a pair get a tiny floor scale (:func:`_floor_scale`)."""

    def __init__(self, params: Mapping[str, Tensor], blocks: Sequence[SymmetryBlock], **kw) -> None:
        super().__init__(params, blocks, **kw)
        self.scales = [(_floor_scale(pg.G), _floor_scale(pg.H)) for pg in self.pairs]

    def sqnorm_terms(self, x: Tangent) -> list[Tensor]:
        return [(xG / cG).square().sum() + (xH / cH).square().sum()
                for (cG, cH), (xG, xH) in zip(self.scales, self._pairs(x))]

    def pair_sqnorms(self, x: Tangent) -> list[Tensor]:
        return [(xG / cG).square().sum((-1, -2)) + (xH / cH).square().sum((-1, -2))
                for (cG, cH), (xG, xH) in zip(self.scales, self._pairs(x))]

    def project(self, x: Tangent) -> Tangent:
        return list(x[:self.n_tensors])

    def rgrad(self, egrad: Tangent) -> Tangent:
        out = []
        for (cG, cH), (gG, gH) in zip(self.scales, self._pairs(egrad)):
            out += [cG.square() * gG, cH.square() * gH]
        return out

    def draw(self, randn: Callable[[Tensor], Tensor]) -> Tangent:
        out = []
        for pg, (cG, cH) in zip(self.pairs, self.scales):
            zG, zH = randn(pg.G), randn(pg.H)
            out += [cG * zG, cH * zH]
        return out


#: the pair part of each ``norm=`` (ball) of :class:`ProductGeometry`
PAIR_PARTS: dict[str, type[PairStack]] = {"riemannian": PairStack, "adaptive": AdaptiveBallPairStack}


# ---------------------------------------------------------------------------- norms
class L2Norm:
    """The ℓ2 ball of a :class:`ProductGeometry`: the ℓ2 norm of all parts' norms (the
    metric norm on the pairs), steepest ascent ``rgrad/‖rgrad‖``, radial shrinking."""

    name = "l2"

    def check(self, blocks: Sequence[SymmetryBlock]) -> None:
        """Any parts are allowed."""

    def norm(self, geo: "ProductGeometry", x: Tangent) -> Tensor:
        return geo.sqnorm(x).sqrt()

    def direction(self, geo: "ProductGeometry", egrad: Tangent, inplace: bool) -> Tangent:
        r = geo.rgrad(egrad, inplace=inplace)
        if inplace and isinstance(egrad, list):
            egrad[:] = r
        n = geo.sqnorm(r).sqrt()
        n = torch.where(n > 0, n, torch.ones_like(n))
        torch._foreach_div_(r, n)
        return r

    def ball(self, geo: "ProductGeometry", x: Tangent, rho: float, project: bool) -> Tangent:
        if project:
            x = geo.project(x)
        n = geo.sqnorm(x).sqrt()
        scale = torch.where(n > rho, rho / n, torch.ones_like(n))
        return list(torch._foreach_mul(x, scale))

    def shrink_(self, geo: "ProductGeometry", x: Tangent, rho: float) -> Tangent:
        n = geo.sqnorm(x).sqrt()
        scale = torch.where(n > rho, rho / n, torch.ones_like(n))
        torch._foreach_mul_(x, scale)
        return x

    def normalise_draw(self, geo: "ProductGeometry", draw: Tangent) -> Tangent:
        """The parts' draw (Gaussian in whitened coordinates) → a uniform unit vector."""
        out = geo.project(draw)
        n = geo.sqnorm(out).sqrt()
        return [t / n for t in out]


class LinfNorm:
    """The ℓ∞ ball (a box) of the free part; defined without pairs only (adaptive ℓ∞)."""

    name = "linf"

    def check(self, blocks: Sequence[SymmetryBlock]) -> None:
        if blocks:
            raise ValueError("the l∞ ball is only defined for the adaptive measure (no pairs)")

    def norm(self, geo: "ProductGeometry", x: Tangent) -> Tensor:
        return torch.stack(geo.adaptive.linf_terms(geo._split(x)[1])).amax()

    def direction(self, geo: "ProductGeometry", egrad: Tangent, inplace: bool) -> Tangent:
        return geo.adaptive.linf_direction(geo._split(egrad)[1], inplace=inplace)

    def ball(self, geo: "ProductGeometry", x: Tangent, rho: float, project: bool) -> Tangent:
        return geo.adaptive.linf_ball(geo._split(x)[1], rho)

    def shrink_(self, geo: "ProductGeometry", x: Tangent, rho: float) -> Tangent:
        return geo.adaptive.linf_ball(geo._split(x)[1], rho, inplace=True)

    def normalise_draw(self, geo: "ProductGeometry", draw: Tangent) -> Tangent:
        return draw  # the parts drew corners of the l∞ ball


#: the ``p=`` of :class:`ProductGeometry`: the norm object that owns its ball, steepest
#: ascent direction and shrinking (ℓ2 over all parts, or the free part's ℓ∞ box)
P_NORMS = {"l2": L2Norm(), "linf": LinfNorm()}


# ---------------------------------------------------------------------------- product
class ProductGeometry:
    """Metric, projection, gradient and geodesic step for all of a model's parameters:
    the product of a pair part (when there are blocks) and the adaptive part.

    Parameters
    ----------
    params:
        ``name -> tensor`` at θ (only the parameters to perturb).
    blocks:
        Symmetry blocks (each owning its parameters entirely); empty for pure adaptive.
    metric, eps:
        Pair metric (a name in :data:`~hideseek.geometry.metrics.METRICS`, ``"invariant"`` or
        ``"mixed"``, or a :class:`~hideseek.geometry.metrics.PairMetric` class) and ε relaxation.
    norm:
        The ball of the pairs: ``"riemannian"`` (:class:`PairStack`: the pair metric,
        horizontal perturbations) or ``"adaptive"`` (:class:`AdaptiveBallPairStack`, the
        Christoffel-only ablation).
    christoffel:
        ``True`` second-order geodesic step, ``False`` straight step, ``"exact"`` the geodesic
        itself (closed form for GL(1), ε = 0; integrated otherwise, docs/maths.md §5.6).
    p:
        ``"l2"`` or ``"linf"``; ``"linf"`` is only defined without pairs (adaptive ℓ∞).
    pair_part:
        A :class:`PairStack` subclass to use instead of ``PAIR_PARTS[norm]``.
    free_part:
        The geometry of the parameters outside pairs: a registered
        :class:`~hideseek.geometry.free.FreePart` (its class or its name in
        :data:`~hideseek.geometry.free.FREE_PARTS`): :class:`AdaptiveGeometry` (default) or
        :class:`~hideseek.geometry.euclidean.EuclideanGeometry` (SAM's plain ball).

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False), torch.nn.Linear(2, 2, bias=False)).eval()
    >>> pair = hs.FactorPair("1.weight", "0.weight", transpose_h=True)    # W₁W₀ = G Hᵀ, G = W₁, H = W₀ᵀ
    >>> batch, mse = (torch.randn(16, 3), torch.randn(16, 2)), torch.nn.functional.mse_loss
    >>> params = {n: p.detach() for n, p in model.named_parameters()}
    >>> geo = hs.ProductGeometry(params, [pair.bind(params)], metric="invariant")
    >>> G, H = params["1.weight"][None], params["0.weight"].T[None]   # the pair's stacks (B, n, h), (B, m, h)
    >>> Lam = torch.randn(1, 2, 2)
    >>> vertical = [G @ Lam, -H @ Lam.mT]                             # moves along the orbit only
    >>> max(t.abs().max().item() for t in geo.project(vertical)) < 1e-6   # no horizontal part
    True
    >>> geo.dimension()                                               # coordinates: 6 + 4 weights
    10
    """

    def __init__(self, params: Mapping[str, Tensor], blocks: Sequence[SymmetryBlock] = (), *,
                 metric: "str | type[PairMetric]" = "invariant", eps: float = 0.0, norm: str = "riemannian",
                 christoffel: bool | str = True, p: str = "l2",
                 pair_part: type[PairStack] | None = None,
                 free_part: "type[FreePart] | str" = AdaptiveGeometry) -> None:
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        if p not in P_NORMS:
            raise ValueError(f"p must be 'l2' or 'linf', got {p!r}")
        self.p_norm = P_NORMS[p]
        self.p_norm.check(blocks)
        self.norm, self.christoffel, self.p = norm, christoffel, p
        self.blocks = list(blocks)
        owned = [n for b in self.blocks for n in b.param_names]
        if len(owned) != len(set(owned)):
            raise ValueError("a parameter belongs to two symmetry blocks")
        missing = [n for n in owned if n not in params]
        if missing:
            raise KeyError(f"symmetry blocks refer to unknown parameters: {missing}")
        self.pair_part = (pair_part or PAIR_PARTS[norm])(params, self.blocks, metric=metric, eps=eps,
                                                         christoffel=christoffel)
        free_names = [n for n in params if n not in set(owned)]
        self.adaptive = get_free_part(free_part)(free_names, [params[n] for n in free_names], p)
        self.parts = [self.pair_part, self.adaptive]
        ref = next(iter(params.values()))
        self.dtype, self.device = ref.dtype, ref.device

    def with_free_part(self, wrap) -> None:
        """Replace the free part by ``wrap(free_part)`` (a wrapper or restriction of it: the
        sharded and row-restricted geometries) and keep :attr:`parts` consistent.  The new
        part must hold the same parameter names in the same order, since the tangent's layout
        (:meth:`_split`) and :attr:`free_names` follow it."""
        new = wrap(self.adaptive)
        if list(new.names) != list(self.adaptive.names):
            raise ValueError("with_free_part: the new free part must hold the same parameters in the same order "
                             f"({len(new.names)} names against {len(self.adaptive.names)}); wrap or restrict the "
                             "part, do not replace its parameters")
        self.adaptive = new
        self.parts = [self.pair_part, new]

    # ------------------------------------------------------------------ basics
    @property
    def pairs(self) -> list[PairGeometry]:
        return self.pair_part.pairs

    @property
    def n_pair_tensors(self) -> int:
        return self.pair_part.n_tensors

    @property
    def free_names(self) -> list[str]:
        return self.adaptive.names

    def _split(self, x: Tangent) -> list[Tangent]:
        out, start = [], 0
        for part in self.parts:
            out.append(x[start:start + part.n_tensors])
            start += part.n_tensors
        return out

    def zeros(self) -> Tangent:
        return [t for part in self.parts for t in part.zeros()]

    def dimension(self) -> int:
        return sum(t.numel() for t in self.zeros())

    # ------------------------------------------------------------------ point
    def point(self, x: Tangent) -> dict[str, Tensor]:
        """Parameters at ``γ_ξ(1)`` (differentiable in ξ) for a functional forward pass."""
        out: dict[str, Tensor] = {}
        for part, xs in zip(self.parts, self._split(x)):
            part.point(xs, out)
        return out

    def pullback(self, grads: Mapping[str, Tensor]) -> Tangent:
        """Gradient with respect to ξ at ξ = 0 of a function of the parameters, from its
        gradient with respect to the parameters (``name -> tensor``; missing names count as
        zero): the vector-Jacobian product of :meth:`point` at ξ = 0.  The second-order
        term of the step is quadratic in ξ, so this is the adjoint of the (linear)
        re-arrangement of parameters into pair stacks — no model pass is needed."""
        # the free parameters' step θ + ξ pulls a gradient back unchanged: only the pairs'
        # step needs autograd (no copy of the free parameters is made)
        z = [t.requires_grad_(True) for t in self.pair_part.zeros()]
        g: list = []
        if z:
            with torch.enable_grad():
                pts: dict[str, Tensor] = {}
                self.pair_part.point(z, pts)
                names = [n for n in pts if n in grads]
                g = list(torch.autograd.grad([pts[n] for n in names], z, [grads[n] for n in names],
                                             allow_unused=True))
        g = [torch.zeros_like(t) if gi is None else gi for t, gi in zip(z, g)]
        return g + [grads[n] if n in grads else torch.zeros_like(t)
                    for n, t in zip(self.adaptive.names, self.adaptive.theta)]

    def correction_ratio(self, x: Tangent) -> float:
        """Largest ``‖½ γ̈(0)‖ / ‖ξ‖`` (Frobenius, per pair) over all pairs: how far the
        second-order step bends away from the straight one.  Values near or above 1 mean the
        radius is too large for the second-order geodesic approximation to be trusted."""
        return self.pair_part.correction_ratio(self._split(x)[0])

    # ------------------------------------------------------------------ metric
    def sqnorm(self, x: Tangent) -> Tensor:
        """Squared norm of the whole perturbation (sum over all parts; ℓ2 only)."""
        terms = [t for part, xs in zip(self.parts, self._split(x)) for t in part.sqnorm_terms(xs)]
        if not terms:
            return torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.stack(terms).sum()

    def sqnorm_by_kind(self, x: Tangent, blocks: Sequence[SymmetryBlock] = ()) -> dict[str, float]:
        """The squared norm of ``x`` (ℓ2 only) split by where it lies: one entry per kind of
        pair (``"qk"``, ``"vo"``, ``"qk_rotary"``, a user label …) and ``"free"`` for the
        rest; the values sum to :meth:`sqnorm`.

        ``blocks``: symmetry blocks whose parameters are *free* in this geometry (the
        adaptive measure has no pairs), for the accounting only: their share of the
        elementwise norm ``Σ (ξ/|θ|)²`` is reported under their pairs' kinds."""
        if self.p != "l2":
            raise ValueError("sqnorm_by_kind is defined for the ℓ2 ball only")
        pair_x, free_x = self._split(x)
        out = {k: float(v) for k, v in self.pair_part.sqnorm_by_kind(pair_x).items()}
        terms = self.adaptive.sqnorm_terms(free_x)
        free = float(torch.stack(terms).sum()) if terms else 0.0
        index = {n: i for i, n in enumerate(self.free_names)}
        for blk in blocks:
            if not all(n in index for n in blk.param_names):
                continue
            z = {}
            for n in blk.param_names:
                xi, c = free_x[index[n]], self.adaptive.theta[index[n]].abs()
                z[n] = torch.where(c > 0, xi / torch.where(c > 0, c, 1), 0)
            for grp, (zG, zH) in zip(blk.groups, blk.split(z)):
                kind = grp.kind + ("_rotary" if grp.rotary else "")
                v = float(zG.square().sum() + zH.square().sum())
                out[kind] = out.get(kind, 0.0) + v
                free -= v
        out["free"] = max(free, 0.0)
        return out

    def norm_of(self, x: Tangent) -> Tensor:
        """The norm of ``x`` in this geometry's ball (ℓ2 metric norm, or ℓ∞)."""
        return self.p_norm.norm(self, x)

    def project(self, x: Tangent) -> Tangent:
        """Onto the tangent space of allowed perturbations: each part's allowed subspace
        (horizontal pair parts; zero where a free parameter is exactly zero)."""
        return [t for part, xs in zip(self.parts, self._split(x)) for t in part.project(xs)]

    def rgrad(self, egrad: Tangent, inplace: bool = False) -> Tangent:
        """Steepest-ascent direction for the chosen norm (not normalised), in the allowed
        subspace (horizontal pair parts for the Riemannian norm).  ``inplace``: the free
        parameters' part overwrites ``egrad`` (no copy of the parameters is made)."""
        out: Tangent = []
        for part, gs in zip(self.parts, self._split(egrad)):
            out += part.rgrad(gs, inplace=True) if inplace and part is self.adaptive else part.rgrad(gs)
        return out

    def direction(self, egrad: Tangent, inplace: bool = False) -> Tangent:
        """Unit steepest-ascent direction (ℓ2: ``grad/‖grad‖``; ℓ∞: ``sign(g) ⊙ |θ|``).
        ``inplace``: ``egrad`` may be overwritten (the free parameters' part holds the
        result; a list ``egrad`` is made to hold the result too, so that the pairs' old
        gradient is freed before the norm's temporaries are made), so that no copy of the
        parameters is made."""
        return self.p_norm.direction(self, egrad, inplace)

    def ball(self, x: Tangent, rho: float, project: bool = True) -> Tangent:
        """Projection onto ``{allowed, ‖ξ‖ ≤ ρ}`` (exact for the metric norm and for ℓ∞).

        ``project=False`` skips the (linear) projection onto the allowed subspace, for ``x``
        that is already a linear combination of allowed vectors."""
        return self.p_norm.ball(self, x, rho, project)

    def shrink_(self, x: Tangent, rho: float) -> Tangent:
        """:meth:`ball` with ``project=False``, in place (ℓ2: ``x`` is scaled
        in place and returned; ℓ∞: the box projection, also in place)."""
        return self.p_norm.shrink_(self, x, rho)

    def random_direction(self, generator: torch.Generator) -> Tangent:
        """A direction drawn uniformly from the unit sphere of the allowed subspace
        (Gaussian in metric-whitened coordinates, projected, normalised); ℓ∞: a random
        corner of the box."""
        def randn(t):
            return torch.randn(t.shape, generator=generator, dtype=t.dtype, device="cpu").to(t.device)

        return self.p_norm.normalise_draw(self, [t for part in self.parts for t in part.draw(randn)])
