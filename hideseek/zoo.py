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
from dataclasses import replace
from typing import Any, Iterable, Sequence

import torch
from torch import Tensor, nn
from torch.func import vmap

from .distributed import dist_rank
from .engine.engine import Prepared, Restarts, batch_loop, start_points
from .engine.problem import SharpnessProblem
from .engine.result import BatchRecord, SharpnessResult
from .engine.settings import resolve
from .inputs import SharpnessInputError, unwrap_model
from .measures import Measure
from .progress import with_progress
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


class _Lockstep:
    """The searches of one chunk (member, radius, start) and their batched evaluation."""

    def __init__(self, members: list[Prepared], keys: list[tuple[int, int, int]]):
        self.members, self.keys = members, keys
        self.loss = members[0].loss
        self.trim = members[0].trim
        names = set(members[0].geometry.point(members[0].geometry.zeros()))
        which = [m for m, _, _ in keys]
        # every parameter and buffer the perturbation does not set, stacked per search
        const = {}
        for n, _ in members[0].model.named_parameters():
            if n not in names:
                const[n] = torch.stack([dict(members[m].model.named_parameters())[n].detach() for m in which])
        for n, _ in members[0].model.named_buffers():
            const[n] = torch.stack([dict(members[m].model.named_buffers())[n] for m in which])
        self.const = const

    def evaluate(self, xs: list[list[Tensor]], x, y) -> list[tuple[Tensor, list[Tensor]]]:
        """``(L(γ_ξ(1)), ∂L/∂ξ)`` of every problem at its point ``xs[k]``, in one vmapped
        forward and backward pass."""
        leaves = [[t.detach().requires_grad_(True) for t in xi] for xi in xs]
        with torch.enable_grad():
            points = [self.members[m].geometry.point(xi) for (m, _, _), xi in zip(self.keys, leaves)]
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
        if self.trim:
            release_freed_memory()     # as hs.sharpness does after each pass
        out, k = [], 0
        for j, xi in enumerate(leaves):
            out.append((losses[j].detach(), list(grads[k:k + len(xi)])))
            k += len(xi)
        return out


