"""Scalar toy model: the library's geometry against independent references."""
import numpy as np
import pytest
import torch

from companion.experiments import toy
from companion.params import ParamsError
from hideseek.geometry.gl import exact_geodesic_gl1
from hideseek.reference import geodesic_rk4, pair_metric_tensor

RNG = np.random.default_rng(0)
POINTS = [(0.5, 0.5), (1.0, 1.0), (1.6, 1.1), (-0.6, 1.2), (-1.2, -1.5), (1.4, -1.4)]


def _params(**kw):
    return {"n_grid": 40, "lim": 2.0, "x": 1.0, "y": 1.0, "metric": "invariant", "points": POINTS, "cpu_kernels": None,
            **kw}
PTS = [(0.7, 1.3), (-1.1, 0.4), (2.0, -0.3), (0.3, 0.25)]


@pytest.mark.parametrize("x,y", [(1.0, 1.0), (0.5, -2.0)])
def test_euclidean_and_riemannian_gradient_norms(x, y):
    g = RNG.uniform(0.2, 2, 20) * RNG.choice([-1, 1], 20)
    h = RNG.uniform(0.2, 2, 20) * RNG.choice([-1, 1], 20)
    f = toy.toy_fields(g, h, x=x, y=y, metric="invariant")
    beta, r = g * h, g * h * x - y
    np.testing.assert_allclose(f["loss"], r**2, rtol=1e-13)
    np.testing.assert_allclose(f["egrad_norm"], 2 * np.abs(r * x) * np.hypot(g, h), rtol=1e-12)
    np.testing.assert_allclose(f["ehess_trace"], 2 * x**2 * (g**2 + h**2), rtol=1e-12)
    # Quotient of the invariant metric: horizontal lift of d beta is (g z, h z) with
    # d beta = 2 beta z and norm^2 = 2 z^2, so ds^2 = d beta^2 / (2 beta^2) and
    # ||grad L|| = |dL/d beta| sqrt(2) |beta|, independent of the library's formula.
    np.testing.assert_allclose(f["rgrad_norm"], np.abs(2 * r * x) * np.sqrt(2) * np.abs(beta), rtol=1e-12)


@pytest.mark.parametrize("g,h", PTS)
def test_riemannian_hessian_against_rk4_geodesic(g, h):
    """Hess L(xi, xi) = d^2/dt^2 L(gamma(t)) with gamma integrated by RK4 from the
    reference Christoffel symbols of the metric tensor (no closed forms)."""
    x, y = 1.3, 0.8
    f = toy.toy_fields(np.array([g]), np.array([h]), x=x, y=y, metric="invariant")
    theta = torch.tensor([g, h], dtype=torch.float64)
    metric = lambda t: pair_metric_tensor(t, 1, 1, 1, "invariant")  # noqa: E731
    for name, vel in (("rhess_trace", [g, h]), ("rhess_vertical", [g, -h])):
        v = torch.tensor(vel, dtype=torch.float64)
        v = v / torch.sqrt(v @ metric(theta) @ v)  # unit speed in the metric
        T, steps = 0.003, 4
        xs_f, _ = geodesic_rk4(metric, theta, v, t=T, steps=steps)
        xs_b, _ = geodesic_rk4(metric, theta, -v, t=T, steps=steps)
        L = lambda p: float((p[0] * p[1] * x - y) ** 2)  # noqa: E731
        d2 = (L(xs_f[-1]) - 2 * L(theta) + L(xs_b[-1])) / T**2
        assert f[name][0] == pytest.approx(d2, abs=1e-4 * max(1.0, abs(d2)))
    # total-space trace = quotient trace, vertical part vanishes
    assert abs(f["rhess_vertical"][0]) < 1e-12
    assert f["rhess_total"][0] == pytest.approx(f["rhess_trace"][0], abs=1e-12)


