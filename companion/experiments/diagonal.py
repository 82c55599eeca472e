"""Diagonal linear networks: Figure 3 and Table 1, row 1 (docs/maths.md §8).

**Population** (the paper follows Andriushchenko et al. 2023; their public setting with
d = 200 and 90 % sparsity): Gaussian design ``X`` (n x d, n < d), a kappa-sparse ground
truth ``beta*`` (random support, entries ``+-1/sqrt(kappa)`` so that ``||beta*|| = 1``),
noiseless labels ``y = X beta*``, training loss ``L(beta) = ||X beta - y||^2 / (2n)``.
A network ``f(x) = <u * v, x>`` starts at ``u = alpha 1``, ``v = 0`` with one constant
``alpha`` and is trained by (stochastic) gradient descent until ``L <= stop_loss``. The
networks differ by the method (GD, ``B = n``, or SGD with batch size ``B``), the step size
and the step-size schedule (constant, or divided by ``decay_factor`` after a fraction of a
fixed horizon): large steps and SGD noise lead to sparser, better generalising solutions.
A secondary population varies the initialisation scale ``alpha`` instead (GD, one step
size); there ``alpha`` alone explains most of the test loss.

Generalisation: the population test loss ``E_x (x^T (beta - beta*))^2 / 2 = ||beta -
beta*||^2 / 2`` for ``x ~ N(0, I)`` (exact, no test sample).

**Sharpness** ``max_{xi in ball} L(gamma_xi(1)) - L(theta)``, solved by Auto-PGD
(:func:`hideseek.solvers.apgd`) over the horizontal velocities ``xi = (u b, v b)``
(coordinates ``b``) or, for adaptive sharpness, over relative perturbations ``(a, c)``:

============================  =====================================================  ==========================
measure / step                point reached                                           ball
============================  =====================================================  ==========================
adaptive                      ``beta (1 + a)(1 + c)``                                 ``||(a, c)|| <= rho``
invariant, exact              ``beta e^{2b}`` (:func:`~hideseek.geometry.gl.exact_geodesic_gl1`)  ``2||b||^2 <= rho^2``
mixed, exact                  ``beta (1 + 2b)`` (:func:`~hideseek.geometry.gl.exact_geodesic_gl1_mixed`)  ``2 sum beta_i^2 b_i^2 <= rho^2`` **and** ``b_i >= -1/2``
either metric, second order   ``theta + xi + Gamma-term / 2`` (library ``PairGeometry.step``)  the metric ball
either metric, straight       ``beta (1 + b)^2``                                      the metric ball
mixed, trust region           ``beta + dbeta``, exact maximum (:func:`trust_region_max`)  ``||dbeta|| <= sqrt2 rho`` (ignores incompleteness)
============================  =====================================================  ==========================

The mixed metric's geodesics are incomplete: the one with ``b_i < -1/2`` reaches
``u_i = v_i = 0`` before ``t = 1`` and ends there. The geodesic ball is the image of
the velocities whose geodesic exists up to ``t = 1``: the metric ball intersected with
``b_i >= -1/2`` (equivalently: no ``beta_i`` changes sign). That set is convex, and
:class:`DiagonalBall` projects onto it in the metric: the projection of ``z`` is
``max(s z, l)`` elementwise for the largest ``s in (0, 1]`` that lands in the ball (the
KKT conditions of the weighted projection; ``s`` by bisection). The closure point
``b_i = -1/2`` itself is kept ``1e-12`` inside (``beta_i`` shrinks by ``1e-12``, not to
0) so that gradients stay finite.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from scipy import optimize
from tqdm.auto import tqdm

from companion import paper
from hideseek.geometry.gl import PairGeometry
from hideseek.solvers.apgd import apgd

MEASURES = ("adaptive", "geodesic_invariant", "geodesic_mixed")
STEPS = ("exact", "second_order", "straight")

#: Paper, Table 1, row "Diagonal networks" (Kendall tau vs test loss).
PAPER_TAU = paper.table1_tau("diagonal")

#: Distance kept from the end of the mixed geodesics (b_i = -1/2), relative.
TIP_MARGIN = 1e-12


# =========================================================================== data


@dataclass
class Problem:
    """A noiseless sparse regression problem; loss ``||X beta - y||^2 / (2n)``."""

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
        """Hessian of the loss in beta, ``X^T X / n``."""
        return self.X.T @ self.X / self.n

    def loss(self, beta: np.ndarray) -> np.ndarray:
        """Training loss; ``beta`` may be (..., d)."""
        r = beta @ self.X.T - self.y
        return 0.5 * np.mean(r**2, axis=-1)

    def grad(self, beta: np.ndarray) -> np.ndarray:
        """Gradient of the training loss in beta, ``X^T (X beta - y) / n``."""
        return (beta @ self.X.T - self.y) @ self.X / self.n

    def test_loss(self, beta: np.ndarray) -> np.ndarray:
        """Population test loss ``||beta - beta*||^2 / 2`` (isotropic Gaussian inputs)."""
        return 0.5 * np.sum((beta - self.beta_star) ** 2, axis=-1)


def make_problem(n: int, d: int, kappa: int, seed: int = 0, *, design: str = "gaussian") -> Problem:
    """Gaussian (or, for checks, orthogonal: ``X^T X = n I``, needs n >= d) design and a
    kappa-sparse ground truth with entries ``+-1/sqrt(kappa)``; noiseless labels."""
    if not (0 < kappa <= d):
        raise ValueError(f"need 0 < kappa <= d, got kappa={kappa}, d={d}")
    rng = np.random.default_rng(seed)
    if design == "gaussian":
        X = rng.standard_normal((n, d))
    elif design == "orthogonal":
        if n < d:
            raise ValueError(f"an orthogonal design needs n >= d, got n={n}, d={d}")
        Q, _ = np.linalg.qr(rng.standard_normal((n, d)))
        X = math.sqrt(n) * Q
    else:
        raise ValueError(f"design must be 'gaussian' or 'orthogonal', got {design!r}")
    beta_star = np.zeros(d)
    support = rng.choice(d, size=kappa, replace=False)
    beta_star[support] = rng.choice([-1.0, 1.0], size=kappa) / math.sqrt(kappa)
    return Problem(X, X @ beta_star, beta_star)


# =========================================================================== population


def sample_population(
    n_nets: int,
    *,
    n: int,
    methods: Mapping[str, Mapping[str, Any]],
    lr_factor_range: Sequence[float],
    schedules: Sequence[str] = ("constant", "decay"),
    decay_fracs: Sequence[float] = (0.1, 0.3, 0.5),
    decay_factor: float = 10.0,
    horizon: int = 20000,
    alpha: float | Sequence[float] = 0.1,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Per-network training hyperparameters.

    ``methods`` maps a name to ``{"batch_size": B, "lr": {schedule: reference step}}``
    (``B = n`` is GD). Each network draws a method and a schedule uniformly, and its
    initial step ``lr0 = factor * reference`` with ``factor`` log-uniform in
    ``lr_factor_range``. A ``decay`` schedule divides the step by ``decay_factor`` after
    ``frac * horizon`` steps, ``frac`` drawn from ``decay_fracs``. ``alpha`` is one
    constant, or a ``[lo, hi]`` range to draw log-uniformly from (the secondary population).
    """
    if n_nets < 1:
        raise ValueError("n_nets must be >= 1")
    if not methods:
        raise ValueError("methods is empty")
    for name, m in methods.items():
        b = int(m["batch_size"])
        if not 1 <= b <= n:
            raise ValueError(f"method {name!r}: batch size {b} outside [1, n={n}]")
        missing = [s for s in schedules if s not in m["lr"]]
        if missing:
            raise ValueError(f"method {name!r} has no reference step for schedule(s) {missing}")
    for s in schedules:
        if s not in ("constant", "decay"):
            raise ValueError(f"schedule must be 'constant' or 'decay', got {s!r}")
    rng = np.random.default_rng(seed)
    names = list(methods)
    method = rng.choice(names, size=n_nets)
    schedule = rng.choice(list(schedules), size=n_nets)
    lo, hi = np.log(lr_factor_range[0]), np.log(lr_factor_range[1])
    factor = np.exp(rng.uniform(lo, hi, n_nets))
    frac = rng.choice(np.asarray(decay_fracs, float), size=n_nets)
    if np.ndim(alpha) == 0:
        alphas = np.full(n_nets, float(alpha))
    else:
        alphas = np.exp(rng.uniform(np.log(alpha[0]), np.log(alpha[1]), n_nets))
    lr0 = np.array([methods[m]["lr"][s] for m, s in zip(method, schedule)]) * factor
    decay = schedule == "decay"
    return {
        "method": method,
        "batch_size": np.array([int(methods[m]["batch_size"]) for m in method]),
        "schedule": schedule,
        "lr_factor": factor,
        "lr0": lr0,
        "decay_at": np.where(decay, np.round(frac * horizon).astype(int), -1),
        "decay_factor": np.where(decay, float(decay_factor), 1.0),
        "alpha": alphas,
    }