def sharpness_zoo(models: Sequence[nn.Module], batches: Iterable, measure: Measure | str = Measure(), *,
                  rho: float | Sequence[float] = 0.1, chunk: int | None = None,
                  **keywords: Any) -> list[SharpnessResult] | list[list[SharpnessResult]]:
    """Worst-case sharpness of every model of a zoo of one architecture on ``batches``, equal
    to ``[hs.sharpness(m, batches, measure, rho=rho, …) for m in models]``.

    ``rho`` may be a sequence of radii: each model's entry is then a list of results, one per
    radius, in the order given.  ``chunk``: members measured together per pass (default
    :data:`DEFAULT_CHUNK`); memory grows with ``chunk × len(rho) × restarts`` (a few parameter
    copies per problem, the activations of the batch per problem).

    Every other keyword is one of :func:`hideseek.sharpness` (``hideseek.problem.KEYWORDS``:
    ``restarts``, ``progress``, the keyword form ``metric=``, ``christoffel=`` …), read by the
    same :func:`hideseek.problem.resolve`, so an unknown one is refused in one line.  The zoo
    runs the worst case from ξ = 0 without a per-iteration observer: ``kind="average"``,
    ``n_samples``, ``random_start=True`` and ``callback`` are refused, saying so.
    ``progress`` shows a bar over each chunk's batches.

    In a ``torch.distributed`` process group of two or more ranks (``distributed="auto"``),
    as :func:`hideseek.sharpness` does (the members' executor's ``reduce``,
    :meth:`hideseek.engine.backends.DataParallelBackend.reduce`, the same code):
    ``DistributedDataParallel``-wrapped or unwrapped members, their weights the same on every
    rank (checked), each rank passing its own batches — every rank returns, per member and
    radius, the result over all ranks' batches, rank 0's first, equal to one process
    measuring them all (``parallel="data"``, ``combined``, ``world_size``,
    ``batches_per_rank``); every rank must make the call.  FSDP2 (``fully_shard``) members
    are refused (their stacked pass needs whole weights): call :func:`hideseek.sharpness`
    per model.  ``distributed=False``: this rank's batches alone, not combined.

    Models whose forward ``torch.func.vmap`` cannot run (data-dependent control flow, in-place
    updates of buffers, ...) are refused with the reason.

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False), torch.nn.Linear(2, 2, bias=False)).eval()
    >>> pair = hs.FactorPair("1.weight", "0.weight", transpose_h=True)    # W₁W₀ = G Hᵀ, G = W₁, H = W₀ᵀ
    >>> batch, mse = (torch.randn(16, 3), torch.randn(16, 2)), torch.nn.functional.mse_loss
    >>> other = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False), torch.nn.Linear(2, 2, bias=False)).eval()
    >>> kw = dict(rho=0.1, n_iters=5, loss_fn=mse, pairs=[pair], progress=False)
    >>> zoo = hs.sharpness_zoo([model, other], [batch], "geodesic_invariant", **kw)
    >>> alone = [hs.sharpness(m, [batch], "geodesic_invariant", **kw).value for m in (model, other)]
    >>> all(abs(z.value - a) < 1e-5 * a for z, a in zip(zoo, alone))   # the same values as one at a time
    True
    """
    rhos, many = _rhos(rho)
    measure, settings = resolve("sharpness_zoo", measure, {"rho": rhos[0], **keywords})
    if measure.kind != "worst":
        raise ValueError("sharpness_zoo measures the worst case (Auto-PGD); for kind='average' call "
                         "hs.sharpness per model")
    for name, value in (("n_samples", settings.n_samples), ("callback", settings.callback)):
        if value is not None:
            raise ValueError(f"sharpness_zoo takes no {name} (it runs the worst case in lockstep without a "
                             "per-iteration observer); call hs.sharpness per model for it")
    if settings.random_start:
        raise ValueError("sharpness_zoo starts every first search from xi = 0; for random starts use "
                         "restarts=k (random points of the ball after the first) or hs.sharpness per model")
    for r in rhos:
        replace(settings, rho=r).check(measure)
    chunk = DEFAULT_CHUNK if chunk is None else chunk
    if isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral) or chunk < 1:
        raise ValueError(f"chunk must be an integer >= 1 (members per pass), got {chunk!r}")
    models = _check_zoo([unwrap_model(m) for m in models])
    members = [SharpnessProblem(models[0], batches, measure, settings=settings)]
    members += [SharpnessProblem(m, members[0].data, measure, settings=settings) for m in models[1:]]
    if not all(m.backend.holds_whole_weights for m in members):
        raise ValueError(f"sharpness_zoo cannot measure FSDP2 (fully_shard) models (rank {dist_rank()}): its "
                         "batched pass stacks the members' whole weights, which no rank holds; call "
                         "hs.sharpness per model on every rank, which measures FSDP2 shards")
    return LockstepBackend(members, rhos, chunk).run(many)