def test_level_sets_and_claims():
    spread = toy.orbit_spread(x=1.0, y=1.0, metric="invariant")
    for k in ("loss", "rgrad_norm", "rhess_trace"):
        assert spread[k] < 1e-12, k          # functions of beta = g h alone
    for k in ("egrad_norm", "ehess_trace"):
        assert spread[k] > 0.1, k            # not constant on the loss's level sets
    res = toy.run(_params())
    c = res["checks"]
    # on the minimum set the Riemannian trace is 4 y^2 (from Hess = 4 x beta (2 x beta - y))
    assert c["at_minimum_raw"]["loss"][1] < 1e-20
    assert c["at_minimum_raw"]["rhess_trace"] == pytest.approx([4.0, 4.0])
    assert c["horizontal_residual_max"] < 1e-12
    assert res["claims"]["a_level_sets_follow_loss"]["holds"]
    assert res["claims"]["d_riemannian_sign_separates_concave_region"]["holds"]


def test_normalisation_and_levels_through_the_six_points():
    """Closed forms by hand: L = (g h - 1)^2 and ||grad L||_R = 2 sqrt2 |g h - 1| |g h| (x = y = 1);
    on [-2, 2]^2 both are 0 at (1, 1) and largest at the corners g h = -4 (grid includes +-2)."""
    pts = POINTS
    res = toy.run(_params())
    b = np.array([g * h for g, h in pts])
    loss_n = (b - 1) ** 2 / 25.0
    rgrad_n = np.abs(b - 1) * np.abs(b) / 20.0
    np.testing.assert_allclose(res["levels"]["loss"], sorted(set(np.round(loss_n, 12))), atol=1e-12)
    np.testing.assert_allclose(res["checks"]["points_normalised"]["rgrad_norm"], rgrad_n, atol=1e-12)
    for k, z in res["normalised"].items():
        assert z.min() >= -1e-15 and z.max() <= 1 + 1e-15, k
    assert res["normalised"]["loss"].max() == pytest.approx(1.0)
    # the field really takes each level value at its point: the contour passes through it
    for k in toy.FIELDS:
        for v in res["checks"]["points_normalised"][k]:
            assert min(abs(v - lv) for lv in res["levels"][k]) < 1e-11


def test_bad_input():
    with pytest.raises(ValueError, match="g != 0"):
        toy.toy_fields(np.array([0.0, 1.0]), np.array([1.0, 1.0]), x=1.0, y=1.0, metric="invariant")
    with pytest.raises(ValueError, match="even"):
        toy.run(_params(n_grid=41))
    with pytest.raises(ValueError, match="six"):
        toy.run(_params(points=[(1.0, 1.0)]))
    with pytest.raises(ValueError, match="window"):
        toy.run(_params(points=[(3.0, 1.0)] * 6))
    with pytest.raises(ParamsError, match="missing"):
        toy.run({"n_grid": 40})
    with pytest.raises(ValueError, match="constant"):
        toy.normalise(np.ones(3), 1.0, 1.0)


@pytest.mark.parametrize("x,y", [(1.0, 1.0), (0.7, -1.6)])
def test_claim_c_both_readings_by_finite_differences_along_the_exact_geodesic(x, y):
    """At a minimum (g h x = y) the Riemannian Hessian along the unit horizontal direction is
    d^2/dt^2 of the function along the exact geodesic (g, h) e^{t/sqrt2}: 4 y^2 for the loss,
    2 y for the network's output f = g h x. Neither is 0 (claim (c) fails in both readings)."""
    g = np.array([0.4, -1.3, 2.0])
    h = y / (x * g)
    loss = toy.toy_fields(g, h, x=x, y=y, metric="invariant")
    net = toy.toy_fields(g, h, x=x, y=y, metric="invariant", of="network")
    T = 1e-3
    for k in range(g.size):
        G, H = torch.tensor([[[g[k]]]], dtype=torch.float64), torch.tensor([[[h[k]]]], dtype=torch.float64)

        def along(t, fn):
            c = t / np.sqrt(2.0)     # unit horizontal velocity (g, h)/sqrt2: ||.||^2 = 1/2 + 1/2
            gt, ht = exact_geodesic_gl1(G, c * G), exact_geodesic_gl1(H, c * H)
            return fn(float(gt) * float(ht) * x)

        for field, fn, closed in ((loss, lambda f: (f - y) ** 2, 4 * y**2), (net, lambda f: f, 2 * y)):
            d2 = (along(T, fn) - 2 * along(0.0, fn) + along(-T, fn)) / T**2
            assert field["rhess_trace"][k] == pytest.approx(d2, rel=1e-5)
            assert field["rhess_trace"][k] == pytest.approx(closed, rel=1e-10)
    assert np.allclose(net["ehess_trace"], 0.0)          # f = g h x has a traceless Euclidean Hessian
    m = toy.summary_metrics(toy.run(_params(x=x, y=y)))
    assert m["checks"]["network_at_minimum_raw"]["rhess_trace"] == pytest.approx([2 * y, 2 * y])
    text = toy.findings(m)
    assert f"{4 * y**2:g}" in text and f"{2 * y:g}" in text and "not 0" in text


