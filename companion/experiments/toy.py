"""The scalar toy model (paper Appendix D; Figures 1 and 6; docs/maths.md §9).

Two scalars ``g, h``, one data point ``(x, y)``, loss ``L = (g h x - y)^2``,
symmetry ``(g a, h / a)``: the GL(1) case of a pair with ``G = [[g]]`` and
``H = [[h]]`` (1 x 1). Everything below is computed by the library, batched over
the grid points: gradients and Hessians by its curvature operators
(:class:`hideseek.RiemannianHessian`, :class:`hideseek.EuclideanHessian`,
docs/maths.md §14), the Riemannian gradient by the pair geometry.

Definitions used (at a point ``theta = (g, h)`` with ``g h != 0``):

* Euclidean gradient norm ``||nabla L||_2``.
* Riemannian gradient norm ``||grad L||_theta``: the library's Riemannian
  gradient (``egrad_to_rgrad``, horizontal) measured in the metric.
* Euclidean Hessian trace ``d^2 L / dg^2 + d^2 L / dh^2``.
* Riemannian Hessian (Levi-Civita) on the quotient, ``hs.RiemannianHessian``;
  its quadratic form is the second derivative along a geodesic,
  ``Hess L(xi, xi) = d^2/dt^2 L(gamma_xi(t))|_0``. Its trace on the quotient is the
  sum over an orthonormal basis of the horizontal space, which is one-dimensional
  here: ``Hess L(xi_h, xi_h)`` for the unit horizontal vector ``xi_h``. The vertical direction is also
  returned (``rhess_vertical``): along the orbit the loss is constant, so it
  must vanish, and the total-space trace equals the quotient trace.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from torch import nn

from companion.params import from_mapping
from hideseek import DiagonalPair, Measure
from hideseek.curvature import EuclideanHessian, RiemannianHessian


def loss_fn(g: torch.Tensor, h: torch.Tensor, x: float, y: float) -> torch.Tensor:
    """``L = (g h x - y)^2`` elementwise."""
    return (g * h * x - y) ** 2


def _grid(lim: float, n: int) -> np.ndarray:
    if n % 2:
        raise ValueError("use an even number of grid points so that g = 0 and h = 0 are not on the grid")
    return np.linspace(-lim, lim, n)


class ToyGrid(nn.Module):
    """One scalar pair ``(g_i, h_i)`` per point, output ``g ⊙ h · x``: with the loss summed
    over points, every operator of the library is block diagonal over them, so one call
    evaluates the whole grid (``hs.DiagonalPair("g", "h")`` declares the GL(1) pairs)."""

    def __init__(self, g: torch.Tensor, h: torch.Tensor) -> None:
        super().__init__()
        self.g, self.h = nn.Parameter(g.clone()), nn.Parameter(h.clone())
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.g * self.h * x


def toy_fields(
    g: np.ndarray,
    h: np.ndarray,
    *,
    x: float,
    y: float,
    metric: str,
    of: str = "loss",
) -> dict[str, np.ndarray]:
    """All quantities of Figures 1 and 6 at the points ``(g, h)`` (arrays of one shape).

    ``of="loss"``: of the loss ``L``; ``of="network"``: of the network's output ``f = g h x``
    instead (the other reading of "the Hessian" in claim (c); the key ``loss`` then holds ``f``).
    Returns arrays of the input shape: ``loss``, ``egrad_norm``,
    ``rgrad_norm``, ``ehess_trace``, ``rhess_trace`` (quotient),
    ``rhess_vertical`` (should be 0), ``rhess_total`` (trace over an
    orthonormal basis of the whole 2-d tangent space).

    Both Hessians come from the library's operators (:class:`hideseek.RiemannianHessian`,
    :class:`hideseek.EuclideanHessian`, docs/maths.md §14) on a :class:`ToyGrid` whose loss
    is the sum over the points: the quotient trace is ``⟨ξ_h, Hess ξ_h⟩_g`` for the unit
    horizontal vector ``ξ_h`` of each point (the quotient is one-dimensional), the vertical
    value ``⟨ξ_v, ∇̄_{ξ_v} grad L⟩_g`` is the total-space Hessian along the orbit.
    """
    g = np.asarray(g, float)
    h = np.asarray(h, float)
    if g.shape != h.shape:
        raise ValueError("g and h must have the same shape")
    if np.any(g == 0) or np.any(h == 0):
        raise ValueError("the geometry needs g != 0 and h != 0 (full column rank)")
    if of not in ("loss", "network"):
        raise ValueError(f"of must be 'loss' or 'network', got {of!r}")
    shape = g.shape
    gt = torch.tensor(g.ravel(), dtype=torch.float64)
    ht = torch.tensor(h.ravel(), dtype=torch.float64)
    model = ToyGrid(gt, ht)
    xs = torch.full_like(gt, x)
    batches = [(xs, torch.full_like(gt, y))]
    summed = (lambda out, t: ((out - t) ** 2).sum()) if of == "loss" else (lambda out, t: out.sum())
    rhess = RiemannianHessian(model, batches, Measure(metric=metric), loss_fn=summed,
                              pairs=[DiagonalPair("g", "h")])
    ehess = EuclideanHessian(model, batches, loss_fn=summed)
    geom = rhess.geometry.pairs[0]                          # the (N, 1, 1) stack of pairs
    gG, gH = rhess.egrad                                    # Euclidean gradient, per point
    rG, rH = geom.egrad_to_rgrad(gG, gH)
    rgrad_norm = geom.sqnorm(rG, rH).clamp_min(0).sqrt()

    def unit(xG, xH):
        nrm = geom.sqnorm(xG, xH).sqrt().reshape(-1, 1, 1)
        return xG / nrm, xH / nrm

    # a horizontal direction: project (G, H) (the radial direction, never vertical)
    hG, hH = unit(*geom.project(geom.G.clone(), geom.H.clone()))
    vG, vH = unit(*geom.vertical(torch.ones_like(geom.G)))
    with torch.no_grad():
        oG, oH = rhess.matvec([hG, hH])
        rh = geom.inner(hG, hH, oG, oH)
        cG, cH = rhess.covariant_derivative([vG, vH])
        rv = geom.inner(vG, vH, cG, cH)
        ones, zero = torch.ones_like(gt), torch.zeros_like(gt)
        hgg = ehess.matvec([ones, zero])[0]                  # ∂²/∂g² per point (block diagonal)
        hhh = ehess.matvec([zero, ones])[1]
        out = {
            "loss": loss_fn(gt, ht, x, y) if of == "loss" else gt * ht * x,
            "egrad_norm": torch.sqrt(gG**2 + gH**2).reshape(-1),
            "rgrad_norm": rgrad_norm.reshape(-1),
            "ehess_trace": (hgg + hhh).reshape(-1),
            "rhess_trace": rh,
            "rhess_vertical": rv,
            "rhess_total": rh + rv,
            "horizontal_residual": geom.horizontal_residual(hG, hH).abs().reshape(-1),
        }
    return {k: v.detach().numpy().reshape(shape) for k, v in out.items()}


def orbit_spread(*, x: float, y: float, metric: str, betas: np.ndarray | None = None,
                 n_orbit: int = 9) -> dict[str, float]:
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


FIELDS = ("loss", "egrad_norm", "rgrad_norm", "ehess_trace", "rhess_trace")


def normalise(z: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """``(z - lo) / (hi - lo)``: the paper's normalisation to [0, 1] over the plotted window."""
    if not hi > lo:
        raise ValueError(f"cannot normalise a field that is constant on the window (min = max = {lo})")
    return (np.asarray(z) - lo) / (hi - lo)


