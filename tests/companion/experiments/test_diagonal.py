"""Diagonal networks: exact GL(1) geodesics, the sign-respecting geodesic ball, closed forms,
training. References: RK4 on Christoffel symbols from finite differences of the metric
tensor, SLSQP projections, brute force on a grid, the paper's closed forms."""
import math

import numpy as np
import pytest
import torch
from scipy import optimize

from companion.experiments import diagonal as D
from hideseek.geometry.gl import PairGeometry, exact_geodesic_gl1_mixed
from hideseek.reference import christoffel_symbols, pair_metric_tensor


def _t(x):
    return torch.tensor(x, dtype=torch.float64).reshape(-1, 1, 1)


def _rk4_fd(theta, vel, t_end, segments):
    """Integrate the geodesic ODE of the scalar mixed metric diag(h^2, g^2) with RK4;
    Christoffel symbols by central finite differences of the metric tensor.
    ``segments``: list of (end time, steps)."""
    metric = lambda th: pair_metric_tensor(th, 1, 1, 1, "mixed")  # noqa: E731

    def acc(x, v):
        G = christoffel_symbols(metric, x, fd_step=1e-6)
        return -torch.einsum("kij,i,j->k", G, v, v)

    x, v, t = theta.clone(), vel.clone(), 0.0
    for t1, steps in segments:
        dt = (t1 - t) / steps
        for _ in range(steps):
            k1x, k1v = v, acc(x, v)
            k2x, k2v = v + 0.5 * dt * k1v, acc(x + 0.5 * dt * k1x, v + 0.5 * dt * k1v)
            k3x, k3v = v + 0.5 * dt * k2v, acc(x + 0.5 * dt * k2x, v + 0.5 * dt * k2v)
            k4x, k4v = v + dt * k3v, acc(x + dt * k3x, v + dt * k3v)
            x = x + dt / 6 * (k1x + 2 * k2x + 2 * k3x + k4x)
            v = v + dt / 6 * (k1v + 2 * k2v + 2 * k3v + k4v)
        t = t1
    return x


# ------------------------------------------------------------------ exact mixed geodesic
@pytest.mark.parametrize("g,h,xg,xh", [(0.7, -1.3, 0.3, -0.9), (-0.4, 0.5, 0.25, 0.3)])
def test_mixed_geodesic_matches_rk4_generic(g, h, xg, xh):
    x = _rk4_fd(torch.tensor([g, h], dtype=torch.float64), torch.tensor([xg, xh], dtype=torch.float64),
                1.0, [(1.0, 60)])
    G, H = exact_geodesic_gl1_mixed(_t(g), _t(h), _t(xg), _t(xh))
    np.testing.assert_allclose([G.item(), H.item()], x.numpy(), rtol=1e-7)


def test_mixed_geodesic_matches_rk4_near_the_end():
    """Horizontal, b = -0.499: the geodesic ends at t = 1.002; at t = 1 it is 0.2 % of the way
    from the tip (u, v scaled by sqrt(0.002)). RK4 on segments halving the time left."""
    g, h, b = 0.8, -1.1, -0.499
    t_end, t, segs = 1.0 / (2 * -b), 0.0, []
    while t < 1.0:
        t = min(1.0, t + 0.5 * (t_end - t))
        segs.append((t, 24))
    x = _rk4_fd(torch.tensor([g, h], dtype=torch.float64), torch.tensor([g * b, h * b], dtype=torch.float64),
                1.0, segs)
    G, H = exact_geodesic_gl1_mixed(_t(g), _t(h), _t(g * b), _t(h * b))
    expected = np.array([g, h]) * math.sqrt(1 + 2 * b)
    np.testing.assert_allclose([G.item(), H.item()], expected, rtol=1e-12)
    np.testing.assert_allclose(x.numpy(), expected, rtol=1e-5)
    # a non-horizontal geodesic passing close to the tip keeps going (no end), signs kept
    xg, xh = g * (-0.97), h * (-0.93)
    segs = [(0.4, 20), (0.5, 20), (0.55, 40), (0.6, 20), (1.0, 40)]
    x = _rk4_fd(torch.tensor([g, h], dtype=torch.float64), torch.tensor([xg, xh], dtype=torch.float64), 1.0, segs)
    G, H = exact_geodesic_gl1_mixed(_t(g), _t(h), _t(xg), _t(xh))
    np.testing.assert_allclose([G.item(), H.item()], x.numpy(), rtol=1e-5)
    assert G.item() * g > 0 and H.item() * h > 0


