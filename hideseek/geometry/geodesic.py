r"""Geodesics of the pair metrics: closed forms for GL(1) and the integrated geodesic equation
for GL(h) pairs of any h (docs/maths.md §5.4, §5.6).

A geodesic from ``θ = (G, H)`` with velocity ``ξ`` solves ``γ'' = −Γ_γ(γ', γ')``.  The
second-order step ``θ + ξ − ½Γ_θ(ξ, ξ)`` is its Taylor truncation at t = 1;
:func:`rk4_geodesic` integrates the first-order system ``(x, v)' = (v, −Γ_x(v, v))`` from 0
to t with a fixed number of classical Runge–Kutta steps, the Christoffel contraction at the
*moving* point (its own Gram inverses, batched:
:meth:`hideseek.geometry.metrics.PairMetric.acceleration_at`).  With the step count fixed,
``ξ ↦ γ_ξ(t)`` is a composition of smooth operations, so autograd differentiates it (the
search's gradient flows through the integrator).  How the count is chosen
(:func:`choose_steps`: step doubling, once per search) is in
:meth:`hideseek.geometry.gl.PairGeometry.integrated_step`.

The mixed metric's geodesics are incomplete: a Gram matrix ``GᵀG`` or ``HᵀH`` can lose
rank in finite time (for h = 1 at ``b = −1/(2t)``, :func:`exact_geodesic_gl1_mixed`).  For a
metric with ``complete = False`` the integrator watches the smallest eigenvalue of both Gram
matrices after every step and refuses in one line (``ValueError``, the closed form's rule:
the geodesic ball ends there) once it falls below :data:`RANK_LOSS_FRACTION` of its value at
the start (checked at every stage point of every step).
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import Tensor

#: an integrated geodesic of an incomplete metric is refused once the smallest eigenvalue of
#: ``GᵀG`` or ``HᵀH`` falls below this fraction of its value at the start (a singular value
#: of the pair below 10 % of its smallest at the start: the path is heading for a
#: rank-deficient point).  Checked at every RK4 stage point, so that a coarse step does not
#: jump over the singular point unnoticed (at 1 % it can: the radial test of
#: tests/hideseek/geometry/test_geodesic.py)
RANK_LOSS_FRACTION = 1e-2
#: step doubling stops when the end point moves by less than this, relative to ‖ξ‖ (both
#: in the metric at θ): the end point is then within about 0.1 % of the step of the
#: geodesic's (RK4's error falls as n⁻⁴), far below the second-order truncation that
#: matters (its correction is flagged above half the step)
GEODESIC_RTOL = 1e-3
#: the most RK4 steps step doubling tries (a warning, and this count, when not converged)
MAX_GEODESIC_STEPS = 512

Accel = Callable[[Tensor, Tensor, Tensor, Tensor], "tuple[Tensor, Tensor]"]


def _t(x: Tensor) -> Tensor:
    return x.transpose(-1, -2)


def gram_min_eigenvalues(G: Tensor, H: Tensor) -> tuple[Tensor, Tensor]:
    """Smallest eigenvalue of ``GᵀG`` and of ``HᵀH`` per pair, ``(B,)`` each (float64, no grad)."""
    with torch.no_grad():
        G64, H64 = G.detach().double(), H.detach().double()
        return torch.linalg.eigvalsh(_t(G64) @ G64)[..., 0], torch.linalg.eigvalsh(_t(H64) @ H64)[..., 0]


class RankLossMonitor:
    """Refuses (``ValueError``, one line) an integrated geodesic of an incomplete metric that
    runs into a rank-deficient pair: at a point it is called with, the smallest eigenvalue
    of ``GᵀG`` or ``HᵀH`` below ``RANK_LOSS_FRACTION`` of its value at the start
    (``S − floor·I`` not positive definite).  Calls only collect the points' h × h Gram
    matrices; :meth:`check` tests them all in one batched float64 Cholesky and raises if one
    failed: one host sync per integration."""

    def __init__(self, G: Tensor, H: Tensor, fraction: float | None = None,
                 start_eigenvalues: "tuple[Tensor, Tensor] | None" = None) -> None:
        lg, lh = gram_min_eigenvalues(G, H) if start_eigenvalues is None else start_eigenvalues
        f = RANK_LOSS_FRACTION if fraction is None else fraction
        self.floor_G, self.floor_H = (f * lg)[:, None, None], (f * lh)[:, None, None]
        self.grams: list[tuple[Tensor, Tensor]] = []

    def __call__(self, G: Tensor, H: Tensor, t: float) -> None:
        with torch.no_grad():      # the h × h Gram matrices only (the points stay with autograd)
            G, H = G.detach(), H.detach()
            self.grams.append((_t(G) @ G, _t(H) @ H))

    def record(self, SG: Tensor, SH: Tensor) -> None:
        """Add a point by its Gram matrices ``GᵀG``, ``HᵀH`` (formed by the caller anyway)."""
        self.grams.append((SG.detach(), SH.detach()))

    def check(self, t: float) -> None:
        if not self.grams:
            return
        k = len(self.grams)
        with torch.no_grad():     # every point of the path in one batched test
            SG = torch.cat([a for a, _ in self.grams]).double()
            SH = torch.cat([b for _, b in self.grams]).double()
            eye = torch.eye(SG.shape[-1], dtype=SG.dtype, device=SG.device)
            bad = (torch.linalg.cholesky_ex(SG - self.floor_G.repeat(k, 1, 1) * eye)[1] != 0) \
                | (torch.linalg.cholesky_ex(SH - self.floor_H.repeat(k, 1, 1) * eye)[1] != 0)
            bad = bad.reshape(k, -1).any(0)
        self.grams = []
        if bool(bad.any()):
            raise ValueError(
                f"{int(bad.sum())} geodesic(s) of the mixed metric reach a rank-deficient pair (GᵀG or HᵀH "
                f"loses rank) before t = {t:.3g}: the geodesic ball ends before the radius (as for GL(1), "
                "exact_geodesic_gl1_mixed). Use a smaller rho, or step='second_order'.")


def singular_gram_refusal(t: float) -> ValueError:
    """The one-line refusal of an integrated geodesic of an incomplete metric that meets an
    *exactly* singular Gram matrix at a point where Γ is evaluated (``torch.linalg`` rejects
    it before :class:`RankLossMonitor` can look): the same event as the monitor's refusal,
    the pair lost rank on the path."""
    return ValueError(
        f"geodesic(s) of the mixed metric reach a rank-deficient pair (GᵀG or HᵀH exactly singular at an RK4 "
        f"point) before t = {t:.3g}: the geodesic ball ends before the radius (as for GL(1), "
        "exact_geodesic_gl1_mixed). Use a smaller rho, or step='second_order'.")


def rk4_geodesic(accel: Accel, G: Tensor, H: Tensor, xG: Tensor, xH: Tensor, steps: int, t: float = 1.0,
                 monitor: Callable[[Tensor, Tensor, float], None] | None = None,
                 first_accel: "tuple[Tensor, Tensor] | None" = None,
                 trajectory: bool = False):
    """Integrate ``(x, v)' = (v, accel(x, v))`` from ``(θ, ξ)`` over ``[0, t]`` with ``steps``
    classical RK4 steps; ``accel(G, H, vG, vH) = −Γ_{(G,H)}(v, v)``.

    ``first_accel``: the acceleration at the start, when the caller has it (precomputed
    Gram inverses).  ``monitor(G, H, s)`` is called at every stage point and after every step,
    and its ``check(t)`` (if it has one) at the end; with a monitor (an incomplete metric), an
    exactly singular Gram matrix on the path is refused in one line
    (:func:`singular_gram_refusal`) instead of ``torch.linalg``'s error.  Returns the end point
    ``(G(t), H(t))`` and velocity ``(vG(t), vH(t))``, or with ``trajectory=True`` the lists of
    the points and velocities at every step (``steps + 1`` each)."""
    if monitor is None:
        return _rk4(accel, G, H, xG, xH, steps, t, None, first_accel, trajectory)
    try:
        return _rk4(accel, G, H, xG, xH, steps, t, monitor, first_accel, trajectory)
    except torch.linalg.LinAlgError:
        raise singular_gram_refusal(t) from None


def _rk4(accel: Accel, G: Tensor, H: Tensor, xG: Tensor, xH: Tensor, steps: int, t: float,
         monitor: Callable[[Tensor, Tensor, float], None] | None,
         first_accel: "tuple[Tensor, Tensor] | None", trajectory: bool):
    """The RK4 loop of :func:`rk4_geodesic`."""
    if steps < 1:
        raise ValueError(f"the number of RK4 steps must be >= 1, got {steps}")
    dt = t / steps
    add = torch.add                  # x + c·y in one kernel: the step is many small tensor ops
    g, h, vg, vh = G, H, xG, xH
    points, velocities = [(g, h)], [(vg, vh)]
    for k in range(steps):
        a1 = first_accel if (k == 0 and first_accel is not None) else accel(g, h, vg, vh)
        g2, h2 = add(g, vg, alpha=0.5 * dt), add(h, vh, alpha=0.5 * dt)
        vg2, vh2 = add(vg, a1[0], alpha=0.5 * dt), add(vh, a1[1], alpha=0.5 * dt)
        if monitor is not None:
            monitor(g2, h2, (k + 0.5) * dt)
        a2 = accel(g2, h2, vg2, vh2)
        g3, h3 = add(g, vg2, alpha=0.5 * dt), add(h, vh2, alpha=0.5 * dt)
        vg3, vh3 = add(vg, a2[0], alpha=0.5 * dt), add(vh, a2[1], alpha=0.5 * dt)
        if monitor is not None:
            monitor(g3, h3, (k + 0.5) * dt)
        a3 = accel(g3, h3, vg3, vh3)
        g4, h4 = add(g, vg3, alpha=dt), add(h, vh3, alpha=dt)
        vg4, vh4 = add(vg, a3[0], alpha=dt), add(vh, a3[1], alpha=dt)
        if monitor is not None:
            monitor(g4, h4, (k + 1) * dt)
        a4 = accel(g4, h4, vg4, vh4)
        # x + dt/6 (k1 + 2 k2 + 2 k3 + k4)
        g = add(g, add(vg + vg4, vg2 + vg3, alpha=2.0), alpha=dt / 6)
        h = add(h, add(vh + vh4, vh2 + vh3, alpha=2.0), alpha=dt / 6)
        vg = add(vg, add(a1[0] + a4[0], a2[0] + a3[0], alpha=2.0), alpha=dt / 6)
        vh = add(vh, add(a1[1] + a4[1], a2[1] + a3[1], alpha=2.0), alpha=dt / 6)
        if monitor is not None:
            monitor(g, h, (k + 1) * dt)
        if trajectory:
            points.append((g, h))
            velocities.append((vg, vh))
    if monitor is not None and hasattr(monitor, "check"):
        monitor.check(t)
    if trajectory:
        return points, velocities
    return (g, h), (vg, vh)


def choose_steps(accel: Accel, G: Tensor, H: Tensor, xG: Tensor, xH: Tensor,
                 sqnorm: Callable[[Tensor, Tensor], Tensor], t: float = 1.0, rtol: float | None = None,
                 monitor_factory: Callable[[], Callable] | None = None, max_steps: int | None = None) -> int:
    """The RK4 step count by step doubling: the smallest ``n = 1, 2, 4, …`` whose end point
    moves by less than ``rtol ‖ξ‖`` when the steps are doubled,
    ``max_pairs √sqnorm(x_n − x_2n) / √sqnorm(ξ)`` (``sqnorm``: the metric at θ, so that the
    choice is invariant under the group action; pairs with ξ = 0 do not count).  Run it on
    float64 inputs without autograd.  ``max_steps`` (default :data:`MAX_GEODESIC_STEPS`):
    a ``RuntimeWarning`` and that count when not converged."""
    rtol = GEODESIC_RTOL if rtol is None else rtol
    cap = MAX_GEODESIC_STEPS if max_steps is None else max_steps
    ref = sqnorm(xG, xH).sqrt()
    live = ref > 0
    if not bool(live.any()):
        raise ValueError("choose_steps needs a nonzero velocity")

    def end(n):
        """End point with n steps, or the refusal of the rank-loss monitor."""
        mon = monitor_factory() if monitor_factory is not None else None
        try:
            return rk4_geodesic(accel, G, H, xG, xH, n, t, monitor=mon)[0], None
        except ValueError as refusal:
            return None, refusal

    # a coarse count may overshoot into a rank-deficient point: a refusal counts only when
    # the doubled count refuses too
    n, (prev, refused) = 1, end(1)
    while 2 * n <= cap:
        nxt, refused_next = end(2 * n)
        if refused is not None and refused_next is not None:
            raise refused_next
        if prev is not None and nxt is not None:
            err = sqnorm(prev[0] - nxt[0], prev[1] - nxt[1]).sqrt()
            if float((err[live] / ref[live]).max()) < rtol:
                return n
        n, prev, refused = 2 * n, nxt, refused_next
    warnings.warn(f"the integrated geodesic did not converge to rtol={rtol:g} within {cap} RK4 steps "
                  "(a pair close to rank deficiency?); using that many", RuntimeWarning, stacklevel=3)
    return cap


# ------------------------------------------------------------------ closed forms for GL(1)
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