@dataclass(frozen=True)
class Settings:
    """The ``toy`` stage's parameters (``params.yaml`` section ``toy``; every key required)."""

    n_grid: int                     # even: g = 0 and h = 0 stay off the grid
    lim: float                      # window [-lim, lim]^2
    x: float
    y: float
    metric: str
    points: list[tuple[float, float]]   # six fixed points (g, h) the level sets go through
    cpu_kernels: str | None         # CPU kernels pinned to this level (companion.kernels), checked before computing

    @classmethod
    def from_params(cls, params: "Mapping[str, Any] | Settings") -> "Settings":
        return params if isinstance(params, cls) else from_mapping(cls, params, "params.yaml toy")


def run(params: "Mapping[str, Any] | Settings") -> dict[str, Any]:
    """Fields over the window, normalised to [0, 1], level values through six fixed points,
    and the paper's Appendix D.1 claims measured on the normalised fields (``params``: the
    stage's resolved parameters or its :class:`Settings`)."""
    from companion import kernels

    st = Settings.from_params(params)
    kernels.check(st.cpu_kernels, "toy")   # the stage's command pins them (python -m companion.kernels toy -- ...)
    lim, n, x, y, metric = st.lim, st.n_grid, st.x, st.y, st.metric
    pts = np.asarray(st.points, float)
    if pts.shape != (6, 2):
        raise ValueError(f"points must be six (g, h) pairs, got shape {pts.shape}")
    if np.any(np.abs(pts) > lim) or np.any(pts == 0):
        raise ValueError(f"every fixed point must lie in the window [-{lim}, {lim}]^2 with g, h != 0")
    gs = _grid(lim, n)
    Gm, Hm = np.meshgrid(gs, gs, indexing="xy")
    f = toy_fields(Gm, Hm, x=x, y=y, metric=metric)
    fp = toy_fields(pts[:, 0], pts[:, 1], x=x, y=y, metric=metric)
    # the window's range: grid and fixed points (the points lie inside the window)
    rng_ = {k: (float(min(f[k].min(), fp[k].min())), float(max(f[k].max(), fp[k].max()))) for k in FIELDS}
    fn = {k: normalise(f[k], *rng_[k]) for k in FIELDS}
    fpn = {k: normalise(fp[k], *rng_[k]) for k in FIELDS}
    levels = {k: sorted({float(v) for v in np.round(fpn[k], 12)}) for k in FIELDS}

    # points on the minimum set g h x = y (both branches), inside the window
    gmin = np.concatenate([np.linspace(y / (x * lim), lim, 60), -np.linspace(y / (x * lim), lim, 60)])
    gmin = gmin[np.abs(y / (x * gmin)) <= lim]
    fmin = toy_fields(gmin, y / (x * gmin), x=x, y=y, metric=metric)
    fnet = toy_fields(gmin, y / (x * gmin), x=x, y=y, metric=metric, of="network")
    fminn = {k: normalise(fmin[k], *rng_[k]) for k in FIELDS}
    beta = Gm * Hm
    concave = (x * beta > 0) & (x * beta < y / 2)
    ehess_argmax = np.unravel_index(np.argmax(f["ehess_trace"]), f["ehess_trace"].shape)
    checks = {
        "orbit_spread": orbit_spread(x=x, y=y, metric=metric),
        "fraction_riemannian_below_euclidean_normalised": {
            "grad_norm": float(np.mean(fn["rgrad_norm"] < fn["egrad_norm"])),
            "hess_trace": float(np.mean(fn["rhess_trace"] < fn["ehess_trace"])),
        },
        "fraction_riemannian_below_euclidean_raw": {
            "grad_norm": float(np.mean(f["rgrad_norm"] < f["egrad_norm"])),
            "hess_trace": float(np.mean(f["rhess_trace"] < f["ehess_trace"])),
        },
        "at_minimum_normalised": {k: [float(fminn[k].min()), float(fminn[k].max())] for k in FIELDS},
        "at_minimum_raw": {k: [float(fmin[k].min()), float(fmin[k].max())] for k in FIELDS},
        "network_at_minimum_raw": {k: [float(fnet[k].min()), float(fnet[k].max())]
                                   for k in ("ehess_trace", "rhess_trace")},
        "window_range_raw": rng_,
        "ehess_trace_argmax": {"g": float(Gm[ehess_argmax]), "h": float(Hm[ehess_argmax]),
                               "loss": float(f["loss"][ehess_argmax])},
        "rhess_trace_negative_fraction": float(np.mean(f["rhess_trace"] < 0)),
        "rhess_trace_negative_iff_concave_region": bool(np.array_equal(f["rhess_trace"] < 0, concave)),
        "ehess_trace_min_raw": float(f["ehess_trace"].min()),
        "rhess_vertical_max_abs": float(np.abs(f["rhess_vertical"]).max()),
        "horizontal_residual_max": float(f["horizontal_residual"].max()),
        "points": pts.tolist(),
        "points_normalised": {k: [float(v) for v in fpn[k]] for k in FIELDS},
    }
    return {"g": gs, "h": gs, "G": Gm, "H": Hm, "fields": f, "normalised": fn, "levels": levels,
            "points": pts, "minimum": {"g": gmin, **fmin}, "checks": checks, "claims": claims(checks),
            "x": x, "y": y, "metric": metric, "lim": lim}


