"""Choosing the radius ρ: what a given ρ means for each measure, and a rule to suggest one.

What ρ means (``d`` the number of perturbed scalars, ``θ`` the weights):

=========================  ================================================================
measure                    the ball ``‖ξ‖ ≤ ρ``
=========================  ================================================================
adaptive ℓ2 (``m_apgd_l2``)  ``‖ξ ⊘ |θ|‖₂ ≤ ρ``: relative changes, summed in squares over all
                           ``d`` weights — a root-mean-square relative change of ``ρ/√d``
                           per weight.  Scale-free; grows with model size as ``√d``.
adaptive ℓ∞                ``|ξᵢ| ≤ ρ|θᵢ|``: every weight moves by at most the fraction ρ.
geodesic, invariant        on each pair ``(G, H)`` ``tr(S_G⁻¹ξ_Gᵀξ_G) + tr(S_H⁻¹ξ_Hᵀξ_H)``
                           (``S`` the Gram matrices): the relative change of the pair in its
                           own scale — scale-free like adaptive ℓ2, summed over pairs and the
                           adaptive ℓ2 part of every other weight.
geodesic, mixed            ``tr(S_H ξ_Gᵀξ_G) + tr(S_G ξ_Hᵀξ_H)``: not scale-free — a relative
                           change ``a`` of a pair costs about ``a·‖G‖‖H‖``, so the same ρ is a
                           smaller relative change on larger weights.  ρ is not comparable
                           with the other measures.
=========================  ================================================================

:func:`suggest_rho` picks ρ by one of two stated rules, by bisection on ``log ρ``:

``"loss"`` (default)
    the ρ at which the measure's value (the worst-case loss increase, Auto-PGD with
    ``n_iters`` steps) on the batches equals ``increase × L(θ)`` (default ``increase=0.1``:
    the worst case in the ball raises the loss by a tenth).  Works for every measure and
    puts measures on a common footing: each at the radius where it sees the same loss rise.
``"correction"``
    (geodesic measures with second-order steps) the largest ρ at which the second-order
    correction ratio ``‖½Γ(ξ,ξ)‖/‖ξ‖`` at the maximiser stays below ``bound`` (default
    :data:`hideseek.sharpness.CORRECTION_BOUND`, the level above which ``sharpness`` warns).

Both assume the quantity grows with ρ (nested balls); the bracket is widened by factors of
10 from ``start`` until it holds the target, then halved ``steps`` times.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable

from torch import nn

from .inputs import SharpnessInputError, check_batches
from .measures import Measure
from .progress import evaluation_bar
from .sharpness import CORRECTION_BOUND, sharpness

__all__ = ["RhoSuggestion", "suggest_rho"]


@dataclass
class RhoSuggestion:
    """``rho`` the suggested radius; ``rule`` and ``target`` what it satisfies; ``achieved``
    the quantity at ``rho``; ``trace`` every ``(rho, quantity)`` evaluated, in order.

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False), torch.nn.Linear(2, 2, bias=False)).eval()
    >>> batch, mse = (torch.randn(16, 3), torch.randn(16, 2)), torch.nn.functional.mse_loss
    >>> s = hs.suggest_rho(model, [batch], "m_apgd_l2", loss_fn=mse, progress=False)
    >>> s.rule, s.measure
    ('loss', 'm_apgd_l2')
    >>> (s.rho, s.achieved) in s.trace                                # every evaluation is in the trace
    True
    """

    rho: float
    rule: str
    target: float
    achieved: float
    measure: str
    trace: list[tuple[float, float]] = field(default_factory=list)


def suggest_rho(model: nn.Module, batches: Iterable, measure: Measure | str = Measure(), *,
                rule: str = "loss", increase: float = 0.1, bound: float = CORRECTION_BOUND,
                n_iters: int = 5, start: float = 0.1, steps: int = 8, seed: int = 0,
                max_rho: float = 1e4, progress: bool = True, **kw: Any) -> RhoSuggestion:
    """A radius for ``measure`` on ``model`` and ``batches`` by ``rule`` (module docstring):
    ``"loss"`` — the ρ whose sharpness is ``increase × L(θ)``; ``"correction"`` — the largest
    ρ whose second-order correction ratio stays below ``bound``.  ``kw`` go to
    :func:`hideseek.sharpness` (``loss_fn``, ``pairs``, ``exclude``, …).  One or a few batches
    suffice; each evaluation is one :func:`~hideseek.sharpness` call with ``n_iters`` steps.
    ``progress``: a bar counting the evaluations, with the last ρ and quantity (tqdm;
    ``progress=False`` for none).

    Examples
    --------
    >>> hs.suggest_rho(model, [batch], "geodesic_mixed").rho               # doctest: +SKIP
    >>> import torch, hideseek as hs
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False), torch.nn.Linear(2, 2, bias=False)).eval()
    >>> pair = hs.FactorPair("1.weight", "0.weight", transpose_h=True)    # W₁W₀ = G Hᵀ, G = W₁, H = W₀ᵀ
    >>> batch, mse = (torch.randn(16, 3), torch.randn(16, 2)), torch.nn.functional.mse_loss
    >>> s = hs.suggest_rho(model, [batch], "geodesic_invariant", loss_fn=mse, pairs=[pair], progress=False)
    >>> loss = mse(model(batch[0]), batch[1]).item()
    >>> abs(s.target - 0.1 * loss) < 1e-6                            # rule "loss": sharpness = 0.1 × L(θ)
    True
    >>> abs(s.achieved - s.target) < 0.05 * s.target                 # reached at the suggested radius
    True
    """
    if rule not in ("loss", "correction"):
        raise ValueError(f"rule must be 'loss' or 'correction', got {rule!r}")
    if not (isinstance(increase, (int, float)) and increase > 0 and math.isfinite(increase)):
        raise ValueError(f"increase must be a positive number (a fraction of the loss at θ), got {increase!r}")
    if not (isinstance(bound, (int, float)) and bound > 0):
        raise ValueError(f"bound must be a positive number, got {bound!r}")
    measure = Measure.from_keywords(measure)
    if rule == "correction" and (measure.geometry != "geodesic" or measure.christoffel is not True):
        raise ValueError(f"rule='correction' needs a geodesic measure with second-order steps, got "
                         f"{measure.name}; use rule='loss'")
    data = check_batches(batches)
    trace: list[tuple[float, float]] = []
    bar = evaluation_bar(f"suggest_rho ({rule}, {measure.name})", progress)

    def quantity(rho: float) -> float:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # large corrections / saturation: expected here
            res = sharpness(model, data, measure, rho=rho, n_iters=n_iters, seed=seed, progress=False, **kw)
        q = res.value if rule == "loss" else max(res.correction_ratio, default=0.0)
        quantity.base = sum(res.base_losses) / len(res.base_losses)
        trace.append((rho, q))
        bar.update(1)
        bar.set_postfix(rho=f"{rho:.3g}", quantity=f"{q:.3g}")
        return q

    try:
        return _search(quantity, trace, rule, increase, bound, start, steps, max_rho, measure)
    finally:
        bar.close()


def _search(quantity, trace, rule, increase, bound, start, steps, max_rho, measure) -> RhoSuggestion:
    """The bracket and the bisection of :func:`suggest_rho` (module docstring)."""
    lo = hi = float(start)
    q = quantity(lo)
    target = increase * quantity.base if rule == "loss" else float(bound)
    if not target > 0:
        raise SharpnessInputError(f"the loss at θ is {quantity.base:.3g}: rule='loss' needs a positive loss "
                                  "(its target is a fraction of it); use rule='correction' or choose rho by hand")
    if q < target:
        while q < target:
            lo, hi = hi, hi * 10
            if hi > max_rho:
                raise SharpnessInputError(
                    f"no rho up to {max_rho:g} reaches the target ({rule}: {target:.3g}; at rho={lo:g} it is "
                    f"{q:.3g}): the measure barely moves the loss on these batches")
            q = quantity(hi)
    else:
        while q >= target:
            hi, lo = lo, lo / 10
            if lo < 1e-12:
                raise SharpnessInputError(f"even rho={lo * 10:g} exceeds the target ({rule}: {target:.3g})")
            q = quantity(lo)
    for _ in range(steps):           # invariant: quantity(lo) < target <= quantity(hi)
        mid = math.sqrt(lo * hi)
        if quantity(mid) < target:
            lo = mid
        else:
            hi = mid
    rho = lo if rule == "correction" else math.sqrt(lo * hi)
    achieved = dict(trace).get(rho)
    if achieved is None:
        achieved = quantity(rho)
    return RhoSuggestion(rho=rho, rule=rule, target=target, achieved=achieved, measure=measure.name, trace=trace)