class LockstepBackend:
    """The zoo's executor, the protocol of :mod:`hideseek.engine.backends` over many problems
    (member × radius × start) at once: ``set_up`` prepares every member of a chunk (the same
    set-up as one call's), ``evaluate`` is the batched pass of every search's point
    (:class:`_Lockstep`), ``reduce`` is the members' own executor's (this process's batches,
    or every rank's combined: :meth:`hideseek.engine.backends.DataParallelBackend.reduce`), and
    ``run`` drives the searches through the one batch loop
    (:func:`hideseek.engine.engine.batch_loop`) and the one restart rule
    (:func:`~hideseek.engine.engine.start_points`, :class:`~hideseek.engine.engine.Restarts`)."""

    name = "lockstep"

    def __init__(self, members: list[SharpnessProblem], rhos: list[float], chunk: int) -> None:
        self.members, self.rhos, self.chunk = members, rhos, chunk
        self.inner = members[0].backend

    def set_up(self, members: Sequence[SharpnessProblem]) -> list[Prepared]:
        return [member.prepare() for member in members]

    def evaluate(self, prepared: list[Prepared], keys: list[tuple[int, int, int]]) -> "_Lockstep":
        return _Lockstep(prepared, keys)

    def reduce(self, problems, measure_local):
        return self.inner.reduce(problems, measure_local)

    def run(self, many: bool) -> list[SharpnessResult] | list[list[SharpnessResult]]:
        members, chunk, rhos = self.members, self.chunk, self.rhos
        show = members[0].settings.progress and dist_rank() == 0
        chunks: list = []       # per chunk: ([member][radius] (records, solver)), seconds per member)

        def local(offset: int) -> tuple[list[list[BatchRecord]], list[list[str]]]:
            for c0 in range(0, len(members), chunk):
                chunks.append(self.measure_chunk(members[c0:c0 + chunk], offset, show))
            slots = [recs for part, _ in chunks for per_member in part for recs, _ in per_member]
            return slots, [list(m.prepared.perturbed) for m in members]

        slots, seconds, fields = self.reduce(members, local)
        if seconds is not None:
            seconds /= len(members)
        out: list = []
        k = 0
        for c, (part, sec) in enumerate(chunks):
            for m, per_member in enumerate(part):
                member = members[c * chunk + m].prepared
                out.append([])
                for r, (_, solver) in enumerate(per_member):
                    out[-1].append(member.result(slots[k], solver, rho=rhos[r], seconds=sec if seconds is None
                                                 else seconds, **fields))
                    k += 1
        return out if many else [r[0] for r in out]

    def measure_chunk(self, members: list[SharpnessProblem], offset: int = 0, progress: bool = True
                      ) -> tuple[list[list[tuple[list[BatchRecord], list[SolverResult]]]], float]:
        """The chunk's searches on this process's batches, batch ``i`` seeded as ``offset + i``:
        per member and radius, every batch's record and its best solver result, and the seconds
        per member."""
        t0 = time.perf_counter()
        rhos = self.rhos
        prepared = self.set_up(members)
        settings = members[0].settings
        keys = [(m, r, j) for m in range(len(members)) for r in range(len(rhos)) for j in range(settings.restarts)]
        batch = self.evaluate(prepared, keys)

        def search(i: int, index: int, x, y):
            x, y = prepared[0].batch(i)
            # batch 0: the set-up pass is every radius's start at zero (shared, so not overwritten)
            first = [p.start.take(p.geometry, p.trim) if i == 0 else None for p in prepared]
            searches = []
            for m, r, j in keys:
                p = prepared[m]
                # start j is the j-th point of the restart rule (the batch's generator drawn afresh)
                for x0 in start_points(p.geometry, rhos[r], p.generator(index), j + 1):
                    pass
                # a random start's value is first taken against 0 and corrected below
                searches.append(apgd_search(p.geometry, rhos[r], settings.n_iters, x0=x0, f0=0.0 if j else None,
                                            start=first[m] if j == 0 else None, keep_best_grad=p.keep_best_grad))
                del x0
            del first
            results = _run_lockstep(searches, batch, x, y)
            best = {}
            for (m, r, j), res in zip(keys, results):
                if j == 0:
                    base = res.f0
                    best[m, r] = Restarts()
                else:   # against L(θ) of the start at zero: best − base, as hs.sharpness computes it
                    Restarts.against(res, base)
                best[m, r].add(res)
            for (m, r), rule in best.items():
                yield (m, r), prepared[m], rule.best, rule.values

        data = prepared[0].data
        out = batch_loop(data, search, offset=offset,
                         batches=lambda d: with_progress(d, f"zoo {members[0].measure.name}", progress))
        seconds = (time.perf_counter() - t0) / len(members)
        return [[out[m, r] for r in range(len(rhos))] for m in range(len(members))], seconds


def _run_lockstep(searches: list, batch: _Lockstep, x, y) -> list[SolverResult]:
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


def _evaluate_subset(batch: _Lockstep, keys: list[int], xs: list[list[Tensor]], x, y):
    """Evaluate some of the problems (searches that asked for an extra point: a restart's
    gradient with ``low_memory``)."""
    sub = _Lockstep.__new__(_Lockstep)
    sub.members, sub.loss, sub.trim = batch.members, batch.loss, batch.trim
    sub.keys = [batch.keys[k] for k in keys]
    idx = torch.tensor(keys, device=next(iter(batch.const.values())).device) if batch.const else None
    sub.const = {n: t.index_select(0, idx) for n, t in batch.const.items()}
    return sub.evaluate(xs, x, y)


def _advance(k: int, search, fg, pending: dict, results: list, first: bool = False) -> None:
    try:
        pending[k] = next(search) if first else search.send(fg)
    except StopIteration as stop:
        results[k] = stop.value