def train_networks(
    problem: Problem,
    pop: Mapping[str, np.ndarray],
    *,
    stop_loss: float,
    max_steps: int,
    seed: int = 0,
    check_every: int = 100,
    max_restarts: int = 4,
    progress: bool = True,
) -> dict[str, np.ndarray]:
    """Train every network of ``pop`` (numpy, float64), vectorised over the networks of
    one batch size.

    SGD samples ``B`` examples per step (with replacement for ``B = 1``, without
    otherwise); ``B = n`` is full-batch GD. The step is ``lr0`` and becomes
    ``lr0 / decay_factor`` at step ``decay_at`` (``-1``: never). Training stops when the
    full training loss is ``<= stop_loss`` (checked every ``check_every`` steps) or after
    ``max_steps``. A run whose loss becomes non-finite or exceeds 100x its initial value
    restarts from its initialisation with half the step (``restarts`` counts them; after
    ``max_restarts`` it is given up). Returns ``u, v, steps, train_loss, converged,
    restarts, lr0`` (the step actually used).
    """
    X, y = problem.X, problem.y
    n, d = X.shape
    N = len(pop["lr0"])
    rng = np.random.default_rng(seed)
    alpha = np.asarray(pop["alpha"], float)
    lr0 = np.asarray(pop["lr0"], float).copy()
    U = np.tile(alpha[:, None], (1, d))
    V = np.zeros((N, d))
    steps = np.zeros(N, int)
    restarts = np.zeros(N, int)
    done = np.zeros(N, bool)
    failed = np.zeros(N, bool)
    L0 = float(problem.loss(np.zeros(d)))
    bar = tqdm(total=N, desc="training diagonal nets", disable=not progress, leave=False, mininterval=10)
    with np.errstate(over="ignore", invalid="ignore"):
        for B in np.unique(pop["batch_size"]):
            grp = np.flatnonzero(pop["batch_size"] == B)
            while True:
                act = grp[~(done[grp] | failed[grp])]
                if act.size == 0:
                    break
                u, v = U[act], V[act]
                decay_at = np.asarray(pop["decay_at"])[act]
                dfac = np.asarray(pop["decay_factor"])[act]
                s0 = steps[act].copy()
                for k in range(check_every):
                    lr = np.where((decay_at >= 0) & (s0 + k >= decay_at), lr0[act] / dfac, lr0[act])[:, None]
                    beta = u * v
                    if B == n:
                        g = (beta @ X.T - y) @ X / n
                    elif B == 1:
                        idx = rng.integers(0, n, size=act.size)
                        Xi = X[idx]
                        g = (np.einsum("kd,kd->k", Xi, beta) - y[idx])[:, None] * Xi
                    else:
                        idx = np.argpartition(rng.random((act.size, n)), B, axis=1)[:, :B]
                        Xb = X[idx]                                      # (a, B, d)
                        r = np.einsum("kbd,kd->kb", Xb, beta) - y[idx]
                        g = np.einsum("kb,kbd->kd", r, Xb) / B
                    u, v = u - lr * v * g, v - lr * u * g
                steps[act] += check_every
                U[act], V[act] = u, v
                loss = problem.loss(u * v)
                bad = ~np.isfinite(loss) | (loss > 100.0 * L0)
                for k in act[bad]:
                    if restarts[k] >= max_restarts:
                        failed[k] = True
                        continue
                    restarts[k] += 1
                    lr0[k] /= 2.0
                    U[k], V[k] = alpha[k], 0.0
                    steps[k] = 0
                ok = act[~bad][loss[~bad] <= stop_loss]
                done[ok] = True
                bar.update(ok.size)
                out_of_time = act[~bad][steps[act[~bad]] >= max_steps]
                failed[np.setdiff1d(out_of_time, ok)] = True
    bar.close()
    return {"u": U, "v": V, "steps": steps, "train_loss": problem.loss(U * V), "converged": done,
            "restarts": restarts, "lr0": lr0}


