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
from companion.analysis import kendall
from companion.params import from_mapping
from hideseek.geometry.gl import PairGeometry
from hideseek.geometry.metrics import InvariantMetric, MixedMetric
from hideseek.measures import Measure
from hideseek.solvers.apgd import apgd_checkpoints

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
    tangent vector). ``lower = None`` is the plain metric ball. Every method also takes a
    batch of vectors ``[S, D]`` (one row per start of :func:`apgd_starts`), row by row.
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
        return (self.w * x[0] ** 2).sum(-1)

    def direction(self, egrad: list[torch.Tensor], inplace: bool = False) -> list[torch.Tensor]:
        """Unit-norm Riemannian gradient ``(g / w) / ||g / w||_w`` (zero where the gradient is);
        ``inplace`` (the library solver's hint that ``egrad`` may be overwritten) is ignored."""
        r = egrad[0] / self.w
        nrm = torch.sqrt((egrad[0] * r).sum(-1, keepdim=True))
        return [torch.where(nrm > 0, r / torch.where(nrm > 0, nrm, 1.0), 0.0)]

    def ball(self, x: list[torch.Tensor], rho: float, project: bool = True) -> list[torch.Tensor]:
        """Metric projection onto the set (``project`` is accepted and ignored: every
        vector here is horizontal)."""
        z = x[0]
        if self.lower is None:
            nrm = torch.sqrt(self.sqnorm([z])).unsqueeze(-1)
            return [torch.where(nrm > rho, z * (rho / nrm), z)]
        y = torch.maximum(z, self.lower)
        inside = (self.sqnorm([y]) <= rho * rho).unsqueeze(-1)
        if bool(inside.all()):
            return [y]
        return [torch.where(inside, y, torch.maximum(self._scale(z, rho) * z, self.lower))]

    def shrink_(self, x: list[torch.Tensor], rho: float) -> list[torch.Tensor]:
        """:meth:`ball` as the library solver's in-place shrink (a new tensor here: these are tiny)."""
        return self.ball(x, rho, project=False)

    def _scale(self, z: torch.Tensor, rho: float) -> torch.Tensor:
        """Per row, the largest ``s in (0, 1]`` with ``||max(s z, l)||_w <= rho`` (shape ``[..., 1]``).

        Coordinate i sits at its bound exactly when ``s > tau_i = l_i / z_i`` (``z_i < 0``),
        so between consecutive sorted ``tau`` the squared norm is ``s^2 F_k + C_k``
        (free part, bound part); the interval where it crosses ``rho^2`` gives ``s``.
        Bisection is the fallback for rows where rounding leaves no interval."""
        w, l = self.w, self.lower
        r2 = rho * rho
        with torch.no_grad():
            tau = torch.where(z < 0, l / z.clamp(max=-torch.finfo(z.dtype).tiny), math.inf)
            tau_s, order = torch.sort(tau, dim=-1)
            wz2 = torch.gather(w * z * z, -1, order)
            wl2 = torch.gather((w * l * l).expand_as(z), -1, order)
            zero = wz2.new_zeros(wz2.shape[:-1] + (1,))
            C = torch.cat([zero, torch.cumsum(wl2, -1)], -1)                     # bound part, first k bound
            F = wz2.sum(-1, keepdim=True) - torch.cat([zero, torch.cumsum(wz2, -1)], -1)  # free part
            left = torch.cat([zero, tau_s], -1)
            right = torch.cat([tau_s, torch.full_like(zero, math.inf)], -1)
            s = torch.sqrt(((r2 - C) / F).clamp(min=0))
            ok = (F > 0) & (C <= r2) & (s >= left * (1 - 1e-12)) & (s <= right * (1 + 1e-12))
            cand = torch.where(ok, s, -math.inf).amax(-1, keepdim=True)
            good = ok.any(-1, keepdim=True) & (
                self.sqnorm([torch.maximum(cand.clamp(min=0) * z, l)]) <= r2 * (1 + 1e-12)).unsqueeze(-1)
            if bool(good.all()):
                return cand.clamp(max=1.0)
            lo, hi = torch.zeros_like(zero), torch.ones_like(zero)   # norm(max(s z, l)) is nondecreasing in s
            for _ in range(200):
                mid = 0.5 * (lo + hi)
                fits = (self.sqnorm([torch.maximum(mid * z, l)]) <= r2).unsqueeze(-1)
                lo, hi = torch.where(fits, mid, lo), torch.where(fits, hi, mid)
                if bool((hi - lo <= 1e-15 * hi).all()):
                    break
            return torch.where(good, cand.clamp(max=1.0), lo)

    def random_direction(self, generator: torch.Generator, n: int | None = None) -> list[torch.Tensor]:
        """A direction uniform in metric-whitened coordinates, of metric norm 1 (``n`` rows when given)."""
        shape = self.w.shape if n is None else (n,) + tuple(self.w.shape)
        z = torch.randn(shape, generator=generator, dtype=self.w.dtype) / self.w.sqrt()
        return [z / torch.sqrt(self.sqnorm([z])).unsqueeze(-1)]


