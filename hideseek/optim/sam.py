"""SAM, ASAM and geodesic SAM: one optimizer, the ascent step taken in a measure's own ball.

One step at θ with gradient ``g = ∇L(θ)`` (docs/optim.md writes every rule out)::

    ξ  = ρ · d(θ, g)          d: the measure's unit steepest-ascent direction at θ
    θ̃  = γ_ξ(1)               the measure's step (straight, or second-order geodesic)
    θ ← base_optimizer step from θ with the gradient ∇L(θ̃)

=====================================  ===============================  ======================
``measure``                            ``d(θ, g)``                      ``γ_ξ(1)``
=====================================  ===============================  ======================
``Measure(geometry="euclidean")``      ``g / ‖g‖`` (SAM)                ``θ + ξ``
``Measure(geometry="adaptive")``       ``|θ|²⊙g / ‖|θ|⊙g‖`` (ASAM)      ``θ + ξ``
``Measure()`` / ``metric="mixed"``     horizontal Riemannian gradient   ``θ + ξ + ½γ̈(0)``
                                       on the GL(h) pairs, ASAM's on    on the pairs
                                       the rest, normalised together
=====================================  ===============================  ======================

The geometry depends on θ (``|θ|``, the Gram matrices ``GᵀG``, ``HᵀH`` of every pair and
their factorisations): it is rebuilt from the current weights at every :meth:`SAM.first_step`
— a few small ``h × h`` factorisations per head, measured in ``benchmarks/bench_sam.py``.
Symmetry discovery (which weights form pairs) happens once, in the constructor.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from ..distributed import Collectives, is_sharded, local_tensor, reshard, sharded_geometry, tangent_grads
from ..measures import Measure
from ..symmetries.base import SymmetryBlock
from ..symmetries.discover import find_symmetries


def _unwrap(model: nn.Module) -> nn.Module:
    """The module inside ``DistributedDataParallel`` / ``DataParallel`` (same parameters)."""
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    while isinstance(model, wrappers):
        model = model.module
    return model


def _gradient_tangent(geometry, grads: dict[str, Tensor]) -> list[Tensor]:
    """The gradient with respect to ξ at ξ = 0 (:meth:`ProductGeometry.pullback`).  Without
    pairs that is the gradient itself; with pairs, the step's second-order term has zero
    derivative at ξ = 0, so the pullback through the straight step (cheaper to
    differentiate) is the same vector."""
    if not geometry.blocks:
        return [grads[n] for n in geometry.free_names]
    part = geometry.pair_part
    step, part.christoffel = part.christoffel, False
    try:
        return geometry.pullback(grads)
    finally:
        part.christoffel = step


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation with the ascent step in ``measure``'s ball.

    Parameters
    ----------
    model:
        The model being trained (a ``DistributedDataParallel`` wrapper is looked through);
        its parameter names find the symmetry pairs.
    base_optimizer:
        A ``torch.optim.Optimizer`` over (some of) the model's parameters, or an optimizer
        class, then built on the model's parameters that require gradients with
        ``**base_kwargs`` (the canonical ``SAM(params, torch.optim.SGD, lr=…)`` shape).
        ``param_groups`` are the base optimizer's own list, so an LR scheduler attached to
        either drives the base optimizer.
    measure:
        The ball: ``Measure(geometry="euclidean")`` (SAM), ``Measure(geometry="adaptive")``
        (ASAM, ``p="linf"`` for its ℓ∞ box), ``Measure()`` / ``Measure(metric="mixed")``
        (geodesic SAM; ``eps``, ``step`` as in :class:`~hideseek.measures.Measure`).  Worst
        case only.  Default: geodesic, invariant metric.
    rho:
        Radius of the ascent step in the measure's own norm (attribute ``rho``, may be
        changed between steps).  The norms differ, so do good radii: docs/optim.md.
    pairs:
        The symmetry blocks to use (geodesic only), e.g. another SAM's ``blocks`` or
        ``hs.find_symmetries(model) + [hs.DiagonalPair(…)]``; ``None``: discovered once here.
    on_unsupported:
        ``"raise"`` or ``"adaptive"``, as in :func:`hideseek.find_symmetries`.

    Notes
    -----
    Parameters that do not require gradients, are not in the base optimizer, or have no
    ``.grad`` at :meth:`first_step` are neither perturbed nor counted in the norm; a pair
    with such a parameter is dropped for that step (its other weights join the free part).

    Examples
    --------
    >>> sam = hs.optim.SAM(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
    ...                    hs.Measure(metric="mixed"), rho=0.02)              # doctest: +SKIP
    >>> loss_fn(model(x), y).backward()                                        # doctest: +SKIP
    >>> sam.first_step(zero_grad=True)          # to θ̃ = γ_ξ(1)                 # doctest: +SKIP
    >>> loss_fn(model(x), y).backward()                                        # doctest: +SKIP
    >>> sam.second_step(zero_grad=True)         # back to θ, base step with ∇L(θ̃) # doctest: +SKIP
    >>> import copy, torch, hideseek as hs
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Linear(3, 2)
    >>> x, y = torch.randn(8, 3), torch.randn(8, 2)
    >>> loss = lambda m: torch.nn.functional.mse_loss(m(x), y)
    >>> ref = copy.deepcopy(model)                                    # SAM's update by hand, on a copy:
    >>> g = torch.autograd.grad(loss(ref), list(ref.parameters()))
    >>> norm = torch.sqrt(sum((t ** 2).sum() for t in g))
    >>> with torch.no_grad():                                        # θ̃ = θ + ρ g / ‖g‖
    ...     for p, t in zip(ref.parameters(), g):
    ...         _ = p.add_(0.05 * t / norm)
    >>> g_tilde = torch.autograd.grad(loss(ref), list(ref.parameters()))
    >>> expected = [p.detach() - 0.1 * t for p, t in zip(model.parameters(), g_tilde)]   # θ − lr ∇L(θ̃)
    >>> sam = hs.optim.SAM(model, torch.optim.SGD(model.parameters(), lr=0.1),
    ...                    hs.Measure(geometry="euclidean"), rho=0.05)
    >>> loss(model).backward()
    >>> sam.first_step(zero_grad=True)
    >>> loss(model).backward()
    >>> sam.second_step(zero_grad=True)
    >>> all(torch.allclose(p, e, atol=1e-6) for p, e in zip(model.parameters(), expected))
    True
    """

    def __init__(self, model: nn.Module, base_optimizer: torch.optim.Optimizer | type, measure: Measure | str = Measure(),
                 *, rho: float = 0.05, pairs: Sequence[SymmetryBlock] | None = None,
                 on_unsupported: str = "raise", **base_kwargs: Any) -> None:
        measure = Measure.parse(measure)
        if measure.kind != "worst":
            raise ValueError(f"SAM takes one worst-case ascent step; the measure {measure.name!r} is an average "
                             "case: use kind='worst'")
        if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not rho >= 0:
            raise ValueError(f"rho must be a number >= 0, got {rho!r}")
        module = _unwrap(model)
        if isinstance(base_optimizer, type):
            base_optimizer = base_optimizer([p for p in module.parameters() if p.requires_grad], **base_kwargs)
        elif base_kwargs:
            raise ValueError(f"keyword arguments {sorted(base_kwargs)} are for building the base optimizer from its "
                             "class; base_optimizer is already an instance")
        if not isinstance(base_optimizer, torch.optim.Optimizer):
            raise TypeError(f"base_optimizer must be a torch.optim.Optimizer or its class, got "
                            f"{type(base_optimizer).__name__}")
        self.base_optimizer, self.measure, self.rho = base_optimizer, measure, float(rho)
        trained = {id(p) for g in base_optimizer.param_groups for p in g["params"]}
        self._named = [(n, p) for n, p in module.named_parameters() if id(p) in trained and p.requires_grad]
        if not self._named:
            raise ValueError("the base optimizer holds none of the model's trainable parameters")
        super().__init__([p for _, p in self._named], dict(rho=self.rho))
        self.param_groups = base_optimizer.param_groups
        self.defaults = {**base_optimizer.defaults, "rho": self.rho}
        self.blocks: list[SymmetryBlock] = []
        if measure.geometry == "geodesic":
            params = {n: p.detach() for n, p in module.named_parameters()}
            self.blocks = list(find_symmetries(module, on_unsupported=on_unsupported)) if pairs is None \
                else [blk.bind(params) for blk in pairs]
            names = {n for n, _ in self._named}
            self.blocks = [b for b in self.blocks if all(n in names for n in b.param_names)]
            if not self.blocks:
                raise ValueError("geodesic SAM found no GL(h) pair among the trained parameters (no attention "
                                 "hideseek recognises, or it is frozen); declare pairs=[...] or use "
                                 "Measure(geometry='adaptive') (ASAM)")
        self._backup: tuple = ()          # (perturbed parameters, their values at θ)
        self._module = module
        self._comm: Collectives | None = None     # FSDP2: the collectives of the sharded ascent
        #: the last first_step met a non-finite gradient and did not move (see first_step)
        self.ascent_skipped = False

    # ------------------------------------------------------------------ steps
    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        """Move the weights to ``θ̃ = γ_ξ(1)``, ``ξ = ρ·d(θ, g)`` with ``g`` the current ``.grad``.

        The direction is normalised, so gradients scaled by a ``GradScaler`` give the same
        step (no unscaling needed).  A non-finite gradient (float16 overflow) gives no ascent
        and keeps the gradients (``zero_grad`` is then ignored): the second backward adds to
        them, they stay non-finite, and ``second_step(scaler=…)`` skips the step as the scaler
        does; ``ascent_skipped`` tells it happened.
        """
        if self._backup:
            raise RuntimeError("first_step called twice: call second_step (or restore) first")
        named = [(n, p) for n, p in self._named if p.grad is not None]
        sharded = is_sharded(self._module)
        if not named and sharded:
            raise RuntimeError(
                "no trained parameter has a gradient: under FSDP2 the first pass must reduce-scatter its "
                "gradient, so call loss.backward() without set_requires_gradient_sync(False) before first_step "
                "(no rank holds a whole gradient to ascend along alone; docs/optim.md)")
        if not named:
            raise RuntimeError("no trained parameter has a gradient: call loss.backward() before first_step")
        if sharded and self._comm is None:
            self._comm = Collectives()
        grads = [local_tensor(p.grad) for _, p in named]
        norms = torch._foreach_norm(grads)
        bad = (~torch.isfinite(torch.stack([n.float() for n in norms]))).any().to(torch.float32)
        if sharded:      # every rank skips when any shard's gradient is not finite
            self._comm.all_reduce(bad.reshape(1), "max")
        self.ascent_skipped = bool(bad)
        if self.ascent_skipped:
            return
        blocks = [b for b in self.blocks if all(n in dict(named) for n in b.param_names)]
        if self.measure.geometry == "geodesic" and not blocks:
            raise RuntimeError("geodesic SAM: no symmetry pair has gradients in this step (frozen or unused "
                               "attention weights?)")
        if sharded:
            # FSDP2: free parameters on this rank's shards (norms all-reduced), pairs gathered
            # whole (hideseek.distributed.sharded_geometry); the gradient is the reduce-scattered
            # one, so the ascent is that of the gradient over every rank's batch
            geometry, layouts = sharded_geometry(self.measure, dict(named), blocks, self._comm)
            in_pairs = {n for b in blocks for n in b.param_names}
            egrad = _gradient_tangent(geometry, tangent_grads({n: p.grad.to(p.dtype) for n, p in named},
                                                               in_pairs, self._comm))
        else:
            params = {n: p.detach() for n, p in named}
            geometry = self.measure.geometry_at(params, blocks)
            layouts, in_pairs = {}, set()
            egrad = _gradient_tangent(geometry, {n: p.grad.to(p.dtype) for n, p in named})
        xi = geometry.direction(egrad)
        torch._foreach_mul_(xi, self.rho)
        perturbed = geometry.point(xi)
        if sharded:
            reshard(self._module)     # the next forward pass gathers the shards written here
        moved = [local_tensor(p) for n, p in named if n in perturbed]
        self._backup = (moved, torch._foreach_mul(moved, 1.0))          # exact copies, one fused call
        torch._foreach_copy_(moved, [layouts[n].local(perturbed[n]) if n in in_pairs else perturbed[n]
                                     for n, _ in named if n in perturbed])
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def restore(self) -> None:
        """Put the weights back to θ (the gradients, taken at θ̃, stay)."""
        if self._backup and self._comm is not None:
            reshard(self._module)
        if self._backup:
            torch._foreach_copy_(*self._backup)
        self._backup = ()

    def second_step(self, zero_grad: bool = False, scaler: "torch.amp.GradScaler | None" = None) -> None:
        """Back to θ, then the base optimizer's step with the gradient now in ``.grad``
        (taken at θ̃): ``scaler.step(base_optimizer)`` when a ``GradScaler`` is given (it
        unscales, and skips the step on inf/NaN; call ``scaler.update()`` after)."""
        self.restore()
        if scaler is None:
            self.base_optimizer.step()
        else:
            scaler.step(self.base_optimizer)
        if zero_grad:
            self.zero_grad()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The whole SAM step; ``closure`` re-evaluates the loss and calls ``backward`` (the
        gradient at θ must already be in ``.grad``, as in the canonical implementation)."""
        if closure is None:
            raise ValueError("SAM.step needs a closure that does the second forward and backward pass; "
                             "or call first_step / second_step yourself")
        self.first_step(zero_grad=True)
        with torch.enable_grad():
            loss = closure()
        self.second_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the trained parameters, directly: a wrapper's ``zero_grad``
        may skip it (accelerate's does while accumulating), which would mix the two passes."""
        for _, p in self._named:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The base optimizer's state plus ``"sam"``: ``rho`` and the measure."""
        return {**self.base_optimizer.state_dict(), "sam": dict(rho=self.rho, measure=self.measure.to_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        sam = state_dict.pop("sam", None)
        if sam is not None:
            saved = Measure.from_dict(sam["measure"])
            if saved != self.measure:
                raise ValueError(f"the state was saved by SAM with measure {saved.label!r}; this SAM uses "
                                 f"{self.measure.label!r}: build it with the saved measure")
            self.rho = float(sam["rho"])
        self.base_optimizer.load_state_dict(state_dict)
        self.param_groups = self.base_optimizer.param_groups   # loading replaced the list

    def __repr__(self) -> str:
        return (f"SAM({self.measure.label}, rho={self.rho:g}, pairs={len(self.blocks)}, "
                f"base={type(self.base_optimizer).__name__})")


_NORM_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


@contextlib.contextmanager
def frozen_norm_stats(model: nn.Module) -> Iterator[None]:
    """Leave the running statistics of norm layers (BatchNorm, InstanceNorm with
    ``track_running_stats``) as they were before the block: wrap SAM's second forward in it
    so each step updates them once, from the pass at θ (what the canonical implementation's
    ``disable_running_stats`` does by setting momentum to 0; here the buffers are restored
    exactly, which also covers ``momentum=None``).  LayerNorm and RMSNorm have no statistics.

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> bn = torch.nn.BatchNorm1d(3)                                  # training mode: passes update the statistics
    >>> with hs.optim.frozen_norm_stats(bn):
    ...     _ = bn(torch.randn(8, 3) + 5)
    >>> bn.running_mean.abs().max().item()                            # restored exactly
    0.0
    >>> _ = bn(torch.randn(8, 3) + 5)
    >>> bool(bn.running_mean.min() > 0.1)                             # outside the block they move
    True
    """
    saved = [(buf, buf.clone()) for m in model.modules()
             if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
             for buf in (getattr(m, k) for k in _NORM_BUFFERS) if isinstance(buf, Tensor)]
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, old in saved:
                buf.copy_(old)
