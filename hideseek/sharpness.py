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

:func:`sharpness` reads in three parts: :func:`_set_up` (the set-up gradient pass, the
deterministic-loss check, symmetry discovery, the geometry), then :func:`_measure_batch` per
batch, then the result.
"""
from __future__ import annotations

import functools
import math
import numbers
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call  # noqa: F401 (the loss's functional call, now in .inputs; kept as a name)
from torch.profiler import record_function

from .embedding_rows import RowsGeometry, batch_geometry, searched_elements
from .geometry.space import ProductGeometry
from .inputs import Loss, SharpnessInputError, check_batch_losses, check_batches as _check_batches, \
    check_finite_loss, check_model, \
    to_device as _to, unwrap_model
from .measures import Measure
from .progress import Progress
from .precision import annotate as annotate_precision, check_fresh_lora
from .solvers.apgd import SolverResult, SolverStep, apgd, average_case
from .symmetries.base import SymmetryBlock
from .symmetries.discover import find_symmetries
from .utils import release_freed_memory


@dataclass
class SharpnessResult:
    """Sharpness of a model on a set of batches.

    ``value`` is the mean of ``per_batch``; ``base_losses`` the loss at θ per batch;
    ``measure`` what was measured (``name`` is ``measure.name``, ``config`` the settings as
    a plain dict, as before).
    """

    value: float
    per_batch: list[float]
    base_losses: list[float]
    name: str
    config: dict[str, Any]
    seconds: float
    n_perturbed: int = 0
    pairs: list[dict] = field(default_factory=list)
    #: largest ‖½γ̈(0)‖/‖ξ‖ over pairs at the maximiser of each batch (second-order steps only)
    correction_ratio: list[float] = field(default_factory=list)
    solver: list[SolverResult] = field(default_factory=list, repr=False)
    measure: Measure = field(default_factory=Measure)
    #: where the worst case lives: the share of the maximiser's squared norm (in the
    #: measure's own norm) per kind of pair — ``"qk"``, ``"vo"``, ``"qk_rotary"``, user labels
    #: — and ``"free"`` (every other parameter), summing to 1, averaged over the batches with
    #: a non-zero maximiser.  Empty for the average case and the ℓ∞ ball.
    norm_share: dict[str, float] = field(default_factory=dict)
    #: names of the parameter tensors perturbed (by default those that require gradients and
    #: get one, minus ``exclude``; frozen ones stay fixed) and their number
    perturbed_params: list[str] = field(default_factory=list)
    n_perturbed_params: int = 0
    #: the value of every Auto-PGD start per batch (``restarts=``): the first from ξ = 0 (or
    #: the random start), then the random ones; ``per_batch`` is each batch's maximum.  One
    #: entry per batch (the value) for the average case and ``restarts=1``.
    restart_values: list[list[float]] = field(default_factory=list)
    #: a half-precision forward pass (half-precision weights, frozen ones included, or
    #: ``autocast``): what a difference of two losses cannot resolve (computed on batch 0,
    #: :func:`hideseek.precision.loss_resolution`), and whether ``|value|`` is below it (then
    #: a warning says so); ``None`` / ``False`` in full precision
    resolution: float | None = None
    below_resolution: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("solver")
        return d


# ---------------------------------------------------------------------------- checks
_HALF = (torch.float16, torch.bfloat16)


def _check_weights(model: nn.Module, perturbed: Sequence[str]) -> None:
    """Always checked (``checks=False`` does not skip it): the parameters to perturb are in
    full precision.  Perturbing half-precision *weights* gives silently wrong numbers —
    sharpness is a small difference of two nearby losses, and a bfloat16 perturbation rounds
    it to exactly 0 — so they are refused; frozen half-precision weights (a LoRA base) are
    fine, and ``autocast=`` runs the passes in half precision."""
    params = dict(model.named_parameters())
    half = [n for n in perturbed if params[n].dtype in _HALF]
    if half:
        dtypes = "/".join(sorted({str(params[n].dtype).removeprefix("torch.") for n in half}))
        raise SharpnessInputError(
            f"{len(half)} of the parameters to perturb are {dtypes} (e.g. {half[0]!r}): sharpness is a small "
            "difference of two losses and a perturbation in half precision rounds it away (bfloat16 gives "
            "exactly 0). Load the model in float32 (from_pretrained(..., dtype=torch.float32) or "
            "model.float(); on the command line --dtype float32) and pass autocast='bfloat16' (or "
            "'float16') to run the passes in half precision, or freeze those parameters "
            "(requires_grad_(False)) to measure the others (a LoRA fine-tune on a half-precision base)")


def _autocast_dtype(autocast) -> torch.dtype | None:
    if autocast is None or autocast is False:
        return None
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, torch.bfloat16: torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
             torch.float16: torch.float16}
    if autocast not in table:
        raise ValueError(f"autocast must be None, 'bfloat16' or 'float16', got {autocast!r}")
    return table[autocast]


# ---------------------------------------------------------------------------- set-up
_Loss = Loss   # the model's loss at given parameters (hideseek.inputs)

#: perturbed parameters (elements) from which ``low_memory=None`` means ``True``: 2**24, 64 MiB
#: in float32 — from there on memory, not the per-pass overhead, limits who can measure
LOW_MEMORY_FROM = 1 << 24
#: perturbed parameters (elements) from which a CPU search hands the heap memory a pass freed
#: back to the system after each pass (:func:`hideseek.utils.release_freed_memory`); below it
#: the heap holds a few MiB at most and the call would cost more than it returns
TRIM_FROM = 1 << 22


@dataclass
class _SetUp:
    """What every batch's search shares."""

    loss: _Loss
    geometry: ProductGeometry
    blocks: list[SymmetryBlock]
    loss0: Tensor                        # loss at θ on the first batch
    setup_grads: dict[str, Tensor]       # its gradient (Auto-PGD's start on batch 0)
    perturbed: list[str] = field(default_factory=list)   # names of the perturbed parameters
    n_perturbed: int = 0                 # their number of elements

    @property
    def trim(self) -> bool:
        """Whether each pass hands freed heap memory back (CPU, models from :data:`TRIM_FROM`)."""
        return self.loss.device.type == "cpu" and self.n_perturbed >= TRIM_FROM

    def low_memory(self, low_memory: bool | None, searched: int | None = None) -> bool:
        """``low_memory`` as given, or for ``None`` whether the search holds
        :data:`LOW_MEMORY_FROM` elements or more (``searched``: the elements of a batch's
        tangent, :func:`hideseek.embedding_rows.searched_elements`; default all perturbed)."""
        n = self.n_perturbed if searched is None else searched
        return n >= LOW_MEMORY_FROM if low_memory is None else low_memory


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _check_settings(measure: Measure, rho: float, n_iters: int, n_samples: int | None, seed: int) -> None:
    """The settings of the computation (the measure checks itself, :class:`Measure`)."""
    if isinstance(rho, bool) or not (isinstance(rho, (int, float)) and math.isfinite(rho) and rho > 0):
        raise ValueError(f"rho must be a positive number, got {rho!r}")
    if not _is_int(seed):
        raise ValueError(f"seed must be an integer (it seeds random starts and average-case draws), got {seed!r}")
    if not _is_int(n_iters):
        raise ValueError(f"n_iters must be an integer, got {n_iters!r}")
    if n_samples is not None and not _is_int(n_samples):
        raise ValueError(f"n_samples must be an integer or None, got {n_samples!r}")
    if measure.kind == "worst" and n_iters < 1:
        raise ValueError(f"n_iters must be at least 1, got {n_iters}")
    if measure.kind == "average":
        draws = n_iters if n_samples is None else n_samples
        if draws < 1:
            which = "n_iters (the number of draws when n_samples is not given)" if n_samples is None \
                else "n_samples"
            raise ValueError(f"the average case needs at least one draw: {which} is {draws}")