def apgd_starts(objective, ball: DiagonalBall, rho: float, n_iters: int, x0: torch.Tensor, *,
                alpha: float = 0.75, rho_frac: float = 0.75) -> tuple[torch.Tensor, torch.Tensor]:
    """Auto-PGD (:func:`hideseek.solvers.apgd`, the same schedule) from every row of ``x0``
    (``[S, D]``, projected onto the set first) at once: each start keeps its own step size,
    momentum, best point and checkpoint decisions; ``objective(z [S, D]) -> (f [S], egrad [S, D])``.
    Returns the best objective value of each start and its maximiser."""
    x = ball.ball([x0], rho)[0]
    f, g = objective(x)
    best_f, best_x, best_g = f.clone(), x.clone(), g.clone()
    checkpoints = set(apgd_checkpoints(n_iters))
    eta = torch.full_like(f, 2.0 * rho)
    x_prev = x
    increases, last_ckpt = torch.zeros_like(f), 0
    eta_last, best_last = eta.clone(), best_f.clone()
    for k in range(n_iters):
        z = ball.ball([x + eta[:, None] * ball.direction([g])[0]], rho)[0]
        x_new = z if k == 0 else ball.ball([(2.0 - 2.0 * alpha) * x + alpha * z - (1.0 - alpha) * x_prev], rho)[0]
        f_new, g_new = objective(x_new)
        increases += (f_new > f).to(f.dtype)
        x_prev, x, f, g = x, x_new, f_new, g_new
        better = f_new > best_f
        best_f = torch.where(better, f_new, best_f)
        best_x, best_g = torch.where(better[:, None], x_new, best_x), torch.where(better[:, None], g_new, best_g)
        if (k + 1) in checkpoints:
            stalled = increases < rho_frac * (k + 1 - last_ckpt)
            halve = stalled | ((eta == eta_last) & (best_f == best_last))
            eta = torch.where(halve, eta / 2.0, eta)
            x, x_prev = torch.where(halve[:, None], best_x, x), torch.where(halve[:, None], best_x, x_prev)
            f, g = torch.where(halve, best_f, f), torch.where(halve[:, None], best_g, g)
            increases, last_ckpt = torch.zeros_like(f), k + 1
            eta_last, best_last = eta.clone(), best_f.clone()
    return best_f, best_x


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
#: The primary comparison's variants (``measure:step``).
MAIN_VARIANTS = ("adaptive:straight", "geodesic_invariant:exact", "geodesic_mixed:exact")
STEP_TITLES = {
    "exact": "exact geodesics (true geodesic ball)",
    "second_order": "second-order geodesic step (transformer recipe)",
    "straight": "straight steps, metric norm (no Christoffel term)",
    "trust_region": "trust region in beta (ignores incompleteness)",
}


