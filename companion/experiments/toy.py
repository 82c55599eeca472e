"""The scalar toy model (paper Appendix D; Figures 1 and 6; docs/maths.md §9).

Two scalars ``g, h``, one data point ``(x, y)``, loss ``L = (g h x - y)^2``,
symmetry ``(g a, h / a)``: the GL(1) case of a pair with ``G = [[g]]`` and
``H = [[h]]`` (1 x 1). Everything Riemannian below is computed by the
library's pair geometry (:class:`hideseek.geometry.PairGeometry`), batched
over the grid points; the Euclidean quantities by autograd.

Definitions used (at a point ``theta = (g, h)`` with ``g h != 0``):

* Euclidean gradient norm ``||nabla L||_2``.
* Riemannian gradient norm ``||grad L||_theta``: the library's Riemannian
  gradient (``egrad_to_rgrad``, horizontal) measured in the metric.
* Euclidean Hessian trace ``d^2 L / dg^2 + d^2 L / dh^2``.
* Riemannian Hessian (Levi-Civita) quadratic form along a geodesic,
  ``Hess L(xi, xi) = d^2/dt^2 L(gamma_xi(t))|_0 = xi^T nabla^2 L xi + <nabla L, gamma''(0)>``
  with ``gamma''(0) = -Gamma(xi, xi)`` the library's geodesic acceleration.
  Its trace on the quotient is the sum over an orthonormal basis of the
  horizontal space, which is one-dimensional here: ``Hess L(xi_h, xi_h)``
  for the unit horizontal vector ``xi_h``. The vertical direction is also
  returned (``rhess_vertical``): along the orbit the loss is constant, so it
  must vanish, and the total-space trace equals the quotient trace.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from hideseek.geometry import PairGeometry


def loss_fn(g: torch.Tensor, h: torch.Tensor, x: float, y: float) -> torch.Tensor:
    """``L = (g h x - y)^2`` elementwise."""
    return (g * h * x - y) ** 2


def _grid(lim: float, n: int) -> np.ndarray:
    if n % 2:
        raise ValueError("use an even number of grid points so that g = 0 and h = 0 are not on the grid")
    return np.linspace(-lim, lim, n)


def toy_fields(
    g: np.ndarray,
    h: np.ndarray,
    *,
    x: float = 1.0,
    y: float = 1.0,
    metric: str = "invariant",
) -> dict[str, np.ndarray]:
    """All quantities of Figures 1 and 6 at the points ``(g, h)`` (arrays of one shape).

    Returns arrays of the input shape: ``loss``, ``egrad_norm``,
    ``rgrad_norm``, ``ehess_trace``, ``rhess_trace`` (quotient),
    ``rhess_vertical`` (should be 0), ``rhess_total`` (trace over an
    orthonormal basis of the whole 2-d tangent space).
    """
    g = np.asarray(g, float)
    h = np.asarray(h, float)
    if g.shape != h.shape:
        raise ValueError("g and h must have the same shape")
    if np.any(g == 0) or np.any(h == 0):
        raise ValueError("the geometry needs g != 0 and h != 0 (full column rank)")
    shape = g.shape
    G = torch.tensor(g.ravel(), dtype=torch.float64).reshape(-1, 1, 1).requires_grad_(True)
    H = torch.tensor(h.ravel(), dtype=torch.float64).reshape(-1, 1, 1).requires_grad_(True)

    L = loss_fn(G, H, x, y)
    gG, gH = torch.autograd.grad(L.sum(), (G, H), create_graph=True)
    # Euclidean Hessian entries (points are independent, so sums give per-point derivatives)
    hGG, hGH = torch.autograd.grad(gG.sum(), (G, H), retain_graph=True)
    hHG, hHH = torch.autograd.grad(gH.sum(), (G, H), retain_graph=True)

    geom = PairGeometry(G.detach(), H.detach(), metric=metric)
    gGd, gHd = gG.detach(), gH.detach()
    rG, rH = geom.egrad_to_rgrad(gGd, gHd)
    rgrad_norm = geom.sqnorm(rG, rH).clamp_min(0).sqrt()

    def hess_quadratic(xG, xH):
        """xi^T nabla^2 L xi + <nabla L, gamma''(0)>, per point."""
        quad = hGG * xG * xG + (hGH + hHG) * xG * xH + hHH * xH * xH
        aG, aH = geom.acceleration(xG, xH)
        return (quad + gGd * aG + gHd * aH).reshape(-1)

    def unit(xG, xH):
        nrm = geom.sqnorm(xG, xH).sqrt().reshape(-1, 1, 1)
        return xG / nrm, xH / nrm

    # a horizontal direction: project (G, H) (the radial direction, never vertical)
    hG, hH = unit(*geom.project(G.detach().clone(), H.detach().clone()))
    vG, vH = unit(*geom.vertical(torch.ones_like(G.detach())))
    with torch.no_grad():
        rh = hess_quadratic(hG, hH)
        rv = hess_quadratic(vG, vH)
        out = {
            "loss": L.detach().reshape(-1),
            "egrad_norm": torch.sqrt(gGd**2 + gHd**2).reshape(-1),
            "rgrad_norm": rgrad_norm.reshape(-1),
            "ehess_trace": (hGG + hHH).reshape(-1),
            "rhess_trace": rh,
            "rhess_vertical": rv,
            "rhess_total": rh + rv,
            "horizontal_residual": geom.horizontal_residual(hG, hH).abs().reshape(-1),
        }
    return {k: v.detach().numpy().reshape(shape) for k, v in out.items()}


def orbit_spread(*, x: float = 1.0, y: float = 1.0, metric: str = "invariant",
                 betas: np.ndarray | None = None, n_orbit: int = 9) -> dict[str, float]:
    """How much each field varies along the loss's level sets (the orbits ``g h = beta``).

    For each ``beta`` the fields are evaluated at ``n_orbit`` points
    ``(g, beta / g)`` of the orbit, ``|g|`` from ``10^-0.5`` to ``10^0.5``; the
    result is the largest spread along an orbit relative to the field's range
    over all orbits: about 1e-15 for a function of ``beta`` alone, of order
    one otherwise.
    """
    if betas is None:
        betas = np.array([b for b in np.linspace(-3, 3, 13) if b != 0])
    gs = np.logspace(-0.5, 0.5, n_orbit)
    Gm = np.tile(gs, (betas.size, 1))
    Hm = betas[:, None] / Gm
    f = toy_fields(Gm, Hm, x=x, y=y, metric=metric)
    out = {}
    for k in ("loss", "egrad_norm", "rgrad_norm", "ehess_trace", "rhess_trace"):
        total = np.ptp(f[k])
        out[k] = float(np.ptp(f[k], axis=1).max() / total) if total > 0 else 0.0
    return out


def run(params: Mapping[str, Any]) -> dict[str, Any]:
    """Fields over a grid plus checks of the paper's Appendix D.1 claims.

    ``params``: ``lim`` (grid half-width), ``n_grid`` (even), ``x``, ``y``, ``metric``.
    """
    lim, n = float(params.get("lim", 2.0)), int(params.get("n_grid", 200))
    x, y = float(params.get("x", 1.0)), float(params.get("y", 1.0))
    metric = params.get("metric", "invariant")
    gs = _grid(lim, n)
    Gm, Hm = np.meshgrid(gs, gs, indexing="xy")
    f = toy_fields(Gm, Hm, x=x, y=y, metric=metric)

    # points on the minimum set g h x = y (one branch, g > 0)
    gmin = np.linspace(0.5, lim, 50) if y / x > 0 else -np.linspace(0.5, lim, 50)
    gmin = gmin[np.abs(y / (x * gmin)) <= lim]
    fmin = toy_fields(gmin, y / (x * gmin), x=x, y=y, metric=metric)
    checks = {
        "orbit_spread": orbit_spread(x=x, y=y, metric=metric),
        "fraction_riemannian_below_euclidean": {
            "grad_norm": float(np.mean(f["rgrad_norm"] < f["egrad_norm"])),
            "hess_trace": float(np.mean(f["rhess_trace"] < f["ehess_trace"])),
        },
        "at_minimum": {
            "loss_max": float(fmin["loss"].max()),
            "rhess_trace_min": float(fmin["rhess_trace"].min()),
            "rhess_trace_max": float(fmin["rhess_trace"].max()),
            "ehess_trace_min": float(fmin["ehess_trace"].min()),
            "ehess_trace_max": float(fmin["ehess_trace"].max()),
        },
        "ehess_trace_grid_max": float(f["ehess_trace"].max()),
        "ehess_trace_grid_max_at_minimum_set": bool(
            np.isclose(f["loss"].ravel()[np.argmax(f["ehess_trace"])], 0.0, atol=1e-2)),
        "rhess_trace_grid_min": float(f["rhess_trace"].min()),
        "rhess_vertical_max_abs": float(np.abs(f["rhess_vertical"]).max()),
        "horizontal_residual_max": float(f["horizontal_residual"].max()),
    }
    return {"g": gs, "h": gs, "G": Gm, "H": Hm, "fields": f, "minimum": {"g": gmin, **fmin},
            "checks": checks, "x": x, "y": y, "metric": metric}
