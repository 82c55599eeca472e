"""Integrated geodesics (hideseek/geometry/geodesic.py, PairGeometry.integrated_step), float64.

References: the GL(1) closed forms (:func:`exact_geodesic_gl1`, :func:`exact_geodesic_gl1_mixed`)
and the radial geodesics of both metrics for any h (``e^{bt}(G, H)``, ``√(1 + 2bt)(G, H)``,
docs/maths.md §5.6); the slow reference integrator :func:`hideseek.reference.geodesic_rk4`
(Christoffel symbols by autograd of the dense metric tensor); conserved quantities (the
metric norm of the velocity); horizontality by hand-built vertical vectors; the group
action applied by hand.
"""
from __future__ import annotations

import math

import pytest
import torch

from hideseek.geometry import PairGeometry, RotaryPairGeometry
from hideseek.geometry import geodesic as geo
from hideseek.geometry.geodesic import exact_geodesic_gl1, exact_geodesic_gl1_mixed
from hideseek.geometry.metrics import get_metric
from hideseek.reference import geodesic_rk4, pair_metric_tensor

pytestmark = pytest.mark.usefixtures("float64_default")

METRIC_EPS = [("invariant", 0.0), ("invariant", 1e-2), ("mixed", 0.0)]


def _conditioned(B, r, h, g):
    """A random (B, r, h) matrix with singular values in [0.7, 1.5] (signs random for r = h = 1)."""
    U = torch.linalg.qr(torch.randn(B, r, h, generator=g)).Q
    V = torch.linalg.qr(torch.randn(B, h, h, generator=g)).Q
    return U * (0.7 + 0.8 * torch.rand(B, 1, h, generator=g)) @ V.transpose(-1, -2)


def _pair(B, n, m, h, seed=0, scale=0.3):
    """A well-conditioned point and a velocity of relative size about ``scale``."""
    g = torch.Generator().manual_seed(seed)
    G, H = _conditioned(B, n, h, g), _conditioned(B, m, h, g)
    return G, H, scale * torch.randn(B, n, h, generator=g), scale * torch.randn(B, m, h, generator=g)


def _flat(a, b):
    return torch.cat([a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)], dim=1)


def test_integration_reproduces_the_gl1_closed_forms():
    G, H, xG, xH = _pair(3, 4, 5, 1, scale=0.5)
    pg = PairGeometry(G, H, "invariant")
    eG, eH = pg.integrated_step(xG, xH, steps=256)
    torch.testing.assert_close(eG, exact_geodesic_gl1(G, xG), rtol=0, atol=1e-9)
    torch.testing.assert_close(eH, exact_geodesic_gl1(H, xH), rtol=0, atol=1e-9)
    G, H, xG, xH = _pair(4, 1, 1, 1, seed=1, scale=0.3)
    pg = PairGeometry(G, H, "mixed")
    e = pg.integrated_step(xG, xH, steps=256)
    for a, b in zip(e, exact_geodesic_gl1_mixed(G, H, xG, xH)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)
    # the step chosen by step doubling meets its tolerance against the closed form
    pg = PairGeometry(G, H, "mixed")
    e = pg.integrated_step(xG, xH)
    err = (_flat(*e) - _flat(*exact_geodesic_gl1_mixed(G, H, xG, xH))).norm(dim=1)
    assert pg.geodesic_steps is not None and float((err / _flat(xG, xH).norm(dim=1)).max()) < 10 * geo.GEODESIC_RTOL


@pytest.mark.parametrize("metric", ["invariant", "mixed"])
def test_radial_geodesics_in_closed_form_for_any_h(metric):
    """ξ = b (G, H): the invariant metric's geodesic is e^{bt}(G, H) (scaling is flat in log
    scale), the mixed metric's √(1 + 2bt)(G, H) (a cone's generator, as for GL(1))."""
    G, H, _, _ = _pair(2, 5, 4, 3)
    b = -0.3
    pg = PairGeometry(G, H, metric)
    eG, eH = pg.integrated_step(b * G, b * H, steps=64)
    s = math.exp(b) if metric == "invariant" else math.sqrt(1 + 2 * b)
    torch.testing.assert_close(eG, s * G, rtol=0, atol=1e-8)
    torch.testing.assert_close(eH, s * H, rtol=0, atol=1e-8)


