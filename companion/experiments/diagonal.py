"""Diagonal linear networks: Figure 3 and Table 1, row 1 (docs/maths.md §8).

Setting (Pesme et al. 2021; Andriushchenko et al. 2023): Gaussian design
``X`` (n x d, n < d, entries N(0, 1)), a kappa-sparse ground truth ``beta*``
(random support, entries +-1), noiseless labels ``y = X beta*``. A network is
``f(x) = <u * v, x>`` with ``beta = u * v`` and training loss
``L(beta) = (1/n) ||X beta - y||^2``. Networks start at ``u = alpha 1``,
``v = 0`` (the initialisation scale ``alpha`` drives the implicit bias from
minimum l2 norm, large alpha, to minimum l1 norm, small alpha) and are trained
with (stochastic) gradient descent in float64 until the full training loss
falls below ``stop_loss``.

Generalisation measure: the population test loss of the regression,
``E_x (x^T beta - x^T beta*)^2 = ||beta - beta*||^2`` for ``x ~ N(0, I)``
(exact, no test sample needed).

Sharpness, worst case, radius ``rho``, three measures, each computed two ways:

* ``adaptive``: ``max_{||(a, b)|| <= rho} L(beta (1 + a)(1 + b)) - L(beta)``,
  i.e. elementwise adaptive l2 sharpness with ``c = |theta|`` written in the
  relative perturbations ``a = du / u``, ``b = dv / v``;
* ``geodesic_invariant`` (metric 5): exact geodesics ``beta exp(2 t z)`` with
  ``||xi||^2 = 2 ||z||^2``, so ``max_{||z|| <= rho / sqrt 2} L(beta e^{2z}) - L(beta)``;
* ``geodesic_mixed`` (metric 6): straight lines in beta with
  ``||xi||^2 = ||dbeta||^2 / 2``, so the trust-region problem
  ``max_{||dbeta|| <= sqrt 2 rho} L(beta + dbeta) - L(beta)``, solved exactly
  by :func:`trust_region_max` (eigendecomposition + secular equation).

The first two are small smooth problems without closed form; they are solved
by :func:`maximize_on_ball` (SLSQP from the exact maximiser of the
second-order model and from random starts; every start is kept only if it
improves). The second way is the library's generic engine
(:func:`hideseek.sharpness` with ``pairs=[DiagonalPair("u", "v")]``), see
:func:`engine_sharpness`.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from scipy import optimize
from tqdm.auto import tqdm

MEASURES = ("adaptive", "geodesic_invariant", "geodesic_mixed")

#: Paper, Table 1, row "Diagonal networks" (Kendall tau vs test loss).
PAPER_TAU = {"adaptive": -0.68, "geodesic_invariant": -0.83, "geodesic_mixed": -0.86}


# =========================================================================== data


@dataclass
class Problem:
    """A sparse regression problem; ``A = X^T X / n`` is the loss Hessian / 2."""

    X: np.ndarray
    y: np.ndarray
    beta_star: np.ndarray

    @property
    def n(self) -> int:
        return self.X.shape[0]

    @property
    def d(self) -> int:
        return self.X.shape[1]

    @property
    def A(self) -> np.ndarray:
        return self.X.T @ self.X / self.n

    def loss(self, beta: np.ndarray) -> np.ndarray:
        """Training loss ``(1/n)||X beta - y||^2``; ``beta`` may be (..., d)."""
        r = beta @ self.X.T - self.y
        return np.mean(r**2, axis=-1)

    def grad(self, beta: np.ndarray) -> np.ndarray:
        """Gradient of the training loss in beta."""
        r = beta @ self.X.T - self.y
        return (2.0 / self.n) * r @ self.X

    def test_loss(self, beta: np.ndarray) -> np.ndarray:
        """Population test loss ``||beta - beta*||^2`` (isotropic Gaussian inputs)."""
        return np.sum((beta - self.beta_star) ** 2, axis=-1)


def make_problem(n: int, d: int, kappa: int, seed: int = 0) -> Problem:
    """Gaussian design, kappa-sparse +-1 ground truth, noiseless labels."""
    if not (0 < n < d):
        raise ValueError(f"need 0 < n < d (overparametrised), got n={n}, d={d}")
    if not (0 < kappa <= d):
        raise ValueError(f"need 0 < kappa <= d, got kappa={kappa}")
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d))
    beta_star = np.zeros(d)
    support = rng.choice(d, size=kappa, replace=False)
    beta_star[support] = rng.choice([-1.0, 1.0], size=kappa)
    return Problem(X, X @ beta_star, beta_star)


# =========================================================================== training


def sample_hyperparameters(
    n_nets: int,
    *,
    alpha_range: Sequence[float],
    lr_factor_range: Sequence[float],
    batch_sizes: Sequence[int],
    n: int,
    d: int,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Draw per-network init scale, batch size and step size.

    ``alpha`` and the step-size factor are log-uniform. The step size is the
    factor divided by a curvature scale of the batch loss,
    ``lr = factor / (4 (1 + sqrt(d / B))^2)`` (the Marchenko-Pastur edge of
    ``X_B^T X_B / B`` times 4, for weights of order one), so that one factor
    range is meaningful for every batch size.
    """
    if n_nets < 1:
        raise ValueError("n_nets must be >= 1")
    for b in batch_sizes:
        if not 1 <= b <= n:
            raise ValueError(f"batch size {b} outside [1, n={n}]")
    rng = np.random.default_rng(seed)
    lo, hi = np.log(alpha_range[0]), np.log(alpha_range[1])
    alpha = np.exp(rng.uniform(lo, hi, n_nets))
    flo, fhi = np.log(lr_factor_range[0]), np.log(lr_factor_range[1])
    factor = np.exp(rng.uniform(flo, fhi, n_nets))
    batch = rng.choice(np.asarray(batch_sizes, dtype=int), size=n_nets)
    lr = factor / (4.0 * (1.0 + np.sqrt(d / batch)) ** 2)
    return {"alpha": alpha, "lr": lr, "batch_size": batch, "lr_factor": factor}


