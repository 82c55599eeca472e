"""Sharpness measures: adaptive (Andriushchenko et al. 2023) and geodesic (this paper).

Worst-case sharpness of one batch (paper Eq. 4, docs/maths.md §7.1)::

    S(θ) = max over allowed ξ with ‖ξ‖_θ ≤ ρ of  L(γ_ξ(1)) − L(θ)

computed with Auto-PGD per batch and averaged over batches.  What defines a measure (the
geometry of the ball, metric, norm, step, ε, ℓ2/ℓ∞, worst/average case) is a
:class:`~hideseek.measures.Measure`:

=====================  ==================================  ==========================
measure                ball / norm                         step ``γ_ξ(1)``
=====================  ==================================  ==========================
``adaptive`` (l2/l∞)   ``‖ξ ⊘ |θ|‖_p``, every parameter    ``θ + ξ``
``geodesic``           invariant or mixed metric on the    second-order geodesic
                       GL(h) pairs (horizontal ξ),         (``step="second_order"``)
                       adaptive ℓ2 elsewhere
=====================  ==================================  ==========================

Ablations (paper Appendix G): ``ball="adaptive"`` (Christoffel-only: adaptive sharpness's
elementwise ball, no horizontal restriction, second-order geodesic step of the metric),
``step="straight"`` (no-Christoffel: Riemannian ball, straight step), ``eps`` (Appendix H.2).
:func:`sharpness` is one :class:`~hideseek.problem.SharpnessProblem` run: validation, the
set-up pass (gradient at θ, the deterministic-loss check, symmetry discovery, the geometry),
one search per batch and the result are written there once, for every entry point.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from .inputs import SharpnessInputError
from .measures import Measure
from .problem import (CORRECTION_BOUND, LOW_MEMORY_FROM, SATURATION, TRIM_FROM, SharpnessProblem,
                      SharpnessResult, norm_share)
from .solvers.apgd import SolverStep
from .symmetries.base import SymmetryBlock

__all__ = ["CORRECTION_BOUND", "LOW_MEMORY_FROM", "SATURATION", "TRIM_FROM", "SharpnessInputError",
           "SharpnessResult", "norm_share", "sharpness"]


def sharpness(model: nn.Module, batches: Iterable, measure: Measure | str = Measure(), *,
              rho: float = 0.1, n_iters: int = 20, seed: int = 0, loss_fn: Callable | None = None,
              pairs: Sequence[SymmetryBlock] | None = None, n_samples: int | None = None,
              random_start: bool = False, on_unsupported: str = "raise", exclude: Sequence[str] = (),
              autocast: str | torch.dtype | None = None, progress: bool = True, checks: bool = True,
              callback: Callable[[SolverStep], Any] | None = None, low_memory: bool | None = None,
              restarts: int = 1, distributed: bool | str = "auto",
              metric: str | None = None, norm: str | None = None, christoffel: bool | str | None = None,
              eps: float | None = None, p: str | None = None, kind: str | None = None) -> SharpnessResult:
    """Worst-case (Auto-PGD) or average-case sharpness of ``model`` on ``batches``.

    Parameters
    ----------
    model:
        In eval mode, finite weights.  **What is perturbed**: the parameters that require
        gradients (and get one), minus ``exclude``; frozen ones stay fixed (a LoRA fine-tune:
        the adapters); ``SharpnessResult.perturbed_params`` lists them.  They must be
        float32/float64 (perturbed half-precision weights are refused: load in float32 and
        use ``autocast=``); frozen half-precision weights are fine.  ``nn.DataParallel``,
        ``DistributedDataParallel`` and ``torch.compile`` wrappers are unwrapped (the wrapped
        module is measured eagerly).  Output: a tensor, an object with ``.logits``, or one
        with ``.loss``.
    batches:
        Iterable (list, ``DataLoader``) of ``(inputs, labels)``; ``inputs`` a tensor (passed
        positionally) or a dict (passed as keyword arguments).  A batch may also be a dict
        holding ``"labels"`` (Hugging Face convention; the other entries are the inputs).
        One pair or one such dict on its own is one batch.  Sharpness is computed per batch
        and averaged.
    measure:
        A :class:`~hideseek.measures.Measure`, or its name (``"geodesic_mixed"``,
        ``"m_apgd_linf"``, ``"avg_l2"``, ``"geodesic_invariant_no_christoffel"`` …) or an
        alias (``"geodesic"``, ``"adaptive"``).  Default ``Measure()``: geodesic sharpness,
        invariant metric.
    rho:
        Radius of the ball; what it means per measure, and :func:`hideseek.suggest_rho` to
        choose one: :mod:`hideseek.rho`.
    n_iters:
        Auto-PGD iterations (gradient evaluations) per batch; the number of draws of the
        average case when ``n_samples`` is not given.
    seed:
        Seeds random starts and average-case draws; the result is deterministic given it.
    loss_fn:
        ``loss_fn(output, labels) -> scalar``.  Default: the model's own ``.loss`` when it
        returns one, else the mean cross-entropy of the logits.  A model whose ``forward``
        takes ``labels`` (Hugging Face) always gets them, so ``lambda out, y: out.loss``
        works too.  (Hugging Face computes causal-LM losses on logits cast to float32, even
        in a float64 model: pass ``loss_fn`` for float64 precision.)
    pairs:
        Extra user-declared symmetry blocks (:class:`~hideseek.symmetries.DiagonalPair`,
        :class:`~hideseek.symmetries.FactorPair`, names full or a unique ending), added to
        the pairs found (attention, and one GL(r) pair per peft LoRA adapter); a declared
        pair replaces a found one on the same parameters.
    n_samples:
        Draws per batch of the average case.
    random_start:
        Start Auto-PGD from a random point of the ball instead of ξ = 0.
    on_unsupported:
        ``"raise"`` or ``"adaptive"``: what to do with attention whose symmetry is unknown.
    exclude:
        Parameter names or dotted prefixes to leave unperturbed besides the frozen ones (a
        single string is one prefix); each must match some parameter, and none may leave a
        symmetry pair perturbed in part (refused, naming the pair).
    autocast:
        ``None`` (full precision), ``"bfloat16"`` or ``"float16"``: run the model's forward
        and backward passes under ``torch.autocast`` in that dtype.  The geometry (metric,
        projection, geodesic step) always stays in the parameters' dtype.  With ``"float16"``
        the loss is scaled by 2¹⁰ before the backward pass so small gradients do not flush to
        zero (only the gradient's direction is used).  Sharpness is a difference of two
        losses, so low precision costs accuracy: ``reports/benchmarks.md`` gives the measured
        agreement with full precision.  Whatever the model computes in, the loss is taken in
        float32 or wider, and with a half-precision forward pass (``autocast`` or half-precision
        frozen weights) ``SharpnessResult.resolution`` says what a difference of two losses
        can resolve; a value below it is flagged (:mod:`hideseek.precision`).
    progress:
        A progress bar over batches when ``tqdm`` is installed (the ``[progress]`` extra), or
        over Auto-PGD iterations when there is one batch (shown after
        :data:`hideseek.progress.DELAY` seconds); ``progress=False`` for none.  Without tqdm
        there is silently none.
    checks:
        Check eval mode, finite weights and a deterministic loss before starting.
    callback:
        Observer called once per solver iteration with a
        :class:`~hideseek.solvers.SolverStep` (``batch``, ``iteration``, ``value``,
        ``best``, ``step_size``, ``seconds``); iteration 0 is the search's start.
    restarts:
        Auto-PGD searches per batch (worst case): the first from ξ = 0 (or from a random
        point with ``random_start``), the other ``restarts − 1`` from random points of the
        ball (uniform direction, radius ``ρ r`` with ``r`` uniform), drawn from the batch's
        seeded generator; the best is kept and every start's value is in
        :attr:`SharpnessResult.restart_values`.  The starts run one after the other (cost:
        ``restarts`` searches).  ``restarts=1`` is the single search.
    low_memory:
        ``True``: Auto-PGD keeps three perturbation-sized vectors instead of four (current,
        previous and best point, not the gradient at the best point): a restart from a best
        point older than the current one takes the gradient there again, one more forward
        and backward pass, at most one per step-size checkpoint (7 at 20 iterations, see
        :func:`~hideseek.solvers.apgd.apgd_checkpoints`).  ``False``: the gradient is kept.
        ``None`` (default): ``True`` when the search holds at least :data:`LOW_MEMORY_FROM`
        (2**24) elements (the perturbed ones less the embedding rows a batch does not
        touch, :mod:`hideseek.embedding_rows`), where memory limits, ``False`` below, where the extra
        passes would cost time for nothing.  Every value is the same either way.  See
        ``reports/benchmarks.md`` for the memory of a call.
    distributed:
        ``"auto"`` (default), ``True`` or ``False``: in an initialised ``torch.distributed``
        process group of two or more ranks (``"auto"``), or insisting on one (``True``), the
        ranks are combined — each rank passes its own batches and every rank returns the
        result over all of them, rank 0's first, equal to one process measuring them all: a
        ``DistributedDataParallel``-wrapped or unwrapped model (its weights the same on every
        rank, checked) is searched per rank on its own batches; an FSDP2 model
        (``fully_shard``) is measured on its shards, every rank taking part in every batch.
        ``False``: this rank's batches alone (refused for FSDP2 shards).  The result's
        ``parallel``, ``world_size``, ``combined``, ``batches_per_rank`` and ``collectives``
        say what happened; :mod:`hideseek.distributed`.  Every rank must make the call.
    metric, norm, christoffel, eps, p, kind:
        Keyword form, a convenience: each one given (not ``None``) replaces that field of
        ``measure`` (see :meth:`Measure.from_keywords`): ``metric`` ``"invariant"`` (paper
        Eq. 9) or ``"mixed"`` (Eq. 10); ``norm`` → ``ball`` (``"riemannian"`` /
        ``"adaptive"``); ``christoffel`` → ``step`` (``True`` second order, ``False``
        straight, ``"exact"`` closed-form GL(1)); ``eps`` the ε relaxation ``S ↦ S + εI``;
        ``p`` ``"l2"`` / ``"linf"`` (adaptive only); ``kind`` ``"worst"`` / ``"average"``.

    Examples
    --------
    >>> hs.sharpness(model, batches, hs.Measure(metric="mixed"), rho=0.1)        # doctest: +SKIP
    >>> hs.sharpness(model, batches, "m_apgd_linf", rho=0.002)                     # doctest: +SKIP
    >>> hs.sharpness(model, batches, measure="geodesic", metric="mixed", christoffel=False,
    ...              rho=0.1)                                                      # doctest: +SKIP
    >>> import torch, hideseek as hs
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False), torch.nn.Linear(2, 2, bias=False)).eval()
    >>> pair = hs.FactorPair("1.weight", "0.weight", transpose_h=True)    # W₁W₀ = G Hᵀ, G = W₁, H = W₀ᵀ
    >>> batch, mse = (torch.randn(16, 3), torch.randn(16, 2)), torch.nn.functional.mse_loss
    >>> kw = dict(rho=0.1, n_iters=5, loss_fn=mse, pairs=[pair], progress=False)
    >>> before = hs.sharpness(model, [batch], "geodesic_invariant", **kw).value
    >>> A = torch.tensor([[2.0, 1.0], [0.0, 0.5]])                  # a group element of GL(2), by hand
    >>> with torch.no_grad():
    ...     _ = model[0].weight.copy_(A @ model[0].weight)                 # W₀ ↦ A W₀
    ...     _ = model[1].weight.copy_(model[1].weight @ torch.linalg.inv(A))  # W₁ ↦ W₁ A⁻¹: same function
    >>> after = hs.sharpness(model, [batch], "geodesic_invariant", **kw).value
    >>> abs(after - before) < 1e-5 * before                          # geodesic sharpness: invariant
    True
    """
    return SharpnessProblem(model, batches, measure, rho=rho, n_iters=n_iters, seed=seed, loss_fn=loss_fn,
                            pairs=pairs, n_samples=n_samples, random_start=random_start,
                            on_unsupported=on_unsupported, exclude=exclude, autocast=autocast,
                            progress=progress, checks=checks, callback=callback, low_memory=low_memory,
                            restarts=restarts, distributed=distributed, metric=metric, norm=norm, christoffel=christoffel, eps=eps,
                            p=p, kind=kind).run()
