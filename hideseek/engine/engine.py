"""The engine: :class:`SharpnessProblem`, one model, its batches and a measure, and every
step of a measurement (:mod:`hideseek.engine`; the module docstring of :mod:`hideseek.problem`
has the overview)."""
from __future__ import annotations

import functools
import time
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

from ..embedding_rows import RowsGeometry, batch_geometry, searched_elements
from ..geometry.space import ProductGeometry
from ..inputs import Loss, check_batch_losses, check_batches, check_model, to_device, unwrap_model
from ..measures import Measure
from ..precision import annotate as annotate_precision, check_fresh_lora
from ..progress import Progress
from ..solvers.apgd import SolverResult, SolverStep, apgd, average_case
from ..symmetries.base import SymmetryBlock
from ..utils import release_freed_memory
from . import settings as thresholds
from .checks import check_amp, check_exclude, check_weights, perturbed_names, symmetry_blocks, \
    warn_large_correction, warn_saturated
from .loss import BatchObjective, random_point, setup_pass, tag_batch
from .result import BatchRecord, SharpnessResult, accounting_blocks, mean_shares, norm_share
from .settings import Settings, resolve, seeded_generator

_to = to_device


class SharpnessProblem:
    """One model, its batches and a measure, validated: the engine of every entry point.

    Built from the keywords of :func:`hideseek.sharpness` (refused in one line when unknown,
    :func:`resolve`) or from ready ``settings``.  Construction validates the settings, the
    model (unwrapped from ``DataParallel`` / ``DistributedDataParallel`` / ``torch.compile``),
    the parameters to perturb and the batches; :meth:`set_up` runs the set-up pass and builds
    the geometry (once); :meth:`measure_batch` searches one batch; :meth:`record` and
    :meth:`result` assemble the :class:`SharpnessResult`; :meth:`run` does all of it.

    Attributes after :meth:`set_up`: ``loss`` (:class:`~hideseek.inputs.Loss`), ``geometry``
    (:class:`~hideseek.geometry.space.ProductGeometry`), ``blocks`` (the GL(h) pairs measured
    on), ``perturbed`` (names of the perturbed parameters), ``n_perturbed`` (their elements).

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False), torch.nn.Linear(2, 2, bias=False)).eval()
    >>> batch, mse = (torch.randn(16, 3), torch.randn(16, 2)), torch.nn.functional.mse_loss
    >>> problem = hs.SharpnessProblem(model, [batch], "m_apgd_l2", rho=0.05, n_iters=5, loss_fn=mse,
    ...                              progress=False)
    >>> direct = hs.sharpness(model, [batch], "m_apgd_l2", rho=0.05, n_iters=5, loss_fn=mse, progress=False)
    >>> problem.run().value == direct.value                          # the engine of hs.sharpness
    True
    """

    def __init__(self, model: nn.Module, batches: Iterable, measure: Measure | str = Measure(), *,
                 settings: Settings | None = None, **keywords: Any) -> None:
        if settings is None:
            measure, settings = resolve(type(self).__name__, measure, keywords)
        elif keywords:
            raise TypeError(f"{type(self).__name__}: give settings= or keywords, not both "
                            f"(got {sorted(keywords)[0]!r} besides settings)")
        else:
            measure = Measure.parse(measure)
        settings.check(measure)
        self.measure, self.settings = measure, settings
        model = unwrap_model(model)
        check_model(model, eval_mode=settings.checks)
        self.exclude = check_exclude(settings.exclude, [n for n, _ in model.named_parameters()])
        self.perturb = perturbed_names(model, self.exclude)
        check_weights(model, self.perturb)
        from ..distributed import ShardedModel, parallel_mode   # (the ranks' module builds on this one)

        #: ``"none"``, ``"data"`` or ``"sharded"``: how :meth:`run` uses a process group
        self.parallel = parallel_mode(model, settings.distributed)
        # under FSDP2 the batches are gathered: a rank may bring none (one that loads the data)
        none = self.parallel == "sharded" and isinstance(batches, (list, tuple)) and not batches
        self.data = [] if none else check_batches(batches)
        self.model = model
        #: the sharded model's local shards and collectives (FSDP2), else ``None``
        self.shards = ShardedModel(model) if self.parallel == "sharded" else None
        self.loss: Loss | None = None
        self.geometry: ProductGeometry | None = None
        self.blocks: list[SymmetryBlock] = []
        self.perturbed: list[str] = []
        self.n_perturbed = 0
        self._loss0: Tensor | None = None
        self._setup_grads: dict[str, Tensor] | None = None
        self._accounting: list[SymmetryBlock] | None | bool = False   # not yet looked up
        #: the solver's observer during :meth:`run` (the user's callback and the progress bar)
        self.observer: Callable[[SolverStep], Any] | None = None

    # ------------------------------------------------------------------ set-up
    def set_up(self) -> "SharpnessProblem":
        """The set-up pass on the first batch (loss and gradient at θ; with ``checks`` a second
        pass must give the same loss), symmetry discovery (geodesic measures) and the geometry
        at θ of the parameters that get a gradient.  Runs once; returns the problem."""
        if self.geometry is not None:
            return self
        s, model = self.settings, self.model
        device = next(model.parameters()).device
        all_params = {n: p_.detach() for n, p_ in model.named_parameters()}
        x0, y0 = _to(self.data[0][0], device), _to(self.data[0][1], device)
        self.loss = Loss(model, s.loss_fn, check_amp(model, s.autocast, self.perturb), device)
        if self.shards is None:
            self._loss0, self._setup_grads = setup_pass(self.loss, all_params, x0, y0, self.perturb, s.checks)
        else:   # FSDP2: the pass runs through the sharded model (hideseek.distributed)
            self._loss0, self._setup_grads = self.shards.setup_pass(self.loss, x0, y0, self.perturb, s.checks)
        used = set(self._setup_grads)
        self.blocks = symmetry_blocks(model, self.measure, all_params, used, s.pairs, s.on_unsupported,
                                       self.exclude)
        params = {n: all_params[n] for n in all_params if n in used}
        if self.measure.eps == 0:
            check_fresh_lora(self.blocks, all_params)     # B = 0: a singular pair, named (hideseek.precision)
        if self.shards is None:
            self.geometry = self.measure.geometry_at(params, self.blocks)
        else:   # local shards for free parameters, pairs gathered; the set-up gradient likewise
            self.geometry, self._setup_grads = self.shards.geometry(self.measure, list(params), self.blocks,
                                                                    self._setup_grads)
        self.perturbed = list(params)
        self.n_perturbed = sum(t.numel() for t in params.values())
        return self

    @property
    def device(self) -> torch.device:
        return self.loss.device

    @property
    def trim(self) -> bool:
        """Whether each pass hands freed heap memory back (CPU, models from :data:`TRIM_FROM`)."""
        return self.loss.device.type == "cpu" and self.n_perturbed >= thresholds.TRIM_FROM

    @property
    def keep_best_grad(self) -> bool:
        """Auto-PGD keeps the gradient at its best point: ``not low_memory``, where
        ``low_memory=None`` means ``True`` from :data:`LOW_MEMORY_FROM` perturbed elements."""
        return self.keeps_best_grad(self.n_perturbed)

    def keeps_best_grad(self, searched: int) -> bool:
        """:attr:`keep_best_grad` for a search holding ``searched`` elements (a batch's
        restricted search, :func:`hideseek.embedding_rows.searched_elements`)."""
        low = self.settings.low_memory
        return not (searched >= thresholds.LOW_MEMORY_FROM if low is None else low)

    def take_start(self, geometry: ProductGeometry | None = None) -> tuple[Tensor, list[Tensor]]:
        """``(L(θ), ∂L/∂ξ at ξ = 0)`` on the first batch from the set-up pass, which the
        problem then lets go of (the caller owns the gradient).  Once only.  ``geometry``:
        the first batch's (default :attr:`geometry`)."""
        grads, self._setup_grads = self._setup_grads, None
        if grads is None:
            raise RuntimeError("the set-up pass was already taken (take_start once, after set_up)")
        start = self._loss0, (geometry or self.geometry).pullback(grads)
        if self.trim:
            release_freed_memory()     # the set-up's temporaries (second pass, geometry) are freed
        return start

    def drop_start(self) -> None:
        """Let go of the set-up pass's gradient without using it."""
        self._setup_grads = None

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

    def objective(self, x, y) -> "BatchObjective":
        """The loss on one batch (already on the device) as a function of the perturbation."""
        if self.shards is not None:
            return self.shards.objective(self.loss, self.geometry, x, y)
        return BatchObjective(self.loss, self.geometry, x, y, trim=self.trim)

    def measure_batch(self, i: int, x=None, y=None, *, index: int | None = None,
                      rho: float | None = None) -> tuple[SolverResult, list[float]]:
        """Sharpness of batch ``i`` of this problem (``x, y``: that batch, when the caller
        already holds it); returns the result of the best start and the value of every start.

        Worst case: ``restarts`` searches, one after the other — the first from ξ = 0 (or from
        a random point with ``random_start``), the others from random points of the ball —
        the best kept; the first batch's first search from ξ = 0 starts from the set-up pass.
        Random draws come from :meth:`generator` of ``index`` (default ``i``: the batch's
        place among all the batches measured, which a rank of a distributed run gives)."""
        s = self.settings
        rho = s.rho if rho is None else rho
        if x is None:
            x, y = self.data[i]
        x, y = _to(x, self.device), _to(y, self.device)
        geom = self.geometry
        if self.shards is None:   # the batch's own rows of large embeddings only (hideseek.embedding_rows)
            geom = batch_geometry(geom, self.loss, i, x, y, setup_grads=self._setup_grads,
                                  from_zero=self.measure.kind == "worst" and not s.random_start and s.restarts == 1)
        f = self.objective(x, y) if geom is self.geometry else BatchObjective(self.loss, geom, x, y, trim=self.trim)
        gen = self.generator(i if index is None else index)
        user = s.callback if self.observer is None else self.observer
        cb = None if user is None else functools.partial(tag_batch, user, i if index is None else index)
        if self.measure.kind == "average":
            res = average_case(f.value, geom, rho, s.n_samples or s.n_iters, gen, callback=cb)
            return res, [res.value]
        best, values, f0 = None, [], None
        for j in range(s.restarts):
            start = self.random_point(rho, gen) if s.random_start or j > 0 else None
            # the set-up pass is the gradient at ξ = 0 on batch 0, handed over as a callable so
            # that the solver alone holds it (and frees it once it has moved on)
            first = functools.partial(self.take_start, geom) if i == 0 and j == 0 and start is None else None
            if first is None:
                self.drop_start()
            res = apgd(f.objective, geom, rho, s.n_iters, x0=start, f0=f0, callback=cb, start=first,
                       keep_best_grad=self.keeps_best_grad(searched_elements(geom, self.n_perturbed)))
            if isinstance(geom, RowsGeometry) and res.best:
                res.best = geom.expand(res.best)     # the full geometry's tangent (zero on the rows left out)
            del start
            f0 = res.f0                       # L(θ): the later starts need not evaluate it again
            values.append(res.value)
            if best is None or res.value > best.value:
                best = res                    # (the maximiser of a worse start is let go at once)
            del res
        return best, values

    # ------------------------------------------------------------------ the result
    def record(self, res: SolverResult, starts: list[float]) -> BatchRecord:
        """What batch result ``res`` (its best start; ``starts`` every start's value) adds to
        the result: plain values, the maximiser's correction ratio and norm share included."""
        ratio = share = None
        if self.blocks and self.measure.christoffel is True and res.best:
            ratio = self.geometry.correction_ratio(res.best)
        if self._accounting is False:
            # on FSDP2 shards the adaptive measure's attention accounting (which splits whole
            # weights into heads) is not made: its share is left empty
            self._accounting = None if self.shards is not None and not self.blocks else \
                accounting_blocks(self.model, self.measure, self.blocks)
        if self._accounting is not None and res.best:
            share = norm_share(self.geometry, res.best, self._accounting) or None
        return BatchRecord(value=res.value, base=res.f0, starts=list(starts), ratio=ratio, share=share)

    def result(self, records: Sequence[BatchRecord], solver: Sequence[SolverResult] = (), *,
               rho: float | None = None, seconds: float = 0.0, **extra: Any) -> SharpnessResult:
        """The :class:`SharpnessResult` from every batch's :class:`BatchRecord` (in batch
        order); ``solver``: the batches' solver results kept in the result; ``extra``:
        further fields of the result."""
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
            n_perturbed=self.geometry.dimension() if self.shards is None else self.shards.dimension(self.geometry),
            pairs=[d for b in self.blocks for d in b.describe()], correction_ratio=ratios,
            solver=list(solver), measure=measure, norm_share=mean_shares(shares),
            restart_values=[list(r.starts) for r in records],
            perturbed_params=self.perturbed, n_perturbed_params=len(self.perturbed), **extra)
        # resolution of a half-precision forward pass, an exact 0 on zero weights (hideseek.precision)
        annotate_precision(result, self.loss.resolution, self.loss.forward_dtype, self.geometry)
        return result

    # ------------------------------------------------------------------ all of it
    def run(self) -> SharpnessResult:
        """Set up, measure every batch, assemble: what :func:`hideseek.sharpness` returns.
        In a process group the ranks' batches are combined (:mod:`hideseek.distributed`)."""
        if self.parallel != "none":
            from ..distributed import run_ranks

            return run_ranks(self)
        t_start = time.perf_counter()
        self.set_up()
        records, solver = [], []
        s = self.settings
        # a bar over batches, or over Auto-PGD iterations when there is one batch (hideseek.progress)
        bar = Progress(len(self.data), (s.n_samples or s.n_iters) if self.measure.kind == "average"
                       else s.n_iters * s.restarts, self.measure.name, s.progress)
        try:
            self.observer = bar.callback(s.callback)
            for i, (x, y) in enumerate(bar.batches(self.data)):
                res, starts = self.measure_batch(i, x, y)
                check_batch_losses(i, res.f0, res.value, y)
                records.append(self.record(res, starts))
                solver.append(res)
        finally:
            self.observer = None
            bar.close()
        return self.result(records, solver, seconds=time.perf_counter() - t_start)