def test_the_mixed_metric_refuses_a_geodesic_that_loses_rank():
    G, H, _, _ = _pair(2, 5, 4, 3)
    pg = PairGeometry(G, H, "mixed")            # √(1 + 2bt) reaches 0 at t = 1/1.2 < 1
    with pytest.raises(ValueError, match=r"rank-deficient pair .* smaller rho"):
        pg.integrated_step(-0.6 * G, -0.6 * H, steps=32)
    with pytest.raises(ValueError, match="rank-deficient"):
        PairGeometry(G, H, "mixed").step(-0.6 * G, -0.6 * H, "exact")     # through step doubling
    PairGeometry(G, H, "invariant").step(-0.6 * G, -0.6 * H, "exact")        # complete: no refusal


def test_an_exactly_singular_gram_matrix_on_the_path_is_refused_in_one_line():
    # G = H = I (h = 2) and ξ = −2θ: RK4's first stage point θ + ξ/2 is exactly 0, where torch.linalg cannot
    # invert GᵀG; the library must refuse as the rank-loss monitor does (ValueError, one line), not leak LinAlgError
    G, H = torch.eye(2).expand(1, 2, 2), torch.eye(2).expand(1, 2, 2)
    with pytest.raises(torch.linalg.LinAlgError):   # the event itself, independent of the library's geometry
        torch.linalg.inv(torch.zeros(1, 2, 2))
    with pytest.raises(ValueError, match=r"exactly singular .* smaller rho") as err:
        PairGeometry(G, H, "mixed").integrated_step(-2 * G, -2 * H, steps=1)
    assert "\n" not in str(err.value) and "rank-deficient pair" in str(err.value)
    with pytest.raises(ValueError, match="rank-deficient pair"):           # through step doubling
        PairGeometry(G, H, "mixed").step(-2 * G, -2 * H, "exact")
    accel = get_metric("mixed").acceleration_at
    with pytest.raises(ValueError, match="exactly singular"):               # the integrator with a monitor
        geo.rk4_geodesic(lambda g, h, vg, vh: accel(g, h, vg, vh, 0.0), G, H, -2 * G, -2 * H, 1,
                         monitor=lambda *a: None)
    with pytest.raises(torch.linalg.LinAlgError):    # without a monitor (a complete metric's caller) it is an error
        geo.rk4_geodesic(lambda g, h, vg, vh: accel(g, h, vg, vh, 0.0), G, H, -2 * G, -2 * H, 1)


@pytest.mark.parametrize("metric,eps", METRIC_EPS)
def test_against_the_reference_integrator(metric, eps):
    n, m, h = 4, 3, 2
    G, H, xG, xH = _pair(2, n, m, h, seed=3)
    pg = PairGeometry(G, H, metric, eps)
    # the same scheme and steps on the same equation: equal up to rounding, and both close to
    # the geodesic (the fine-step limit) — the reference at 64 steps
    end = _flat(*pg.integrated_step(xG, xH, steps=8))
    theta = torch.cat([G[0].reshape(-1), H[0].reshape(-1)])
    v = torch.cat([xG[0].reshape(-1), xH[0].reshape(-1)])
    xs, _ = geodesic_rk4(lambda th: pair_metric_tensor(th, n, m, h, metric, eps), theta, v, steps=8)
    torch.testing.assert_close(end[0], xs[-1], rtol=0, atol=1e-12)
    xs, _ = geodesic_rk4(lambda th: pair_metric_tensor(th, n, m, h, metric, eps), theta, v, steps=64)
    torch.testing.assert_close(_flat(*pg.integrated_step(xG, xH, steps=64))[0], xs[-1], rtol=0, atol=1e-12)
    assert float((end[0] - xs[-1]).abs().max()) < 1e-5