# =========================================================================== the perturbation set


class DiagonalBall:
    """``{z : sum_i w_i z_i^2 <= rho^2, z >= lower}`` with the metric ``sum w_i z_i eta_i``.

    The small geometry object :func:`hideseek.solvers.apgd` works with (one tensor per
    tangent vector). ``lower = None`` is the plain metric ball.
    """

    def __init__(self, weights: torch.Tensor, lower: torch.Tensor | None = None):
        if bool((weights <= 0).any()):
            raise ValueError("metric weights must be positive (a zero weight means a zero weight "
                             "u_i or v_i, where the metric degenerates)")
        self.w = weights
        self.lower = lower
        if lower is not None and bool((lower > 0).any()):
            raise ValueError("lower bounds must be <= 0 (the start z = 0 must be allowed)")

    def zeros(self) -> list[torch.Tensor]:
        return [torch.zeros_like(self.w)]

    def sqnorm(self, x: list[torch.Tensor]) -> torch.Tensor:
        return (self.w * x[0] ** 2).sum()

    def direction(self, egrad: list[torch.Tensor]) -> list[torch.Tensor]:
        """Unit-norm Riemannian gradient ``(g / w) / ||g / w||_w``."""
        r = egrad[0] / self.w
        nrm = torch.sqrt((egrad[0] * r).sum())
        return [r / nrm if float(nrm) > 0 else torch.zeros_like(r)]

    def ball(self, x: list[torch.Tensor], rho: float, project: bool = True) -> list[torch.Tensor]:
        """Metric projection onto the set (``project`` is accepted and ignored: every
        vector here is horizontal)."""
        z = x[0]
        if self.lower is None:
            nrm = float(torch.sqrt(self.sqnorm([z])))
            return [z * (rho / nrm) if nrm > rho else z]
        y = torch.maximum(z, self.lower)
        if float(self.sqnorm([y])) <= rho * rho:
            return [y]
        s = self._scale(z, rho)
        return [torch.maximum(s * z, self.lower)]

    def _scale(self, z: torch.Tensor, rho: float) -> float:
        """The largest ``s in (0, 1]`` with ``||max(s z, l)||_w <= rho``.

        Coordinate i sits at its bound exactly when ``s > tau_i = l_i / z_i`` (``z_i < 0``),
        so between consecutive sorted ``tau`` the squared norm is ``s^2 F_k + C_k``
        (free part, bound part); the interval where it crosses ``rho^2`` gives ``s``.
        Bisection is the fallback should rounding leave no interval."""
        w, l = self.w, self.lower
        tau = torch.where(z < 0, l / z.clamp(max=-torch.finfo(z.dtype).tiny), torch.full_like(z, math.inf))
        order = torch.argsort(tau)
        tau_s = tau[order]
        wz2, wl2 = (w * z * z)[order], (w * l * l)[order]
        C = torch.cat([wz2.new_zeros(1), torch.cumsum(wl2, 0)])            # bound part, first k bound
        F = wz2.sum() - torch.cat([wz2.new_zeros(1), torch.cumsum(wz2, 0)])  # free part
        left = torch.cat([tau_s.new_zeros(1), tau_s])
        right = torch.cat([tau_s, tau_s.new_full((1,), math.inf)])
        with torch.no_grad():
            s = torch.sqrt(((rho * rho - C) / F).clamp(min=0))
            ok = (F > 0) & (C <= rho * rho) & (s >= left * (1 - 1e-12)) & (s <= right * (1 + 1e-12))
        if bool(ok.any()):
            cand = float(s[ok].max())
            if float(self.sqnorm([torch.maximum(cand * z, l)])) <= rho * rho * (1 + 1e-12):
                return min(cand, 1.0)
        lo, hi = 0.0, 1.0                       # norm(max(s z, l)) is nondecreasing in s
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if float(self.sqnorm([torch.maximum(mid * z, l)])) <= rho * rho:
                lo = mid
            else:
                hi = mid
            if hi - lo <= 1e-15 * hi:
                break
        return lo

    def random_direction(self, generator: torch.Generator) -> list[torch.Tensor]:
        z = torch.randn(self.w.shape, generator=generator, dtype=self.w.dtype) / self.w.sqrt()
        return [z / torch.sqrt(self.sqnorm([z]))]