def test_mixed_geodesic_ends_at_the_tip():
    G, H = exact_geodesic_gl1_mixed(_t([0.5, 2.0]), _t([-3.0, 0.1]), _t([-0.25, -1.0]), _t([1.5, -0.05]))
    np.testing.assert_allclose(G.reshape(-1).numpy(), 0.0, atol=1e-8)
    np.testing.assert_allclose(H.reshape(-1).numpy(), 0.0, atol=1e-8)
    with pytest.raises(ValueError, match="end at G = H = 0 before t"):
        exact_geodesic_gl1_mixed(_t(0.5), _t(-3.0), _t(-0.3), _t(1.8))   # b = -0.6
    G, _ = exact_geodesic_gl1_mixed(_t(0.5), _t(-3.0), _t(-0.3), _t(1.8), t=0.8)  # before the end
    assert G.item() == pytest.approx(0.5 * math.sqrt(1 - 1.2 * 0.8))
    # the library's step dispatches to it
    geom = PairGeometry(_t([0.5, 2.0]), _t([-3.0, 0.1]), metric="mixed")
    Gp, Hp = geom.step(_t([0.1, 0.2]), _t([-0.6, 0.01]), christoffel="exact")
    np.testing.assert_allclose((Gp * Hp).reshape(-1).numpy(), np.array([-1.5 * 1.4, 0.2 * 1.2]), rtol=1e-12)


# ------------------------------------------------------------------ the ball
def test_ball_projection_is_the_metric_projection_and_respects_bounds():
    rng = np.random.default_rng(0)
    for trial in range(12):
        d = 7
        w = rng.uniform(0.01, 2.0, d)
        lower = -rng.uniform(0.0, 0.6, d)
        z = rng.standard_normal(d) * rng.choice([0.3, 3.0])
        rho = 0.5
        ball = D.DiagonalBall(torch.tensor(w), torch.tensor(lower))
        x = ball.ball([torch.tensor(z)], rho)[0].numpy()
        ref = optimize.minimize(
            lambda y: np.sum(w * (y - z) ** 2), np.zeros(d), jac=lambda y: 2 * w * (y - z), method="SLSQP",
            bounds=[(lo, None) for lo in lower],
            constraints=[{"type": "ineq", "fun": lambda y: rho**2 - np.sum(w * y * y), "jac": lambda y: -2 * w * y}],
            options={"ftol": 1e-15, "maxiter": 1000})
        np.testing.assert_allclose(x, ref.x, atol=1e-6)
        assert np.all(x >= lower) and np.sum(w * x * x) <= rho**2 * (1 + 1e-12)
        x2 = ball.ball([torch.tensor(x)], rho)[0].numpy()
        np.testing.assert_allclose(x2, x, atol=1e-14)                 # idempotent


def _sparse_net(d=12, seed=0):
    """A network with a few tiny coordinates (many near-zero beta_i, as after sparse training)."""
    rng = np.random.default_rng(seed)
    prob = D.make_problem(6, d, 3, seed=seed)
    beta = prob.beta_star + 0.05 * rng.standard_normal(d)
    beta[np.abs(prob.beta_star) == 0] = 1e-4 * rng.standard_normal((prob.beta_star == 0).sum())
    u = np.sqrt(np.abs(beta)) * rng.choice([-1.0, 1.0], d)
    return prob, u, beta / u, beta


def test_mixed_sharpness_keeps_every_sign_and_is_below_the_trust_region():
    prob, u, v, beta = _sparse_net()
    rho = 0.3
    val, bp = D.sharpness(prob, u, v, rho, D.Variant("geodesic_mixed", "exact"), n_iters=200, return_point=True)
    assert np.all(bp * beta >= 0)                                   # no beta_i changed sign
    assert np.linalg.norm(bp - beta) <= math.sqrt(2) * rho * (1 + 1e-9)
    assert val == pytest.approx(prob.loss(bp) - prob.loss(beta), rel=1e-10)
    tr, bt = D.sharpness(prob, u, v, rho, D.Variant("geodesic_mixed", "trust_region"), n_iters=0,
                         return_point=True)
    assert np.any(bt * beta < 0)                 # the plain trust region does flip signs here ...
    assert val < tr * (1 - 1e-3)                 # ... and overstates the geodesic-ball value


