"""The sharpness problem: one model, its batches and a measure, validated, with its executor
(:mod:`hideseek.engine.backends`); the module docstring of :mod:`hideseek.problem` has the
overview."""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from torch import Tensor, nn

from ..geometry.space import ProductGeometry
from ..inputs import Loss, check_batches, check_model, unwrap_model
from ..measures import Measure
from ..solvers.apgd import SolverResult
from ..symmetries.base import SymmetryBlock
from .backends import backend_for
from .checks import check_exclude, check_weights, perturbed_names
from .engine import Prepared
from .result import BatchRecord, SharpnessResult
from .settings import Settings, resolve, seeded_generator


class SharpnessProblem:
    """One model, its batches and a measure, validated: the engine of every entry point.

    Built from the keywords of :func:`hideseek.sharpness` (refused in one line when unknown,
    :func:`resolve`) or from ready ``settings``.  Construction validates the settings, the
    model (unwrapped from ``DataParallel`` / ``DistributedDataParallel`` / ``torch.compile``),
    the parameters to perturb and the batches, and picks the executor (``backend``, from the
    process group and the model: :func:`hideseek.engine.backends.backend_for`).
    :meth:`prepare` runs the set-up pass and builds the geometry, once, into an immutable
    :class:`~hideseek.engine.engine.Prepared` that searches batches
    (:meth:`~hideseek.engine.engine.Prepared.measure_batch`) and assembles the
    :class:`SharpnessResult`; :meth:`run` does all of it through the executor.

    The steps can be driven by hand on the problem too (:meth:`set_up`, :meth:`measure_batch`,
    :meth:`record`, :meth:`result`: its prepared problem's); attributes after :meth:`set_up`:
    ``loss`` (:class:`~hideseek.inputs.Loss`), ``geometry``
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
        #: the executor (:mod:`hideseek.engine.backends`): how :meth:`run` runs the problem
        self.backend = backend_for(model, settings.distributed)
        # an executor that gathers the ranks' batches (FSDP2) lets a rank bring none
        none = self.backend.gathers_batches and isinstance(batches, (list, tuple)) and not batches
        self.data = [] if none else check_batches(batches)
        self.model = model
        #: the prepared problem once set up (:meth:`prepare`), else ``None``
        self.prepared: Prepared | None = None

    @property
    def parallel(self) -> str:
        """``"none"``, ``"data"`` or ``"sharded"``: the executor's name."""
        return self.backend.name

    # ------------------------------------------------------------------ set-up
    def prepare(self) -> Prepared:
        """The set-up pass on the first batch (loss and gradient at θ; with ``checks`` a second
        pass must give the same loss), symmetry discovery (geodesic measures) and the geometry
        at θ of the parameters that get a gradient, by the executor: the immutable
        :class:`~hideseek.engine.engine.Prepared` problem.  Runs once; later calls return it."""
        if self.prepared is None:
            self.prepared = self.backend.set_up(self)
        return self.prepared

    def set_up(self) -> "SharpnessProblem":
        """:meth:`prepare`; returns the problem (whose attributes are then the prepared one's)."""
        self.prepare()
        return self

    def drop_start(self) -> None:
        """Let go of the set-up pass's gradient early (a caller that searches no batch; not
        needed for correctness: the first batch's search consumes or drops it)."""
        if self.prepared is not None:
            self.prepared.start.drop()

    @property
    def loss(self) -> Loss | None:
        return None if self.prepared is None else self.prepared.loss

    @property
    def geometry(self) -> ProductGeometry | None:
        return None if self.prepared is None else self.prepared.geometry

    @property
    def blocks(self) -> list[SymmetryBlock]:
        return [] if self.prepared is None else self.prepared.blocks

    @property
    def perturbed(self) -> list[str]:
        return [] if self.prepared is None else self.prepared.perturbed

    @property
    def n_perturbed(self) -> int:
        return 0 if self.prepared is None else self.prepared.n_perturbed

    @property
    def device(self) -> torch.device:
        return self.prepare().device

    @property
    def trim(self) -> bool:
        return self.prepare().trim

    @property
    def keep_best_grad(self) -> bool:
        return self.prepare().keep_best_grad

    def keeps_best_grad(self, searched: int) -> bool:
        return self.prepare().keeps_best_grad(searched)

    # ------------------------------------------------------------------ per batch (the prepared problem's)
    def generator(self, i: int) -> torch.Generator:
        """Batch ``i``'s generator (:func:`seeded_generator` with this problem's seed)."""
        return seeded_generator(self.settings.seed, i)

    def random_point(self, rho: float, gen: torch.Generator) -> list[Tensor]:
        return self.prepare().random_point(rho, gen)

    def batch(self, i: int) -> tuple[Any, Any]:
        """Batch ``i`` as ``(inputs, labels)`` on the model's device."""
        return self.prepare().batch(i)

    def objective(self, x, y):
        """The loss on one batch (already on the device) as a function of the perturbation."""
        return self.prepare().objective(x, y)

    def measure_batch(self, i: int, x=None, y=None, *, index: int | None = None,
                      rho: float | None = None) -> tuple[SolverResult, list[float]]:
        """:meth:`hideseek.engine.engine.Prepared.measure_batch` of the prepared problem."""
        return self.prepare().measure_batch(i, x, y, index=index, rho=rho)

    def record(self, res: SolverResult, starts: list[float]) -> BatchRecord:
        return self.prepare().record(res, starts)

    def result(self, records: Sequence[BatchRecord], solver: Sequence[SolverResult] = (), *,
               rho: float | None = None, seconds: float = 0.0, **extra: Any) -> SharpnessResult:
        return self.prepare().result(records, solver, rho=rho, seconds=seconds, **extra)

    # ------------------------------------------------------------------ all of it
    def run(self) -> SharpnessResult:
        """Set up, measure every batch, assemble: what :func:`hideseek.sharpness` returns,
        by the executor (in a process group the ranks' batches are combined)."""
        return self.backend.run(self)