def _setup(problem: Problem, u: np.ndarray, v: np.ndarray, variant: Variant, n_rows: int = 1):
    """(point map z [S, D] -> beta' [S, d], DiagonalBall) for one network and one variant, ``n_rows`` = S."""
    if variant.step not in STEPS:
        raise ValueError(f"step must be one of {STEPS} here, got {variant.step!r}")
    U = torch.as_tensor(np.asarray(u, float)).reshape(-1, 1, 1)
    V = torch.as_tensor(np.asarray(v, float)).reshape(-1, 1, 1)
    if bool((U == 0).any()) or bool((V == 0).any()):
        raise ValueError("a network has u_i = 0 or v_i = 0: the quotient geometry is undefined there")
    beta = (U * V).reshape(-1)
    d = beta.numel()
    if variant.measure == "adaptive":
        if variant.step != "straight":
            raise ValueError("adaptive sharpness has straight steps only")
        return (lambda z: beta * (1 + z[..., :d]) * (1 + z[..., d:])), DiagonalBall(torch.ones(2 * d, dtype=beta.dtype))
    metric = Measure.parse(variant.measure).metric   # the registry's name of the pair metric
    Us, Vs = U.repeat(n_rows, 1, 1), V.repeat(n_rows, 1, 1)   # the S starts side by side: S*d scalar pairs
    geom = PairGeometry(Us, Vs, metric=metric)
    christoffel = {"exact": "exact", "second_order": True, "straight": False}[variant.step]

    def point(z):
        b = z.reshape(-1, 1, 1)
        Gp, Hp = geom.step(Us * b, Vs * b, christoffel=christoffel)
        return (Gp * Hp).reshape(n_rows, d)

    # ||(u b, v b)||^2 = 2 ||b||^2 (invariant), 2 sum beta_i^2 b_i^2 (mixed)
    w = torch.full_like(beta, 2.0) if metric == InvariantMetric.name else 2.0 * beta**2
    lower = None
    if metric == MixedMetric.name and variant.step == "exact":
        lower = torch.full_like(beta, -0.5 * (1.0 - TIP_MARGIN))
    return point, DiagonalBall(w, lower)


@dataclass(frozen=True)
class Starts:
    """Sharpness of one network from every start: ``values[0]`` from ξ = 0 (the single start of the
    paper), the others from random points of the sphere of radius ρ; ``point``: the best maximiser β'."""

    values: np.ndarray
    point: np.ndarray

    @property
    def value(self) -> float:
        return float(self.values.max())

    @property
    def single(self) -> float:
        return float(self.values[0])

    @property
    def best_start(self) -> int:
        return int(np.argmax(self.values))


def multistart(problem: Problem, u: np.ndarray, v: np.ndarray, rho: float, variant: Variant, *,
               n_iters: int, n_starts: int, seed: int) -> Starts:
    """Worst-case sharpness of one network from ``n_starts`` starts of Auto-PGD run side by side
    (:func:`apgd_starts`): ξ = 0 and ``n_starts - 1`` random points of the sphere of radius ρ
    (projected onto the set), drawn from ``seed``. ``trust_region``: the exact maximum (one value)."""
    if rho <= 0:
        raise ValueError(f"rho must be > 0, got {rho}")
    if n_starts < 1:
        raise ValueError(f"n_starts must be >= 1, got {n_starts}")
    if variant.step == "trust_region":
        if variant.measure != "geodesic_mixed":
            raise ValueError("the trust-region value exists for the mixed metric only")
        beta = np.asarray(u, float) * np.asarray(v, float)
        res = trust_region_max(problem.grad(beta), 0.5 * problem.A, math.sqrt(2.0) * rho)
        return Starts(np.array([res.value]), beta + res.x)
    point, ball = _setup(problem, u, v, variant, n_starts)
    X, y = torch.as_tensor(problem.X), torch.as_tensor(problem.y)

    def objective(z):
        z = z.detach().requires_grad_(True)
        r = point(z) @ X.T - y
        f = 0.5 * (r * r).sum(-1) / problem.n
        (g,) = torch.autograd.grad(f.sum(), z)
        return f.detach(), g

    gen = torch.Generator().manual_seed(int(seed))
    x0 = torch.cat([torch.zeros_like(ball.w)[None], rho * ball.random_direction(gen, n_starts - 1)[0]])
    best, arg = apgd_starts(objective, ball, rho, n_iters, x0)
    base = objective(torch.zeros_like(x0))[0][0]
    with torch.no_grad():
        beta_p = point(arg)[int(torch.argmax(best))].numpy()
    return Starts((best - base).numpy(), beta_p)