def _check_exclude(exclude, names: Sequence[str]) -> tuple[str, ...]:
    """``exclude`` as a tuple of names / prefixes; a single string is one prefix.  Every
    entry must match a parameter (a typo would silently perturb what it meant to leave out)."""
    if isinstance(exclude, str):
        exclude = (exclude,)
    exclude = tuple(exclude)
    bad = [e for e in exclude if not isinstance(e, str)]
    if bad:
        raise ValueError(f"exclude must be parameter names or prefixes (strings), got {bad[0]!r}")
    for e in exclude:
        if not any(_excluded(n, (e,)) for n in names):
            raise ValueError(f"exclude entry {e!r} matches no parameter of the model (names look like "
                             f"{list(names)[:3]}); give full names or dotted prefixes")
    return exclude


def _check_amp(model: nn.Module, autocast, perturb: Sequence[str] = ()) -> torch.dtype | None:
    """The autocast dtype; the perturbed parameters must then be float32 (torch.autocast
    leaves other dtypes alone; frozen half-precision weights are fine)."""
    amp_dtype = _autocast_dtype(autocast)
    params = dict(model.named_parameters())
    names = perturb or list(params)
    other = sorted({str(params[n].dtype) for n in names if params[n].dtype != torch.float32})
    if amp_dtype is not None and other:
        raise ValueError(f"autocast={autocast!r} needs a float32 model (its perturbed parameters in float32: "
                         f"torch.autocast leaves other dtypes alone), but some are {other}; call model.float() "
                         "first or drop autocast")
    return amp_dtype