def train_networks(
    problem: Problem,
    alpha: np.ndarray,
    lr: np.ndarray,
    batch_size: np.ndarray,
    *,
    stop_loss: float,
    max_steps: int,
    seed: int = 0,
    check_every: int = 50,
    max_retries: int = 6,
    progress: bool = True,
) -> dict[str, np.ndarray]:
    """Train many diagonal networks at once (numpy, float64).

    Each network does SGD with its own batch size (sampling without
    replacement within a step; ``batch_size == n`` is full-batch GD) until
    its full training loss is <= ``stop_loss`` (checked every
    ``check_every`` steps). A network whose loss becomes non-finite or
    exceeds 1e6 is restarted from its initialisation with half the step size,
    at most ``max_retries`` times. Returns ``u, v`` (N, d), the final ``lr``,
    ``steps``, ``train_loss``, ``converged`` and ``restarts``.
    """
    X, y = problem.X, problem.y
    n, d = X.shape
    N = len(alpha)
    alpha = np.asarray(alpha, float)
    lr = np.asarray(lr, float).copy()
    batch_size = np.asarray(batch_size, int)
    rng = np.random.default_rng(seed)
    U = np.tile(alpha[:, None], (1, d))
    V = np.zeros((N, d))
    steps = np.zeros(N, int)
    restarts = np.zeros(N, int)
    done = np.zeros(N, bool)
    failed = np.zeros(N, bool)
    bar = tqdm(total=N, desc="training diagonal nets", disable=not progress, leave=False, mininterval=10)
    step = 0
    errstate = np.errstate(over="ignore", invalid="ignore")
    errstate.__enter__()
    while not np.all(done | failed) and step < max_steps:
        act = np.flatnonzero(~(done | failed))
        u, v = U[act], V[act]
        for _ in range(check_every):
            R = (u * v) @ X.T - y  # (a, n); may overflow for a diverging net (handled below)
            # per-network random batch: the B smallest of n uniforms
            keys = rng.random((act.size, n))
            ranks = np.argsort(np.argsort(keys, axis=1), axis=1)
            W = (ranks < batch_size[act, None]) / batch_size[act, None]
            G = 2.0 * (W * R) @ X  # gradient of the batch loss in beta
            step_lr = lr[act, None]
            u, v = u - step_lr * v * G, v - step_lr * u * G
        step += check_every
        steps[act] += check_every
        U[act], V[act] = u, v
        loss = problem.loss(u * v)
        bad = ~np.isfinite(loss) | (loss > 1e6)
        for k in act[bad]:
            if restarts[k] >= max_retries:
                failed[k] = True
                continue
            restarts[k] += 1
            lr[k] /= 2.0
            U[k], V[k] = alpha[k], 0.0
            steps[k] = 0
        good = act[~bad][loss[~bad] <= stop_loss]
        done[good] = True
        bar.update(good.size)
    bar.close()
    errstate.__exit__(None, None, None)
    beta = U * V
    return {
        "u": U,
        "v": V,
        "lr": lr,
        "steps": steps,
        "train_loss": problem.loss(beta),
        "converged": done,
        "restarts": restarts,
    }


