"""GL(h) pair geometry against independent references (float64, seeded)."""
import numpy as np
import pytest
import scipy.linalg
import torch

from hideseek.geometry.gl import PairGeometry, act, exact_geodesic_gl1
from hideseek.reference import (christoffel_contraction, christoffel_symbols, geodesic_rk4, pair_metric_tensor,
                                taylor_remainder_slope)
from hideseek.symmetries.action import random_gl



pytestmark = pytest.mark.usefixtures("float64_default")   # every tensor here is float64

METRICS = ["invariant", "mixed"]
SHAPES = [(5, 4, 2), (6, 3, 3), (4, 4, 1)]


def make(B, n, m, h, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return r(B, n, h), r(B, m, h), r(B, n, h), r(B, m, h), r(B, n, h), r(B, m, h)


def vec(xG, xH, b=0):
    return torch.cat([xG[b].reshape(-1), xH[b].reshape(-1)])


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("shape", SHAPES)
def test_metric_matches_dense_tensor_and_is_invariant(metric, shape):
    n, m, h = shape
    G, H, xG, xH, yG, yH = make(3, n, m, h)
    geo = PairGeometry(G, H, metric)
    ip = geo.inner(xG, xH, yG, yH)
    for b in range(3):
        gmat = pair_metric_tensor(vec(G, H, b), n, m, h, metric)
        assert torch.allclose(ip[b], vec(xG, xH, b) @ gmat @ vec(yG, yH, b), rtol=1e-12)
    A = random_gl(3, h, torch.Generator().manual_seed(1), log_cond=2.0)
    G2, H2 = act(G, H, A)
    (xG2, xH2), (yG2, yH2) = act(xG, xH, A), act(yG, yH, A)
    ip2 = PairGeometry(G2, H2, metric).inner(xG2, xH2, yG2, yH2)
    assert torch.allclose(ip, ip2, rtol=1e-10)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("shape", SHAPES)
def test_projection_horizontal_idempotent_kills_vertical(metric, shape):
    n, m, h = shape
    G, H, xG, xH, _, _ = make(4, n, m, h, seed=2)
    geo = PairGeometry(G, H, metric)
    pG, pH = geo.project(xG, xH)
    scale = geo.horizontal_residual(xG, xH).abs().max()
    assert geo.horizontal_residual(pG, pH).abs().max() < 1e-10 * scale
    ppG, ppH = geo.project(pG, pH)
    assert torch.allclose(ppG, pG, atol=1e-11) and torch.allclose(ppH, pH, atol=1e-11)
    Lam = torch.randn(4, h, h, generator=torch.Generator().manual_seed(3))
    vG, vH = geo.vertical(Lam)
    zG, zH = geo.project(vG, vH)
    assert zG.abs().max() < 1e-10 and zH.abs().max() < 1e-10
    # the removed part is vertical: ξ − Pξ = (GΛ, −HΛᵀ) for some Λ (least squares in Λ)
    dG, dH = xG - pG, xH - pH
    for b in range(4):
        lhs = torch.cat([torch.kron(G[b], torch.eye(h)), -torch.kron(H[b], torch.eye(h)) @ _transpose_perm(h)])
        sol = torch.linalg.lstsq(lhs, torch.cat([dG[b].reshape(-1), dH[b].reshape(-1)])).solution
        assert torch.allclose(lhs @ sol, torch.cat([dG[b].reshape(-1), dH[b].reshape(-1)]), atol=1e-10)
    # orthogonality in the metric: g(Pξ, ξ − Pξ) = 0
    assert geo.inner(pG, pH, dG, dH).abs().max() < 1e-10 * geo.sqnorm(xG, xH).max()


def _transpose_perm(h):
    """Permutation matrix P with vec(Λᵀ) = P vec(Λ) (row-major)."""
    P = torch.zeros(h * h, h * h)
    for i in range(h):
        for j in range(h):
            P[j * h + i, i * h + j] = 1
    return P


@pytest.mark.parametrize("eps", [0.0, 0.3])
@pytest.mark.parametrize("shape", SHAPES)
def test_invariant_projection_agrees_with_scipy_sylvester(shape, eps):
    n, m, h = shape
    G, H, xG, xH, _, _ = make(2, n, m, h, seed=4)
    pG, pH = PairGeometry(G, H, "invariant", eps).project(xG, xH)
    I = np.eye(h)
    for b in range(2):
        g, hh, xg, xh = (t[b].numpy() for t in (G, H, xG, xH))
        SG, SH = g.T @ g, hh.T @ hh
        SGt, SHt = SG + eps * I, SH + eps * I
        # horizontality for the relaxed metric: (S̃_G S_H) X + X (S_G S̃_H) = ξ_Gᵀ G S̃_H − S̃_G Hᵀ ξ_H
        X = scipy.linalg.solve_sylvester(SGt @ SH, SG @ SHt, xg.T @ g @ SHt - SGt @ hh.T @ xh)
        Lam = X.T
        assert np.allclose(pG[b].numpy(), xg - g @ Lam, atol=1e-10)
        assert np.allclose(pH[b].numpy(), xh + hh @ Lam.T, atol=1e-10)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("shape", [(4, 3, 2), (3, 3, 1), (5, 4, 3)])
def test_acceleration_equals_christoffel_from_metric_derivatives(metric, shape):
    n, m, h = shape
    G, H, xG, xH, _, _ = make(1, n, m, h, seed=5)
    geo = PairGeometry(G, H, metric)
    xG, xH = geo.project(xG, xH)
    aG, aH = geo.acceleration(xG, xH)
    mf = lambda th: pair_metric_tensor(th, n, m, h, metric)  # noqa: E731
    theta, v = vec(G, H), vec(xG, xH)
    gam = christoffel_symbols(mf, theta)
    gam_fd = christoffel_symbols(mf, theta, fd_step=1e-5)
    assert torch.allclose(gam, gam_fd, atol=1e-7)
    expected = -torch.einsum("kij,i,j->k", gam, v, v)
    assert torch.allclose(vec(aG, aH), expected, atol=1e-10, rtol=1e-9)
    # the contraction used by the RK4 reference agrees with the full symbols
    assert torch.allclose(christoffel_contraction(mf, theta, v), -expected, atol=1e-10)


def test_eps_invariant_acceleration_is_christoffel_of_relaxed_metric():
    n, m, h, eps = 4, 3, 2, 0.4
    G, H, xG, xH, _, _ = make(1, n, m, h, seed=6)
    geo = PairGeometry(G, H, "invariant", eps)
    aG, aH = geo.acceleration(xG, xH)
    mf = lambda th: pair_metric_tensor(th, n, m, h, "invariant", eps)  # noqa: E731
    gam = christoffel_symbols(mf, vec(G, H))
    v = vec(xG, xH)
    assert torch.allclose(vec(aG, aH), -torch.einsum("kij,i,j->k", gam, v, v), atol=1e-10)


@pytest.mark.parametrize("metric", METRICS)
def test_second_order_step_matches_integrated_geodesic_to_third_order(metric):
    n, m, h = 3, 3, 2
    G, H, xG, xH, _, _ = make(1, n, m, h, seed=7)
    geo = PairGeometry(G, H, metric)
    xG, xH = geo.project(xG, xH)
    nrm = geo.sqnorm(xG, xH).sqrt()
    xG, xH = xG / nrm, xH / nrm
    mf = lambda th: pair_metric_tensor(th, n, m, h, metric)  # noqa: E731
    errs = []
    for t in (0.2, 0.1, 0.05):
        xs, vs = geodesic_rk4(mf, vec(G, H), vec(xG, xH), t=t, steps=20)
        sG, sH = geo.step(xG, xH, True, t=t)
        errs.append(float((vec(sG, sH) - xs[-1]).norm()))
        lG, lH = geo.step(xG, xH, False, t=t)
        assert float((vec(lG, lH) - xs[-1]).norm()) > 3 * errs[-1]  # the correction helps
    # O(t³): halving t divides the error by ~8
    assert 6 < errs[0] / errs[1] < 10 and 6 < errs[1] / errs[2] < 10
    # constant speed along the integrated geodesic, and it stays horizontal
    xs, vs = geodesic_rk4(mf, vec(G, H), vec(xG, xH), t=0.5, steps=50)
    speeds = torch.stack([v @ mf(x) @ v for x, v in zip(xs, vs)])
    assert (speeds - speeds[0]).abs().max() < 1e-8
    xe, ve = xs[-1], vs[-1]
    Ge, He = xe[: n * h].reshape(1, n, h), xe[n * h:].reshape(1, m, h)
    vGe, vHe = ve[: n * h].reshape(1, n, h), ve[n * h:].reshape(1, m, h)
    assert PairGeometry(Ge, He, metric).horizontal_residual(vGe, vHe).abs().max() < 1e-7


@pytest.mark.parametrize("n", [1, 4])
def test_exact_gl1_geodesic_matches_integration(n):
    g = torch.Generator().manual_seed(8)
    G, xi = torch.randn(1, n, 1, generator=g), torch.randn(1, n, 1, generator=g)
    # the G-factor of the invariant metric for h = 1: |ξ|²/|G|²
    mf = lambda th: torch.eye(n) / (th @ th)  # noqa: E731
    xs, _ = geodesic_rk4(mf, G.reshape(-1), xi.reshape(-1), t=0.7, steps=200)
    assert torch.allclose(exact_geodesic_gl1(G, xi, 0.7).reshape(-1), xs[-1], atol=1e-9)


@pytest.mark.parametrize("metric", METRICS)
def test_riemannian_gradient_taylor_and_riesz(metric):
    """g(grad f, v) = Df[v] for horizontal v, for a loss that is *not* invariant."""
    n, m, h = 4, 3, 2
    G, H, _, _, _, _ = make(1, n, m, h, seed=9)
    W = torch.randn(n, m, generator=torch.Generator().manual_seed(10))
    C = torch.randn(n, n, generator=torch.Generator().manual_seed(11))

    def f(th):  # depends on G Hᵀ (invariant) plus a non-invariant term
        Gm, Hm = th[: n * h].reshape(n, h), th[n * h:].reshape(m, h)
        return ((Gm @ Hm.T - W) ** 2).sum() + 0.3 * (Gm.T @ C @ Gm).trace()

    th = vec(G, H).requires_grad_(True)
    egrad = torch.autograd.grad(f(th), th)[0].detach()
    geo = PairGeometry(G, H, metric)
    rG, rH = geo.egrad_to_rgrad(egrad[: n * h].reshape(1, n, h), egrad[n * h:].reshape(1, m, h))
    vG, vH = geo.project(*make(1, n, m, h, seed=12)[2:4])
    dd = float(geo.inner(rG, rH, vG, vH))
    assert abs(dd - float(egrad @ vec(vG, vH))) < 1e-10 * max(1.0, abs(dd))
    slope = taylor_remainder_slope(lambda x: f(x).detach(), vec(G, H), vec(vG, vH), dd)
    assert 1.9 < slope < 2.1
    wrong = taylor_remainder_slope(lambda x: f(x).detach(), vec(G, H), vec(vG, vH), 1.1 * dd)
    assert wrong < 1.2
    # the Riemannian gradient is horizontal
    assert geo.horizontal_residual(rG, rH).abs().max() < 1e-9


def test_whitening_gives_unit_metric_coordinates():
    G, H, zG, zH, _, _ = make(2, 5, 4, 3, seed=13)
    for metric in METRICS:
        geo = PairGeometry(G, H, metric)
        xG, xH = geo.whiten_inverse(zG, zH)
        assert torch.allclose(geo.sqnorm(xG, xH), (zG ** 2).sum((1, 2)) + (zH ** 2).sum((1, 2)))


def test_singular_pair_gives_clear_error_and_eps_fixes_it():
    G = torch.zeros(1, 4, 2)
    G[0, :, 0] = 1.0   # rank 1
    H = torch.randn(1, 3, 2)
    with pytest.raises(ValueError, match="rank deficient"):
        PairGeometry(G, H, "invariant")
    PairGeometry(G, H, "invariant", eps=1e-3)


def test_float32_inputs_stay_float32():
    G, H, xG, xH, _, _ = make(2, 5, 4, 3, seed=14)
    geo = PairGeometry(G.float(), H.float(), "invariant")
    pG, pH = geo.project(xG.float(), xH.float())
    assert pG.dtype == torch.float32
    ref = PairGeometry(G, H, "invariant").project(xG, xH)
    assert torch.allclose(pG.double(), ref[0], atol=1e-4)
