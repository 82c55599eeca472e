"""The sharpness problem: one engine behind every entry point.

A :class:`SharpnessProblem` is one model, its batches and a measure, validated, with the
settings of the computation (:class:`Settings`).  It owns every step of a measurement, each
written once:

* **validation** — the settings (:meth:`Settings.check`), the model, the perturbed
  parameters, the batches (:mod:`hideseek.inputs`);
* **the set-up pass** (:meth:`SharpnessProblem.set_up`) — loss and gradient at θ on the
  first batch, the deterministic-loss check, symmetry discovery, the geometry
  (docs/maths.md §6–7); the gradient is Auto-PGD's start on the first batch
  (:meth:`SharpnessProblem.take_start`);
* **the seed rule** (:meth:`SharpnessProblem.generator`): batch ``i``'s random draws come
  from one generator seeded by ``(seed, i)`` alone;
* **evaluating a point** (:meth:`SharpnessProblem.objective`, a :class:`BatchObjective`);
* **one batch's search** (:meth:`SharpnessProblem.measure_batch`) and **assembling the
  result** (:meth:`SharpnessProblem.result`, a :class:`SharpnessResult`).

:func:`hideseek.sharpness` is :meth:`SharpnessProblem.run`; :func:`hideseek.sharpness_zoo`
builds one problem per member and advances their searches in lockstep; on several ranks
:mod:`hideseek.distributed` drives the same object.  Every entry point takes the keywords of
:class:`Settings` plus the measure's keyword form (:data:`MEASURE_KEYWORDS`) and refuses an
unknown one in one line (:func:`resolve`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor, nn
from torch.profiler import record_function

from .embedding_rows import RowsGeometry, batch_geometry, searched_elements
from .geometry.space import ProductGeometry
from .inputs import Loss, SharpnessInputError, check_batch_losses, check_batches, check_deterministic, \
    check_model, to_device, unwrap_model
from .measures import Measure
from .precision import annotate as annotate_precision, check_fresh_lora
from .progress import Progress, with_progress  # noqa: F401 (with_progress: re-exported, its old place)
from .solvers.apgd import SolverResult, SolverStep, apgd, average_case
from .symmetries.base import SymmetryBlock
from .symmetries.discover import find_symmetries
from .utils import release_freed_memory

_to = to_device


@dataclass
class SharpnessResult:
    """Sharpness of a model on a set of batches.

    ``value`` is the mean of ``per_batch``; ``base_losses`` the loss at θ per batch;
    ``measure`` what was measured (``name`` is ``measure.name``, ``config`` the settings as
    a plain dict, as before).

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False), torch.nn.Linear(2, 2, bias=False)).eval()
    >>> pair = hs.FactorPair("1.weight", "0.weight", transpose_h=True)    # W₁W₀ = G Hᵀ, G = W₁, H = W₀ᵀ
    >>> batch, mse = (torch.randn(16, 3), torch.randn(16, 2)), torch.nn.functional.mse_loss
    >>> res = hs.sharpness(model, [batch, batch], "geodesic_mixed", rho=0.1, n_iters=5, loss_fn=mse,
    ...                    pairs=[pair], progress=False)
    >>> len(res.per_batch), res.value == sum(res.per_batch) / 2       # the mean over the batches
    (2, True)
    >>> abs(res.base_losses[0] - mse(model(batch[0]), batch[1]).item()) < 1e-6   # the loss at θ
    True
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
    #: how the ranks of a ``torch.distributed`` process group took part
    #: (:mod:`hideseek.distributed`): ``"none"`` (one process, or ``distributed=False``),
    #: ``"data"`` (each rank measured its own batches; results gathered) or ``"sharded"``
    #: (FSDP2: every rank took part in every batch, the model's weights sharded)
    parallel: str = "none"
    #: ranks in the process group whose batches the result covers (1 when not combined)
    world_size: int = 1
    #: whether ``per_batch`` holds every rank's batches (rank 0's first), the same result on
    #: every rank
    combined: bool = False
    #: batches each rank brought, in rank order (empty when not combined)
    batches_per_rank: list[int] = field(default_factory=list)
    #: the collectives hideseek itself called, by name (FSDP2's own all-gathers and
    #: reduce-scatters inside each pass not counted): docs/architecture.md, "Ranks"
    collectives: dict[str, int] = field(default_factory=dict)
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

