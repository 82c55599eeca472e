"""Sharpness and SAM on the ranks of a ``torch.distributed`` process group (DDP and FSDP2).

:func:`hideseek.sharpness` (``distributed="auto"``, the default) looks at the process group
and the model (:func:`parallel_mode`):

* **no group, one rank, or** ``distributed=False`` — one process measures its own batches
  (``SharpnessResult.parallel == "none"``);
* **data parallel** (``"data"``) — a ``DistributedDataParallel``-wrapped model, or an
  unwrapped one, in an initialised group of two or more ranks: each rank measures *its own*
  batches with its own replica (no collective inside a search), then every rank receives
  every rank's per-batch records (one ``all_gather_object``) and returns the same result
  over all batches, rank 0's first — equal to one process measuring them all, because batch
  ``i`` of the whole is seeded by its place in that order (the seed rule,
  :func:`hideseek.problem.seeded_generator`).  The ranks' weights must agree (checked:
  DDP broadcasts rank 0's; an unwrapped model must be built the same on every rank);
* **sharded** (``"sharded"``) — an FSDP2 model (``torch.distributed.fsdp.fully_shard``: its
  parameters are ``DTensor`` shards): the ranks share the *weights*, not the batches.  The
  batches are gathered (every rank then holds all of them; a rank may bring none, ``[]``),
  and every rank takes part in every batch's passes, so the time is that of one process and
  the memory is split.  See
  :class:`ShardedModel` for what lives where.

Every rank must make the call, as with any collective.  The result says what happened:
``parallel``, ``world_size``, ``combined``, ``batches_per_rank`` and ``collectives`` (the
collectives hideseek called, by name).  The executors that run a problem in each mode are
:mod:`hideseek.engine.backends` (this module holds what they use: the group, the collectives,
the shards); docs/architecture.md ("Ranks") has the design and the collectives of each
mode; :class:`hideseek.optim.SAM` uses :func:`sharded_geometry` under FSDP2 (docs/optim.md).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor, nn

from .inputs import SharpnessInputError, check_deterministic
from .measures import Measure
from .symmetries.base import SymmetryBlock

MODES = ("auto", True, False)


# ---------------------------------------------------------------------------- the group
def group_size() -> int:
    """Ranks of the default process group (1 when torch.distributed is not initialised)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:        # torch without distributed support
        return None
    return DTensor


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are ``DTensor`` shards (FSDP2's ``fully_shard``)."""
    DTensor = _dtensor_type()
    return DTensor is not None and any(isinstance(p, DTensor) for p in model.parameters())


def parallel_mode(model: nn.Module, distributed: bool | str = "auto") -> str:
    """``"none"``, ``"data"`` or ``"sharded"``: how a call on ``model`` uses the process group
    (module docstring).  ``distributed=True`` insists on a group of two or more ranks (or a
    sharded model in any group); ``False`` measures on this rank alone (refused for sharded
    weights, which no rank holds alone)."""
    ranks = group_size()
    sharded = is_sharded(model)
    if distributed is False:
        if sharded:
            raise SharpnessInputError(
                "distributed=False, but the model's parameters are FSDP2 shards (DTensor): no rank holds the "
                "whole model. Call with distributed='auto' on every rank, or measure an unsharded copy")
        return "none"
    if sharded:
        return "sharded"
    if ranks > 1:
        return "data"
    if distributed is True:
        raise SharpnessInputError(
            "distributed=True needs torch.distributed initialised with two or more ranks "
            f"(world size now {ranks}): call torch.distributed.init_process_group first (torchrun does the "
            "environment), or leave distributed='auto'")
    return "none"


class Collectives:
    """The collectives hideseek calls, on the default group, counted by name (what
    ``SharpnessResult.collectives`` reports)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.counts: Counter = Counter()

    def all_reduce(self, t: Tensor, op: str = "sum") -> Tensor:
        """``t`` summed (``op="sum"``) or maximised (``"max"``) over the ranks, in place."""
        self.counts[f"all_reduce_{op}"] += 1
        self.dist.all_reduce(t, op=self.dist.ReduceOp.SUM if op == "sum" else self.dist.ReduceOp.MAX)
        return t

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (pickled)."""
        self.counts["all_gather_object"] += 1
        out: list[Any] = [None] * self.world
        self.dist.all_gather_object(out, obj)
        return out

    def full_tensor(self, p: Tensor) -> Tensor:
        """The whole tensor of a ``DTensor`` (an all-gather); a plain tensor as it is."""
        DTensor = _dtensor_type()
        if DTensor is not None and isinstance(p, DTensor):
            self.counts["all_gather"] += 1
            return p.full_tensor()
        return p


# ---------------------------------------------------------------------------- shards
@dataclass(frozen=True)
class ShardLayout:
    """Where a rank's shard of a parameter lies in the whole: ``torch.chunk`` of the whole
    along ``dim`` into ``world`` pieces, piece ``rank`` (FSDP2's ``Shard(dim)``; an empty
    piece past the last chunk).  ``dim=None``: the rank holds the whole tensor."""

    shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    stop: int = 0

    def local(self, full: Tensor) -> Tensor:
        """This rank's piece of ``full`` (a view)."""
        if self.dim is None:
            return full
        return full.narrow(self.dim, self.start, self.stop - self.start)


def local_tensor(p: Tensor) -> Tensor:
    """A parameter's local shard (``DTensor.to_local()``, sharing its storage) or the tensor."""
    DTensor = _dtensor_type()
    return p.to_local() if DTensor is not None and isinstance(p, DTensor) else p


def layout_of(name: str, p: Tensor) -> ShardLayout:
    """The :class:`ShardLayout` of parameter ``p``: a ``DTensor`` on a one-dimensional mesh
    with one ``Shard(dim)`` placement (what ``fully_shard`` makes), or a plain tensor."""
    DTensor = _dtensor_type()
    if DTensor is None or not isinstance(p, DTensor):
        return ShardLayout(tuple(p.shape))
    from torch.distributed.tensor import Replicate, Shard

    placements, mesh = p.placements, p.device_mesh
    if mesh.ndim != 1 or len(placements) != 1 or not isinstance(placements[0], (Shard, Replicate)):
        raise SharpnessInputError(
            f"parameter {name!r} is a DTensor placed {placements} on a {mesh.ndim}-D mesh: hideseek measures "
            "FSDP2 models sharded on a one-dimensional mesh (fully_shard(model) without a 2-D HSDP mesh)")
    if isinstance(placements[0], Replicate):
        return ShardLayout(tuple(p.shape))
    dim, world, rank = placements[0].dim, mesh.size(), mesh.get_local_rank()
    size = p.shape[dim]
    step = -(-size // world)              # torch.chunk's piece size
    start, stop = min(rank * step, size), min((rank + 1) * step, size)
    lay = ShardLayout(tuple(p.shape), dim, start, stop)
    want = list(p.shape)
    want[dim] = stop - start
    if tuple(local_tensor(p).shape) != tuple(want):
        raise SharpnessInputError(
            f"parameter {name!r}: the local shard has shape {tuple(local_tensor(p).shape)}, not the torch.chunk "
            f"piece {tuple(want)} of {tuple(p.shape)} along dim {dim}; hideseek reads FSDP2's even sharding only")
    return lay


class ShardedFree:
    """The free part (adaptive or Euclidean ball) of a :class:`ProductGeometry` on this
    rank's shards: every elementwise operation is the wrapped part's on the local tensors;
    the norms are completed across ranks — the squared ℓ2 norm's terms summed into one
    all-reduce (``all_reduce_sum``), the ℓ∞ maxima into one (``all_reduce_max``) — and a
    random draw takes this rank's piece of a draw of each whole tensor, so that the draws
    are those of one process."""

    def __init__(self, inner, layouts: Sequence[ShardLayout], comm: Collectives) -> None:
        self.inner, self.layouts, self.comm = inner, list(layouts), comm

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def _total(self, terms: list[Tensor], like: Tensor, op: str) -> list[Tensor]:
        if terms:
            local = torch.stack(terms).sum() if op == "sum" else torch.stack(terms).amax()
        else:
            local = torch.zeros((), dtype=like.dtype, device=like.device)
        return [self.comm.all_reduce(local.clone(), op)]

    def sqnorm_terms(self, x: list[Tensor]) -> list[Tensor]:
        if not self.layouts:
            return []
        return self._total(self.inner.sqnorm_terms(x), self.inner.theta[0], "sum")

    def linf_terms(self, x: list[Tensor]) -> list[Tensor]:
        if not self.layouts:
            return []
        return self._total(self.inner.linf_terms(x), self.inner.theta[0], "max")

    def draw(self, randn) -> list[Tensor]:
        lays = iter(self.layouts)

        def local_randn(t: Tensor) -> Tensor:
            lay = next(lays)
            return lay.local(randn(torch.empty(lay.shape, dtype=t.dtype, device=t.device)))

        return self.inner.draw(local_randn)


def reshard(model: nn.Module) -> None:
    """Free every FSDP2 unit's gathered weights, so that the next forward pass gathers the
    shards again: after a forward pass without a backward one (the deterministic-loss check,
    the average case) FSDP2 keeps the root's gathered weights, which would not see a point
    written into the shards."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def sharded_geometry(measure: Measure, params: Mapping[str, Tensor], blocks: Sequence[SymmetryBlock],
                     comm: Collectives, *, names: Sequence[str] | None = None,
                     local: Mapping[str, Tensor] | None = None):
    """The :class:`~hideseek.geometry.space.ProductGeometry` of ``measure`` on sharded
    parameters ``params`` (``name -> DTensor``; ``names``: those to perturb, default all):
    the GL(h) pairs of ``blocks`` on whole tensors (one all-gather each, ``all_gather``; the
    pair geometry, its Gram matrices and factorisations then replicated on every rank), every
    other parameter on this rank's shard (``local``: the tensors to use for θ, default the
    shards themselves) under :class:`ShardedFree`.  Returns the geometry and the layouts."""
    names = list(params) if names is None else list(names)
    in_pairs = {n for b in blocks for n in b.param_names}
    layouts = {n: layout_of(n, params[n]) for n in names}
    theta = {}
    for n in names:
        if n in in_pairs:
            theta[n] = comm.full_tensor(params[n].detach())
        else:
            theta[n] = local[n] if local is not None else local_tensor(params[n].detach())
    geom = measure.geometry_at(theta, blocks)
    geom.with_free_part(lambda free: ShardedFree(free, [layouts[n] for n in free.names], comm))
    return geom, layouts


def tangent_grads(grads: Mapping[str, Tensor], in_pairs: set[str], comm: Collectives) -> dict[str, Tensor]:
    """Gradients of sharded parameters as the geometry reads them: whole tensors for the
    pairs' parameters (an all-gather each), local shards for the others."""
    return {n: comm.full_tensor(g) if n in in_pairs else local_tensor(g) for n, g in grads.items()}


# ---------------------------------------------------------------------------- FSDP2 sharpness
class ShardedModel:
    """An FSDP2 model as :class:`~hideseek.problem.SharpnessProblem` measures it.

    * The forward and backward passes are the model's own (FSDP2 all-gathers each unit's
      weights and reduce-scatters its gradient): a point ``θ̃ = γ_ξ(1)`` is *written into*
      the local shards of the parameters (in place, under ``no_grad``), the loss and its
      gradient taken, and θ written back when the call ends (also on an error).  The
      parameters' own ``.grad`` is set aside during the call and put back after it.
    * Free parameters (outside GL(h) pairs): θ, ξ, Auto-PGD's vectors and the adaptive
      scale live on this rank's shard — one copy of the shard is kept as θ (the parameters
      themselves hold the point); the norms are all-reduced (:class:`ShardedFree`).
    * GL(h) pairs (attention): their parameters are gathered whole once (their pair geometry
      needs every row of a head's factors for its Gram matrices) and their part of ξ and of
      Auto-PGD's vectors is whole on every rank; the gradient of a pair parameter is
      gathered whole after each backward pass (one all-gather per pair parameter).  So the
      pairs cost what they cost on one process, on every rank; memory per rank is measured
      in ``benchmarks/bench_distributed.py``.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.comm = Collectives()
        self.params = dict(model.named_parameters())
        self.in_pairs: set[str] = set()
        self.layouts: dict[str, ShardLayout] = {}
        self.theta: dict[str, Tensor] = {}          # θ's local shards (copies), to write back
        self.names: list[str] = []
        self._grads: dict[str, Tensor | None] = {}

    # the parameters as points
    def _reshard(self) -> None:
        reshard(self.model)

    def _write(self, values: Mapping[str, Tensor]) -> None:
        """Write whole (pair) or local (free) values into the parameters' local shards."""
        self._reshard()
        with torch.no_grad():
            for n, v in values.items():
                local_tensor(self.params[n]).copy_(self.layouts[n].local(v) if n in self.in_pairs else v)

    def restore(self) -> None:
        """θ back into the parameters, and their own gradients back."""
        self._reshard()
        with torch.no_grad():
            for n, t in self.theta.items():
                local_tensor(self.params[n]).copy_(t)
        for n, p in self.params.items():
            if n in self._grads:
                p.grad = self._grads[n]
        self._grads = {}

    def _take_grads(self, names: Sequence[str]) -> dict[str, Tensor]:
        out = {}
        for n in names:
            g = self.params[n].grad
            if g is not None:
                out[n] = g
        for p in self.params.values():
            p.grad = None
        return out

    def _backward(self, loss: Tensor, scale: float) -> None:
        if scale != 1.0:
            loss = loss * scale
        loss.backward()

    # the problem's hooks
    def setup_pass(self, loss_of, x0, y0, perturb: Sequence[str], checks: bool):
        """Loss and gradient at θ on the first batch through the sharded model (the
        gradients as ``DTensor`` shards, pairs not yet gathered)."""
        self._grads = {n: p.grad for n, p in self.params.items()}
        for p in self.params.values():
            p.grad = None
        with torch.enable_grad():
            loss0 = loss_of.checked({}, x0, y0, 0)
            self._backward(loss0, loss_of.grad_scale)
        grads = self._take_grads(perturb)
        if checks:
            with torch.enable_grad():
                again = loss_of({}, x0, y0).detach()
            check_deterministic(loss0, again, y0)
        return loss0.detach(), grads

    def geometry(self, measure: Measure, names: Sequence[str], blocks: Sequence[SymmetryBlock],
                 grads: Mapping[str, Tensor]):
        """The geometry on the shards (:func:`sharded_geometry`; θ's free shards copied, since
        the parameters will hold the points) and the set-up gradient in its layout."""
        self.names = list(names)
        self.in_pairs = {n for b in blocks for n in b.param_names}
        self.theta = {n: local_tensor(self.params[n]).detach().clone() for n in self.names}
        geom, self.layouts = sharded_geometry(measure, self.params, blocks, self.comm, names=self.names,
                                              local=self.theta)
        return geom, tangent_grads(grads, self.in_pairs, self.comm)

    def objective(self, loss_of, geometry, x, y) -> "ShardedObjective":
        return ShardedObjective(self, loss_of, geometry, x, y)

    def dimension(self, geometry) -> int:
        """Elements of the whole perturbation (every rank's shards)."""
        n_pair = sum(t.numel() for t in geometry.pair_part.zeros())
        return n_pair + sum(_numel(self.layouts[n].shape) for n in geometry.free_names)


def _numel(shape: Sequence[int]) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


class ShardedObjective:
    """The loss on one batch as a function of ξ on a sharded model (:class:`ShardedModel`):
    the pairs' step ``γ_ξ(1)`` is differentiated by autograd on whole tensors (its
    vector-Jacobian product with the gathered gradient), the free parameters' step ``θ + ξ``
    passes the local gradient through unchanged."""

    def __init__(self, shards: ShardedModel, loss_of, geometry, x, y) -> None:
        self.shards, self.loss, self.geometry, self.x, self.y = shards, loss_of, geometry, x, y

    def _point(self, xi: list[Tensor], grad: bool):
        geom = self.geometry
        k = geom.n_pair_tensors
        xp = [t.detach().requires_grad_(grad) for t in xi[:k]]
        pts: dict[str, Tensor] = {}
        with torch.set_grad_enabled(grad):
            geom.pair_part.point(xp, pts)
        free = {n: self.shards.theta[n] + t for n, t in zip(geom.free_names, xi[k:])}
        self.shards._write({**{n: v.detach() for n, v in pts.items()}, **free})
        return xp, pts

    def objective(self, xi: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """``(L(γ_ξ(1)), ∂L/∂ξ)`` — what Auto-PGD calls."""
        xp, pts = self._point(xi, True)
        with torch.enable_grad():
            loss = self.loss({}, self.x, self.y)
            self.shards._backward(loss, self.loss.grad_scale)
        grads = tangent_grads(self.shards._take_grads(self.shards.names), self.shards.in_pairs, self.shards.comm)
        names = list(pts)
        gp: list = []
        if xp:
            gp = list(torch.autograd.grad([pts[n] for n in names], xp,
                                          [grads.get(n, torch.zeros_like(pts[n])) for n in names],
                                          allow_unused=True))
            gp = [torch.zeros_like(t) if g is None else g for t, g in zip(xp, gp)]
        theta = self.shards.theta
        free = [grads[n] if n in grads else torch.zeros_like(theta[n]) for n in self.geometry.free_names]
        return loss.detach(), gp + free

    def value(self, xi: list[Tensor]) -> Tensor:
        """``L(γ_ξ(1))`` without gradient — what the average case calls."""
        self._point(xi, False)
        with torch.no_grad():
            return self.loss({}, self.x, self.y)


# ---------------------------------------------------------------------------- the rank
def dist_rank() -> int:
    """This process's rank in the default group (0 when torch.distributed is not initialised)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
