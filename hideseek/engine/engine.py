"""The engine: what set-up gives (:class:`Prepared`, immutable), one batch's search with the
restart rule (:meth:`Prepared.measure_batch`, :class:`Restarts`, :func:`start_points`), the
batch loop (:func:`batch_loop`) and the result (:meth:`Prepared.result`) — each written once,
for every executor (:mod:`hideseek.engine.backends`, the zoo's lockstep in :mod:`hideseek.zoo`).

The order of a measurement is carried by ownership, not by a protocol of calls: an executor's
``set_up`` returns a :class:`Prepared` (the loss, the geometry, the blocks, the perturbed
parameters; frozen), and only a :class:`Prepared` can search a batch.  The set-up pass's
gradient, the first search's first evaluation, is a :class:`~hideseek.engine.loss.Start` the
prepared problem holds and its first batch's search consumes (or lets go of); the norm
accounting is looked up on first use and then fixed (:attr:`Prepared.accounting`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import Tensor, nn

from ..embedding_rows import RowsGeometry, batch_geometry, searched_elements
from ..geometry.space import ProductGeometry
from ..inputs import Loss, check_batch_losses, to_device
from ..measures import Measure
from ..precision import annotate as annotate_precision
from ..progress import Progress
from ..solvers.apgd import SolverResult, SolverStep, apgd, average_case
from ..symmetries.base import SymmetryBlock
from . import settings as thresholds
from .checks import warn_large_correction, warn_saturated
from .loss import Start, random_point, tag_batch
from .result import BatchRecord, SharpnessResult, mean_shares, norm_share
from .settings import Settings, seeded_generator

_to = to_device


# ---------------------------------------------------------------------------- the restart rule
def start_points(geometry: ProductGeometry, rho: float, gen: torch.Generator, restarts: int,
                 random_start: bool = False) -> Iterator[list[Tensor] | None]:
    """Where a batch's ``restarts`` searches start: the first from ξ = 0 (``None``; a random
    point of the ball with ``random_start``), every later one from the next random point of
    the batch's generator (a uniform direction times ``ρ r``, ``r`` uniform on [0, 1)).
    Drawn lazily, so that one start at a time is held."""
    for j in range(restarts):
        yield random_point(geometry, rho, gen) if random_start or j > 0 else None


class Restarts:
    """The restart rule's bookkeeping for one batch: every start's value, in order, and the
    best start (the first of equal values).  A start's value is its best loss minus ``L(θ)``
    of the first start (:meth:`against`, for starts searched before ``L(θ)`` was known)."""

    def __init__(self) -> None:
        self.best: SolverResult | None = None
        self.values: list[float] = []

    def add(self, res: SolverResult) -> None:
        self.values.append(res.value)
        if self.best is None or res.value > self.best.value:
            self.best = res                   # (the maximiser of a worse start is let go at once)

    @staticmethod
    def against(res: SolverResult, base) -> None:
        """``res`` (searched with ``f0 = 0``) measured against ``L(θ) = base``, in place."""
        res.value, res.f0 = res.value - base, base


# ---------------------------------------------------------------------------- the batch loop
def batch_loop(data: Sequence, search: Callable[[int, int, Any, Any], Iterable], *, offset: int = 0,
               batches: Callable[[Sequence], Iterable] = lambda d: d) -> dict[Any, tuple[list, list]]:
    """The one batch loop of every executor: batch ``i`` of ``data`` (batch ``offset + i`` of
    the whole, for the seed rule and the messages) goes to ``search(i, offset + i, x, y)``,
    which yields ``(key, prepared, result, starts)`` per search it ran; each result's losses
    are checked finite, and per key come back the :class:`BatchRecord` and the solver result
    of every batch, in batch order.  ``batches`` wraps ``data`` (a progress bar)."""
    out: dict[Any, tuple[list, list]] = {}
    for i, (x, y) in enumerate(batches(data)):
        for key, prepared, res, starts in search(i, offset + i, x, y):
            check_batch_losses(offset + i, res.f0, res.value, y)
            records, solver = out.setdefault(key, ([], []))
            records.append(prepared.record(res, starts))
            solver.append(res)
    return out


# ---------------------------------------------------------------------------- the prepared problem
@dataclass(frozen=True, eq=False)
class Prepared:
    """A :class:`~hideseek.engine.problem.SharpnessProblem` after its set-up, as an executor's
    ``set_up`` returns it: fixed from here on.

    ``loss`` (:class:`~hideseek.inputs.Loss`), ``geometry`` (at θ), ``blocks`` (the GL(h)
    pairs measured on), ``perturbed`` (names of the parameters that got a gradient),
    ``n_perturbed`` (their elements, this rank's), ``data`` (the batches measured: under
    FSDP2 every rank's), ``start`` (the set-up pass, consumed by the first batch's search),
    ``backend`` (the executor that evaluates points)."""

    problem: Any
    backend: Any
    data: list
    loss: Loss
    geometry: ProductGeometry
    blocks: list[SymmetryBlock]
    perturbed: list[str]
    n_perturbed: int
    start: Start

    @property
    def model(self) -> nn.Module:
        return self.problem.model

    @property
    def measure(self) -> Measure:
        return self.problem.measure

    @property
    def settings(self) -> Settings:
        return self.problem.settings

    @property
    def device(self) -> torch.device:
        return self.loss.device

    @property
    def trim(self) -> bool:
        """Whether each pass hands freed heap memory back (CPU, models from ``TRIM_FROM``)."""
        return self.loss.device.type == "cpu" and self.n_perturbed >= thresholds.TRIM_FROM

    @property
    def keep_best_grad(self) -> bool:
        """Auto-PGD keeps the gradient at its best point: ``not low_memory``, where
        ``low_memory=None`` means ``True`` from ``LOW_MEMORY_FROM`` perturbed elements."""
        return self.keeps_best_grad(self.n_perturbed)

    def keeps_best_grad(self, searched: int) -> bool:
        """:attr:`keep_best_grad` for a search holding ``searched`` elements (a batch's
        restricted search, :func:`hideseek.embedding_rows.searched_elements`)."""
        low = self.settings.low_memory
        return not (searched >= thresholds.LOW_MEMORY_FROM if low is None else low)

    @functools.cached_property
    def accounting(self) -> list[SymmetryBlock] | None:
        """The blocks the maximiser's norm is split by (``None``: no share reported), looked
        up on first use (the executor's, :func:`hideseek.engine.result.accounting_blocks`)."""
        return self.backend.accounting(self.model, self.measure, self.blocks)

    # ------------------------------------------------------------------ per batch
    def generator(self, i: int) -> torch.Generator:
        """Batch ``i``'s generator (:func:`seeded_generator` with this problem's seed)."""
        return seeded_generator(self.settings.seed, i)

    def random_point(self, rho: float, gen: torch.Generator) -> list[Tensor]:
        """A random point of the ball: a uniform direction times ``ρ r``, ``r`` uniform on [0, 1)."""
        return random_point(self.geometry, rho, gen)

    def batch(self, i: int) -> tuple[Any, Any]:
        """Batch ``i`` as ``(inputs, labels)`` on the model's device."""
        x, y = self.data[i]
        return _to(x, self.device), _to(y, self.device)

    def objective(self, x, y, geometry: ProductGeometry | None = None):
        """The loss on one batch (already on the device) as a function of the perturbation
        (the executor's evaluation; ``geometry``: the batch's, default :attr:`geometry`)."""
        return self.backend.evaluate(self.loss, self.geometry if geometry is None else geometry, x, y, self.trim)

    def measure_batch(self, i: int, x=None, y=None, *, index: int | None = None, rho: float | None = None,
                      observer: Callable[[SolverStep], Any] | None = None) -> tuple[SolverResult, list[float]]:
        """Sharpness of batch ``i`` (``x, y``: that batch, when the caller already holds it);
        returns the result of the best start and the value of every start.

        Worst case: ``restarts`` searches, one after the other (:func:`start_points`,
        :class:`Restarts`), the best kept; the first batch's first search from ξ = 0 starts
        from the set-up pass (:attr:`start`).  Random draws come from :meth:`generator` of
        ``index`` (default ``i``: the batch's place among all the batches measured, which a
        rank of a distributed run gives).  ``observer``: called with every solver step
        (default the settings' ``callback``)."""
        s = self.settings
        rho = s.rho if rho is None else rho
        index = i if index is None else index
        if x is None:
            x, y = self.data[i]
        x, y = _to(x, self.device), _to(y, self.device)
        # the batch's own rows of large embeddings only (hideseek.embedding_rows)
        geom = batch_geometry(self.geometry, self.loss, i, x, y, setup_grads=self.start.grads,
                              from_zero=self.measure.kind == "worst" and not s.random_start and s.restarts == 1)
        f = self.objective(x, y, geom)
        gen = self.generator(index)
        user = s.callback if observer is None else observer
        cb = None if user is None else functools.partial(tag_batch, user, index)
        if self.measure.kind == "average":
            res = average_case(f.value, geom, rho, s.n_samples or s.n_iters, gen, callback=cb)
            return res, [res.value]
        restarts, f0 = Restarts(), None
        for j, x0 in enumerate(start_points(self.geometry, rho, gen, s.restarts, s.random_start)):
            # the set-up pass is the gradient at ξ = 0 on batch 0, handed over as a callable so
            # that the solver alone holds it (and frees it once it has moved on)
            first = None
            if i == 0 and j == 0 and x0 is None and self.start.grads is not None:
                first = functools.partial(self.start.take, geom, self.trim)
            else:
                self.start.drop()
            res = apgd(f.objective, geom, rho, s.n_iters, x0=x0, f0=f0, callback=cb, start=first,
                       keep_best_grad=self.keeps_best_grad(searched_elements(geom, self.n_perturbed)))
            if isinstance(geom, RowsGeometry) and res.best:
                res.best = geom.expand(res.best)     # the full geometry's tangent (zero on the rows left out)
            del x0, first
            f0 = res.f0                       # L(θ): the later starts need not evaluate it again
            restarts.add(res)
            del res
        return restarts.best, restarts.values

    def measure_batches(self, *, offset: int = 0, show: bool = True) -> tuple[list[BatchRecord], list[SolverResult]]:
        """Every batch of :attr:`data` (batch ``i`` seeded as ``offset + i``) through
        :func:`batch_loop`: the records and the solver results, in batch order.  A bar over
        batches, or over Auto-PGD iterations when there is one batch (``show``: this rank
        shows it; :mod:`hideseek.progress`)."""
        s = self.settings
        bar = Progress(len(self.data), (s.n_samples or s.n_iters) if self.measure.kind == "average"
                       else s.n_iters * s.restarts, self.measure.name, s.progress and show)
        try:
            observer = bar.callback(s.callback)

            def search(i: int, index: int, x, y):
                res, starts = self.measure_batch(i, x, y, index=index, observer=observer)
                yield None, self, res, starts

            out = batch_loop(self.data, search, offset=offset, batches=bar.batches)
        finally:
            bar.close()
        return out.get(None, ([], []))

    # ------------------------------------------------------------------ the result
    def record(self, res: SolverResult, starts: list[float]) -> BatchRecord:
        """What batch result ``res`` (its best start; ``starts`` every start's value) adds to
        the result: plain values, the maximiser's correction ratio and norm share included."""
        ratio = share = None
        if self.blocks and self.measure.christoffel is True and res.best:
            ratio = self.geometry.correction_ratio(res.best)
        if self.accounting is not None and res.best:
            share = norm_share(self.geometry, res.best, self.accounting) or None
        return BatchRecord(value=res.value, base=res.f0, starts=list(starts), ratio=ratio, share=share)

    def result(self, records: Sequence[BatchRecord], solver: Sequence[SolverResult] = (), *,
               rho: float | None = None, seconds: float = 0.0, **extra: Any) -> SharpnessResult:
        """The :class:`SharpnessResult` from every batch's :class:`BatchRecord` (in batch
        order); ``solver``: the batches' solver results kept in the result; ``extra``:
        further fields of the result (an executor's: ``parallel``, ``world_size`` …)."""
        s, measure = self.settings, self.measure
        rho = s.rho if rho is None else rho
        ratios = [r.ratio for r in records if r.ratio is not None]
        shares = [r.share for r in records if r.share]
        warn_large_correction(ratios, rho)
        warn_saturated([r.value for r in records], [r.base for r in records], rho)
        amp_dtype = self.loss.amp_dtype
        config = dict(measure=measure.geometry, metric=measure.metric, rho=rho, n_iters=s.n_iters,
                      norm=measure.norm, christoffel=measure.christoffel, eps=measure.eps, seed=s.seed,
                      p=measure.p, kind=measure.kind, n_samples=s.n_samples,
                      random_start=s.random_start, restarts=s.restarts,
                      n_batches=len(records),
                      autocast=None if amp_dtype is None else str(amp_dtype).removeprefix("torch."))
        values = [r.value for r in records]
        result = SharpnessResult(
            value=sum(values) / len(values), per_batch=values, base_losses=[r.base for r in records],
            name=measure.name, config=config, seconds=seconds,
            n_perturbed=self.backend.dimension(self.geometry),
            pairs=[d for b in self.blocks for d in b.describe()], correction_ratio=ratios,
            solver=list(solver), measure=measure, norm_share=mean_shares(shares),
            restart_values=[list(r.starts) for r in records],
            perturbed_params=self.perturbed, n_perturbed_params=len(self.perturbed), **extra)
        # resolution of a half-precision forward pass, an exact 0 on zero weights (hideseek.precision)
        annotate_precision(result, self.loss.resolution, self.loss.forward_dtype, self.geometry)
        return result