@pytest.mark.parametrize("metric", ["invariant", "mixed"])
def test_fourth_order_convergence(metric):
    G, H, xG, xH = _pair(2, 4, 3, 2, seed=4, scale=0.6)
    pg = PairGeometry(G, H, metric)
    fine = _flat(*pg.integrated_step(xG, xH, steps=256))
    errs = [float((_flat(*pg.integrated_step(xG, xH, steps=n)) - fine).norm()) for n in (4, 8, 16)]
    orders = [math.log2(a / b) for a, b in zip(errs, errs[1:])]
    assert all(3.6 < o < 4.4 for o in orders), orders


@pytest.mark.parametrize("metric,eps", METRIC_EPS)
def test_metric_norm_of_the_velocity_is_constant(metric, eps):
    G, H, xG, xH = _pair(2, 4, 3, 2, seed=5, scale=0.5)
    pg = PairGeometry(G, H, metric, eps)
    points, velocities = geo.rk4_geodesic(lambda g, h, vg, vh: pg.impl.acceleration_at(g, h, vg, vh, eps),
                                          G, H, xG, xH, 128, trajectory=True)
    cls = get_metric(metric)
    speeds = []
    for (g, h), (vg, vh) in zip(points, velocities):
        MG, MH = cls.blocks(g, h, eps)
        speeds.append(((vg @ MG) * vg).sum((-1, -2)) + ((vh @ MH) * vh).sum((-1, -2)))
    speeds = torch.stack(speeds)
    drift = float(((speeds - speeds[0]).abs() / speeds[0]).max())
    if metric == "mixed" and eps > 0:
        assert drift < 1e-2                     # ε only regularises Γ: conserved to O(ε)
    else:
        assert drift < 1e-9, drift


@pytest.mark.parametrize("kind", ["gl", "rotary"])
@pytest.mark.parametrize("metric", ["invariant", "mixed"])
def test_a_horizontal_start_stays_horizontal(kind, metric):
    """O'Neill: the group acts by isometries, so a geodesic horizontal at t = 0 stays so.
    Checked with vertical vectors (GΛ, −HΛᵀ) built by hand at points along the curve."""
    n, m, h = (4, 3, 2) if kind == "gl" else (5, 4, 4)
    G, H, xG, xH = _pair(2, n, m, h, seed=6, scale=0.5)
    make = (lambda g, hh: PairGeometry(g, hh, metric)) if kind == "gl" else \
        (lambda g, hh: RotaryPairGeometry(g, hh, metric, rotary=((0, 2),)))
    pg = make(G, H)
    xG, xH = pg.project(xG, xH)
    points, velocities = geo.rk4_geodesic(lambda g, hh, vg, vh: pg.impl.acceleration_at(g, hh, vg, vh),
                                          G, H, xG, xH, 64, trajectory=True)
    gen = torch.Generator().manual_seed(7)
    for (g, hh), (vg, vh) in list(zip(points, velocities))[16::16]:
        here = make(g, hh)
        Lam = torch.randn(2, h, h, generator=gen)
        Lam = Lam if kind == "gl" else here.lie_algebra(Lam)
        ip = here.inner(vg, vh, g @ Lam, -(hh @ Lam.transpose(-1, -2)))
        scale = (here.sqnorm(vg, vh) * here.sqnorm(g @ Lam, hh @ Lam.transpose(-1, -2))).sqrt()
        assert float((ip.abs() / scale).max()) < 1e-8      # RK4's own error at 64 steps: ~1e-9
    # and a vertical start is not horizontal (the check can fail)
    vert = G @ torch.eye(h), -(H @ torch.eye(h))
    assert float(pg.horizontal_residual(*vert).abs().max()) > 1e-3