@dataclass(frozen=True)
class Variant:
    """One sharpness computation: a measure and the step that reaches the perturbed point."""

    measure: str          # adaptive | geodesic_invariant | geodesic_mixed
    step: str             # exact | second_order | straight | trust_region

    @property
    def name(self) -> str:
        return f"{self.measure}:{self.step}"


#: Every variant the experiment computes; the main Table 1 row uses the exact steps.
VARIANTS = (
    Variant("adaptive", "straight"),
    Variant("geodesic_invariant", "exact"), Variant("geodesic_invariant", "second_order"),
    Variant("geodesic_invariant", "straight"),
    Variant("geodesic_mixed", "exact"), Variant("geodesic_mixed", "second_order"),
    Variant("geodesic_mixed", "straight"), Variant("geodesic_mixed", "trust_region"),
)
STEP_TITLES = {
    "exact": "exact geodesics (true geodesic ball)",
    "second_order": "second-order geodesic step (transformer recipe)",
    "straight": "straight steps, metric norm (no Christoffel term)",
    "trust_region": "trust region in beta (ignores incompleteness)",
}


def _setup(problem: Problem, u: np.ndarray, v: np.ndarray, variant: Variant):
    """(point map z -> beta', DiagonalBall) for one network and one variant."""
    if variant.step not in STEPS:
        raise ValueError(f"step must be one of {STEPS} here, got {variant.step!r}")
    U = torch.as_tensor(np.asarray(u, float)).reshape(-1, 1, 1)
    V = torch.as_tensor(np.asarray(v, float)).reshape(-1, 1, 1)
    if bool((U == 0).any()) or bool((V == 0).any()):
        raise ValueError("a network has u_i = 0 or v_i = 0: the quotient geometry is undefined there")
    beta = (U * V).reshape(-1)
    if variant.measure == "adaptive":
        if variant.step != "straight":
            raise ValueError("adaptive sharpness has straight steps only")
        d = beta.numel()
        return (lambda z: beta * (1 + z[:d]) * (1 + z[d:])), DiagonalBall(torch.ones(2 * d, dtype=beta.dtype))
    metric = {"geodesic_invariant": "invariant", "geodesic_mixed": "mixed"}[variant.measure]
    geom = PairGeometry(U, V, metric=metric)
    christoffel = {"exact": "exact", "second_order": True, "straight": False}[variant.step]

    def point(z):
        b = z.reshape(-1, 1, 1)
        Gp, Hp = geom.step(U * b, V * b, christoffel=christoffel)
        return (Gp * Hp).reshape(-1)

    # ||(u b, v b)||^2 = 2 ||b||^2 (invariant), 2 sum beta_i^2 b_i^2 (mixed)
    w = torch.full_like(beta, 2.0) if metric == "invariant" else 2.0 * beta**2
    lower = None
    if metric == "mixed" and variant.step == "exact":
        lower = torch.full_like(beta, -0.5 * (1.0 - TIP_MARGIN))
    return point, DiagonalBall(w, lower)