def _excluded(name: str, exclude: Sequence[str]) -> bool:
    return any(name == e or name.startswith(e.rstrip(".") + ".") for e in exclude)


def _perturbed(model: nn.Module, exclude: Sequence[str]) -> list[str]:
    """The parameters to perturb: those that require gradients, minus ``exclude``."""
    params = list(model.named_parameters())
    names = [n for n, p_ in params if p_.requires_grad and not _excluded(n, exclude)]
    if not names:
        why = "every parameter is frozen (requires_grad=False)" if not any(p_.requires_grad for _, p_ in params) \
            else "exclude leaves none of the parameters that require gradients"
        raise SharpnessInputError(f"nothing to perturb: {why}. Sharpness perturbs the parameters that require "
                                  "gradients; call requires_grad_(True) on those to measure")
    return names


def _setup_pass(loss: _Loss, all_params: dict[str, Tensor], x0, y0, perturb: Sequence[str],
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
        check_finite_loss(0, again, y0)
        if float(again) != float(loss0.detach()):
            raise SharpnessInputError(
                "the loss differs between two identical forward passes "
                f"({float(loss0.detach())!r} vs {float(again)!r}): the model is not deterministic (dropout or "
                "another random layer still active?). Sharpness needs a deterministic loss.")
    return loss0.detach(), setup_grads


def _check_whole(blocks: Sequence[SymmetryBlock], used: set[str], exclude: Sequence[str],
                 declared: Sequence[SymmetryBlock]) -> list[SymmetryBlock]:
    """The blocks whose parameters are all perturbed.  A block perturbed in part cannot keep
    its GL(h) geometry: ``exclude`` (or ``pairs=``) asking for that is refused, naming the
    pair; a block frozen in part is measured elementwise, with a warning naming it."""
    keep = []
    for b in blocks:
        missing = [n for n in b.param_names if n not in used]
        if not missing:
            keep.append(b)
            continue
        if len(missing) == len(b.param_names) and not any(b is d for d in declared):
            continue                      # frozen or unused as a whole: not perturbed at all
        moving = [n for n in b.param_names if n in used]
        if any(b is d for d in declared) or any(_excluded(n, exclude) for n in missing):
            state = f"{missing[0]!r} left fixed, {moving[0]!r} perturbed" if moving else \
                f"{missing[0]!r} and the rest left fixed"
            names = ", ".join(repr(n) for n in b.param_names[:4]) + (" …" if len(b.param_names) > 4 else "")
            raise SharpnessInputError(
                f"the symmetry pair(s) of {b.module} would be perturbed in part ({state}): a GL(h) pair is "
                f"measured as a whole. Exclude all of its parameters ({names}) or none of them")
        warnings.warn(f"the symmetry pair(s) of {b.module} are frozen in part ({missing[0]!r} does not require "
                      f"gradients, {moving[0]!r} does): its perturbed parameters get the adaptive geometry, "
                      "without GL(h) invariance", RuntimeWarning, stacklevel=4)
    for b in keep:
        shadow = [n for n in getattr(b, "adapters", ()) if n in used]
        if shadow:
            raise SharpnessInputError(
                f"{b.module}: its projections carry LoRA adapters ({shadow[0]!r}, …) and their base weights are "
                "perturbed too; the attention's GL(h) action would also have to move the adapters. Freeze the "
                "base weights (peft's default) to measure the adapters' GL(r) pairs, or exclude the adapters")
    return keep


def _symmetry_blocks(model: nn.Module, measure: Measure, all_params: dict[str, Tensor], used: set[str],
                     pairs: Sequence[SymmetryBlock] | None, on_unsupported: str,
                     exclude: Sequence[str] = ()) -> list[SymmetryBlock]:
    """The GL(h) blocks to measure on (geodesic only): those found in the model (attention,
    peft LoRA adapters) and those declared, restricted to blocks whose parameters are all
    perturbed (:func:`_check_whole`)."""
    if measure.geometry != "geodesic":
        return []
    found = find_symmetries(model, on_unsupported=on_unsupported)
    extra = [_bind_declared(blk, all_params) for blk in (pairs or [])]
    declared = {n for b in extra for n in b.param_names}
    found = [b for b in found if not declared & set(b.param_names)]   # a declaration wins
    blocks = _check_whole(found + extra, used, exclude, extra)
    if not blocks:
        raise SharpnessInputError(
            "no GL(h) symmetry to measure on: the model has no attention or LoRA adapter that hideseek "
            "recognises" + (" among the perturbed parameters (frozen ones stay fixed)" if found else "")
            + ". Declare pairs with pairs=[hideseek.DiagonalPair(...)/FactorPair(...)] "
            "or use measure='adaptive'.")
    return blocks


def _bind_declared(blk: SymmetryBlock, all_params: dict[str, Tensor]) -> SymmetryBlock:
    resolve = getattr(blk, "resolve", None)
    if callable(resolve):
        blk = resolve(list(all_params))
    return blk.bind(all_params)


def _set_up(model: nn.Module, data: list, measure: Measure, *, loss_fn: Callable | None, autocast,
            pairs, on_unsupported: str, exclude: Sequence[str], checks: bool,
            perturb: Sequence[str] | None = None) -> _SetUp:
    device = next(model.parameters()).device
    all_params = {n: p_.detach() for n, p_ in model.named_parameters()}
    perturb = _perturbed(model, exclude) if perturb is None else perturb
    x0, y0 = _to(data[0][0], device), _to(data[0][1], device)
    loss = _Loss(model, loss_fn, _check_amp(model, autocast, perturb), device)
    loss0, setup_grads = _setup_pass(loss, all_params, x0, y0, perturb, checks)
    used = set(setup_grads)
    blocks = _symmetry_blocks(model, measure, all_params, used, pairs, on_unsupported, exclude)
    params = {n: all_params[n] for n in all_params if n in used}
    if measure.eps == 0:
        check_fresh_lora(blocks, all_params)     # B = 0: a singular pair, named (issue 25)
    geom = measure.geometry_at(params, blocks)
    return _SetUp(loss, geom, blocks, loss0, setup_grads, list(params),
                  sum(t.numel() for t in params.values()))


# ---------------------------------------------------------------------------- per batch
class _BatchObjective:
    """The loss on one batch as a function of the perturbation ξ (a tangent list)."""

    def __init__(self, loss: _Loss, geometry: ProductGeometry, x, y, trim: bool = False) -> None:
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


def _tag_batch(callback: Callable[[SolverStep], Any], batch: int, step: SolverStep) -> None:
    callback(replace(step, batch=batch))


def _check_low_memory(low_memory) -> None:
    if low_memory is not None and not isinstance(low_memory, bool):
        raise ValueError(f"low_memory must be True, False or None (automatic: True from {LOW_MEMORY_FROM} "
                         f"perturbed elements), got {low_memory!r}")


def _check_restarts(restarts) -> None:
    if not _is_int(restarts) or restarts < 1:
        raise ValueError(f"restarts must be an integer >= 1 (Auto-PGD starts per batch), got {restarts!r}")


def _random_point(geom: ProductGeometry, rho: float, gen: torch.Generator) -> list[Tensor]:
    """A random point of the ball: a uniform direction times ``ρ r``, ``r`` uniform on [0, 1)."""
    r = float(torch.rand((), generator=gen))
    return [rho * r * t for t in geom.random_direction(gen)]


def _measure_batch(setup: _SetUp, measure: Measure, i: int, x, y, *, rho: float, n_iters: int,
                   seed: int, n_samples: int | None, random_start: bool,
                   callback: Callable[[SolverStep], Any] | None, low_memory: bool | None = None,
                   restarts: int = 1) -> tuple[SolverResult, list[float]]:
    """Sharpness of batch ``i``: Auto-PGD (worst case) or the sphere mean (average case);
    returns the result of the best start and the value of every start.

    Worst case: ``restarts`` searches, one after the other — the first from ξ = 0 (or from a
    random point with ``random_start``), the others from random points of the ball — the
    best kept.  Random draws come, in that order, from one generator seeded by
    ``(seed, i)`` alone."""
    device = setup.loss.device
    x, y = _to(x, device), _to(y, device)
    # the batch's own rows of large embeddings only (issue 25; hideseek.embedding_rows)
    geom = batch_geometry(setup.geometry, setup.loss, i, x, y, setup_grads=setup.setup_grads,
                          from_zero=measure.kind == "worst" and not random_start and restarts == 1)
    f = _BatchObjective(setup.loss, geom, x, y, trim=setup.trim)
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + i)
    cb = None if callback is None else functools.partial(_tag_batch, callback, i)
    if measure.kind == "average":
        res = average_case(f.value, geom, rho, n_samples or n_iters, gen, callback=cb)
        return res, [res.value]
    best, values, f0 = None, [], None
    for j in range(restarts):
        start = _random_point(geom, rho, gen) if random_start or j > 0 else None
        # the set-up pass is the gradient at ξ = 0 on batch 0, handed over as a callable so
        # that the solver alone holds it (and frees it once it has moved on)
        first = functools.partial(_setup_start, setup, geom) if i == 0 and j == 0 and start is None else None
        setup.setup_grads = setup.setup_grads if first else None
        res = apgd(f.objective, geom, rho, n_iters, x0=start, f0=f0, callback=cb, start=first,
                   keep_best_grad=not setup.low_memory(low_memory, searched_elements(geom, setup.n_perturbed)))
        if isinstance(geom, RowsGeometry) and res.best:
            res.best = geom.expand(res.best)
        del start
        f0 = res.f0                       # L(θ): the later starts need not evaluate it again
        values.append(res.value)
        if best is None or res.value > best.value:
            best = res                    # (the maximiser of a worse start is let go at once)
        del res
    return best, values