# =========================================================================== exact / reference sharpness


@dataclass
class BallMax:
    """The maximiser and maximum of an objective on a ball."""

    value: float
    x: np.ndarray
    hard_case: bool = False


def trust_region_max(g: np.ndarray, M: np.ndarray, radius: float, *, tol: float = 1e-13) -> BallMax:
    """Exact global maximum of ``q(x) = g^T x + x^T M x`` over ``||x|| <= radius``.

    ``M`` symmetric, possibly indefinite. Optimality (the trust-region
    conditions, for the maximisation): ``g + 2 M x = 2 mu x`` with
    ``mu >= max(lambda_max(M), 0)`` and ``mu (||x|| - radius) = 0``. With
    ``M = Q diag(lam) Q^T`` and ``c = Q^T g``, ``x(mu)`` has coordinates
    ``c_i / (2 (mu - lam_i))``; ``mu`` solves the secular equation
    ``||x(mu)|| = radius`` (monotone in ``mu``, solved by Brent's method).
    The "hard case" (``g`` orthogonal to the top eigenspace) adds a multiple
    of a top eigenvector to reach the boundary.
    """
    g = np.asarray(g, float)
    M = np.asarray(M, float)
    if radius < 0:
        raise ValueError("radius must be >= 0")
    if radius == 0:
        return BallMax(0.0, np.zeros_like(g))
    M = 0.5 * (M + M.T)
    lam, Q = np.linalg.eigh(M)
    c = Q.T @ g
    lam_max = lam[-1]
    scale = max(abs(lam_max), np.abs(lam).max(), 1e-300)
    top = lam >= lam_max - 1e-12 * scale

    def q(x):
        return float(g @ x + x @ M @ x)

    # interior solution possible only when M is negative definite
    if lam_max < 0:
        x_int = Q @ (c / (-2.0 * lam))
        if np.linalg.norm(x_int) <= radius:
            return BallMax(q(x_int), x_int)

    lo = max(lam_max, 0.0)

    def phi(mu):
        return np.sqrt(np.sum((c / (2.0 * (mu - lam))) ** 2)) - radius

    gnorm = np.linalg.norm(g)
    if lam_max < 0:
        a = lo  # x(0) is the interior stationary point, outside the ball: phi(0) > 0
    else:
        c_top = np.sqrt(np.sum(c[top] ** 2))
        # top components alone have norm >= 2 radius at mu = lam_max + c_top / (4 radius)
        a = lo + c_top / (4.0 * radius)
        if a - lo <= 1e-13 * scale or phi(a) <= 0:
            a = lo + 1e-13 * scale
            if phi(a) <= 0:
                # hard case: mu = lam_max, reach the boundary along a top eigenvector
                nt = ~top
                x = Q[:, nt] @ (c[nt] / (2.0 * (lam_max - lam[nt])))
                e = Q[:, top][:, -1]
                rem = max(radius**2 - x @ x, 0.0)
                cand = [x + s * np.sqrt(rem) * e for s in (1.0, -1.0)]
                vals = [q(z) for z in cand]
                k = int(np.argmax(vals))
                return BallMax(vals[k], cand[k], hard_case=True)
    hi = lo + gnorm / (2.0 * radius) + 1e-13 * scale
    while phi(hi) > 0:
        hi = lo + 2.0 * (hi - lo)
    xtol = max(min(tol * max(1.0, abs(hi)), 1e-8 * (a - lo)), 1e-300)
    mu = optimize.brentq(phi, a, hi, xtol=xtol, rtol=1e-15, maxiter=500)
    x = Q @ (c / (2.0 * (mu - lam)))
    x *= radius / np.linalg.norm(x)
    return BallMax(q(x), x)


