"""Executors behind one protocol: how a problem's passes run and how ranks' results combine.

A :class:`Backend` owns running a :class:`~hideseek.engine.problem.SharpnessProblem`:

* ``set_up(problem)`` — the set-up pass, symmetry discovery and the geometry, written once
  here (:meth:`Backend.set_up`) around two hooks, ``setup_pass`` and ``geometry``; returns the
  immutable :class:`~hideseek.engine.engine.Prepared`;
* ``evaluate(loss, geometry, x, y, trim)`` — the loss on one batch as a function of ξ (what
  Auto-PGD calls);
* ``reduce(problems, measure_local)`` — this rank's batches measured (``measure_local(offset)``)
  and the ranks' records combined, with the result's fields (``parallel``, ``world_size`` …);
* ``run(problem)`` — all of it (:meth:`Backend.run`, written once): set up and the one batch
  loop (:meth:`~hideseek.engine.engine.Prepared.measure_batches`) inside ``reduce``, then
  the result.

The engine never asks which executor it has.  :data:`BACKENDS` holds them by the name
:func:`hideseek.distributed.parallel_mode` gives (``"none"``, ``"data"``, ``"sharded"``);
:func:`backend_for` picks one for a model.  The zoo's lockstep executor
(:class:`hideseek.zoo.LockstepBackend`) runs many problems at once through the same
``set_up``, batch loop, restart rule and ``reduce``.  docs/architecture.md ("Ranks") has the
collectives of each.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Protocol, Sequence

from torch import Tensor, nn

from ..distributed import Collectives, ShardedModel, ShardedObjective, dist_rank, parallel_mode
from ..errors import SharpnessInputError
from ..geometry.space import ProductGeometry
from ..inputs import Loss, to_device
from ..measures import Measure
from ..precision import check_fresh_lora
from ..symmetries.base import SymmetryBlock
from .checks import check_amp, symmetry_blocks
from .engine import Prepared
from .loss import BatchObjective, Start, setup_pass
from .result import accounting_blocks

#: measures this rank's batches from an offset; returns its slots (per result to assemble, the
#: records of every local batch) and the perturbed parameters' names per problem
MeasureLocal = Callable[[int], "tuple[list[list], list[list[str]]]"]


class ExecutorProtocol(Protocol):
    """What the engine needs of an executor (module docstring)."""

    name: str

    def set_up(self, problem) -> Prepared: ...

    def evaluate(self, loss: Loss, geometry: ProductGeometry, x, y, trim: bool): ...

    def reduce(self, problems: Sequence, measure_local: MeasureLocal) -> tuple[list[list], float | None,
                                                                                   dict[str, Any]]: ...

    def run(self, problem) -> Any: ...


#: the executors by name (:func:`register_backend`)
BACKENDS: dict[str, type] = {}


def register_backend(cls: type) -> type:
    """Register an executor under its ``name`` (a class decorator).  An executor that is not
    one of :func:`hideseek.distributed.parallel_mode`'s modes says when it runs a call with a
    class method ``selects(model, distributed) -> bool`` (docs/architecture.md, "Adding an
    executor")."""
    BACKENDS[cls.name] = cls
    return cls


def backend_for(model: nn.Module, distributed: bool | str = "auto") -> "Backend":
    """The executor of a call on ``model``: the last registered one whose ``selects`` takes
    the call, else the one :func:`hideseek.distributed.parallel_mode` names."""
    for cls in reversed(list(BACKENDS.values())):
        selects = getattr(cls, "selects", None)
        if selects is not None and selects(model, distributed):
            return cls(model)
    return BACKENDS[parallel_mode(model, distributed)](model)


# ---------------------------------------------------------------------------- one process
@register_backend
class Backend:
    """One process, its own batches: ``SharpnessResult.parallel == "none"`` (also the base
    of the others: the set-up and the run are written here once)."""

    name = "none"
    #: whether this rank holds whole weights (the zoo stacks them)
    holds_whole_weights = True
    #: whether the ranks' batches are gathered, so that a rank may bring none
    gathers_batches = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @property
    def rank(self) -> int:
        """The rank that shows progress bars (0: this process)."""
        return 0

    # ------------------------------------------------------------------ set up
    def batches(self, problem) -> list:
        """The batches this executor measures."""
        return problem.data

    def setup_pass(self, loss: Loss, all_params: dict[str, Tensor], x0, y0, perturb: Sequence[str],
                   checks: bool) -> tuple[Tensor, dict[str, Tensor]]:
        """Loss and gradient at θ on the first batch (:func:`hideseek.engine.loss.setup_pass`)."""
        return setup_pass(loss, all_params, x0, y0, perturb, checks)

    def geometry(self, measure: Measure, params: dict[str, Tensor], blocks: Sequence[SymmetryBlock],
                 grads: Mapping[str, Tensor]) -> tuple[ProductGeometry, Mapping[str, Tensor]]:
        """The geometry at θ of ``params`` and the set-up gradient in its layout."""
        return measure.geometry_at(params, blocks), grads

    def set_up(self, problem) -> Prepared:
        """The set-up pass on the first batch (loss and gradient at θ; with ``checks`` a second
        pass must give the same loss), symmetry discovery (geodesic measures) and the geometry
        at θ of the parameters that get a gradient: the :class:`Prepared` problem."""
        data = self.batches(problem)
        s, model, measure = problem.settings, problem.model, problem.measure
        device = next(model.parameters()).device
        all_params = {n: p_.detach() for n, p_ in model.named_parameters()}
        x0, y0 = to_device(data[0][0], device), to_device(data[0][1], device)
        loss = Loss(model, s.loss_fn, check_amp(model, s.autocast, problem.perturb), device)
        loss0, grads = self.setup_pass(loss, all_params, x0, y0, problem.perturb, s.checks)
        used = set(grads)
        blocks = symmetry_blocks(model, measure, all_params, used, s.pairs, s.on_unsupported, problem.exclude)
        params = {n: all_params[n] for n in all_params if n in used}
        if measure.eps == 0:
            check_fresh_lora(blocks, all_params)     # B = 0: a singular pair, named (hideseek.precision)
        geometry, grads = self.geometry(measure, params, blocks, grads)
        n_perturbed = sum(t.numel() for t in params.values())
        return Prepared(problem=problem, backend=self, data=data, loss=loss, geometry=geometry, blocks=blocks,
                        perturbed=list(params), n_perturbed=n_perturbed, start=Start(loss0, grads))

    # ------------------------------------------------------------------ evaluate
    def evaluate(self, loss: Loss, geometry: ProductGeometry, x, y, trim: bool = False):
        """The loss on one batch (on the device) as a function of the perturbation."""
        return BatchObjective(loss, geometry, x, y, trim=trim)

    def dimension(self, geometry: ProductGeometry) -> int:
        """Elements of the whole perturbation."""
        return geometry.dimension()

    def accounting(self, model: nn.Module, measure: Measure, blocks: Sequence[SymmetryBlock]):
        """The blocks the maximiser's norm is split by (:func:`hideseek.engine.result.accounting_blocks`)."""
        return accounting_blocks(model, measure, blocks)

    # ------------------------------------------------------------------ reduce and run
    def reduce(self, problems: Sequence, measure_local: MeasureLocal) -> tuple[list[list], float | None,
                                                                                   dict[str, Any]]:
        """This process's batches alone: the slots as measured, no seconds of its own (the
        caller's clock), no further fields."""
        slots, _ = measure_local(0)
        return slots, None, {}

    def close(self) -> None:
        """Called when a run ends, also on an error."""

    def run(self, problem) -> Any:
        """Set up, measure every batch, combine, assemble: what :func:`hideseek.sharpness`
        returns."""
        t_start = time.perf_counter()
        solver: list = []

        def measure_local(offset: int):
            prepared = problem.prepare()
            records, results = prepared.measure_batches(offset=offset, show=self.rank == 0)
            solver.extend(results)
            return [records], [list(prepared.perturbed)]

        try:
            (records,), seconds, fields = self.reduce([problem], measure_local)
        finally:
            self.close()
        seconds = time.perf_counter() - t_start if seconds is None else seconds
        return problem.prepare().result(records, solver, seconds=seconds, **fields)


# ---------------------------------------------------------------------------- data parallel
def check_same_weights(model: nn.Module, comm: Collectives) -> None:
    """The ranks hold the same weights (data parallel measures one model)."""
    sums = [(n, float(p.detach().double().sum()), float(p.detach().double().square().sum()))
            for n, p in model.named_parameters()]
    every = comm.all_gather_object(sums)
    for r, theirs in enumerate(every[1:], 1):
        for (n, a, b), (_, c, d) in zip(sums if comm.rank == 0 else every[0], theirs):
            if (a, b) != (c, d):
                raise SharpnessInputError(
                    f"rank {r} holds other weights than rank 0 (parameter {n!r} differs): data-parallel sharpness "
                    "measures one model on every rank's batches. Wrap the model in DistributedDataParallel (it "
                    "broadcasts rank 0's weights) or build it identically on every rank, or pass "
                    "distributed=False to measure each rank's own model on its own batches")


def gather_or_raise(comm: Collectives, payload, error: str | None):
    """Every rank's payload; if any rank failed, every rank raises its message (so that no
    rank waits forever in a later collective)."""
    every = comm.all_gather_object((payload, error))
    bad = [(r, e) for r, (_, e) in enumerate(every) if e is not None]
    if bad:
        r, e = bad[0]
        raise SharpnessInputError(f"rank {r}: {e}")
    return [p for p, _ in every]


@register_backend
class DataParallelBackend(Backend):
    """Each rank its own batches with its own replica (DDP-wrapped or unwrapped, two or more
    ranks): ``parallel == "data"``; the records gathered, every rank the same result."""

    name = "data"

    @property
    def rank(self) -> int:
        return dist_rank()

    def reduce(self, problems: Sequence, measure_local: MeasureLocal) -> tuple[list[list], float | None,
                                                                                   dict[str, Any]]:
        """The data-parallel run of ``problems`` — models whose weights must agree across the
        ranks, each measured on this rank's batches: ``hs.sharpness``'s one problem, or every
        member of ``hs.sharpness_zoo``.  ``measure_local(offset)`` measures this rank's
        batches, its batch ``i`` seeded as batch ``offset + i`` of the whole (the seed rule).
        Collectives: the batch counts and the weights' check (``all_gather_object``), then
        every rank's records in one ``all_gather_object`` (an error on one rank raised on
        every rank).  Returns each slot's records over every rank's batches in rank order, the
        slowest rank's seconds and the result's fields (``parallel``, ``world_size``,
        ``combined``, ``batches_per_rank``, ``collectives``)."""
        t_start = time.perf_counter()
        comm = Collectives()
        counts = comm.all_gather_object(len(problems[0].data))
        for problem in problems:
            check_same_weights(problem.model, comm)
        offset = sum(counts[:comm.rank])
        slots, names, error = [], [], None
        try:
            slots, names = measure_local(offset)
        except (SharpnessInputError, ValueError, RuntimeError) as err:
            error = " ".join(str(err).split())
            if comm.world == 1:
                raise
        every = gather_or_raise(comm, (slots, names, time.perf_counter() - t_start), error)
        names = every[0][1]
        for r, (_, theirs, _) in enumerate(every):
            for mine, other in zip(names, theirs):
                if other != mine:
                    raise SharpnessInputError(
                        f"rank {r} perturbs other parameters than rank 0 ({len(other)} vs {len(mine)}): a "
                        "parameter got no gradient on one rank's first batch; give every rank batches that use "
                        "the same parameters")
        combined = [[rec for recs, _, _ in every for rec in recs[k]] for k in range(len(every[0][0]))]
        fields = dict(parallel="data", world_size=comm.world, combined=True, batches_per_rank=counts,
                      collectives=dict(comm.counts))
        return combined, max(sec for _, _, sec in every), fields


# ---------------------------------------------------------------------------- sharded
@register_backend
class ShardedBackend(Backend):
    """An FSDP2 model (``fully_shard``): every rank every batch (gathered once), the weights
    split (:class:`hideseek.distributed.ShardedModel`): ``parallel == "sharded"``."""

    name = "sharded"
    holds_whole_weights = False
    gathers_batches = True

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        #: the sharded model's local shards and collectives
        self.shards = ShardedModel(model)
        self.counts: list[int] = []

    @property
    def rank(self) -> int:
        return self.shards.comm.rank

    def batches(self, problem) -> list:
        """Every rank's batches on every rank (CPU copies travel), rank 0's first."""
        every = self.shards.comm.all_gather_object([(to_device(x, "cpu"), to_device(y, "cpu"))
                                                    for x, y in problem.data])
        self.counts = [len(d) for d in every]
        data = [b for d in every for b in d]
        if not data:
            raise SharpnessInputError("no rank brought a batch: under FSDP2 the ranks' batches are measured "
                                      "together, and at least one rank must pass some")
        return data

    def setup_pass(self, loss, all_params, x0, y0, perturb, checks):
        """The pass runs through the sharded model (gradients as ``DTensor`` shards)."""
        return self.shards.setup_pass(loss, x0, y0, perturb, checks)

    def geometry(self, measure, params, blocks, grads):
        """Local shards for free parameters, pairs gathered; the set-up gradient likewise."""
        return self.shards.geometry(measure, list(params), blocks, grads)

    def evaluate(self, loss, geometry, x, y, trim: bool = False):
        return ShardedObjective(self.shards, loss, geometry, x, y)

    def dimension(self, geometry) -> int:
        return self.shards.dimension(geometry)

    def accounting(self, model, measure, blocks):
        # the adaptive measure's attention accounting (which splits whole weights into heads)
        # is not made on shards: its share is left empty
        return accounting_blocks(model, measure, blocks) if blocks else None

    def reduce(self, problems, measure_local):
        slots, _ = measure_local(0)
        comm = self.shards.comm
        return slots, None, dict(parallel="sharded", world_size=comm.world, combined=True,
                                 batches_per_rank=self.counts, collectives=dict(comm.counts))

    def close(self) -> None:
        """θ written back into the parameters, and their own gradients back."""
        self.shards.restore()
