"""The loss as the engine evaluates it: the set-up pass at θ and the loss on one batch as a
function of the perturbation ξ (:mod:`hideseek.engine`)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
from torch import Tensor
from torch.profiler import record_function

from ..geometry.space import ProductGeometry
from ..inputs import Loss, check_deterministic
from ..solvers.apgd import SolverStep
from ..utils import release_freed_memory


def setup_pass(loss: Loss, all_params: dict[str, Tensor], x0, y0, perturb: Sequence[str],
               checks: bool) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss and gradient at θ on the first batch.  The parameters that get a gradient are
    the ones that take part (an unused text tower does not); the gradient is also Auto-PGD's
    start on the first batch (ξ = 0).  With ``checks``, a second identical pass must give
    the same loss (a deterministic model)."""
    leaves = {n: all_params[n].detach().requires_grad_(True) for n in perturb}
    with torch.enable_grad():
        loss0 = loss.checked(leaves, x0, y0, 0)
        grads = torch.autograd.grad(loss0 * loss.grad_scale, list(leaves.values()), allow_unused=True)
    setup_grads = {n: g for n, g in zip(leaves, grads) if g is not None}
    del grads
    if checks:
        with torch.enable_grad():   # same kernels as the first pass (no inference fast path)
            again = loss(leaves, x0, y0).detach()
        check_deterministic(loss0, again, y0)
    return loss0.detach(), setup_grads


class BatchObjective:
    """The loss on one batch as a function of the perturbation ξ (a tangent list)."""

    def __init__(self, loss: Loss, geometry: ProductGeometry, x, y, trim: bool = False) -> None:
        self.loss, self.geometry, self.x, self.y, self.trim = loss, geometry, x, y, trim

    def objective(self, xi: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """``(L(γ_ξ(1)), ∂L/∂ξ)`` — what Auto-PGD calls."""
        xi = [t.detach().requires_grad_(True) for t in xi]
        with torch.enable_grad():
            with record_function("hideseek.step"):
                params = self.geometry.point(xi)
            with record_function("hideseek.forward"):
                loss = self.loss(params, self.x, self.y)
            # only the graph holds the perturbed weights now: the backward pass frees each
            # layer's as it goes, so they and the gradient are not both held in full
            del params
            with record_function("hideseek.backward"):
                g = torch.autograd.grad(loss * self.loss.grad_scale, xi)
        if self.trim:
            # the perturbed weights and the pass's temporaries are freed: give back the heap
            # memory they leave, so that resident memory tracks what the search holds
            release_freed_memory()
        return loss.detach(), list(g)

    def value(self, xi: list[Tensor]) -> Tensor:
        """``L(γ_ξ(1))`` without gradient — what the average case calls."""
        with torch.no_grad():
            return self.loss(self.geometry.point(xi), self.x, self.y)


def tag_batch(callback: Callable[[SolverStep], Any], batch: int, step: SolverStep) -> None:
    callback(replace(step, batch=batch))


def random_point(geom: ProductGeometry, rho: float, gen: torch.Generator) -> list[Tensor]:
    """A random point of the ball: a uniform direction times ``ρ r``, ``r`` uniform on [0, 1)."""
    r = float(torch.rand((), generator=gen))
    return [rho * r * t for t in geom.random_direction(gen)]


class Start:
    """The set-up pass's ``L(θ)`` and gradient on the first batch: the first evaluation of a
    search from ξ = 0 there, handed over once (:meth:`take`; the search then alone holds the
    gradient and frees it when it moves on).  Held by the prepared problem
    (:class:`hideseek.engine.engine.Prepared`), consumed by the first batch's search: no
    caller has to remember to take or drop it."""

    def __init__(self, loss0: Tensor, grads: dict[str, Tensor]) -> None:
        self.loss0, self._grads = loss0, grads

    @property
    def grads(self) -> dict[str, Tensor] | None:
        """The set-up gradient by parameter name, or ``None`` once taken or dropped."""
        return self._grads

    def take(self, geometry: ProductGeometry, trim: bool = False) -> tuple[Tensor, list[Tensor]]:
        """``(L(θ), ∂L/∂ξ at ξ = 0)`` in ``geometry``'s layout (the first batch's); the start
        lets go of the gradient (``trim``: then hands freed heap memory back)."""
        grads, self._grads = self._grads, None
        if grads is None:
            raise RuntimeError("the set-up pass's gradient was already handed to a search")
        start = self.loss0, geometry.pullback(grads)
        if trim:
            release_freed_memory()     # the set-up's temporaries (second pass, geometry) are freed
        return start

    def drop(self) -> None:
        """Let go of the gradient unused (a search that starts elsewhere)."""
        self._grads = None