def _old_toy_hessians(g, h, x, y, metric, of="loss"):
    """The formulas toy.py used before it called hs.RiemannianHessian, kept here only as an
    independent reference: autograd's Euclidean Hessian, and the Riemannian quadratic form
    ``ξᵀ∇²Lξ + ⟨∇L, γ̈(0)⟩`` along the unit horizontal and vertical vectors, with γ̈(0) the
    pair geometry's geodesic acceleration."""
    from hideseek.geometry import PairGeometry

    G = torch.tensor(g, dtype=torch.float64).reshape(-1, 1, 1).requires_grad_(True)
    H = torch.tensor(h, dtype=torch.float64).reshape(-1, 1, 1).requires_grad_(True)
    L = (G * H * x - y) ** 2 if of == "loss" else G * H * x
    gG, gH = torch.autograd.grad(L.sum(), (G, H), create_graph=True)
    hGG, hGH = [torch.zeros_like(G) if s is None else s
                for s in torch.autograd.grad(gG.sum(), (G, H), retain_graph=True, allow_unused=True)]
    _, hHH = [torch.zeros_like(G) if s is None else s
              for s in torch.autograd.grad(gH.sum(), (G, H), retain_graph=True, allow_unused=True)]
    geom = PairGeometry(G.detach(), H.detach(), metric=metric)

    def quad(xG, xH):
        aG, aH = geom.acceleration(xG, xH)
        return (hGG * xG * xG + 2 * hGH * xG * xH + hHH * xH * xH + gG * aG + gH * aH).reshape(-1)

    def unit(xG, xH):
        n = geom.sqnorm(xG, xH).sqrt().reshape(-1, 1, 1)
        return xG / n, xH / n

    with torch.no_grad():
        hor = quad(*unit(*geom.project(G.detach().clone(), H.detach().clone())))
        ver = quad(*unit(*geom.vertical(torch.ones_like(G))))
        return (hGG + hHH).reshape(-1).numpy(), hor.numpy(), ver.numpy()


@pytest.mark.parametrize("metric", ["invariant", "mixed"])
@pytest.mark.parametrize("of", ["loss", "network"])
def test_operator_values_agree_with_the_old_formulas(metric, of):
    """Figure 6's traces now come from hs.RiemannianHessian / hs.EuclideanHessian; at several
    points they equal the formulas toy.py used before (to rounding) and, for the loss, the
    closed forms invariant 4βx(2βx − y), mixed 4x² (docs/maths.md §14.4)."""
    g = np.array([0.7, -1.1, 2.0, 0.3, -0.45])
    h = np.array([1.3, 0.4, -0.3, 0.25, -1.7])
    x, y = 1.3, 0.8
    f = toy.toy_fields(g, h, x=x, y=y, metric=metric, of=of)
    e, r, v = _old_toy_hessians(g, h, x, y, metric, of)
    np.testing.assert_allclose(f["ehess_trace"], e, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(f["rhess_trace"], r, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(f["rhess_vertical"], v, rtol=1e-12, atol=1e-12)
    if of == "loss":
        beta = g * h
        closed = 4 * beta * x * (2 * beta * x - y) if metric == "invariant" else np.full_like(beta, 4 * x * x)
        np.testing.assert_allclose(f["rhess_trace"], closed, rtol=1e-12)