def sharpness(problem: Problem, u: np.ndarray, v: np.ndarray, rho: float, variant: Variant, *,
              n_iters: int = 100, return_point: bool = False):
    """Worst-case sharpness of one network by Auto-PGD (``trust_region``: exact maximum).

    Returns the value, or ``(value, beta')`` with the maximiser when ``return_point``.
    """
    if rho <= 0:
        raise ValueError(f"rho must be > 0, got {rho}")
    if variant.step == "trust_region":
        if variant.measure != "geodesic_mixed":
            raise ValueError("the trust-region value exists for the mixed metric only")
        beta = np.asarray(u, float) * np.asarray(v, float)
        res = trust_region_max(problem.grad(beta), 0.5 * problem.A, math.sqrt(2.0) * rho)
        return (res.value, beta + res.x) if return_point else res.value
    point, ball = _setup(problem, u, v, variant)
    X = torch.as_tensor(problem.X)
    y = torch.as_tensor(problem.y)
    n = problem.n

    def objective(x):
        z = x[0].detach().requires_grad_(True)
        r = X @ point(z) - y
        f = 0.5 * (r @ r) / n
        (g,) = torch.autograd.grad(f, z)
        return f.detach(), [g]

    res = apgd(objective, ball, rho, n_iters)
    if return_point:
        with torch.no_grad():
            return res.value, point(res.best[0]).numpy()
    return res.value


# =========================================================================== exact references


@dataclass
class BallMax:
    """The maximiser and maximum of an objective on a ball."""

    value: float
    x: np.ndarray
    hard_case: bool = False