def sphere_max(
    fun: Callable[[np.ndarray], float],
    grad: Callable[[np.ndarray], np.ndarray],
    radius: float,
    x0: np.ndarray,
    *,
    maxiter: int = 3000,
) -> BallMax:
    """Local maximum of ``fun`` on the sphere ``||x|| = radius`` (L-BFGS in ``x = radius w / ||w||``).

    When the returned point satisfies ``grad = lam x`` with ``lam >= 0`` it is a
    KKT point of the *ball* problem as well (the gradient points outward);
    :func:`ball_kkt` measures that.
    """
    x0 = np.asarray(x0, float)
    if np.linalg.norm(x0) == 0:
        raise ValueError("sphere_max needs a nonzero start")

    def f(w):
        return -fun(radius * w / np.linalg.norm(w))

    def g(w):
        nw = np.linalg.norm(w)
        u = w / nw
        gx = grad(radius * u)
        return -(radius / nw) * (gx - u * (u @ gx))

    gscale = max(np.abs(grad(x0)).max() * radius, 1e-300)
    res = optimize.minimize(f, x0 / np.linalg.norm(x0), jac=g, method="L-BFGS-B",
                            options={"gtol": 1e-12 * gscale, "ftol": 1e-15, "maxiter": maxiter,
                                     "maxcor": 30})
    x = radius * res.x / np.linalg.norm(res.x)
    return BallMax(fun(x), x)


def ball_kkt(grad: Callable[[np.ndarray], np.ndarray], x: np.ndarray) -> tuple[float, float]:
    """``(lam, residual)`` for ``grad(x) = lam x``: relative residual ``||grad - lam x|| / ||grad||``.

    A boundary maximiser of a smooth function on a ball has residual 0 and ``lam >= 0``.
    """
    gx = grad(x)
    lam = float(gx @ x / (x @ x))
    return lam, float(np.linalg.norm(gx - lam * x) / max(np.linalg.norm(gx), 1e-300))


def maximize_on_ball(
    fun: Callable[[np.ndarray], float],
    grad: Callable[[np.ndarray], np.ndarray],
    radius: float,
    starts: Sequence[np.ndarray],
    *,
    ftol: float = 1e-15,
    maxiter: int = 500,
) -> BallMax:
    """Best local maximum of a smooth ``fun`` on ``||x|| <= radius`` from several starts (SLSQP)."""
    best = BallMax(-np.inf, np.zeros_like(np.asarray(starts[0], float)))
    cons = {
        "type": "ineq",
        "fun": lambda x: radius**2 - x @ x,
        "jac": lambda x: -2.0 * x,
    }
    for x0 in starts:
        x0 = np.asarray(x0, float)
        nrm = np.linalg.norm(x0)
        if nrm > radius:
            x0 = x0 * (radius / nrm)
        f0 = fun(x0)
        if f0 > best.value:
            best = BallMax(f0, x0)
        res = optimize.minimize(
            lambda x: -fun(x), x0, jac=lambda x: -grad(x), method="SLSQP",
            constraints=[cons], options={"ftol": ftol, "maxiter": maxiter},
        )
        x = res.x
        nrm = np.linalg.norm(x)
        if nrm > radius:
            x = x * (radius / nrm)
        fx = fun(x)
        if np.isfinite(fx) and fx > best.value:
            best = BallMax(fx, x)
    return best


def _random_sphere(rng, k, dim, radius):
    z = rng.standard_normal((k, dim))
    return radius * z / np.linalg.norm(z, axis=1, keepdims=True)


