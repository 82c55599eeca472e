"""Sharpness of a zoo of models of one architecture in one batched pass (issue 17).

:func:`sharpness_zoo` measures every member (and every radius, every Auto-PGD start) as
:func:`hideseek.sharpness` would, one search per *problem* (member, radius, start), but
advances all searches in lockstep (:func:`hideseek.solvers.apgd_search`) and evaluates their
points together: the members' parameters are stacked and the loss of every problem is one
``torch.func.vmap`` of ``functional_call`` over the stack, one forward and one backward pass
per iteration for the whole chunk.  Each problem keeps its own geometry and Auto-PGD state
(step size, checkpoints, best point); the geometry runs per problem (in Python, as in
separate calls), only the model's passes are batched.

Values equal separate :func:`hideseek.sharpness` calls up to the rounding of batched
kernels (tests: float64 1e-10 relative, float32 1e-5).
"""
from __future__ import annotations

import numbers
import time
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor, nn
from torch.func import vmap

from .measures import Measure
from .inputs import check_batch_losses, check_model, unwrap_model
from .sharpness import (SharpnessInputError, SharpnessResult, _assemble, _check_batches, _check_exclude,
                        _check_low_memory, _check_restarts, _check_settings, _check_weights, _is_int,
                        _perturbed, _random_point, _set_up, _setup_start, _to)
from .solvers.apgd import SolverResult, apgd_search
from .utils import release_freed_memory

#: members per pass when ``chunk`` is not given
DEFAULT_CHUNK = 8


def _check_zoo(models: Sequence[nn.Module]) -> list[nn.Module]:
    models = list(models)
    if not models:
        raise SharpnessInputError("models is empty: pass a list of models of one architecture")
    ref = [(n, tuple(p.shape), p.dtype) for n, p in models[0].named_parameters()]
    for k, m in enumerate(models[1:], 1):
        if type(m) is not type(models[0]) or [(n, tuple(p.shape), p.dtype) for n, p in m.named_parameters()] != ref:
            raise SharpnessInputError(
                f"model {k} ({type(m).__name__}) differs from model 0 ({type(models[0]).__name__}) in its "
                "class or its parameters' names, shapes or dtypes: sharpness_zoo needs one architecture; "
                "measure different architectures with separate hs.sharpness calls")
    return models


def _rhos(rho) -> tuple[list[float], bool]:
    """The radii as a list, and whether a sequence was given."""
    many = not isinstance(rho, numbers.Real)
    rhos = list(rho) if many else [rho]
    if not rhos:
        raise ValueError("rho is an empty sequence: give a radius or a non-empty list of radii")
    return rhos, many


class _Problems:
    """The problems of one chunk (member, radius, start) and their batched evaluation."""

    def __init__(self, models: list[nn.Module], setups: list, problems: list[tuple[int, int, int]]):
        self.setups, self.problems = setups, problems
        self.loss = setups[0].loss
        names = set(setups[0].geometry.point(setups[0].geometry.zeros()))
        members = [m for m, _, _ in problems]
        # every parameter and buffer the perturbation does not set, stacked per problem
        const = {}
        for n, _ in models[0].named_parameters():
            if n not in names:
                const[n] = torch.stack([dict(models[m].named_parameters())[n].detach() for m in members])
        for n, _ in models[0].named_buffers():
            const[n] = torch.stack([dict(models[m].named_buffers())[n] for m in members])
        self.const = const
        self.model = models[0]

    def evaluate(self, xs: list[list[Tensor]], x, y) -> list[tuple[Tensor, list[Tensor]]]:
        """``(L(γ_ξ(1)), ∂L/∂ξ)`` of every problem at its point ``xs[k]``, in one vmapped
        forward and backward pass."""
        leaves = [[t.detach().requires_grad_(True) for t in xi] for xi in xs]
        with torch.enable_grad():
            points = [self.setups[m].geometry.point(xi) for (m, _, _), xi in zip(self.problems, leaves)]
            stacked = {n: torch.stack([p[n] for p in points]) for n in points[0]}
            del points
            stacked.update(self.const)
            loss = self.loss

            def one(params):
                return loss(params, x, y)

            # nn.MultiheadAttention's inference fast path does not see through vmap that a
            # gradient is wanted, and has no derivative: off while the zoo's pass runs
            fast = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)
            try:
                losses = vmap(one)(stacked)
            except Exception as e:   # noqa: BLE001 — any failure of vmap is a refusal
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                raise SharpnessInputError(
                    f"sharpness_zoo cannot batch this model with torch.func.vmap ({type(e).__name__}: "
                    f"{first[:200]}); measure its members with separate hs.sharpness calls") from e
            finally:
                torch.backends.mha.set_fastpath_enabled(fast)
            del stacked
            flat = [t for xi in leaves for t in xi]
            grads = torch.autograd.grad(losses.sum() * loss.grad_scale, flat)
        if self.setups[0].trim:
            release_freed_memory()     # as hs.sharpness does after each pass
        out, k = [], 0
        for j, xi in enumerate(leaves):
            out.append((losses[j].detach(), list(grads[k:k + len(xi)])))
            k += len(xi)
        return out