def test_sign_binding_case_against_brute_force():
    """Orthogonal 2-d design where the unconstrained maximiser would push beta_1 through 0."""
    X = math.sqrt(2) * np.linalg.qr(np.random.default_rng(1).standard_normal((2, 2)))[0]
    bstar = np.array([0.5, 0.8])
    prob = D.Problem(X, X @ bstar, bstar)
    beta, rho = np.array([0.05, 1.0]), 0.2
    u = np.array([0.5, -1.0])
    val = D.sharpness(prob, u, beta / u, rho, D.Variant("geodesic_mixed", "exact"), n_iters=200)
    r = np.sqrt(np.linspace(0, 1, 801))[:, None] * math.sqrt(2) * rho
    phi = np.linspace(0, 2 * np.pi, 3601)[None, :]
    pts = np.stack([beta[0] + r * np.cos(phi), beta[1] + r * np.sin(phi)], -1).reshape(-1, 2)
    pts = pts[np.all(pts * beta >= 0, axis=1)]
    R = math.sqrt(2) * rho                      # and the face beta_1' = 0 of the feasible set
    d2 = np.linspace(-1, 1, 20001) * math.sqrt(R**2 - beta[0] ** 2)
    face = np.stack([np.zeros_like(d2), beta[1] + d2], -1)
    brute = max(np.max(prob.loss(pts)), np.max(prob.loss(face))) - prob.loss(beta)
    assert val >= brute - 1e-9
    assert val == pytest.approx(brute, rel=1e-6)
    unconstrained = math.sqrt(2) * rho * np.linalg.norm(beta - bstar) + rho**2
    assert val < 0.95 * unconstrained


def test_engine_against_closed_forms_on_an_orthogonal_design():
    rows = D.orthogonal_check(d=10, rho=1e-3, n_iters=100, seed=3)
    for row in rows:
        if row["measure"] == "geodesic_mixed":   # exact formula (no sign binds at this rho)
            assert row["rel_diff"] == pytest.approx(0.0, abs=1e-6), row
        else:                                   # first / second order in rho: O(rho) relative
            assert abs(row["rel_diff"]) < 2e-2, row
    # the leading term is right: error shrinks ~ linearly with rho
    r2 = D.orthogonal_check(d=10, rho=2.5e-4, n_iters=100, seed=3)
    for a, b in zip(rows, r2):
        if a["measure"] != "geodesic_mixed":
            assert abs(b["rel_diff"]) < 0.5 * abs(a["rel_diff"]), (a, b)


@pytest.mark.parametrize("var", [v for v in D.VARIANTS if v.step != "trust_region"], ids=lambda v: v.name)
def test_sharpness_invariant_under_rescaling(var):
    prob, u, v, _ = _sparse_net(seed=2)
    a = np.exp(np.random.default_rng(3).uniform(-1, 1, u.size))
    s1 = D.sharpness(prob, u, v, 0.05, var, n_iters=30)
    s2 = D.sharpness(prob, u * a, v / a, 0.05, var, n_iters=30)
    assert s2 == pytest.approx(s1, rel=1e-7)


def test_second_order_and_straight_steps_match_the_paper_reduction():
    """beta(1+b+b^2/2)^2 (invariant), beta(1+b-b^2/2)^2 (mixed), beta(1+b)^2 (straight)."""
    rng = np.random.default_rng(4)
    u, v = rng.uniform(0.3, 1.5, 5) * rng.choice([-1, 1], 5), rng.uniform(0.3, 1.5, 5)
    b = rng.uniform(-0.3, 0.3, 5)
    beta = u * v
    U, V, B = _t(u), _t(v), _t(b)
    for metric, poly in (("invariant", 1 + b + b**2 / 2), ("mixed", 1 + b - b**2 / 2)):
        geom = PairGeometry(U, V, metric=metric)
        G, H = geom.step(U * B, V * B, christoffel=True)
        np.testing.assert_allclose((G * H).reshape(-1).numpy(), beta * poly**2, rtol=1e-12)
        G, H = geom.step(U * B, V * B, christoffel=False)
        np.testing.assert_allclose((G * H).reshape(-1).numpy(), beta * (1 + b) ** 2, rtol=1e-12)