def trust_region_max(g: np.ndarray, M: np.ndarray, radius: float) -> BallMax:
    """Exact global maximum of ``q(x) = g^T x + x^T M x`` over ``||x|| <= radius``.

    ``M`` symmetric, possibly indefinite. Optimality: ``g + 2 M x = 2 mu x`` with
    ``mu >= max(lambda_max(M), 0)`` and ``mu (||x|| - radius) = 0``. With ``M = Q diag(lam)
    Q^T`` and ``c = Q^T g``, ``x(mu)`` has coordinates ``c_i / (2 (mu - lam_i))``; ``mu``
    solves the secular equation ``||x(mu)|| = radius`` (Brent's method). The "hard case"
    (``g`` orthogonal to the top eigenspace) adds a multiple of a top eigenvector.
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
    scale = max(np.abs(lam).max(), 1e-300)
    top = lam >= lam_max - 1e-12 * scale

    def q(x):
        return float(g @ x + x @ M @ x)

    if lam_max < 0:
        x_int = Q @ (c / (-2.0 * lam))
        if np.linalg.norm(x_int) <= radius:
            return BallMax(q(x_int), x_int)
    lo = max(lam_max, 0.0)

    def phi(mu):
        return np.sqrt(np.sum((c / (2.0 * (mu - lam))) ** 2)) - radius

    if lam_max < 0:
        a = lo
    else:
        c_top = np.sqrt(np.sum(c[top] ** 2))
        a = lo + c_top / (4.0 * radius)
        if a - lo <= 1e-13 * scale or phi(a) <= 0:
            a = lo + 1e-13 * scale
            if phi(a) <= 0:
                nt = ~top
                x = Q[:, nt] @ (c[nt] / (2.0 * (lam_max - lam[nt])))
                e = Q[:, top][:, -1]
                rem = max(radius**2 - x @ x, 0.0)
                cand = [x + s * np.sqrt(rem) * e for s in (1.0, -1.0)]
                vals = [q(z) for z in cand]
                k = int(np.argmax(vals))
                return BallMax(vals[k], cand[k], hard_case=True)
    hi = lo + np.linalg.norm(g) / (2.0 * radius) + 1e-13 * scale
    while phi(hi) > 0:
        hi = lo + 2.0 * (hi - lo)
    xtol = max(min(1e-13 * max(1.0, abs(hi)), 1e-8 * (a - lo)), 1e-300)
    mu = optimize.brentq(phi, a, hi, xtol=xtol, rtol=1e-15, maxiter=500)
    x = Q @ (c / (2.0 * (mu - lam)))
    x *= radius / np.linalg.norm(x)
    return BallMax(q(x), x)


def orthogonal_closed_forms(beta: np.ndarray, beta_star: np.ndarray, rho: float) -> dict[str, float]:
    """The paper's Eq. 8 and its mixed-metric counterpart on an orthogonal design
    (``X^T X = n I``, so ``L(beta) = ||beta - beta*||^2 / 2 + const``), in this module's
    conventions (``||xi||^2 = 2||b||^2``, loss with ``1/(2n)``):

    * invariant, first order: ``sqrt2 rho ||beta (beta - beta*)||``; at ``beta = beta*``,
      second order: ``rho^2 max_i beta_i^2`` (paper: ``4 rho ||.|| + 4 rho^2 max beta_i^2``
      for ``||b|| <= rho`` and the loss without ``1/2``);
    * adaptive, same leading terms as the invariant metric;
    * mixed, exact while no ``beta_i`` would change sign: ``sqrt2 rho ||beta - beta*|| + rho^2``
      (paper: ``rho ||beta - beta*||`` up to constants).
    """
    r = beta - beta_star
    interp = bool(np.allclose(r, 0))
    inv = rho**2 * np.max(beta**2) if interp else math.sqrt(2) * rho * np.linalg.norm(beta * r)
    return {"adaptive": inv, "geodesic_invariant": inv,
            "geodesic_mixed": math.sqrt(2) * rho * np.linalg.norm(r) + rho**2}


def orthogonal_check(*, d: int = 20, rho: float = 1e-3, n_iters: int = 100, seed: int = 0) -> list[dict]:
    """APGD (exact steps) against :func:`orthogonal_closed_forms` on an orthogonal design,
    at a generic point (first-order regime) and at an interpolating dense point (second order)."""
    prob = make_problem(d, d, d, seed=seed, design="orthogonal")   # dense beta*: every beta_i != 0
    rng = np.random.default_rng(seed + 1)
    points = {"generic (r != 0)": prob.beta_star * (1 + 0.3 * rng.standard_normal(d)),
              "interpolating (beta = beta*)": prob.beta_star.copy()}
    rows = []
    for case, beta in points.items():
        u = np.sqrt(np.abs(beta)) * rng.choice([-1.0, 1.0], d)
        v = beta / u
        cf = orthogonal_closed_forms(beta, prob.beta_star, rho)
        for m in MEASURES:
            step = "straight" if m == "adaptive" else "exact"
            val = sharpness(prob, u, v, rho, Variant(m, step), n_iters=n_iters)
            rows.append({"case": case, "measure": m, "step": step, "rho": rho, "apgd": val,
                         "closed_form": cf[m], "rel_diff": (val - cf[m]) / cf[m]})
    return rows


# =========================================================================== the experiment


def _population(problem: Problem, p: Mapping[str, Any], *, seed: int, progress: bool):
    pop = sample_population(
        int(p["n_nets"]), n=problem.n, methods=p["methods"], lr_factor_range=p["lr_factor_range"],
        schedules=p.get("schedules", ("constant", "decay")), decay_fracs=p.get("decay_fracs", (0.1, 0.3, 0.5)),
        decay_factor=float(p.get("decay_factor", 10.0)), horizon=int(p.get("horizon", 20000)),
        alpha=p["alpha"], seed=seed)
    tr = train_networks(problem, pop, stop_loss=float(p["stop_loss"]), max_steps=int(p["max_steps"]),
                        seed=seed + 1, check_every=int(p.get("check_every", 100)), progress=progress)
    import pandas as pd

    beta = tr["u"] * tr["v"]
    nets = pd.DataFrame({
        "net": np.arange(len(beta)), "method": pop["method"], "batch_size": pop["batch_size"],
        "schedule": pop["schedule"], "alpha": pop["alpha"], "lr_factor": pop["lr_factor"],
        "lr0": tr["lr0"], "decay_at": pop["decay_at"], "decay_factor": pop["decay_factor"],
        "steps": tr["steps"], "restarts": tr["restarts"], "converged": tr["converged"],
        "train_loss": tr["train_loss"], "test_loss": problem.test_loss(beta),
        "l1_norm": np.abs(beta).sum(1),
        "n_large": (np.abs(beta) > 1e-2 / math.sqrt(problem.d)).sum(1),
        "min_abs_beta": np.abs(beta).min(1),
    })
    return nets, tr["u"], tr["v"]


def _sharpness_table(problem, nets, U, V, rhos, variants, n_iters, progress, desc):
    rows = []
    ok = nets.net[nets.converged].to_numpy()
    it = [(k, r, var) for k in ok for r in rhos for var in variants]
    for k, r, var in tqdm(it, desc=desc, disable=not progress, leave=False, mininterval=10):
        t = time.perf_counter()
        val = sharpness(problem, U[k], V[k], r, var, n_iters=n_iters)
        rows.append({"net": int(k), "rho": float(r), "measure": var.measure, "step": var.step,
                     "sharpness": float(val), "seconds": time.perf_counter() - t})
    import pandas as pd

    return pd.DataFrame(rows)


def _taus(sharp, nets, n_boot, seed):
    import pandas as pd

    from companion.experiments.correlation import kendall_tau

    gen = nets.set_index("net").test_loss
    out = []
    for (m, step, r), grp in sharp.groupby(["measure", "step", "rho"]):
        s = grp.set_index("net").sharpness
        if not np.all(np.isfinite(s.to_numpy())):
            out.append({"measure": m, "step": step, "rho": r, "tau": float("nan"), "ci_low": float("nan"),
                        "ci_high": float("nan"), "pvalue": float("nan"), "n": int(s.size), "n_boot": 0})
            continue
        t = kendall_tau(s.to_numpy(), gen.loc[s.index].to_numpy(), n_boot=n_boot, seed=seed)
        out.append({"measure": m, "step": step, "rho": r, **t.as_dict()})
    return pd.DataFrame(out)


def run(params: Mapping[str, Any], *, progress: bool = True, threads: int = 1) -> dict[str, Any]:
    """Train both populations, measure every sharpness variant, correlate; plain data back.

    ``params`` keys: ``n, d, kappa, seed, stop_loss, max_steps, rho`` (main radius, fixed
    in advance), ``rhos`` (sweep), ``n_iters`` (Auto-PGD), ``n_boot``, ``convergence_factor``
    (the main row is recomputed with this many times more iterations), ``main`` (the
    population: ``n_nets, alpha, methods, lr_factor_range, schedules, decay_fracs,
    decay_factor, horizon``), ``alpha_sweep`` (same keys, or absent), ``orthogonal``
    (``d, rho`` of the closed-form check, or absent).
    """
    import contextlib

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
    import pandas as pd

    p = dict(params)
    seed = int(p["seed"])
    timings: dict[str, float] = {}
    t0, c0 = time.perf_counter(), time.process_time()
    problem = make_problem(int(p["n"]), int(p["d"]), int(p["kappa"]), seed=seed)
    rho = float(p["rho"])
    rhos = sorted({float(r) for r in p.get("rhos", [])} | {rho})
    n_iters = int(p.get("n_iters", 100))
    n_boot = int(p.get("n_boot", 2000))

    nets, U, V = _population(problem, {**p, **p["main"]}, seed=seed + 1, progress=progress)
    timings["train_s"] = time.perf_counter() - t0
    t = time.perf_counter()
    # every variant at the main radius; the exact steps (and adaptive) over the whole sweep
    main = [v for v in VARIANTS if v.step == "exact" or v.measure == "adaptive"]
    sharp = pd.concat([
        _sharpness_table(problem, nets, U, V, [rho], VARIANTS, n_iters, progress, "sharpness"),
        _sharpness_table(problem, nets, U, V, [r for r in rhos if r != rho], main, n_iters, progress, "rho sweep"),
    ], ignore_index=True)
    timings["sharpness_s"] = time.perf_counter() - t
    taus = _taus(sharp, nets, n_boot, seed)

    # optimiser check: the exact-step main row again with more iterations
    t = time.perf_counter()
    conv = None
    cf = int(p.get("convergence_factor", 0))
    if cf > 1:
        more = _sharpness_table(problem, nets, U, V, [rho], main, cf * n_iters, progress, "convergence")
        base = sharp[np.isclose(sharp.rho, rho)].set_index(["net", "measure", "step"]).sharpness
        more = more.set_index(["net", "measure", "step"]).sharpness
        rel = (more - base.loc[more.index]) / base.loc[more.index].abs()
        conv = {"n_iters": n_iters, "n_iters_more": cf * n_iters,
                "max_rel_increase": {m: float(rel.xs(m, level="measure").max()) for m in MEASURES},
                "median_rel_increase": {m: float(rel.xs(m, level="measure").median()) for m in MEASURES}}
    timings["convergence_s"] = time.perf_counter() - t

    # secondary population: initialisation-scale sweep
    sweep = None
    if p.get("alpha_sweep"):
        t = time.perf_counter()
        sp = {**p, **p["alpha_sweep"]}
        nets_a, Ua, Va = _population(problem, sp, seed=seed + 11, progress=progress)
        sharp_a = _sharpness_table(problem, nets_a, Ua, Va, [rho], main, n_iters, progress, "alpha sweep")
        sweep = {"nets": nets_a, "sharpness": sharp_a, "taus": _taus(sharp_a, nets_a, n_boot, seed)}
        timings["alpha_sweep_s"] = time.perf_counter() - t

    ortho = None
    if p.get("orthogonal"):
        t = time.perf_counter()
        o = p["orthogonal"]
        ortho = pd.DataFrame(orthogonal_check(d=int(o.get("d", 20)), rho=float(o.get("rho", 1e-3)),
                                              n_iters=n_iters, seed=seed))
        timings["orthogonal_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - t0
    timings["total_cpu_s"] = time.process_time() - c0   # this process's CPU time (the machine is shared)
    return {"problem": problem, "nets": nets, "u": U, "v": V, "sharpness": sharp, "taus": taus,
            "convergence": conv, "alpha_sweep": sweep, "orthogonal": ortho, "timings": timings,
            "rho": rho}


def _tau_entry(taus, step, rho):
    out = {}
    for m in MEASURES:
        st = "straight" if m == "adaptive" else step
        row = taus[(taus.measure == m) & (taus.step == st) & np.isclose(taus.rho, rho)]
        if len(row):
            r = row.iloc[0]
            out[m] = {"tau": float(r.tau), "ci_low": float(r.ci_low), "ci_high": float(r.ci_high),
                      "pvalue": float(r.pvalue), "n": int(r.n)}
    return out


def summary_metrics(result: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """The stage's metrics JSON, Table 1 rows included (main row: exact geodesics)."""
    nets, taus, rho = result["nets"], result["taus"], float(result["rho"])
    conv = nets[nets.converged]
    table1 = []
    by_step = {}
    for step in ("exact", "second_order", "straight"):
        e = _tau_entry(taus, step, rho)
        by_step[step] = e
        if len(e) == len(MEASURES):
            table1.append({"row": "diagonal", "variant": STEP_TITLES[step] if step != "exact"
                           else "exact geodesics, true geodesic ball (main)", "source": step,
                           "rho": rho, "n_models": int(len(conv)),
                           "tau": {m: v["tau"] for m, v in e.items()},
                           "ci": {m: [v["ci_low"], v["ci_high"]] for m, v in e.items()}})
    tr = _tau_entry(taus, "trust_region", rho)
    out = {
        "setting": {
            "n": int(params["n"]), "d": int(params["d"]), "kappa": int(params["kappa"]),
            "n_nets": int(len(nets)), "n_converged": int(len(conv)),
            "not_converged": nets.loc[~nets.converged, ["net", "method", "schedule", "lr0", "steps",
                                                        "train_loss"]].to_dict("records"),
            "methods": sorted(set(nets.method)), "schedules": sorted(set(nets.schedule)),
            "alpha": sorted({float(a) for a in nets.alpha}),
            "lr0_range": [float(nets.lr0.min()), float(nets.lr0.max())],
            "stop_loss": float(params["stop_loss"]), "rho": rho, "n_iters": int(params.get("n_iters", 100)),
            "generalisation": "population test loss ||beta - beta*||^2 / 2",
        },
        "train_loss_range": [float(conv.train_loss.min()), float(conv.train_loss.max())],
        "test_loss_range": [float(conv.test_loss.min()), float(conv.test_loss.max())],
        "tau_exact": by_step["exact"],
        "tau_second_order": by_step["second_order"],
        "tau_straight": by_step["straight"],
        "tau_trust_region_mixed": tr.get("geodesic_mixed"),
        "paper_tau": PAPER_TAU,
        "convergence": result["convergence"],
        "timings": {k: round(v, 2) for k, v in result["timings"].items()},
        "table1": table1,
    }
    if result.get("alpha_sweep"):
        sw = result["alpha_sweep"]
        sc = sw["nets"][sw["nets"].converged]
        out["alpha_sweep"] = {
            "n_nets": int(len(sw["nets"])), "n_converged": int(len(sc)),
            "alpha_range": [float(sc.alpha.min()), float(sc.alpha.max())],
            "test_loss_range": [float(sc.test_loss.min()), float(sc.test_loss.max())],
            "tau_exact": _tau_entry(sw["taus"], "exact", rho),
        }
    if result.get("orthogonal") is not None:
        o = result["orthogonal"]
        out["orthogonal_check"] = {"max_abs_rel_diff": float(o.rel_diff.abs().max()),
                                   "rows": o.to_dict("records")}
    return _plain(out)


def _plain(x: Any) -> Any:
    """Plain JSON types (numpy scalars and arrays converted)."""
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [_plain(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x