@pytest.mark.parametrize("kind", ["gl", "rotary"])
@pytest.mark.parametrize("metric,eps", METRIC_EPS)
def test_equivariance_under_the_group_action(kind, metric, eps):
    """γ_{θ·A, ξ·A}(1) = γ_{θ,ξ}(1)·A (A orthogonal at ε > 0), step counts chosen alike."""
    n, m, h = (4, 3, 2) if kind == "gl" else (5, 4, 4)
    G, H, xG, xH = _pair(2, n, m, h, seed=8)
    gen = torch.Generator().manual_seed(9)
    if kind == "gl":
        X = torch.randn(2, h, h, generator=gen)
        A = torch.linalg.qr(X).Q if eps > 0 else torch.eye(h) + 0.5 * X / math.sqrt(h)
    else:
        phi = torch.rand(2, generator=gen) * 2 * math.pi
        r = 1.0 if eps > 0 else 1.3
        A = torch.zeros(2, h, h)
        A[:, 0, 0] = A[:, 2, 2] = r * torch.cos(phi)
        A[:, 2, 0], A[:, 0, 2] = r * torch.sin(phi), -r * torch.sin(phi)
        F = torch.randn(2, 2, 2, generator=gen)
        idx = torch.tensor([1, 3])
        A[:, idx[:, None], idx[None, :]] = torch.linalg.qr(F).Q if eps > 0 else torch.eye(2) + 0.3 * F
    Ait = torch.linalg.inv(A).transpose(-1, -2)
    make = (lambda g, hh: PairGeometry(g, hh, metric, eps)) if kind == "gl" else \
        (lambda g, hh: RotaryPairGeometry(g, hh, metric, eps, rotary=((0, 2),)))
    p, q = make(G, H), make(G @ A, H @ Ait)
    eG, eH = p.step(xG, xH, "exact")
    fG, fH = q.step(xG @ A, xH @ Ait, "exact")
    assert p.geodesic_steps == q.geodesic_steps
    torch.testing.assert_close(fG, eG @ A, rtol=0, atol=1e-10)
    torch.testing.assert_close(fH, eH @ Ait, rtol=0, atol=1e-10)


def test_the_step_count_is_fixed_after_the_first_nonzero_velocity():
    G, H, xG, xH = _pair(2, 4, 3, 2, seed=10, scale=0.6)
    pg = PairGeometry(G, H, "mixed")
    pg.step(0 * xG, 0 * xH, "exact")
    assert pg.geodesic_steps is None                   # ξ = 0 fixes nothing
    pg.step(xG, xH, "exact")
    n = pg.geodesic_steps
    assert n is not None and n > 1
    pg.step(0.5 * xG, -0.5 * xH, "exact")
    assert pg.geodesic_steps == n                      # fixed within one search
    # so ξ ↦ γ_ξ(1) is one smooth map: its autograd derivative matches finite differences
    d = torch.randn(xG.shape, generator=torch.Generator().manual_seed(1))
    x = xG.clone().requires_grad_(True)
    out = pg.step(x, xH, "exact")[0].sum()
    (grad,) = torch.autograd.grad(out, x)
    fd = (pg.step(xG + 1e-6 * d, xH, "exact")[0].sum() - pg.step(xG - 1e-6 * d, xH, "exact")[0].sum()) / 2e-6
    assert abs(float((grad * d).sum() - fd)) < 1e-7 * (1 + abs(float(fd)))


def test_the_step_error_shrinks_like_the_cube_of_the_velocity():
    """The integrated and second-order end points differ by O(‖ξ‖³)."""
    G, H, xG, xH = _pair(2, 4, 3, 2, seed=11)
    diffs = []
    for s in (0.2, 0.1, 0.05):
        pg = PairGeometry(G, H, "invariant")
        e = _flat(*pg.integrated_step(s * xG, s * xH, steps=32))
        diffs.append(float((e - _flat(*pg.step(s * xG, s * xH, True))).norm()))
    orders = [math.log2(a / b) for a, b in zip(diffs, diffs[1:])]
    assert all(2.7 < o < 3.3 for o in orders), orders