def _setup_start(setup: _SetUp, geometry: ProductGeometry | None = None) -> tuple[Tensor, list[Tensor]]:
    """``(L(θ), ∂L/∂ξ at ξ = 0)`` on batch 0 from the set-up pass, which it lets go of
    (``geometry``: batch 0's, default the set-up's)."""
    grads, setup.setup_grads = setup.setup_grads, None
    start = setup.loss0, (geometry or setup.geometry).pullback(grads)
    if setup.trim:
        release_freed_memory()     # the set-up's temporaries (second pass, geometry) are freed
    return start


def _warn_large_correction(ratios: list[float], rho: float) -> None:
    if ratios and max(ratios) > CORRECTION_BOUND:
        warnings.warn(
            f"the second-order geodesic correction is large at rho={rho}: ‖½Γ(ξ,ξ)‖/‖ξ‖ reaches "
            f"{max(ratios):.3g} on some pair (near-zero or nearly rank-deficient weights allow huge "
            "relative steps), so the second-order approximation of the geodesic is unreliable there. "
            "Use a smaller rho: hs.suggest_rho(model, batches, measure) (command line: --rho auto) "
            f"gives the largest one whose correction stays below {CORRECTION_BOUND}", RuntimeWarning,
            stacklevel=3)


#: the largest ‖½Γ(ξ,ξ)‖/‖ξ‖ the second-order step is trusted with (warning above it;
#: :func:`hideseek.rho.suggest_rho`'s ``"correction"`` rule stays below it)
CORRECTION_BOUND = 0.5
#: a mean loss increase above this many times ``max(L(θ), 1)`` is saturation (warning)
SATURATION = 10.0