def sharpness_zoo(models: Sequence[nn.Module], batches: Iterable, measure: Measure | str = Measure(), *,
                  rho: float | Sequence[float] = 0.1, n_iters: int = 20, seed: int = 0, restarts: int = 1,
                  chunk: int | None = None, loss_fn: Callable | None = None, pairs=None,
                  on_unsupported: str = "raise", exclude: Sequence[str] = (), autocast=None,
                  checks: bool = True, low_memory: bool | None = None, **measure_keywords: Any) -> list[SharpnessResult] | list[list[SharpnessResult]]:
    """Worst-case sharpness of every model of a zoo of one architecture on ``batches``, equal
    to ``[hs.sharpness(m, batches, measure, rho=rho, …) for m in models]``.

    ``rho`` may be a sequence of radii: each model's entry is then a list of results, one per
    radius, in the order given.  ``restarts`` as in :func:`hideseek.sharpness`.  ``chunk``:
    members measured together per pass (default :data:`DEFAULT_CHUNK`); memory grows with
    ``chunk × len(rho) × restarts`` (a few parameter copies per problem, the activations of
    the batch per problem).  Other arguments as in :func:`hideseek.sharpness` (the keyword
    form ``metric=``, ``christoffel=`` … included); the worst case only, no callback.

    Models whose forward ``torch.func.vmap`` cannot run (data-dependent control flow, in-place
    updates of buffers, ...) are refused with the reason.
    """
    measure = Measure.from_keywords(measure, **measure_keywords)
    if measure.kind != "worst":
        raise ValueError("sharpness_zoo measures the worst case (Auto-PGD); for kind='average' call "
                         "hs.sharpness per model")
    rhos, many = _rhos(rho)
    for r in rhos:
        _check_settings(measure, r, n_iters, None, seed)
    _check_restarts(restarts)
    _check_low_memory(low_memory)
    chunk = DEFAULT_CHUNK if chunk is None else chunk
    if not _is_int(chunk) or chunk < 1:
        raise ValueError(f"chunk must be an integer >= 1 (members per pass), got {chunk!r}")
    models = _check_zoo([unwrap_model(m) for m in models])
    exclude = _check_exclude(exclude, [n for n, _ in models[0].named_parameters()])
    for m in models:
        check_model(m, eval_mode=checks)
        _check_weights(m, _perturbed(m, exclude))
    data = _check_batches(batches)
    out: list = []
    for c0 in range(0, len(models), chunk):
        out += _chunk(models[c0:c0 + chunk], data, measure, rhos, n_iters=n_iters, seed=seed,
                      restarts=restarts, low_memory=low_memory,
                      set_up=dict(loss_fn=loss_fn, autocast=autocast, pairs=pairs,
                                  on_unsupported=on_unsupported, exclude=exclude, checks=checks))
    return out if many else [r[0] for r in out]