def sharpness(problem: Problem, u: np.ndarray, v: np.ndarray, rho: float, variant: Variant, *,
              n_iters: int, n_starts: int = 1, seed: int = 0, return_point: bool = False):
    """Worst-case sharpness of one network: the best of ``n_starts`` Auto-PGD starts
    (:func:`multistart`; ``trust_region``: the exact maximum). Returns the value, or
    ``(value, beta')`` with the maximiser when ``return_point``."""
    res = multistart(problem, u, v, rho, variant, n_iters=n_iters, n_starts=n_starts, seed=seed)
    return (res.value, res.point) if return_point else res.value


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


@dataclass(frozen=True)
class Method:
    """A training method: batch size (``n`` is GD) and reference step per schedule."""

    batch_size: int
    lr: dict[str, float]


@dataclass(frozen=True)
class Population:
    """A population of networks (:func:`sample_population`'s arguments)."""

    n_nets: int
    alpha: float | list[float]
    methods: dict[str, Method]
    lr_factor_range: list[float]
    schedules: list[str]
    decay_fracs: list[float]
    decay_factor: float
    horizon: int


@dataclass(frozen=True)
class Orthogonal:
    """The closed-form check on an orthogonal design."""

    d: int
    rho: float


@dataclass(frozen=True)
class Settings:
    """The ``diagonal`` stage's parameters (``params.yaml`` section ``diagonal``; every key required)."""

    n: int
    d: int
    kappa: int
    seed: int
    stop_loss: float
    max_steps: int
    check_every: int
    rho: float                 # main radius, fixed in advance
    rhos: list[float]          # sweep (exact steps and adaptive)
    n_iters: int               # Auto-PGD iterations per start
    n_starts: int              # starts per network, measure and radius: xi = 0 plus n_starts - 1 random
    convergence_factor: int    # main row recomputed with this many times the iterations (a check)
    n_boot: int
    main: Population
    alpha_sweep: Population | None
    orthogonal: Orthogonal | None
    cpu_kernels: str | None    # CPU kernels pinned to this level (companion.kernels), checked before training

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | "Settings") -> "Settings":
        if isinstance(params, cls):
            return params
        return from_mapping(cls, params, "params.yaml diagonal")


def _population(problem: Problem, p: Population, s: Settings, *, seed: int, progress: bool):
    import pandas as pd

    pop = sample_population(
        p.n_nets, n=problem.n, methods={k: {"batch_size": m.batch_size, "lr": m.lr} for k, m in p.methods.items()},
        lr_factor_range=p.lr_factor_range, schedules=p.schedules, decay_fracs=p.decay_fracs,
        decay_factor=p.decay_factor, horizon=p.horizon, alpha=p.alpha, seed=seed)
    tr = train_networks(problem, pop, stop_loss=s.stop_loss, max_steps=s.max_steps, seed=seed + 1,
                        check_every=s.check_every, progress=progress)
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


def start_seed(seed: int, net: int, variant: Variant, rho: float) -> int:
    """The seed of the random starts of one (network, variant, radius)."""
    key = [seed, net, VARIANTS.index(variant), int(round(rho * 1e9))]
    return int(np.random.SeedSequence(key).generate_state(1)[0])


def _sharpness_table(problem, nets, U, V, rhos, variants, n_iters, s: Settings, progress, desc):
    """One row per (converged network, radius, variant): the best of ``s.n_starts`` starts, the
    single start at xi = 0, which start won and the relative gain of the best over the single."""
    import pandas as pd

    rows = []
    ok = nets.net[nets.converged].to_numpy()
    it = [(k, r, var) for k in ok for r in rhos for var in variants]
    for k, r, var in tqdm(it, desc=desc, disable=not progress, leave=False, mininterval=10):
        st = multistart(problem, U[k], V[k], r, var, n_iters=n_iters, n_starts=s.n_starts,
                        seed=start_seed(s.seed, int(k), var, r))
        rows.append({"net": int(k), "rho": float(r), "measure": var.measure, "step": var.step,
                     "sharpness": st.value, "sharpness_single": st.single, "best_start": st.best_start,
                     "gain": (st.value - st.single) / abs(st.single) if st.single != 0 else 0.0})
    return pd.DataFrame(rows)