#: perturbed parameters (elements) from which ``low_memory=None`` means ``True``: 2**24, 64 MiB
#: in float32 — from there on memory, not the per-pass overhead, limits who can measure
LOW_MEMORY_FROM = 1 << 24
#: perturbed parameters (elements) from which a CPU search hands the heap memory a pass freed
#: back to the system after each pass (:func:`hideseek.utils.release_freed_memory`); below it
#: the heap holds a few MiB at most and the call would cost more than it returns
TRIM_FROM = 1 << 22


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


def _setup_pass(loss: Loss, all_params: dict[str, Tensor], x0, y0, perturb: Sequence[str],
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
                      "without GL(h) invariance", RuntimeWarning, stacklevel=6)
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


# ---------------------------------------------------------------------------- per batch
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


def _warn_large_correction(ratios: list[float], rho: float) -> None:
    if ratios and max(ratios) > CORRECTION_BOUND:
        warnings.warn(
            f"the second-order geodesic correction is large at rho={rho}: ‖½Γ(ξ,ξ)‖/‖ξ‖ reaches "
            f"{max(ratios):.3g} on some pair (near-zero or nearly rank-deficient weights allow huge "
            "relative steps), so the second-order approximation of the geodesic is unreliable there. "
            "Use step='exact' (the integrated geodesic), or a smaller rho: hs.suggest_rho(model, batches, "
            f"measure) (command line: --rho auto) gives the largest one whose correction stays below {CORRECTION_BOUND}",
            RuntimeWarning, stacklevel=5)


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
            RuntimeWarning, stacklevel=5)


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


def _accounting_blocks(model: nn.Module, measure: Measure,
                       blocks: Sequence[SymmetryBlock]) -> list[SymmetryBlock] | None:
    """Blocks to split the maximiser's norm by (``None``: no share is reported)."""
    if measure.kind != "worst" or measure.p != "l2":
        return None
    if blocks:
        return []
    # the adaptive measure: its parameters are all free; account for attention pairs anyway
    return find_symmetries(model, on_unsupported="adaptive")


def _mean_shares(shares: list[dict[str, float]]) -> dict[str, float]:
    if not shares:
        return {}
    keys = sorted({k for s in shares for k in s}, key=lambda k: (k == "free", k))
    return {k: sum(s.get(k, 0.0) for s in shares) / len(shares) for k in keys}

# ---------------------------------------------------------------------------- settings
#: the measure's keyword form, read by :meth:`Measure.from_keywords`
MEASURE_KEYWORDS = ("metric", "norm", "christoffel", "eps", "p", "kind")


@dataclass(frozen=True)
class Settings:
    """The settings of a computation (everything but the model, the batches and the
    measure): the keywords of :func:`hideseek.sharpness`, documented there.  Built by
    :func:`resolve`, checked by :meth:`check`."""

    rho: float = 0.1
    n_iters: int = 20
    seed: int = 0
    loss_fn: Callable | None = None
    pairs: Sequence[SymmetryBlock] | None = None
    n_samples: int | None = None
    random_start: bool = False
    on_unsupported: str = "raise"
    exclude: Sequence[str] = ()
    autocast: Any = None
    progress: bool = True
    checks: bool = True
    callback: Callable[[SolverStep], Any] | None = None
    low_memory: bool | None = None
    restarts: int = 1
    distributed: bool | str = "auto"

    def check(self, measure: Measure) -> None:
        """The settings are valid for ``measure`` (one-line errors)."""
        _check_settings(measure, self.rho, self.n_iters, self.n_samples, self.seed)
        _check_restarts(self.restarts)
        _check_low_memory(self.low_memory)
        if not (isinstance(self.distributed, bool) or (isinstance(self.distributed, str)
                                                       and self.distributed == "auto")):
            raise ValueError(f"distributed must be 'auto', True or False, got {self.distributed!r}")