def _best_of(fun, grad, half_hess, radius, dim, n_random, seed) -> BallMax:
    """Ascent on the sphere from both signs of the exact maximiser of the
    second-order model at 0 (:func:`trust_region_max`), then SLSQP on the ball
    from ``n_random`` random points; the best. If the sphere maximiser has an
    inward gradient (``lam < 0``: the ball maximum may be interior) SLSQP
    is also started from it."""
    x0 = np.zeros(dim)
    tr = trust_region_max(grad(x0), half_hess(x0), radius)
    best = BallMax(-np.inf, x0)
    for start in (tr.x, -tr.x):
        cand = sphere_max(fun, grad, radius, start)
        if ball_kkt(grad, cand.x)[0] < 0:
            alt = maximize_on_ball(fun, grad, radius, [cand.x])
            cand = alt if alt.value > cand.value else cand
        if cand.value > best.value:
            best = cand
    if n_random:
        rng = np.random.default_rng(seed)
        cand = maximize_on_ball(fun, grad, radius, list(_random_sphere(rng, n_random, dim, radius)))
        if cand.value > best.value:
            best = cand
    return best


def sharpness_mixed_exact(problem: Problem, beta: np.ndarray, rho: float) -> BallMax:
    """Metric (6): exact trust-region maximum over ``||dbeta|| <= sqrt(2) rho``.

    ``L(beta + db) - L(beta) = g^T db + db^T A db`` exactly (quadratic loss),
    ``g`` the gradient in beta, ``A = X^T X / n``.
    """
    return trust_region_max(problem.grad(beta), problem.A, math.sqrt(2.0) * rho)


def sharpness_invariant_exact(
    problem: Problem, beta: np.ndarray, rho: float, *, n_random: int = 0, seed: int = 0
) -> BallMax:
    """Metric (5): ``max_{||z|| <= rho/sqrt 2} L(beta e^{2z}) - L(beta)`` (exact geodesics).

    Started from both signs of the exact maximiser of the second-order model
    ``(2 beta g)^T z + z^T (2 diag(beta g) + 4 D_beta A D_beta) z`` and from
    random points; returns the best maximiser found (value in ``.value``, ``z`` in ``.x``).
    """
    beta = np.asarray(beta, float)
    L0 = float(problem.loss(beta))
    g = problem.grad(beta)
    A = problem.A
    r = rho / math.sqrt(2.0)

    def fun(z):
        with np.errstate(over="ignore", invalid="ignore"):
            val = float(problem.loss(beta * np.exp(2.0 * z))) - L0
        return val if np.isfinite(val) else -np.inf

    def grad(z):
        with np.errstate(over="ignore", invalid="ignore"):
            b = beta * np.exp(2.0 * z)
            return np.nan_to_num(2.0 * b * problem.grad(b))

    def half_hess(z):
        b = beta * np.exp(2.0 * z)
        return 2.0 * np.diag(b * problem.grad(b)) + 4.0 * (b[:, None] * A * b[None, :])

    return _best_of(fun, grad, half_hess, r, beta.size, n_random, seed)


def sharpness_adaptive_ref(
    problem: Problem, beta: np.ndarray, rho: float, *, n_random: int = 0, seed: int = 0
) -> BallMax:
    """Adaptive l2: ``max_{||(a, b)|| <= rho} L(beta (1 + a)(1 + b)) - L(beta)``.

    This is elementwise adaptive sharpness with ``c = |theta|`` for
    ``theta = (u, v)``: ``u + du = u (1 + a)`` with ``||du / u||`` the norm, so
    it depends on the network only through ``beta``. Started from the exact
    maximiser of the second-order model and random points; ``.x = (a, b)``.
    """
    beta = np.asarray(beta, float)
    d = beta.size
    L0 = float(problem.loss(beta))
    g = problem.grad(beta)
    A = problem.A

    def fun(w):
        a, b = w[:d], w[d:]
        return float(problem.loss(beta * (1.0 + a) * (1.0 + b))) - L0

    def grad(w):
        a, b = w[:d], w[d:]
        gb = problem.grad(beta * (1.0 + a) * (1.0 + b))
        return np.concatenate([gb * beta * (1.0 + b), gb * beta * (1.0 + a)])

    def half_hess(w):
        a, b = w[:d], w[d:]
        ca, cb = beta * (1.0 + b), beta * (1.0 + a)  # d beta' / da, d beta' / db
        gb = problem.grad(beta * (1.0 + a) * (1.0 + b))
        Paa = ca[:, None] * A * ca[None, :]
        Pbb = cb[:, None] * A * cb[None, :]
        Pab = ca[:, None] * A * cb[None, :] + 0.5 * np.diag(gb * beta)
        return np.block([[Paa, Pab], [Pab.T, Pbb]])

    return _best_of(fun, grad, half_hess, rho, 2 * d, n_random, seed)


