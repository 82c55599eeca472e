"""Diagonal networks: exact/reference sharpness, the generic engine, training."""
import math

import numpy as np
import pytest
import torch

from companion.experiments import diagonal as D


def _sphere(rng, k, dim, r):
    z = rng.standard_normal((k, dim))
    return r * z / np.linalg.norm(z, axis=1, keepdims=True)


# ------------------------------------------------------------------ trust region
@pytest.mark.parametrize("kind", ["psd", "indefinite", "negdef", "hard"])
def test_trust_region_max_is_global(kind):
    rng = np.random.default_rng({"psd": 0, "indefinite": 1, "negdef": 2, "hard": 3}[kind])
    dim, R = 6, 0.7
    B = rng.standard_normal((dim, dim))
    M = {"psd": B @ B.T, "indefinite": B + B.T, "negdef": -(B @ B.T) - np.eye(dim),
         "hard": B @ B.T}[kind]
    g = rng.standard_normal(dim)
    if kind == "hard":  # gradient orthogonal to the top eigenvector
        lam, Q = np.linalg.eigh(M)
        g = g - (Q[:, -1] @ g) * Q[:, -1]
        g *= 1e-3
    res = D.trust_region_max(g, M, R)
    q = lambda x: g @ x + x @ M @ x  # noqa: E731
    assert np.linalg.norm(res.x) <= R * (1 + 1e-12)
    assert res.value == pytest.approx(q(res.x), rel=1e-12, abs=1e-14)
    # dominates brute force on the ball (sphere + interior) ...
    pts = np.concatenate([_sphere(rng, 20000, dim, R), _sphere(rng, 5000, dim, R) * rng.uniform(0, 1, (5000, 1))])
    brute = np.max(np.einsum("ki,i->k", pts, g) + np.einsum("ki,ij,kj->k", pts, M, pts))
    assert res.value >= brute - 1e-12
    # ... and local optimisation from many starts
    slsqp = D.maximize_on_ball(q, lambda x: g + 2 * M @ x, R, list(_sphere(rng, 8, dim, R)))
    assert res.value >= slsqp.value - 1e-10
    assert res.value == pytest.approx(max(slsqp.value, brute), rel=1e-6, abs=1e-9)
    if kind == "hard":
        assert res.hard_case
        assert res.value == pytest.approx(np.linalg.eigvalsh(M)[-1] * R**2, rel=1e-5)


# ------------------------------------------------------------------ the three measures
@pytest.fixture(scope="module")
def small():
    rng = np.random.default_rng(0)
    prob = D.make_problem(10, 20, 3, seed=1)
    u = rng.uniform(0.5, 1.5, 20) * rng.choice([-1, 1], 20)
    v = rng.uniform(0.5, 1.5, 20) * rng.choice([-1, 1], 20)
    return prob, u, v


@pytest.mark.parametrize("rho", [0.05, 0.3])
def test_reference_maximisers_dominate_random_search(small, rho):
    prob, u, v = small
    beta = u * v
    rng = np.random.default_rng(5)
    L0 = prob.loss(beta)
    # metric (6): straight lines in beta, ||dbeta|| <= sqrt 2 rho
    mix = D.sharpness_mixed_exact(prob, beta, rho)
    assert np.linalg.norm(mix.x) == pytest.approx(math.sqrt(2) * rho)
    assert mix.value == pytest.approx(prob.loss(beta + mix.x) - L0, rel=1e-10)
    db = _sphere(rng, 20000, 20, math.sqrt(2) * rho)
    assert mix.value >= np.max(prob.loss(beta + db) - L0) - 1e-12
    # metric (5): exact geodesics beta e^{2z}, ||z|| <= rho / sqrt 2
    inv = D.sharpness_invariant_exact(prob, beta, rho)
    z = _sphere(rng, 20000, 20, rho / math.sqrt(2))
    assert np.linalg.norm(inv.x) <= rho / math.sqrt(2) * (1 + 1e-12)
    assert inv.value == pytest.approx(prob.loss(beta * np.exp(2 * inv.x)) - L0, rel=1e-10)
    assert inv.value >= np.max(prob.loss(beta * np.exp(2 * z)) - L0) - 1e-12
    multi = D.sharpness_invariant_exact(prob, beta, rho, n_random=6, seed=1)
    assert inv.value >= multi.value - 1e-10 * abs(multi.value)
    lam, resid = D.ball_kkt(lambda zz: 2 * beta * np.exp(2 * zz) * prob.grad(beta * np.exp(2 * zz)), inv.x)
    assert lam > 0 and resid < 1e-6
    # adaptive: beta (1 + a)(1 + b), ||(a, b)|| <= rho
    ad = D.sharpness_adaptive_ref(prob, beta, rho)
    w = _sphere(rng, 20000, 40, rho)
    assert ad.value >= np.max(prob.loss(beta * (1 + w[:, :20]) * (1 + w[:, 20:])) - L0) - 1e-12
    multi = D.sharpness_adaptive_ref(prob, beta, rho, n_random=6, seed=1)
    assert ad.value >= multi.value - 1e-10 * abs(multi.value)