def test_trust_region_max_is_global():
    rng = np.random.default_rng(1)
    dim, R = 6, 0.7
    Bm = rng.standard_normal((dim, dim))
    M, g = Bm + Bm.T, rng.standard_normal(dim)
    res = D.trust_region_max(g, M, R)
    z = rng.standard_normal((20000, dim))
    pts = R * z / np.linalg.norm(z, axis=1, keepdims=True)
    brute = np.max(pts @ g + np.einsum("ki,ij,kj->k", pts, M, pts))
    cons = {"type": "ineq", "fun": lambda x: R**2 - x @ x, "jac": lambda x: -2 * x}
    f = lambda x: g @ x + x @ M @ x  # noqa: E731
    # SLSQP may overstep the sphere by its own tolerance: its points are pulled back onto the ball,
    # so that the reference value is that of a feasible point (on some CPUs the overstep alone
    # exceeded the true maximum by ~1e-9 relative)
    feasible = [x * min(1.0, R / np.linalg.norm(x)) for x in
                (optimize.minimize(lambda x: -f(x), x0, jac=lambda x: -(g + 2 * M @ x), method="SLSQP",
                                   constraints=[cons], options={"ftol": 1e-14}).x for x0 in pts[:8])]
    local = max(f(x) for x in feasible)
    assert np.linalg.norm(res.x) <= R * (1 + 1e-12)
    assert res.value >= max(brute, local) - 1e-12 * abs(local)
    assert res.value == pytest.approx(local, rel=1e-7)


# ------------------------------------------------------------------ training
def test_training_gd_and_sgd_reach_the_stop_loss():
    prob = D.make_problem(20, 40, 4, seed=0)
    methods = {"gd": {"batch_size": 20, "lr": {"constant": 0.5, "decay": 1.0}},
               "sgd": {"batch_size": 1, "lr": {"constant": 0.1, "decay": 0.15}},
               "mb": {"batch_size": 5, "lr": {"constant": 0.2, "decay": 0.3}}}
    pop = D.sample_population(8, n=20, methods=methods, lr_factor_range=[0.3, 1.0], horizon=2000, seed=0)
    assert set(pop["method"]) == {"gd", "sgd", "mb"}
    tr = D.train_networks(prob, pop, stop_loss=1e-6, max_steps=100000, seed=0, progress=False)
    assert tr["converged"].all()
    assert np.all(tr["train_loss"] <= 1e-6)
    np.testing.assert_allclose(tr["train_loss"], prob.loss(tr["u"] * tr["v"]))


def test_divergence_restarts_with_smaller_step_and_failures_are_reported():
    prob = D.make_problem(15, 40, 2, seed=0)
    pop = {"lr0": np.array([2.0, 0.1]), "alpha": np.array([1.0, 1.0]), "batch_size": np.array([15, 15]),
           "decay_at": np.array([-1, -1]), "decay_factor": np.array([1.0, 1.0])}
    tr = D.train_networks(prob, pop, stop_loss=1e-6, max_steps=60000, seed=0, progress=False)
    assert tr["restarts"][0] >= 1 and tr["lr0"][0] < 2.0 and tr["converged"][0]
    tr = D.train_networks(prob, pop, stop_loss=1e-30, max_steps=200, seed=0, progress=False)
    assert not tr["converged"].any()             # out of steps: not converged, not silently kept


def test_bad_input():
    with pytest.raises(ValueError, match="n >= d"):
        D.make_problem(10, 20, 2, design="orthogonal")
    with pytest.raises(ValueError, match="batch size"):
        D.sample_population(3, n=10, methods={"x": {"batch_size": 0, "lr": {"constant": 1, "decay": 1}}},
                            lr_factor_range=[0.1, 1])
    prob, u, v, _ = _sparse_net()
    u[0] = 0.0
    with pytest.raises(ValueError, match="u_i = 0"):
        D.sharpness(prob, u, v, 0.1, D.Variant("geodesic_mixed", "exact"), n_iters=5)
    with pytest.raises(ValueError, match="rho must be > 0"):
        D.sharpness(prob, u, v, 0.0, D.Variant("adaptive", "straight"), n_iters=5)
    with pytest.raises(ValueError, match="n_starts"):
        D.multistart(prob, u, v, 0.1, D.Variant("adaptive", "straight"), n_iters=5, n_starts=0, seed=0)