def exact_sharpness(problem: Problem, beta: np.ndarray, rho: float, *, seed: int = 0) -> dict[str, float]:
    """The three reference sharpness values of one network at one radius."""
    return {
        "adaptive": sharpness_adaptive_ref(problem, beta, rho, seed=seed).value,
        "geodesic_invariant": sharpness_invariant_exact(problem, beta, rho, seed=seed).value,
        "geodesic_mixed": sharpness_mixed_exact(problem, beta, rho).value,
    }


# =========================================================================== generic engine


def make_torch_model(u: np.ndarray, v: np.ndarray):
    """``f(x) = <u * v, x>`` as a torch module with parameters named ``u`` and ``v`` (float64)."""
    import torch
    from torch import nn

    class DiagonalNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.u = nn.Parameter(torch.as_tensor(np.asarray(u), dtype=torch.float64).clone())
            self.v = nn.Parameter(torch.as_tensor(np.asarray(v), dtype=torch.float64).clone())

        def forward(self, x):
            return x @ (self.u * self.v)

    return DiagonalNet().eval()


def mse(out, y):
    """Mean squared error, the diagonal networks' training loss."""
    return ((out - y) ** 2).mean()


#: keyword arguments of :func:`hideseek.sharpness` for the three measures
ENGINE_MEASURES: dict[str, dict[str, Any]] = {
    "adaptive": dict(measure="adaptive", p="l2"),
    "geodesic_invariant": dict(measure="geodesic", metric="invariant"),
    "geodesic_mixed": dict(measure="geodesic", metric="mixed"),
}


def engine_sharpness(
    problem: Problem,
    u: np.ndarray,
    v: np.ndarray,
    rho: float,
    measure: str,
    *,
    n_iters: int = 20,
    seed: int = 0,
    **kwargs,
) -> float:
    """Sharpness by the library's generic engine, the diagonal pairs declared by the user."""
    import torch

    import hideseek as hs

    if measure not in ENGINE_MEASURES:
        raise ValueError(f"unknown measure {measure!r}; expected one of {MEASURES}")
    model = make_torch_model(u, v)
    batches = [(torch.as_tensor(problem.X), torch.as_tensor(problem.y))]
    opts = dict(ENGINE_MEASURES[measure])
    if opts["measure"] == "geodesic":
        opts["pairs"] = [hs.DiagonalPair("u", "v")]
    opts.update(kwargs)
    opts.setdefault("progress", False)
    res = hs.sharpness(model, batches, rho=rho, n_iters=n_iters, seed=seed, loss_fn=mse, **opts)
    return float(res.value)


# =========================================================================== the experiment


def run(params: Mapping[str, Any], *, progress: bool = True, threads: int = 1) -> dict[str, Any]:
    """Train the population, measure sharpness, correlate (see :func:`_run`).

    BLAS and torch use ``threads`` threads (1 by default: the problems are
    small and single-threaded linear algebra is much faster for them).
    """
    import contextlib

    import torch

    try:  # ships with scikit-learn; only a speed-up
        from threadpoolctl import threadpool_limits
        limit = threadpool_limits(limits=threads)
    except ImportError:  # pragma: no cover
        limit = contextlib.nullcontext()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with limit:
            return _run(params, progress=progress)
    finally:
        torch.set_num_threads(old)