def test_interpolation_limit_closed_forms():
    """At an interpolating beta (g = 0): mixed = 2 rho^2 lam_max(A), and adaptive and
    invariant both -> 2 rho^2 lam_max(D_beta A D_beta) as rho -> 0 (docs/maths.md §8.3)."""
    prob = D.make_problem(10, 20, 3, seed=2)
    beta = prob.beta_star.copy()   # interpolates exactly
    beta[beta == 0] = 0.05         # but not sparse; shift y so that beta interpolates
    prob = D.Problem(prob.X, prob.X @ beta, prob.beta_star)
    rho = 1e-3
    lam_A = np.linalg.eigvalsh(prob.A)[-1]
    lam_B = np.linalg.eigvalsh(beta[:, None] * prob.A * beta[None, :])[-1]
    assert D.sharpness_mixed_exact(prob, beta, rho).value == pytest.approx(2 * rho**2 * lam_A, rel=1e-10)
    for f in (D.sharpness_invariant_exact, D.sharpness_adaptive_ref):
        assert f(prob, beta, rho).value == pytest.approx(2 * rho**2 * lam_B, rel=5e-3)


# ------------------------------------------------------------------ the generic engine
def test_engine_agrees_with_exact(small):
    """Adaptive and exact-step geodesic (christoffel='exact') agree to optimiser
    accuracy; the default second-order step differs by O(rho^3): the difference
    drops ~8x per halving of rho."""
    torch.set_num_threads(1)
    prob, u, v = small
    beta = u * v
    diffs = {"geodesic_invariant": [], "geodesic_mixed": []}
    for rho in (0.04, 0.02, 0.01):
        ex = D.exact_sharpness(prob, beta, rho)
        ad = D.engine_sharpness(prob, u, v, rho, "adaptive")
        assert ad <= ex["adaptive"] * (1 + 1e-9)
        assert ad == pytest.approx(ex["adaptive"], rel=1e-6)
        exact_step = D.engine_sharpness(prob, u, v, rho, "geodesic_invariant", christoffel="exact")
        assert exact_step <= ex["geodesic_invariant"] * (1 + 1e-9)  # a feasible point of the same problem
        assert exact_step == pytest.approx(ex["geodesic_invariant"], rel=1e-6)
        for m in diffs:
            val = D.engine_sharpness(prob, u, v, rho, m)
            assert val == pytest.approx(ex[m], rel=1e-3)
            diffs[m].append(abs(val - ex[m]))
    for m, d in diffs.items():
        ratios = np.array(d[:-1]) / np.array(d[1:])
        assert np.all((ratios > 6) & (ratios < 10)), (m, d, ratios)


def test_engine_invariant_under_rescaling(small):
    prob, u, v = small
    a = np.exp(np.random.default_rng(3).uniform(-1, 1, u.size))
    for m in ("geodesic_invariant", "geodesic_mixed", "adaptive"):
        s1 = D.engine_sharpness(prob, u, v, 0.05, m)
        s2 = D.engine_sharpness(prob, u * a, v / a, 0.05, m)
        assert s2 == pytest.approx(s1, rel=1e-8), m


# ------------------------------------------------------------------ training
def test_training_reaches_stop_loss_and_init_scale_drives_generalisation():
    prob = D.make_problem(15, 40, 2, seed=0)
    alpha = np.array([0.02, 0.02, 1.5, 1.5])
    lr = np.array([0.03, 0.015, 0.02, 0.005])
    bs = np.array([15, 5, 15, 5])
    tr = D.train_networks(prob, alpha, lr, bs, stop_loss=1e-6, max_steps=60000, seed=0, progress=False)
    assert tr["converged"].all()
    assert np.all(tr["train_loss"] <= 1e-6)
    test = prob.test_loss(tr["u"] * tr["v"])
    # small initialisation -> sparse recovery; large -> close to min l2 norm
    assert test[:2].max() < 0.05 * test[2:].min()
    # min-l2-norm interpolator's test loss is the large-alpha limit
    b_l2 = np.linalg.pinv(prob.X) @ prob.y
    assert test[2:] == pytest.approx(np.full(2, prob.test_loss(b_l2)), rel=0.2)


def test_divergence_restarts_with_smaller_step():
    prob = D.make_problem(15, 40, 2, seed=0)
    tr = D.train_networks(prob, np.array([1.0]), np.array([5.0]), np.array([15]),
                          stop_loss=1e-6, max_steps=60000, seed=0, progress=False)
    assert tr["restarts"][0] >= 1 and tr["lr"][0] < 5.0 and tr["converged"][0]


def test_bad_input():
    with pytest.raises(ValueError, match="n < d"):
        D.make_problem(20, 10, 2)
    with pytest.raises(ValueError, match="batch size"):
        D.sample_hyperparameters(3, alpha_range=[0.1, 1], lr_factor_range=[0.1, 1],
                                 batch_sizes=[0, 5], n=10, d=20)