def _warn_saturated(values: list[float], bases: list[float], rho: float) -> None:
    value, base = sum(values) / len(values), sum(bases) / len(bases)
    if value > SATURATION * max(base, 1.0):
        warnings.warn(
            f"rho={rho} is so large that the measure saturates: the loss rises by {value:.4g} from "
            f"{base:.4g} at θ (more than {SATURATION:g}× max(loss, 1)); the ball reaches far past the "
            "model's neighbourhood and the value reflects the perturbation, not the model. Use a "
            "smaller rho: hs.suggest_rho(model, batches, measure) (command line: --rho auto)",
            RuntimeWarning, stacklevel=3)


# ---------------------------------------------------------------------------- where
def norm_share(geometry: ProductGeometry, xi: list[Tensor],
               blocks: Sequence[SymmetryBlock] = ()) -> dict[str, float]:
    """Share of ``‖ξ‖²`` (the geometry's own ℓ2 norm) per kind of pair and ``"free"``,
    summing to 1 (empty when ξ = 0).  ``blocks``: pairs to account for among the geometry's
    free parameters (the adaptive measure's), see :meth:`ProductGeometry.sqnorm_by_kind`."""
    parts = geometry.sqnorm_by_kind(xi, blocks)
    total = sum(parts.values())
    if not total > 0:
        return {}
    return {k: v / total for k, v in parts.items()}