def _run(params: Mapping[str, Any], *, progress: bool = True) -> dict[str, Any]:
    """Train the population, measure sharpness, correlate; returns plain data.

    ``params`` keys: ``n, d, kappa, seed, n_nets, alpha_range, lr_factor_range,
    batch_sizes, stop_loss, max_steps, rho, rhos, n_boot, engine`` (bool),
    ``engine_n_iters``, ``engine_rhos`` (radii at which the engine is also run),
    ``engine_exact_invariant`` (bool: also run the engine with exact GL(1) geodesics).
    """
    import pandas as pd

    from companion.experiments.correlation import kendall_tau, tau_split_half

    t0 = time.perf_counter()
    p = dict(params)
    problem = make_problem(int(p["n"]), int(p["d"]), int(p["kappa"]), seed=int(p["seed"]))
    hp = sample_hyperparameters(
        int(p["n_nets"]), alpha_range=p["alpha_range"], lr_factor_range=p["lr_factor_range"],
        batch_sizes=p["batch_sizes"], n=problem.n, d=problem.d, seed=int(p["seed"]) + 1,
    )
    tr = train_networks(
        problem, hp["alpha"], hp["lr"], hp["batch_size"], stop_loss=float(p["stop_loss"]),
        max_steps=int(p["max_steps"]), seed=int(p["seed"]) + 2, progress=progress,
    )
    t_train = time.perf_counter() - t0
    beta = tr["u"] * tr["v"]
    nets = pd.DataFrame({
        "net": np.arange(len(beta)),
        "alpha": hp["alpha"],
        "lr": tr["lr"],
        "lr_factor": hp["lr_factor"],
        "batch_size": hp["batch_size"],
        "steps": tr["steps"],
        "restarts": tr["restarts"],
        "converged": tr["converged"],
        "train_loss": tr["train_loss"],
        "test_loss": problem.test_loss(beta),
        "l1_norm": np.abs(beta).sum(1),
        "l2_norm": np.sqrt((beta**2).sum(1)),
    })
    ok = nets["converged"].to_numpy()

    rho = float(p["rho"])
    rhos = sorted({float(r) for r in p["rhos"]} | {rho})
    rows = []
    t1 = time.perf_counter()
    it = [(k, r) for k in range(len(beta)) for r in rhos]
    for k, r in tqdm(it, desc="reference sharpness", disable=not progress, leave=False, mininterval=10):
        vals = exact_sharpness(problem, beta[k], r, seed=k)
        for m, val in vals.items():
            rows.append({"net": k, "rho": r, "measure": m, "method": "exact", "sharpness": val})
    t_exact = time.perf_counter() - t1

    t_engine = 0.0
    if p.get("engine", True):
        t2 = time.perf_counter()
        e_rhos = sorted({float(r) for r in p.get("engine_rhos", [rho])})
        jobs = [("engine", m, {}) for m in MEASURES]
        if p.get("engine_exact_invariant", True):
            # same Auto-PGD, exact GL(1) geodesics: separates optimiser error from step error
            jobs.append(("engine_exact_step", "geodesic_invariant", {"christoffel": "exact"}))
        it = [(k, r, job) for k in range(len(beta)) for r in e_rhos for job in jobs]
        for k, r, (method, m, extra) in tqdm(it, desc="engine sharpness", disable=not progress,
                                              leave=False, mininterval=10):
            val = engine_sharpness(problem, tr["u"][k], tr["v"][k], r, m,
                                   n_iters=int(p.get("engine_n_iters", 20)), seed=k, **extra)
            rows.append({"net": k, "rho": r, "measure": m, "method": method, "sharpness": val})
        t_engine = time.perf_counter() - t2
    sharp = pd.DataFrame(rows)

    # ---- correlations over converged networks
    gen = nets.loc[ok, "test_loss"].to_numpy()
    n_boot = int(p.get("n_boot", 2000))
    taus = []
    for (method, m, r), grp in sharp.groupby(["method", "measure", "rho"]):
        s = grp.set_index("net").loc[nets.loc[ok, "net"], "sharpness"].to_numpy()
        t = kendall_tau(s, gen, n_boot=n_boot, seed=int(p["seed"]))
        taus.append({"method": method, "measure": m, "rho": r, **t.as_dict()})
    taus = pd.DataFrame(taus)

    split = {}
    ex = sharp[sharp.method == "exact"]
    for m in MEASURES:
        by_rho = {
            r: grp.set_index("net").loc[nets.loc[ok, "net"], "sharpness"].to_numpy()
            for r, grp in ex[ex.measure == m].groupby("rho")
        }
        if len(by_rho) > 1 and ok.sum() >= 6:
            split[m] = tau_split_half(by_rho, gen, seed=int(p["seed"]), n_boot=n_boot).as_dict()

    return {
        "problem": problem,
        "nets": nets,
        "sharpness": sharp,
        "taus": taus,
        "split_half": split,
        "u": tr["u"],
        "v": tr["v"],
        "timings": {"train_s": t_train, "exact_s": t_exact, "engine_s": t_engine,
                    "total_s": time.perf_counter() - t0},
    }