def _taus(sharp, nets, n_boot, seed, column="sharpness"):
    import pandas as pd

    gen = nets.set_index("net").test_loss
    out = []
    for (m, step, r), grp in sharp.groupby(["measure", "step", "rho"]):
        v = grp.set_index("net")[column]
        if not np.all(np.isfinite(v.to_numpy())):
            out.append({"measure": m, "step": step, "rho": r, "tau": float("nan"), "ci_low": float("nan"),
                        "ci_high": float("nan"), "pvalue": float("nan"), "n": int(v.size), "n_boot": 0})
            continue
        t = kendall(v.to_numpy(), gen.loc[v.index].to_numpy(), n_boot=n_boot, seed=seed)
        out.append({"measure": m, "step": step, "rho": r, **t.as_dict()})
    return pd.DataFrame(out)


def run(params: Mapping[str, Any] | Settings, *, progress: bool = True, threads: int = 1) -> dict[str, Any]:
    """Train both populations, measure every sharpness variant from every start, correlate; plain
    data back (``params``: the stage's resolved parameters or its :class:`Settings`)."""
    import contextlib

    from companion import kernels

    s = Settings.from_params(params)
    kernels.check(s.cpu_kernels, "diagonal")   # the stage's command pins them (python -m companion.kernels ...)
    try:  # ships with scikit-learn; only a speed-up
        from threadpoolctl import threadpool_limits
        limit = threadpool_limits(limits=threads)
    except ImportError:  # pragma: no cover
        limit = contextlib.nullcontext()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with limit:
            return _run(s, progress=progress)
    finally:
        torch.set_num_threads(old)


def _convergence(problem, nets, U, V, sharp, s: Settings, main, progress):
    """The main row again with ``convergence_factor`` times the iterations (same starts)."""
    if s.convergence_factor <= 1:
        return None
    more = _sharpness_table(problem, nets, U, V, [s.rho], main, s.convergence_factor * s.n_iters, s,
                            progress, "convergence")
    base = sharp[np.isclose(sharp.rho, s.rho)].set_index(["net", "measure", "step"]).sharpness
    more = more.set_index(["net", "measure", "step"]).sharpness
    rel = (more - base.loc[more.index]) / base.loc[more.index].abs()
    return {"n_iters": s.n_iters, "n_iters_more": s.convergence_factor * s.n_iters,
            "max_rel_increase": {m: float(rel.xs(m, level="measure").max()) for m in MEASURES},
            "median_rel_increase": {m: float(rel.xs(m, level="measure").median()) for m in MEASURES}}