def _chunk(models: list[nn.Module], data: list, measure: Measure, rhos: list[float], *, n_iters: int,
           seed: int, restarts: int, low_memory: bool | None, set_up: dict) -> list[list[SharpnessResult]]:
    t0 = time.perf_counter()
    setups = [_set_up(m, data, measure, **set_up) for m in models]
    problems = [(m, r, j) for m in range(len(models)) for r in range(len(rhos)) for j in range(restarts)]
    batch = _Problems(models, setups, problems)
    device = setups[0].loss.device
    # per (member, radius): the best solver result and every start's value, per batch
    best: dict[tuple[int, int], list[SolverResult]] = {(m, r): [] for m in range(len(models))
                                                       for r in range(len(rhos))}
    values: dict[tuple[int, int], list[list[float]]] = {k: [] for k in best}
    for i, (x, y) in enumerate(data):
        x, y = _to(x, device), _to(y, device)
        # batch 0: the set-up pass is every radius's start at zero (shared, so not overwritten)
        first = [_setup_start(s) if i == 0 else None for s in setups]
        searches = []
        for m, r, j in problems:
            geom = setups[m].geometry
            gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + i)
            x0 = None
            for _ in range(j):    # start j is the j-th draw of the batch's generator
                x0 = _random_point(geom, rhos[r], gen)
            # a random start's value is first taken against 0 and corrected below
            searches.append(apgd_search(geom, rhos[r], n_iters, x0=x0, f0=0.0 if j else None,
                                        start=first[m] if j == 0 else None,
                                        keep_best_grad=not setups[m].low_memory(low_memory)))
            del x0
        del first
        results = _run_lockstep(searches, batch, x, y)
        for (m, r, j), res in zip(problems, results):
            if j == 0:
                base = res.f0
                values[m, r].append([])
                best[m, r].append(res)
            else:   # against L(θ) of the start at zero: best − base, as hs.sharpness computes it
                res.value, res.f0 = res.value - base, base
                if res.value > best[m, r][-1].value:
                    best[m, r][-1] = res
            values[m, r][-1].append(res.value)
        for res in (best[k][-1] for k in best):
            check_batch_losses(i, res.f0, res.value, y)
    seconds = (time.perf_counter() - t0) / len(models)
    config = dict(n_samples=None, random_start=False, restarts=restarts)
    return [[_assemble(models[m], measure, setups[m], best[m, r], values[m, r], rho=rhos[r], n_iters=n_iters,
                       seed=seed, config=config, seconds=seconds) for r in range(len(rhos))]
            for m in range(len(models))]


def _run_lockstep(searches: list, batch: _Problems, x, y) -> list[SolverResult]:
    """Advance every search to its next point, evaluate the points together, send the values
    back; until all have finished."""
    results: list[SolverResult | None] = [None] * len(searches)
    pending: dict[int, list[Tensor]] = {}
    for k, s in enumerate(searches):
        _advance(k, s, None, pending, results, first=True)
    while pending:
        keys = sorted(pending)
        evals = batch.evaluate([pending[k] for k in keys], x, y) if len(keys) == len(searches) else \
            _evaluate_subset(batch, keys, [pending[k] for k in keys], x, y)
        pending.clear()
        for n, k in enumerate(keys):
            box = [evals[n]]
            evals[n] = None    # the search alone holds its gradient (it overwrites and frees it)
            _advance(k, searches[k], box, pending, results)
    return results  # type: ignore[return-value]


def _evaluate_subset(batch: _Problems, keys: list[int], xs: list[list[Tensor]], x, y):
    """Evaluate some of the problems (searches that asked for an extra point: a restart's
    gradient with ``low_memory``)."""
    sub = _Problems.__new__(_Problems)
    sub.setups, sub.loss, sub.model = batch.setups, batch.loss, batch.model
    sub.problems = [batch.problems[k] for k in keys]
    idx = torch.tensor(keys, device=next(iter(batch.const.values())).device) if batch.const else None
    sub.const = {n: t.index_select(0, idx) for n, t in batch.const.items()}
    return sub.evaluate(xs, x, y)


def _advance(k: int, search, fg, pending: dict, results: list, first: bool = False) -> None:
    try:
        pending[k] = next(search) if first else search.send(fg)
    except StopIteration as stop:
        results[k] = stop.value