def summary_metrics(result: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """The metrics JSON of the stage, including the Table 1 row."""
    nets, taus = result["nets"], result["taus"]
    rho = float(params["rho"])
    main = taus[np.isclose(taus.rho, rho)]

    def pick(method):
        out = {}
        for m in MEASURES:
            row = main[(main.method == method) & (main.measure == m)]
            if len(row):
                r = row.iloc[0]
                out[m] = {"tau": float(r.tau), "ci_low": float(r.ci_low), "ci_high": float(r.ci_high),
                          "pvalue": float(r.pvalue), "n": int(r.n)}
        return out

    engine = pick("engine")
    exact = pick("exact")
    conv = nets[nets.converged]
    table1 = [{
        "row": "diagonal", "variant": "closed forms / exact maximisation", "source": "exact",
        "rho": rho, "n_models": int(len(conv)),
        "tau": {m: v["tau"] for m, v in exact.items()},
        "ci": {m: [v["ci_low"], v["ci_high"]] for m, v in exact.items()},
    }]
    if len(engine) == len(MEASURES):
        table1.append({
            "row": "diagonal", "variant": "generic engine, second-order geodesic steps", "source": "engine",
            "rho": rho, "n_models": int(len(conv)),
            "tau": {m: v["tau"] for m, v in engine.items()},
            "ci": {m: [v["ci_low"], v["ci_high"]] for m, v in engine.items()},
        })
    exact_step = main[(main.method == "engine_exact_step")]
    return {
        "engine_vs_exact": agreement(result["sharpness"], rho),
        "setting": {
            "n": int(params["n"]), "d": int(params["d"]), "kappa": int(params["kappa"]),
            "n_nets": int(len(nets)), "n_converged": int(nets.converged.sum()),
            "alpha_range": [float(nets.alpha.min()), float(nets.alpha.max())],
            "lr_range": [float(nets.lr.min()), float(nets.lr.max())],
            "batch_sizes": sorted(int(b) for b in set(nets.batch_size)),
            "stop_loss": float(params["stop_loss"]),
            "rho": rho,
            "generalisation": "population test loss ||beta - beta*||^2",
        },
        "test_loss_range": [float(conv.test_loss.min()), float(conv.test_loss.max())],
        "train_loss_max": float(conv.train_loss.max()),
        "tau_exact": exact,
        "tau_engine": engine,
        "tau_engine_exact_step_invariant": (float(exact_step.iloc[0].tau) if len(exact_step) else None),
        "paper_tau": PAPER_TAU,
        "split_half": result["split_half"],
        "timings": {k: round(v, 2) for k, v in result["timings"].items()},
        "table1": table1,
    }


def agreement(sharp, rho: float) -> dict[str, dict[str, float]]:
    """Relative difference engine - exact per measure at ``rho``: median, max |.|, and
    the fraction of networks where the engine exceeds the exact value by > 1e-9 (relative)."""
    out = {}
    at = sharp[np.isclose(sharp.rho, rho)]
    ex = at[at.method == "exact"].set_index(["net", "measure"]).sharpness
    for method in ("engine", "engine_exact_step"):
        en = at[at.method == method].set_index(["net", "measure"]).sharpness
        for m in MEASURES:
            if m not in en.index.get_level_values(1):
                continue
            e = en.xs(m, level="measure")
            x = ex.xs(m, level="measure").loc[e.index]
            rel = ((e - x) / x.abs()).to_numpy()
            out[f"{method}:{m}"] = {
                "median_rel": float(np.median(rel)),
                "max_abs_rel": float(np.max(np.abs(rel))),
                "frac_engine_above": float(np.mean(rel > 1e-9)),
            }
    return out
