"""The perturbation space of a whole model at a fixed point θ.

Parameters inside GL(h) pairs (attention, user-declared pairs) get the quotient geometry
of :mod:`hideseek.geometry.gl`, stacked over heads and layers that share a shape; every
other parameter gets the elementwise adaptive geometry (MATH.md §6).  A tangent vector is
a plain list of tensors: ``[ξ_G, ξ_H]`` per stacked pair group, then one tensor per free
parameter.  All state that depends only on θ is computed once here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import Tensor

from ..symmetries.base import SymmetryBlock
from .gl import PairGeometry

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


class ProductGeometry:
    """Metric, projection, gradient and geodesic step for all of a model's parameters.

    Parameters
    ----------
    params:
        ``name -> tensor`` at θ (only the parameters to perturb).
    blocks:
        Symmetry blocks (each owning its parameters entirely); empty for pure adaptive.
    metric, eps:
        Pair metric (``"invariant"`` or ``"mixed"``) and ε relaxation.
    norm:
        ``"riemannian"``: the pair metric, perturbations of the pairs restricted to the
        horizontal space; ``"adaptive"``: the elementwise ``‖ξ ⊘ |θ|‖₂`` ball on every
        parameter with no horizontal restriction — adaptive sharpness's own ball — while the
        step can still follow the metric's geodesic (the Christoffel-only ablation).  The
        horizontal space is orthogonal to the orbits in the *metric*, not in the adaptive
        inner product, so restricting the adaptive ball to it would make the ball projection
        oblique and the search degenerate; the ablation therefore isolates the step alone.
    christoffel:
        ``True`` second-order geodesic step, ``False`` straight step, ``"exact"`` closed-form
        geodesics (invariant metric, h = 1, ε = 0).
    p:
        ``"l2"`` or ``"linf"``; ``"linf"`` is only defined without pairs (adaptive ℓ∞).
    """

    def __init__(self, params: Mapping[str, Tensor], blocks: Sequence[SymmetryBlock] = (), *,
                 metric: str = "invariant", eps: float = 0.0, norm: str = "riemannian",
                 christoffel: bool | str = True, p: str = "l2") -> None:
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        if p not in ("l2", "linf"):
            raise ValueError(f"p must be 'l2' or 'linf', got {p!r}")
        if p == "linf" and blocks:
            raise ValueError("the l∞ ball is only defined for the adaptive measure (no pairs)")
        self.norm, self.christoffel, self.p = norm, christoffel, p
        self.blocks = list(blocks)
        owned = [n for b in self.blocks for n in b.param_names]
        if len(owned) != len(set(owned)):
            raise ValueError("a parameter belongs to two symmetry blocks")
        missing = [n for n in owned if n not in params]
        if missing:
            raise KeyError(f"symmetry blocks refer to unknown parameters: {missing}")
        self.free_names = [n for n in params if n not in set(owned)]
        self.theta_free = [params[n].detach() for n in self.free_names]
        self.c_free = [t.abs() for t in self.theta_free]
        # exact zeros (vanishing adaptive scale) are rare: remember where, handle them apart
        self._zero = [bool((c == 0).any()) for c in self.c_free]
        self._nz = [i for i, z in enumerate(self._zero) if not z]
        self._z = [i for i, z in enumerate(self._zero) if z]

        # Stack pair groups of equal shape over blocks.
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
        self.pairs: list[PairGeometry] = []
        for key in keys:
            G = torch.cat([g for g, _ in stacks[key]])
            H = torch.cat([h for _, h in stacks[key]])
            self.pairs.append(PairGeometry(G, H, metric, eps))
        if norm == "adaptive":
            self.c_pairs = [(_floor_scale(pg.G), _floor_scale(pg.H)) for pg in self.pairs]
        ref = next(iter(params.values()))
        self.dtype, self.device = ref.dtype, ref.device

    # ------------------------------------------------------------------ basics
    @property
    def n_pair_tensors(self) -> int:
        return 2 * len(self.pairs)

    def zeros(self) -> Tangent:
        out = []
        for pg in self.pairs:
            out += [torch.zeros_like(pg.G), torch.zeros_like(pg.H)]
        return out + [torch.zeros_like(t) for t in self.theta_free]

    def _split(self, x: Tangent):
        k = self.n_pair_tensors
        return [(x[2 * i], x[2 * i + 1]) for i in range(len(self.pairs))], x[k:]

    def dimension(self) -> int:
        return sum(t.numel() for t in self.zeros())

    # ------------------------------------------------------------------ point
    def point(self, x: Tangent) -> dict[str, Tensor]:
        """Parameters at ``γ_ξ(1)`` (differentiable in ξ) for a functional forward pass."""
        pair_x, free_x = self._split(x)
        stepped = [pg.step(xG, xH, self.christoffel) for pg, (xG, xH) in zip(self.pairs, pair_x)]
        out: dict[str, Tensor] = {}
        for blk, slots in zip(self.blocks, self.slots):
            out.update(blk.merge([(stepped[s.group][0][s.start:s.stop], stepped[s.group][1][s.start:s.stop])
                                  for s in slots]))
        for name, t, xi in zip(self.free_names, self.theta_free, free_x):
            out[name] = t + xi
        return out

    def pullback(self, grads: Mapping[str, Tensor]) -> Tangent:
        """Gradient with respect to ξ at ξ = 0 of a function of the parameters, from its
        gradient with respect to the parameters (``name -> tensor``; missing names count as
        zero): the vector-Jacobian product of :meth:`point` at ξ = 0.  The second-order
        term of the step is quadratic in ξ, so this is the adjoint of the (linear)
        re-arrangement of parameters into pair stacks — no model pass is needed."""
        z = [t.requires_grad_(True) for t in self.zeros()]
        with torch.enable_grad():
            pts = self.point(z)
            names = [n for n in pts if n in grads]
            g = torch.autograd.grad([pts[n] for n in names], z, [grads[n] for n in names],
                                    allow_unused=True)
        return [torch.zeros_like(t) if gi is None else gi for t, gi in zip(z, g)]

    def correction_ratio(self, x: Tangent) -> float:
        """Largest ``‖½ γ̈(0)‖ / ‖ξ‖`` (Frobenius, per pair) over all pairs: how far the
        second-order step bends away from the straight one.  Values near or above 1 mean the
        radius is too large for the second-order geodesic approximation to be trusted."""
        pair_x, _ = self._split(x)
        worst = 0.0
        for pg, (xG, xH) in zip(self.pairs, pair_x):
            aG, aH = pg.acceleration(xG, xH)
            num = 0.5 * (aG.square().sum((-1, -2)) + aH.square().sum((-1, -2))).sqrt()
            den = (xG.square().sum((-1, -2)) + xH.square().sum((-1, -2))).sqrt()
            ok = den > 0
            if bool(ok.any()):
                worst = max(worst, float((num[ok] / den[ok]).max()))
        return worst

    # ------------------------------------------------------------------ metric
    def sqnorm(self, x: Tangent) -> Tensor:
        """Squared norm of the whole perturbation (sum over all parts; ℓ2 only)."""
        pair_x, free_x = self._split(x)
        parts = []
        for i, (pg, (xG, xH)) in enumerate(zip(self.pairs, pair_x)):
            if self.norm == "riemannian":
                parts.append(pg.sqnorm(xG, xH).sum())
            else:
                cG, cH = self.c_pairs[i]
                parts.append((xG / cG).square().sum() + (xH / cH).square().sum())
        if self._nz:   # one fused division and one fused norm over the tensors without zeros
            q = torch._foreach_div([free_x[i] for i in self._nz], [self.c_free[i] for i in self._nz])
            parts += [n.square() for n in torch._foreach_norm(q)]
        for i in self._z:
            c = self.c_free[i]
            parts.append(torch.where(c > 0, free_x[i] / torch.where(c > 0, c, 1), 0).square().sum())
        if not parts:
            return torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.stack(parts).sum()

    def norm_of(self, x: Tangent) -> Tensor:
        if self.p == "linf":
            vals = [torch.where(c > 0, xi.abs() / torch.where(c > 0, c, 1), 0).amax()
                    for xi, c in zip(x, self.c_free) if xi.numel()]
            return torch.stack(vals).amax()
        return self.sqnorm(x).sqrt()

    def project(self, x: Tangent) -> Tangent:
        """Onto the tangent space of allowed perturbations: horizontal pair parts, zero where
        a free parameter is exactly zero (its adaptive scale vanishes)."""
        pair_x, free_x = self._split(x)
        out = []
        for pg, (xG, xH) in zip(self.pairs, pair_x):
            # with the adaptive norm the pair parts are free (see the class docstring)
            out += list(pg.project(xG, xH)) if self.norm == "riemannian" else [xG, xH]
        return out + [torch.where(c > 0, xi, 0) if z else xi
                      for xi, c, z in zip(free_x, self.c_free, self._zero)]

    def rgrad(self, egrad: Tangent) -> Tangent:
        """Steepest-ascent direction for the chosen norm (not normalised), in the allowed
        subspace (horizontal pair parts for the Riemannian norm)."""
        pair_g, free_g = self._split(egrad)
        out = []
        for i, (pg, (gG, gH)) in enumerate(zip(self.pairs, pair_g)):
            if self.norm == "riemannian":
                out += list(pg.egrad_to_rgrad(gG, gH))
            else:
                cG, cH = self.c_pairs[i]
                out += [cG.square() * gG, cH.square() * gH]
        if free_g:
            r = list(torch._foreach_mul(free_g, self.c_free))
            torch._foreach_mul_(r, self.c_free)
            out += r
        return out

    def direction(self, egrad: Tangent) -> Tangent:
        """Unit steepest-ascent direction (ℓ2: ``grad/‖grad‖``; ℓ∞: ``sign(g) ⊙ |θ|``)."""
        if self.p == "linf":
            return [torch.sign(g) * c for g, c in zip(egrad, self.c_free)]
        r = self.rgrad(egrad)
        n = self.sqnorm(r).sqrt()
        n = torch.where(n > 0, n, torch.ones_like(n))
        return list(torch._foreach_div(r, n))

    def ball(self, x: Tangent, rho: float, project: bool = True) -> Tangent:
        """Projection onto ``{allowed, ‖ξ‖ ≤ ρ}`` (exact for the metric norm and for ℓ∞).

        ``project=False`` skips the (linear) projection onto the allowed subspace, for ``x``
        that is already a linear combination of allowed vectors."""
        if self.p == "linf":
            return [torch.maximum(torch.minimum(xi, rho * c), -rho * c) for xi, c in zip(x, self.c_free)]
        if project:
            x = self.project(x)
        n = self.sqnorm(x).sqrt()
        scale = torch.where(n > rho, rho / n, torch.ones_like(n))
        return list(torch._foreach_mul(x, scale))

    def random_direction(self, generator: torch.Generator) -> Tangent:
        """A direction drawn uniformly from the unit sphere of the allowed subspace
        (Gaussian in metric-whitened coordinates, projected, normalised)."""
        def randn(t):
            return torch.randn(t.shape, generator=generator, dtype=t.dtype, device="cpu").to(t.device)

        out = []
        for i, pg in enumerate(self.pairs):
            zG, zH = randn(pg.G), randn(pg.H)
            if self.norm == "riemannian":
                out += list(pg.whiten_inverse(zG, zH))
            else:
                cG, cH = self.c_pairs[i]
                out += [cG * zG, cH * zH]
        for t, c in zip(self.theta_free, self.c_free):
            z = randn(t)
            out.append(c * (torch.sign(z) if self.p == "linf" else z))
        if self.p == "linf":
            return out  # corners of the l∞ ball
        out = self.project(out)
        n = self.sqnorm(out).sqrt()
        return [t / n for t in out]