def _run(s: Settings, *, progress: bool = True) -> dict[str, Any]:
    import pandas as pd

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    problem = make_problem(s.n, s.d, s.kappa, seed=s.seed)
    rhos = sorted(set(s.rhos) | {s.rho})
    nets, U, V = _population(problem, s.main, s, seed=s.seed + 1, progress=progress)
    timings["train_s"] = time.perf_counter() - t0
    t = time.perf_counter()
    # every variant at the main radius; the exact steps (and adaptive) over the whole sweep
    main = [v for v in VARIANTS if v.step == "exact" or v.measure == "adaptive"]
    sharp = pd.concat([
        _sharpness_table(problem, nets, U, V, [s.rho], VARIANTS, s.n_iters, s, progress, "sharpness"),
        _sharpness_table(problem, nets, U, V, [r for r in rhos if r != s.rho], main, s.n_iters, s, progress,
                         "rho sweep"),
    ], ignore_index=True)
    timings["sharpness_s"] = time.perf_counter() - t
    taus = _taus(sharp, nets, s.n_boot, s.seed)
    taus_single = _taus(sharp, nets, s.n_boot, s.seed, column="sharpness_single")
    t = time.perf_counter()
    conv = _convergence(problem, nets, U, V, sharp, s, main, progress)
    timings["convergence_s"] = time.perf_counter() - t
    sweep = None
    if s.alpha_sweep is not None:   # secondary population: initialisation-scale sweep
        t = time.perf_counter()
        nets_a, Ua, Va = _population(problem, s.alpha_sweep, s, seed=s.seed + 11, progress=progress)
        sharp_a = _sharpness_table(problem, nets_a, Ua, Va, [s.rho], main, s.n_iters, s, progress, "alpha sweep")
        sweep = {"nets": nets_a, "sharpness": sharp_a, "taus": _taus(sharp_a, nets_a, s.n_boot, s.seed)}
        timings["alpha_sweep_s"] = time.perf_counter() - t
    ortho = None
    if s.orthogonal is not None:
        t = time.perf_counter()
        ortho = pd.DataFrame(orthogonal_check(d=s.orthogonal.d, rho=s.orthogonal.rho, n_iters=s.n_iters,
                                              seed=s.seed))
        timings["orthogonal_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - t0
    return {"problem": problem, "nets": nets, "u": U, "v": V, "sharpness": sharp, "taus": taus,
            "taus_single": taus_single, "convergence": conv, "alpha_sweep": sweep, "orthogonal": ortho,
            "timings": timings, "rho": s.rho, "settings": s}


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


def restart_gains(sharp, rho: float) -> dict[str, dict[str, Any]]:
    """Per ``measure:step`` at radius ``rho``: the relative gain of the best start over the single
    start at xi = 0 (median, max, networks improved by more than 1e-6, the net with the max)."""
    out = {}
    at = sharp[np.isclose(sharp.rho, rho) & (sharp.step != "trust_region")]
    for (m, st), g in at.groupby(["measure", "step"], sort=False):
        out[f"{m}:{st}"] = {"median": float(g.gain.median()), "max": float(g.gain.max()),
                            "n_improved": int((g.gain > 1e-6).sum()), "n": int(len(g)),
                            "net_max": int(g.net.iloc[int(np.argmax(g.gain.to_numpy()))])}
    return out


def _table1(by_step, single, rho, n_models, n_starts):
    """Table 1 lines: the primary comparison (exact geodesics, best of the starts) first, then the
    exploratory ones (other steps, and the paper's single start at xi = 0)."""
    lines = []
    for step in ("exact", "second_order", "straight"):
        e = by_step[step]
        if len(e) == len(MEASURES):
            title = (f"exact geodesics, true geodesic ball, best of {n_starts} starts (primary)" if step == "exact"
                     else f"{STEP_TITLES[step]}, best of {n_starts} starts")
            lines.append({"row": "diagonal", "variant": title, "source": step, "rho": rho, "n_models": n_models,
                          "primary": step == "exact", "exploratory": step != "exact", "n_starts": n_starts,
                          "tau": {m: v["tau"] for m, v in e.items()},
                          "ci": {m: [v["ci_low"], v["ci_high"]] for m, v in e.items()}})
    if len(single) == len(MEASURES):
        lines.append({"row": "diagonal", "variant": "exact geodesics, one Auto-PGD start at ξ = 0 (the paper's)",
                      "source": "exact_single_start", "rho": rho, "n_models": n_models, "primary": False,
                      "exploratory": True, "n_starts": 1, "tau": {m: v["tau"] for m, v in single.items()},
                      "ci": {m: [v["ci_low"], v["ci_high"]] for m, v in single.items()}})
    return lines


def summary_metrics(result: Mapping[str, Any]) -> dict[str, Any]:
    """The stage's metrics JSON, Table 1 lines included (primary: exact geodesics, best of the starts)."""
    nets, taus, rho, s = result["nets"], result["taus"], float(result["rho"]), result["settings"]
    conv = nets[nets.converged]
    by_step = {step: _tau_entry(taus, step, rho) for step in ("exact", "second_order", "straight")}
    single = _tau_entry(result["taus_single"], "exact", rho)
    out = {
        "setting": {
            "n": s.n, "d": s.d, "kappa": s.kappa, "n_nets": int(len(nets)), "n_converged": int(len(conv)),
            "not_converged": nets.loc[~nets.converged, ["net", "method", "schedule", "lr0", "steps",
                                                        "train_loss"]].to_dict("records"),
            "methods": sorted(set(nets.method)), "schedules": sorted(set(nets.schedule)),
            "alpha": sorted({float(a) for a in nets.alpha}),
            "lr0_range": [float(nets.lr0.min()), float(nets.lr0.max())],
            "stop_loss": s.stop_loss, "rho": rho, "rhos": sorted(set(s.rhos) | {rho}), "n_iters": s.n_iters,
            "n_starts": s.n_starts, "generalisation": "population test loss ||beta - beta*||^2 / 2",
        },
        "n_starts": s.n_starts,
        "train_loss_range": [float(conv.train_loss.min()), float(conv.train_loss.max())],
        "test_loss_range": [float(conv.test_loss.min()), float(conv.test_loss.max())],
        "tau_exact": by_step["exact"],
        "tau_exact_single_start": single,
        "tau_second_order": by_step["second_order"],
        "tau_straight": by_step["straight"],
        "tau_trust_region_mixed": _tau_entry(taus, "trust_region", rho).get("geodesic_mixed"),
        "restart_gain": restart_gains(result["sharpness"], rho),
        "tau_vs_rho": {m: [[float(r.rho), float(r.tau), float(r.ci_low), float(r.ci_high)]
                           for r in taus[(taus.measure == m) & (taus.step == ("straight" if m == "adaptive"
                                                                              else "exact"))].itertuples()]
                       for m in MEASURES},
        "paper_tau": PAPER_TAU,
        "convergence": result["convergence"],
        "table1": _table1(by_step, single, rho, int(len(conv)), s.n_starts),
    }
    if result.get("alpha_sweep"):
        sw = result["alpha_sweep"]
        sc = sw["nets"][sw["nets"].converged]
        out["alpha_sweep"] = {
            "n_nets": int(len(sw["nets"])), "n_converged": int(len(sc)),
            "alpha_range": [float(sc.alpha.min()), float(sc.alpha.max())],
            "test_loss_range": [float(sc.test_loss.min()), float(sc.test_loss.max())],
            "tau_alpha_test_loss": kendall(sc.alpha, sc.test_loss, n_boot=0, seed=s.seed).tau,
            "tau_exact": _tau_entry(sw["taus"], "exact", rho),
        }
    if result.get("orthogonal") is not None:
        o = result["orthogonal"]
        out["orthogonal_check"] = {"max_abs_rel_diff": float(o.rel_diff.abs().max()),
                                   "rows": o.to_dict("records")}
    return _plain(out)


def run_report(profile: str, params: Mapping[str, Any] | Settings, out_dir: str | Path, *,
               progress: bool = True) -> dict[str, Any]:
    """The stage's one computing call (the entry signature every stage module shares, checked by
    ``tests/companion/test_contract.py``; ``profile`` is accepted and unused: ``params`` is the resolved
    profile already): :func:`run`, then every output written under ``out_dir``:
    ``metrics/diagonal.json`` (:func:`summary_metrics`) and ``data/{networks,sharpness,taus,
    alpha_sweep_networks,alpha_sweep_sharpness}.csv`` and the ``plots:`` files
    (:func:`companion.metrics.write_plot_data`; ``taus.csv``: one row per measure, step, radius
    and ``starts`` — ``best`` of the starts or the ``single`` start at xi = 0); the wall-clock times
    go to ``timings/diagonal.json`` (published to ``reports/timings/``, no DVC output). Returns the
    result of :func:`run` with ``metrics`` added."""
    from pathlib import Path

    import pandas as pd

    from companion.metrics import write_plot_data, write_stage_metrics, write_stage_timings

    res = run(params, progress=progress)
    res["metrics"] = summary_metrics(res)
    out = Path(out_dir)
    (out / "data").mkdir(parents=True, exist_ok=True)
    (out / "figures").mkdir(parents=True, exist_ok=True)
    write_stage_metrics(out, "diagonal", res["metrics"])
    write_stage_timings(out, "diagonal", {k: round(v, 2) for k, v in res["timings"].items()})   # git, not DVC
    res["nets"].to_csv(out / "data" / "networks.csv", index=False)
    res["sharpness"].to_csv(out / "data" / "sharpness.csv", index=False)
    pd.concat([res["taus"].assign(starts="best"), res["taus_single"].assign(starts="single")],
              ignore_index=True).to_csv(out / "data" / "taus.csv", index=False)
    main = res["taus"][[f"{m}:{st}" in MAIN_VARIANTS for m, st in zip(res["taus"].measure, res["taus"].step)]]
    at = res["sharpness"][np.isclose(res["sharpness"].rho, res["rho"])
                          & [f"{m}:{st}" in MAIN_VARIANTS for m, st in zip(res["sharpness"].measure,
                                                                            res["sharpness"].step)]]
    scatter = at.pivot(index="net", columns="measure", values="sharpness").join(
        res["nets"].set_index("net").test_loss).reset_index()
    write_plot_data(out / "data", main, scatter)
    if res["alpha_sweep"] is not None:
        res["alpha_sweep"]["nets"].to_csv(out / "data" / "alpha_sweep_networks.csv", index=False)
        res["alpha_sweep"]["sharpness"].to_csv(out / "data" / "alpha_sweep_sharpness.csv", index=False)
    return res


def _ci(t: Mapping[str, Any]) -> str:
    return f"{t['tau']:+.2f} [{t['ci_low']:+.2f}, {t['ci_high']:+.2f}]"


def findings(metrics: Mapping[str, Any]) -> str:
    """The notebook's findings, in words, generated from the stage's metrics (no typed numbers)."""
    s, best, single = metrics["setting"], metrics["tau_exact"], metrics["tau_exact_single_start"]
    lines = [f"* **Population.** {s['n_converged']} of {s['n_nets']} networks reached the stop loss "
             f"{s['stop_loss']:g}; test losses {metrics['test_loss_range'][0]:.2g}–{metrics['test_loss_range'][1]:.2g}."]
    lines.append(f"* **Primary comparison (exact geodesics, ρ = {s['rho']:g} fixed in advance, best of "
                 f"{s['n_starts']} Auto-PGD starts).** " + "; ".join(
                     f"{m}: τ = {_ci(best[m])} (paper {PAPER_TAU[m]:+.2f}; "
                     f"{'inside' if best[m]['ci_low'] <= PAPER_TAU[m] <= best[m]['ci_high'] else 'outside'} the interval)"
                     for m in MEASURES) + ".")
    lines.append("* **One start at ξ = 0 (the paper's protocol) on the same networks.** " + "; ".join(
        f"{m}: τ = {_ci(single[m])}" for m in MEASURES) + ". Largest gain of the best start over the single one: "
        + "; ".join(f"{k.split(':')[0]} {100 * g['max']:.2g} % (median {100 * g['median']:.2g} %, {g['n_improved']} "
                    f"of {g['n']} networks improved)" for k, g in metrics["restart_gain"].items() if k in MAIN_VARIANTS)
        + ".")
    signs = {m: sorted({np.sign(t) for _, t, _, _ in metrics["tau_vs_rho"][m] if t != 0}) for m in MEASURES}
    lines.append("* **Radius sweep (exploratory).** " + "; ".join(
        f"{m}: τ " + ", ".join(f"{t:+.2f} at ρ = {r:g}" for r, t, _, _ in metrics["tau_vs_rho"][m])
        + (" (the sign changes with ρ)" if len(signs[m]) > 1 else "") for m in MEASURES) + ".")
    tr = metrics.get("tau_trust_region_mixed")
    lines.append("* **Mixed metric, labelled alternatives (exploratory).** " + "; ".join(
        [f"second-order step τ = {_ci(metrics['tau_second_order']['geodesic_mixed'])}",
         f"straight steps τ = {_ci(metrics['tau_straight']['geodesic_mixed'])}"]
        + ([f"trust region in β (ignores incompleteness) τ = {_ci(tr)}"] if tr else [])) + ".")
    conv = metrics.get("convergence")
    if conv:
        lines.append(f"* **Checks.** {conv['n_iters_more']} instead of {conv['n_iters']} iterations raise no main "
                     "value by more than " + ", ".join(f"{v:.2g} ({m})" for m, v in conv["max_rel_increase"].items())
                     + " (relative)" + (f"; orthogonal design: Auto-PGD vs closed forms, largest relative difference "
                                        f"{metrics['orthogonal_check']['max_abs_rel_diff']:.2g}"
                                        if "orthogonal_check" in metrics else "") + ".")
    if "alpha_sweep" in metrics:
        a = metrics["alpha_sweep"]
        lines.append(f"* **α sweep (secondary, exploratory).** τ(α, test loss) = {a['tau_alpha_test_loss']:+.2f}; "
                     + "; ".join(f"{m} τ = {_ci(t)}" for m, t in a["tau_exact"].items()) + ".")
    return "\n".join(lines)


def _plain(x: Any) -> Any:
    """Plain JSON types (numpy scalars and arrays converted)."""
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [_plain(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x
