"""Auto-PGD (Croce & Hein 2020) over weight perturbations, and random search.

The solvers see a problem through a small interface: ``objective(x) -> (f, egrad)`` and a
geometry with ``zeros``, ``direction``, ``ball``, ``shrink_`` and ``random_direction``: the
typed protocol :class:`hideseek.geometry.protocol.SolverGeometry` (implemented by
:class:`hideseek.geometry.space.ProductGeometry`).  They maximise ``f`` over the ball.

Observers (progress, benchmarks, tests) pass ``callback=``: it is called with a
:class:`SolverStep` at the start (iteration 0) and after every iteration.  The search's
phases are also labelled for ``torch.profiler`` (``hideseek.geometry`` around the direction
and the ball projection).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor
from torch.profiler import record_function

from ..geometry.protocol import SolverGeometry

Objective = Callable[[list[Tensor]], tuple[Tensor, list[Tensor]]]


@dataclass(frozen=True)
class SolverStep:
    """What an observer sees after each iteration of a solver (iteration 0: the start).

    ``value`` is the objective at this iteration's point, ``best`` the largest so far (for
    :func:`average_case`, the running mean), ``step_size`` Auto-PGD's current η (``None``
    for the sampling solvers), ``n_evals`` objective evaluations so far, ``seconds`` since
    the solver started; ``batch`` is set by :func:`hideseek.sharpness` (the batch index).

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False), torch.nn.Linear(2, 2, bias=False)).eval()
    >>> batch, mse = (torch.randn(16, 3), torch.randn(16, 2)), torch.nn.functional.mse_loss
    >>> steps = []
    >>> res = hs.sharpness(model, [batch], "m_apgd_l2", rho=0.1, n_iters=5, loss_fn=mse, progress=False,
    ...                    callback=steps.append)
    >>> [s.iteration for s in steps]                                  # the start, then each iteration
    [0, 1, 2, 3, 4, 5]
    >>> all(b.best >= a.best for a, b in zip(steps, steps[1:]))         # the best value never decreases
    True
    """

    iteration: int
    value: float
    best: float
    step_size: float | None
    n_evals: int
    seconds: float
    batch: int | None = None


Callback = Callable[[SolverStep], Any]


def apgd_checkpoints(n_iters: int) -> list[int]:
    """Iterations at which the step size is reconsidered: ``ceil(p_j n_iters)`` with
    ``p_0 = 0``, ``p_1 = 0.22``, ``p_{j+1} = p_j + max(p_j − p_{j−1} − 0.03, 0.06)``.
    (For 20 iterations: 5, 9, 12, 15, 16, 18, 19 — computed in floating point exactly as
    the reference adaptive-sharpness code does, so schedules stay comparable.)"""
    p = [0.0, 0.22]
    while p[-1] < 1:
        p.append(p[-1] + max(p[-1] - p[-2] - 0.03, 0.06))
    return sorted({math.ceil(q * n_iters) for q in p[1:] if 0 < math.ceil(q * n_iters) < n_iters})


@dataclass
class SolverResult:
    """Outcome of one maximisation.

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False), torch.nn.Linear(2, 2, bias=False)).eval()
    >>> batch, mse = (torch.randn(16, 3), torch.randn(16, 2)), torch.nn.functional.mse_loss
    >>> res = hs.sharpness(model, [batch], "m_apgd_l2", rho=0.1, n_iters=5, loss_fn=mse, progress=False)
    >>> s = res.solver[0]                                            # one SolverResult per batch
    >>> abs(s.value - res.per_batch[0]) < 1e-12, s.value == max(s.history) - s.f0
    (True, True)
    """

    value: float                 # best objective minus the objective at ξ = 0
    f0: float                    # objective at ξ = 0
    best: list[Tensor]           # maximiser found
    history: list[float] = field(default_factory=list)   # objective at every evaluated point
    step_sizes: list[float] = field(default_factory=list)
    n_evals: int = 0
    seconds: float = 0.0
    stop_reason: str = "max_iters"


_SLICE = 1 << 20   # elements per temporary of the momentum step (a multiple of every SIMD width)


def _momentum(x: list[Tensor], z: list[Tensor], x_prev: list[Tensor], alpha: float,
              out: list[Tensor] | None) -> list[Tensor]:
    """``(2 − 2α) x + α z − (1 − α) x_prev``, each element computed exactly as
    ``m = x·(2 − 2α); m += α z; m += −(1 − α) x_prev`` (the same kernels, the same bits),
    written into ``out`` (may be ``x_prev``) when given.  The temporary ``m`` is one slice of
    at most ``_SLICE`` elements at a time, not a copy of the parameters."""
    c1, c3 = 2.0 - 2.0 * alpha, -(1.0 - alpha)
    res = []
    for i, (xi, zi, pi) in enumerate(zip(x, z, x_prev)):
        o = torch.empty_like(xi) if out is None else out[i]
        parts = [(xi, zi, pi, o)]
        if xi.numel() > _SLICE and all(t.is_contiguous() for t in (xi, zi, pi, o)):
            flat = [t.view(-1) for t in (xi, zi, pi, o)]
            parts = [tuple(t[a:a + _SLICE] for t in flat) for a in range(0, xi.numel(), _SLICE)]
        for px, pz, pp, po in parts:
            m = torch.mul(px, c1)
            m.add_(pz, alpha=alpha)
            torch.add(m, pp, alpha=c3, out=po)
        res.append(o)
    return res


def _owned(g: list[Tensor]) -> list[Tensor]:
    """``g`` with every tensor safe to overwrite in place (autograd may return expanded or
    other non-contiguous views: those few are copied)."""
    return [t if t.is_contiguous() else t.contiguous() for t in g]


def apgd(objective: Objective, geometry: SolverGeometry, rho: float, n_iters: int = 20, *,
         f0: float | None = None, x0: list[Tensor] | None = None, alpha: float = 0.75,
         rho_frac: float = 0.75,
         start: tuple[Tensor, list[Tensor]] | Callable[[], tuple[Tensor, list[Tensor]]] | None = None,
         callback: Callback | None = None, keep_best_grad: bool = True) -> SolverResult:
    """Maximise ``objective`` over ``{ξ allowed, ‖ξ‖ ≤ ρ}`` with Auto-PGD.

    Initial step size ``2ρ``; momentum mixes ``alpha`` of the projected step with
    ``1 − alpha`` of the previous move; at each checkpoint the step size is halved when
    fewer than ``rho_frac`` of the steps since the last one raised the objective, or when
    neither the step size nor the best value changed, and the search restarts from the best
    point *with the gradient taken there*.  ``n_iters`` gradient evaluations after the one at
    the start.  Returns the best value found minus the value at ξ = 0.

    ``start = (f, egrad)`` gives the objective and its gradient at the starting point when
    the caller already has them (``hideseek.sharpness`` reuses its set-up pass at ξ = 0), so
    that the search costs ``n_iters`` gradient evaluations instead of ``n_iters + 1``.  It
    may also be a callable returning that pair: the solver then owns the gradient (it is
    overwritten, and freed once the search has moved on).

    Memory: the iterates are updated in place, so the search holds the current point, the
    previous one, the best one and (``keep_best_grad=True``) the gradient at the best point:
    at most four perturbation-sized vectors besides the objective's own.
    ``keep_best_grad=False`` keeps three: a restart from a best point older than the
    current one evaluates the gradient there again (one more gradient evaluation, counted
    in ``n_evals``, not in ``history``; the same bits on a deterministic model).

    ``callback(SolverStep)`` is called at the start and after each iteration; it sees
    Python floats only (no extra host sync).
    """
    return drive(apgd_search(geometry, rho, n_iters, f0=f0, x0=x0, alpha=alpha, rho_frac=rho_frac,
                             start=start, callback=callback, keep_best_grad=keep_best_grad), objective)


def drive(search, objective: Objective):
    """Run a search generator (:func:`apgd_search`) with ``objective``; its result."""
    try:
        x = next(search)
        while True:
            x = search.send([objective(x)])
    except StopIteration as stop:
        return stop.value


def apgd_search(geometry: SolverGeometry, rho: float, n_iters: int = 20, *, f0: float | None = None,
                x0: list[Tensor] | None = None, alpha: float = 0.75, rho_frac: float = 0.75,
                start=None, callback: Callback | None = None, keep_best_grad: bool = True):
    """:func:`apgd` as a generator: it yields each point to evaluate and is sent back a
    one-element list holding ``(f, egrad)`` there, which it empties (so that it alone holds the
    gradient, which it overwrites and frees); it returns the :class:`SolverResult`
    (``StopIteration.value``).
    Many searches can so be advanced in lockstep, their points evaluated together
    (:func:`hideseek.sharpness_zoo`)."""
    t0 = time.perf_counter()
    x = geometry.zeros() if x0 is None else geometry.ball(x0, rho)
    n_start = 1 if start is None else 0
    # the caller's gradient is never overwritten; one made by a callable ``start`` is ours
    g_owned = start is None or callable(start)
    f, g = (yield x).pop() if start is None else start() if callable(start) else start
    g = _owned(g)
    f_val = float(f)
    base = f_val if x0 is None else (float(f0) if f0 is not None else None)
    if base is None:
        base = float((yield geometry.zeros()).pop()[0])
    history = [f_val]
    # best_g is g while the best point is the current one; without keep_best_grad it is
    # dropped (None) once the search moves on
    best_val, best_x, best_g = f_val, x, g
    checkpoints = set(apgd_checkpoints(n_iters))
    eta = 2.0 * rho
    steps = [eta]
    x_prev = x
    increases, last_ckpt = 0, 0
    eta_last, best_last = eta, best_val
    n_extra = 0
    if callback is not None:
        callback(SolverStep(0, f_val, best_val, eta, n_start, time.perf_counter() - t0))
    for k in range(n_iters):
        with record_function("hideseek.geometry"):
            # x, x_prev and the direction d are allowed (horizontal) vectors, so are their
            # combinations: only the radial part of the ball projection is needed.
            # Every step writes into a buffer nobody else holds: d into g's (unless g is the
            # best point's gradient, kept for a restart), z = x + η d into d's, the momentum
            # step into x_prev's (unless x_prev is the current or the best point).
            d = geometry.direction(g, inplace=g_owned and (g is not best_g or not keep_best_grad))
            if g is best_g and not keep_best_grad:
                best_g = None
            g = None
            for xi, di in zip(x, d):
                torch.add(xi, di, alpha=eta, out=di)
            z = geometry.shrink_(d, rho)
            del d
            if k == 0:
                x_new = z
            else:
                # x + α(z − x) + (1 − α)(x − x_prev) = (2 − 2α) x + α z − (1 − α) x_prev
                free = x_prev is not x and x_prev is not best_x
                x_new = _momentum(x, z, x_prev, alpha, out=x_prev if free else None)
                del z
                x_new = geometry.shrink_(x_new, rho)
        f_new, g_new = (yield x_new).pop()
        g_new = _owned(g_new)
        fv = float(f_new)     # the one host sync per iteration the schedule needs
        history.append(fv)
        if fv > f_val:
            increases += 1
        x_prev, x, f_val, g = x, x_new, fv, g_new
        del f_new, g_new, x_new    # g's buffers are overwritten next: no other name may hold them
        g_owned = True
        if fv > best_val:
            best_val, best_x, best_g = fv, x, g
        if (k + 1) in checkpoints:
            n_steps = k + 1 - last_ckpt
            stalled = increases < rho_frac * n_steps
            unchanged = eta == eta_last and best_val == best_last
            if stalled or unchanged:
                eta /= 2.0
                if best_g is None:   # the best point's gradient was not kept: take it again
                    best_g = _owned((yield best_x).pop()[1])
                    n_extra += 1
                x, x_prev, f_val, g = best_x, best_x, best_val, best_g
            increases, last_ckpt = 0, k + 1
            eta_last, best_last = eta, best_val
        steps.append(eta)
        if callback is not None:
            callback(SolverStep(k + 1, fv, best_val, eta, n_start + k + 1 + n_extra,
                                time.perf_counter() - t0))
    return SolverResult(best_val - base, base, [t.detach() for t in best_x], history, steps,
                        n_iters + n_start + n_extra, time.perf_counter() - t0)


def random_search(value: Callable[[list[Tensor]], Tensor], geometry: SolverGeometry, rho: float, n_samples: int,
                  generator: torch.Generator, *, sphere: bool = True,
                  callback: Callback | None = None) -> SolverResult:
    """Best of ``n_samples`` random perturbations on the sphere of radius ρ (or in the ball
    when ``sphere=False``), drawn uniformly in metric-whitened coordinates."""
    t0 = time.perf_counter()
    base = float(value(geometry.zeros()))
    best, best_x, hist = -math.inf, None, []
    for _ in range(n_samples):
        d = geometry.random_direction(generator)
        r = rho if sphere else rho * float(torch.rand((), generator=generator))
        x = [r * t for t in d]
        v = float(value(x))
        hist.append(v)
        if v > best:
            best, best_x = v, x
        if callback is not None:
            callback(SolverStep(len(hist), v, best, None, len(hist) + 1, time.perf_counter() - t0))
    return SolverResult(best - base, base, best_x, hist, [], n_samples + 1, time.perf_counter() - t0)


def average_case(value: Callable[[list[Tensor]], Tensor], geometry: SolverGeometry, rho: float, n_samples: int,
                 generator: torch.Generator, *, callback: Callback | None = None) -> SolverResult:
    """Mean of ``L(γ_ξ(1)) − L(θ)`` over ξ uniform on the sphere of radius ρ
    (``callback``'s ``best`` is the running mean of the values)."""
    t0 = time.perf_counter()
    base = float(value(geometry.zeros()))
    hist = []
    for _ in range(n_samples):
        x = [rho * t for t in geometry.random_direction(generator)]
        hist.append(float(value(x)))
        if callback is not None:
            callback(SolverStep(len(hist), hist[-1], sum(hist) / len(hist), None, len(hist) + 1,
                                time.perf_counter() - t0))
    mean = sum(hist) / len(hist)
    return SolverResult(mean - base, base, [], hist, [], n_samples + 1, time.perf_counter() - t0)