#: every keyword an entry point takes: the settings, then the measure's keyword form
KEYWORDS = tuple(f.name for f in dataclasses.fields(Settings)) + MEASURE_KEYWORDS


def resolve(entry: str, measure: Measure | str, keywords: dict[str, Any]) -> tuple[Measure, Settings]:
    """The measure and the settings that ``keywords`` give an entry point called ``entry``:
    the measure keywords (:data:`MEASURE_KEYWORDS`) replace fields of ``measure``, the
    others are :class:`Settings`; an unknown keyword is refused in one line, naming the
    closest known one."""
    unknown = [k for k in keywords if k not in KEYWORDS]
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], KEYWORDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(f"{entry}() got an unexpected keyword argument {unknown[0]!r}{hint}; it takes "
                        f"{', '.join(KEYWORDS)}")
    m = Measure.from_keywords(measure, **{k: keywords[k] for k in MEASURE_KEYWORDS if k in keywords})
    return m, Settings(**{k: v for k, v in keywords.items() if k not in MEASURE_KEYWORDS})


def seeded_generator(seed: int, i: int) -> torch.Generator:
    """The seed rule: batch ``i``'s random draws (random starts, restarts, average-case
    draws) come, in order, from one generator seeded by ``(seed, i)`` alone."""
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + i)


@dataclass
class BatchRecord:
    """What one batch adds to a :class:`SharpnessResult`, as plain Python values (what the
    ranks of a distributed run exchange, :mod:`hideseek.distributed`)."""

    value: float                       # sharpness of the batch (its best start)
    base: float                        # L(θ) on the batch
    starts: list[float]                # every start's value
    ratio: float | None = None         # largest ‖½γ̈(0)‖/‖ξ‖ at the maximiser (second-order steps)
    share: dict[str, float] | None = None   # the maximiser's norm share per kind (ℓ2 worst case)




# ---------------------------------------------------------------------------- the problem
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
        self.exclude = _check_exclude(settings.exclude, [n for n, _ in model.named_parameters()])
        self.perturb = _perturbed(model, self.exclude)
        _check_weights(model, self.perturb)
        from .distributed import ShardedModel, parallel_mode   # (the ranks' module builds on this one)

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
        self.loss = Loss(model, s.loss_fn, _check_amp(model, s.autocast, self.perturb), device)
        if self.shards is None:
            self._loss0, self._setup_grads = _setup_pass(self.loss, all_params, x0, y0, self.perturb, s.checks)
        else:   # FSDP2: the pass runs through the sharded model (hideseek.distributed)
            self._loss0, self._setup_grads = self.shards.setup_pass(self.loss, x0, y0, self.perturb, s.checks)
        used = set(self._setup_grads)
        self.blocks = _symmetry_blocks(model, self.measure, all_params, used, s.pairs, s.on_unsupported,
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
        return self.loss.device.type == "cpu" and self.n_perturbed >= TRIM_FROM

    @property
    def keep_best_grad(self) -> bool:
        """Auto-PGD keeps the gradient at its best point: ``not low_memory``, where
        ``low_memory=None`` means ``True`` from :data:`LOW_MEMORY_FROM` perturbed elements."""
        return self.keeps_best_grad(self.n_perturbed)

    def keeps_best_grad(self, searched: int) -> bool:
        """:attr:`keep_best_grad` for a search holding ``searched`` elements (a batch's
        restricted search, :func:`hideseek.embedding_rows.searched_elements`)."""
        low = self.settings.low_memory
        return not (searched >= LOW_MEMORY_FROM if low is None else low)

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
        return _random_point(self.geometry, rho, gen)

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
        cb = None if user is None else functools.partial(_tag_batch, user, i if index is None else index)
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
                _accounting_blocks(self.model, self.measure, self.blocks)
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
        _warn_large_correction(ratios, rho)
        _warn_saturated([r.value for r in records], [r.base for r in records], rho)
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
            solver=list(solver), measure=measure, norm_share=_mean_shares(shares),
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
            from .distributed import run_ranks

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