def _accounting_blocks(model: nn.Module, measure: Measure, setup: _SetUp) -> list[SymmetryBlock] | None:
    """Blocks to split the maximiser's norm by (``None``: no share is reported)."""
    if measure.kind != "worst" or measure.p != "l2":
        return None
    if setup.blocks:
        return []
    # the adaptive measure: its parameters are all free; account for attention pairs anyway
    return find_symmetries(model, on_unsupported="adaptive")


def _mean_shares(shares: list[dict[str, float]]) -> dict[str, float]:
    if not shares:
        return {}
    keys = sorted({k for s in shares for k in s}, key=lambda k: (k == "free", k))
    return {k: sum(s.get(k, 0.0) for s in shares) / len(shares) for k in keys}


# ---------------------------------------------------------------------------- main
def sharpness(model: nn.Module, batches: Iterable, measure: Measure | str = Measure(), *,
              rho: float = 0.1, n_iters: int = 20, seed: int = 0, loss_fn: Callable | None = None,
              pairs: Sequence[SymmetryBlock] | None = None, n_samples: int | None = None,
              random_start: bool = False, on_unsupported: str = "raise", exclude: Sequence[str] = (),
              autocast: str | torch.dtype | None = None, progress: bool = True, checks: bool = True,
              callback: Callable[[SolverStep], Any] | None = None, low_memory: bool | None = None,
              restarts: int = 1,
              metric: str | None = None, norm: str | None = None, christoffel: bool | str | None = None,
              eps: float | None = None, p: str | None = None, kind: str | None = None) -> SharpnessResult:
    """Worst-case (Auto-PGD) or average-case sharpness of ``model`` on ``batches``.

    >>> hs.sharpness(model, batches, hs.Measure(metric="mixed"), rho=0.1)        # doctest: +SKIP
    >>> hs.sharpness(model, batches, "m_apgd_linf", rho=0.002)                     # doctest: +SKIP
    >>> hs.sharpness(model, batches, measure="geodesic", metric="mixed", christoffel=False,
    ...              rho=0.1)                                                      # doctest: +SKIP

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
        agreement with full precision.
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
    metric, norm, christoffel, eps, p, kind:
        Keyword form, a convenience: each one given (not ``None``) replaces that field of
        ``measure`` (see :meth:`Measure.from_keywords`): ``metric`` ``"invariant"`` (paper
        Eq. 9) or ``"mixed"`` (Eq. 10); ``norm`` → ``ball`` (``"riemannian"`` /
        ``"adaptive"``); ``christoffel`` → ``step`` (``True`` second order, ``False``
        straight, ``"exact"`` closed-form GL(1)); ``eps`` the ε relaxation ``S ↦ S + εI``;
        ``p`` ``"l2"`` / ``"linf"`` (adaptive only); ``kind`` ``"worst"`` / ``"average"``.
    """
    measure = Measure.from_keywords(measure, metric=metric, p=p, kind=kind, norm=norm,
                                    christoffel=christoffel, eps=eps)
    _check_settings(measure, rho, n_iters, n_samples, seed)
    _check_restarts(restarts)
    _check_low_memory(low_memory)
    model = unwrap_model(model)
    check_model(model, eval_mode=checks)
    exclude = _check_exclude(exclude, [n for n, _ in model.named_parameters()])
    perturb = _perturbed(model, exclude)
    _check_weights(model, perturb)
    data = _check_batches(batches)
    t_start = time.perf_counter()
    setup = _set_up(model, data, measure, loss_fn=loss_fn, autocast=autocast, pairs=pairs,
                    on_unsupported=on_unsupported, exclude=exclude, checks=checks, perturb=perturb)
    results, starts = [], []
    # a bar over batches, or over Auto-PGD iterations when there is one batch (hideseek.progress)
    bar = Progress(len(data), (n_samples or n_iters) if measure.kind == "average" else n_iters * restarts,
                   measure.name, progress)
    try:
        for i, (x, y) in enumerate(bar.batches(data)):
            res, values = _measure_batch(setup, measure, i, x, y, rho=rho, n_iters=n_iters, seed=seed,
                                         n_samples=n_samples, random_start=random_start,
                                         callback=bar.callback(callback), low_memory=low_memory, restarts=restarts)
            check_batch_losses(i, res.f0, res.value, y)
            results.append(res)
            starts.append(values)
    finally:
        bar.close()
    config = dict(n_samples=n_samples, random_start=random_start, restarts=restarts)
    return _assemble(model, measure, setup, results, starts, rho=rho, n_iters=n_iters, seed=seed,
                     config=config, seconds=time.perf_counter() - t_start)