# --------------------------------------------------------------------------- multi-start


def _trained(seed=0, n=12, d=24):
    prob = D.make_problem(n, d, 3, seed=seed)
    pop = D.sample_population(3, n=n, methods={"sgd": {"batch_size": 1, "lr": {"constant": 0.25}}},
                              lr_factor_range=[0.3, 1.0], schedules=["constant"], seed=seed)
    tr = D.train_networks(prob, pop, stop_loss=1e-5, max_steps=50000, seed=seed + 1, progress=False)
    assert tr["converged"].all()
    return prob, tr["u"], tr["v"]


@pytest.mark.parametrize("variant", [D.Variant("adaptive", "straight"), D.Variant("geodesic_invariant", "exact"),
                                     D.Variant("geodesic_mixed", "exact"), D.Variant("geodesic_mixed", "second_order")])
def test_first_of_the_batched_starts_is_the_library_single_start_apgd(variant):
    from hideseek.solvers.apgd import apgd

    prob, U, V = _trained()
    X, y = torch.as_tensor(prob.X), torch.as_tensor(prob.y)
    for k in range(2):
        point, ball = D._setup(prob, U[k], V[k], variant)

        def objective(x):
            z = x[0].detach().requires_grad_(True)
            r = point(z[None])[0] @ X.T - y
            f = 0.5 * (r @ r) / prob.n
            return f.detach(), list(torch.autograd.grad(f, z))

        ref = apgd(objective, ball, 0.1, 60).value
        st = D.multistart(prob, U[k], V[k], 0.1, variant, n_iters=60, n_starts=6, seed=k)
        assert st.single == pytest.approx(ref, rel=1e-9) and st.value >= st.single
        again = D.multistart(prob, U[k], V[k], 0.1, variant, n_iters=60, n_starts=6, seed=k)
        assert np.array_equal(again.values, st.values)           # seeded: the same starts, the same values


def test_batched_projection_equals_row_by_row():
    rng = np.random.default_rng(3)
    w = torch.tensor(rng.uniform(0.01, 2.0, 9))
    ball = D.DiagonalBall(w, torch.full((9,), -0.5))
    Z = torch.tensor(rng.normal(0, 3.0, (7, 9)))
    rows = ball.ball([Z], 0.4)[0]
    for i in range(7):
        assert torch.allclose(rows[i], ball.ball([Z[i]], 0.4)[0], rtol=1e-12, atol=1e-14)
        assert float(ball.sqnorm([rows[i]])) <= 0.16 * (1 + 1e-9) and bool((rows[i] >= -0.5).all())


@pytest.mark.slow
def test_best_of_starts_reaches_an_independent_multistart_maximum():
    """Tiny mixed-metric problem (the objective is a convex quadratic in b on an ellipsoid cut by
    b >= -1/2, so it has local maxima): SLSQP from 300 random starts is the reference."""
    prob = D.make_problem(3, 5, 2, seed=4)
    rng = np.random.default_rng(0)
    u, v = rng.uniform(0.2, 1.0, 5) * rng.choice([-1, 1], 5), rng.uniform(0.2, 1.0, 5)
    beta, rho = u * v, 0.3
    w = 2 * beta**2
    f = lambda b: prob.loss(beta * (1 + 2 * b)) - prob.loss(beta)
    cons = [{"type": "ineq", "fun": lambda b: rho**2 - np.sum(w * b * b)}]
    best = -np.inf
    for _ in range(300):
        b0 = rng.normal(size=5) / np.sqrt(w)
        b0 *= rng.uniform(0, rho) / np.sqrt(np.sum(w * b0 * b0))
        r = optimize.minimize(lambda b: -f(b), np.maximum(b0, -0.5), method="SLSQP", constraints=cons,
                              bounds=[(-0.5, None)] * 5, options={"ftol": 1e-14, "maxiter": 500})
        if r.success and np.sum(w * r.x**2) <= rho**2 * (1 + 1e-9):
            best = max(best, f(r.x))
    st = D.multistart(prob, u, v, rho, D.Variant("geodesic_mixed", "exact"), n_iters=200, n_starts=17, seed=0)
    assert st.value == pytest.approx(best, rel=1e-6)