def claims(c: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The paper's Appendix D.1 claims (a)-(d), each with the numbers that decide it.

    (a) Riemannian gradient norm and Hessian trace have the loss's level sets;
    (b) both are smaller than their Euclidean counterparts throughout (normalised);
    (c) the Riemannian trace reaches 0 at the minimum, the Euclidean one is largest there;
    (d) the Euclidean trace cannot tell a minimum from a maximum, the Riemannian can.
    """
    sp = c["orbit_spread"]
    fr = c["fraction_riemannian_below_euclidean_normalised"]
    at = c["at_minimum_normalised"]
    e_at_min_max = at["ehess_trace"][1]
    return {
        "a_level_sets_follow_loss": {
            "holds": bool(sp["rgrad_norm"] < 1e-10 and sp["rhess_trace"] < 1e-10
                          and sp["egrad_norm"] > 1e-2 and sp["ehess_trace"] > 1e-2),
            "evidence": {k: sp[k] for k in ("rgrad_norm", "rhess_trace", "egrad_norm", "ehess_trace")}},
        "b_riemannian_smaller_throughout": {
            "holds": bool(fr["grad_norm"] == 1.0 and fr["hess_trace"] == 1.0),
            "evidence": fr},
        "c_riemannian_trace_zero_at_minimum": {
            "holds": bool(at["rhess_trace"][1] < 1e-8),
            "evidence": {"normalised_on_minimum_set": at["rhess_trace"],
                         "raw_on_minimum_set": c["at_minimum_raw"]["rhess_trace"],
                         "network_hessian_raw_on_minimum_set": c["network_at_minimum_raw"]["rhess_trace"]}},
        "c_euclidean_trace_largest_at_minimum": {
            "holds": bool(e_at_min_max >= 1.0 - 1e-8),
            "evidence": {"normalised_on_minimum_set": at["ehess_trace"], "argmax": c["ehess_trace_argmax"]}},
        "d_riemannian_sign_separates_concave_region": {
            "holds": bool(c["rhess_trace_negative_iff_concave_region"] and c["ehess_trace_min_raw"] >= 0),
            "evidence": {"rhess_negative_fraction": c["rhess_trace_negative_fraction"],
                         "ehess_min_raw": c["ehess_trace_min_raw"]}},
    }


def summary_metrics(res: Mapping[str, Any]) -> dict[str, Any]:
    """The stage's metrics JSON."""
    return {"checks": res["checks"], "claims": {k: v["holds"] for k, v in res["claims"].items()},
            "claims_evidence": {k: v["evidence"] for k, v in res["claims"].items()},
            "levels": res["levels"], "x": res["x"], "y": res["y"], "metric": res["metric"],
            "lim": res["lim"], "n_grid": int(res["g"].size)}


def _pct(v: float) -> str:
    return f"{100 * v:.4g} %"


def findings(m: Mapping[str, Any]) -> str:
    """The notebook's reading of claims (a)-(d), generated from the stage's metrics (no typed numbers)."""
    c, ev, holds = m["checks"], m["claims_evidence"], m["claims"]
    sp, fr = c["orbit_spread"], c["fraction_riemannian_below_euclidean_normalised"]
    word = {True: "holds", False: "does not hold"}
    lr, nr = c["at_minimum_raw"]["rhess_trace"], c["network_at_minimum_raw"]["rhess_trace"]
    closed = (f" (closed forms for the invariant metric: 4y² = {4 * m['y'] ** 2:g} and 2y = {2 * m['y']:g})"
              if m["metric"] == "invariant" else "")
    lines = [
        f"* **(a) {word[holds['a_level_sets_follow_loss']]}.** Largest spread along a loss level set relative to the "
        f"field's range: Riemannian gradient norm {sp['rgrad_norm']:.2g}, Riemannian trace {sp['rhess_trace']:.2g}; "
        f"Euclidean gradient norm {sp['egrad_norm']:.2g}, Euclidean trace {sp['ehess_trace']:.2g}.",
        f"* **(b) {word[holds['b_riemannian_smaller_throughout']]}.** After normalisation the Riemannian value is below "
        f"the Euclidean one on {_pct(fr['grad_norm'])} of the window (gradient norm) and {_pct(fr['hess_trace'])} "
        "(Hessian trace); before normalisation the comparison mixes units.",
        f"* **(c), first half: the Riemannian trace is not 0 at the minimum, in either reading.** Of the loss: "
        f"{lr[0]:.6g}–{lr[1]:.6g} on the minimum set; of the network's output f = ghx: {nr[0]:.6g}–{nr[1]:.6g}"
        f"{closed}. Normalised to the window, the loss trace is {c['at_minimum_normalised']['rhess_trace'][1]:.2g} "
        f"there (the window's smallest raw value is {c['window_range_raw']['rhess_trace'][0]:.3g}, where the loss is "
        "concave along geodesics), which is why the figure shows it near the bottom of its colour scale.",
        f"* **(c), second half {word[holds['c_euclidean_trace_largest_at_minimum']]}.** The normalised Euclidean trace "
        f"on the minimum set spans {c['at_minimum_normalised']['ehess_trace'][0]:.2g}–"
        f"{c['at_minimum_normalised']['ehess_trace'][1]:.2g}; it peaks at (g, h) = "
        f"({c['ehess_trace_argmax']['g']:g}, {c['ehess_trace_argmax']['h']:g}).",
        f"* **(d) {word[holds['d_riemannian_sign_separates_concave_region']]}.** The raw Riemannian trace is negative on "
        f"{_pct(c['rhess_trace_negative_fraction'])} of the window, exactly where the loss is concave along geodesics "
        f"({'yes' if c['rhess_trace_negative_iff_concave_region'] else 'no'}); the smallest raw Euclidean trace is "
        f"{c['ehess_trace_min_raw']:.3g}, so its sign says nothing about the kind of critical structure.",
    ]
    return "\n".join(lines)


def run_report(profile: str, params: "Mapping[str, Any] | Settings", out_dir: "str | Path", *,
               progress: bool = True) -> dict[str, Any]:
    """The stage's one computing call: :func:`run`, then ``out_dir/metrics/toy.json``
    (:func:`summary_metrics`) written; returns the result with ``metrics`` added. The entry signature every
    stage module shares (``tests/companion/test_contract.py``): ``profile`` (``params`` is the resolved
    profile already) and ``progress`` (closed forms on a grid, nothing to report) are accepted and unused."""
    from pathlib import Path

    from companion.metrics import write_stage_metrics

    res = run(params)
    res["metrics"] = summary_metrics(res)
    (Path(out_dir) / "figures").mkdir(parents=True, exist_ok=True)
    write_stage_metrics(out_dir, "toy", res["metrics"])
    return res