def _assemble(model: nn.Module, measure: Measure, setup: _SetUp, results: list[SolverResult],
              starts: list[list[float]], *, rho: float, n_iters: int, seed: int, config: dict,
              seconds: float) -> SharpnessResult:
    """The :class:`SharpnessResult` of one model from its per-batch solver results (the best
    start of each batch) and every start's value."""
    ratios, shares = [], []
    accounting = _accounting_blocks(model, measure, setup)
    for res in results:
        if setup.blocks and measure.christoffel is True and res.best:
            ratios.append(setup.geometry.correction_ratio(res.best))
        if accounting is not None and res.best:
            share = norm_share(setup.geometry, res.best, accounting)
            if share:
                shares.append(share)
    _warn_large_correction(ratios, rho)
    _warn_saturated([r.value for r in results], [r.f0 for r in results], rho)

    amp_dtype = setup.loss.amp_dtype
    config = dict(measure=measure.geometry, metric=measure.metric, rho=rho, n_iters=n_iters,
                  norm=measure.norm, christoffel=measure.christoffel, eps=measure.eps, seed=seed,
                  p=measure.p, kind=measure.kind, n_samples=config["n_samples"],
                  random_start=config["random_start"], restarts=config["restarts"],
                  n_batches=len(results),
                  autocast=None if amp_dtype is None else str(amp_dtype).removeprefix("torch."))
    values = [r.value for r in results]
    result = SharpnessResult(
        value=sum(values) / len(values), per_batch=values, base_losses=[r.f0 for r in results],
        name=measure.name, config=config, seconds=seconds,
        n_perturbed=setup.geometry.dimension(),
        pairs=[d for b in setup.blocks for d in b.describe()], correction_ratio=ratios,
        solver=results, measure=measure, norm_share=_mean_shares(shares), restart_values=starts,
        perturbed_params=setup.perturbed, n_perturbed_params=len(setup.perturbed))
    # resolution of a half-precision forward pass, an exact 0 on zero weights (hideseek.precision)
    annotate_precision(result, setup.loss.resolution, setup.loss.forward_dtype, setup.geometry)
    return result
