"""Sharpness measures: adaptive (Andriushchenko et al. 2023) and geodesic (this paper).

Worst-case sharpness of one batch (paper Eq. 3, MATH.md §7)::

    S(θ) = max over allowed ξ with ‖ξ‖_θ ≤ ρ of  L(γ_ξ(1)) − L(θ)

computed with Auto-PGD per batch and averaged over batches.  The measures differ in the
geometry of the ball:

=====================  ==================================  ==========================
measure                ball / norm                         step ``γ_ξ(1)``
=====================  ==================================  ==========================
``adaptive`` (l2/l∞)   ``‖ξ ⊘ |θ|‖_p``, every parameter    ``θ + ξ``
``geodesic``           invariant or mixed metric on the    second-order geodesic
                       GL(h) pairs (horizontal ξ),         (``christoffel=True``)
                       adaptive ℓ2 elsewhere
=====================  ==================================  ==========================

Ablation switches (paper Appendix G): ``norm="adaptive"`` (Christoffel-only: adaptive
sharpness's elementwise ball, no horizontal restriction, second-order geodesic step of the
metric), ``christoffel=False`` (no-Christoffel, the "norm-only" ablation: Riemannian ball,
straight step), ``eps`` (Appendix H.2).
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from .geometry.space import ProductGeometry
from .solvers.apgd import SolverResult, apgd, average_case
from .symmetries.base import SymmetryBlock
from .symmetries.discover import find_symmetries

_ALIASES = {
    "m_apgd_l2": dict(measure="adaptive", kind="worst", p="l2"),
    "m_apgd_linf": dict(measure="adaptive", kind="worst", p="linf"),
    "avg_l2": dict(measure="adaptive", kind="average", p="l2"),
    "avg_linf": dict(measure="adaptive", kind="average", p="linf"),
    "geodesic_invariant": dict(measure="geodesic", metric="invariant"),
    "geodesic_mixed": dict(measure="geodesic", metric="mixed"),
}


@dataclass
class SharpnessResult:
    """Sharpness of a model on a set of batches.

    ``value`` is the mean of ``per_batch``; ``base_losses`` the loss at θ per batch.
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

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("solver")
        return d


class SharpnessInputError(ValueError):
    """The model, its weights or the batches are not fit for a sharpness measurement."""


# ---------------------------------------------------------------------------- checks
def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise SharpnessInputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    training = [n or type(model).__name__ for n, m in model.named_modules() if m.training]
    if training:
        dropouts = [n for n, m in model.named_modules()
                    if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0]
        why = (f" It has active dropout ({len(dropouts)} modules, e.g. {dropouts[0]!r}), which makes "
               "the loss random and sharpness meaningless." if dropouts else "")
        raise SharpnessInputError(
            f"the model is in training mode ({len(training)} modules, e.g. {training[0]!r})." + why
            + " Call model.eval() before measuring sharpness.")
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise SharpnessInputError(f"the model has NaN or infinite weights in {len(bad)} parameters: "
                                  f"{bad[:5]}{' …' if len(bad) > 5 else ''}. Sharpness is undefined there; "
                                  "check the checkpoint or the training run.")


def _check_batches(batches: Iterable) -> list[tuple[Any, Tensor]]:
    if isinstance(batches, (Tensor, Mapping)):
        raise SharpnessInputError("batches must be an iterable of (inputs, labels) pairs, e.g. a "
                                  "DataLoader or [(x, y)], not a single tensor or dict")
    out = []
    for i, b in enumerate(batches):
        if not isinstance(b, (tuple, list)) or len(b) != 2:
            raise SharpnessInputError(
                f"batch {i} is a {type(b).__name__}{'' if not hasattr(b, '__len__') else f' of length {len(b)}'}; "
                "each batch must be a pair (inputs, labels), where inputs is a tensor (passed "
                "positionally) or a dict (passed as keyword arguments)")
        x, y = b
        if not isinstance(x, (Tensor, Mapping)):
            raise SharpnessInputError(f"batch {i}: inputs must be a tensor or a dict of tensors, got "
                                      f"{type(x).__name__}")
        out.append((x, y))
    if not out:
        raise SharpnessInputError("batches is empty")
    return out


def _to(obj, device):
    if isinstance(obj, Tensor):
        return obj.to(device)
    if isinstance(obj, Mapping):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def _logits(out) -> Tensor:
    if isinstance(out, Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    raise SharpnessInputError(f"the model returned {type(out).__name__}; expected a tensor or an "
                              "object with .logits (or pass loss_fn that accepts this output)")


def _autocast_dtype(autocast) -> torch.dtype | None:
    if autocast is None or autocast is False:
        return None
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, torch.bfloat16: torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
             torch.float16: torch.float16}
    if autocast not in table:
        raise ValueError(f"autocast must be None, 'bfloat16' or 'float16', got {autocast!r}")
    return table[autocast]


def _default_loss(out, y: Tensor) -> Tensor:
    return F.cross_entropy(_logits(out), y)


# ---------------------------------------------------------------------------- main
def _resolve(measure: str, metric: str, p: str, kind: str, norm, christoffel):
    if measure in _ALIASES:
        a = _ALIASES[measure]
        measure, metric = a["measure"], a.get("metric", metric)
        p, kind = a.get("p", p), a.get("kind", kind)
    if measure not in ("adaptive", "geodesic"):
        raise ValueError(f"measure must be 'adaptive', 'geodesic' or one of {sorted(_ALIASES)}, got {measure!r}")
    if kind not in ("worst", "average"):
        raise ValueError(f"kind must be 'worst' or 'average', got {kind!r}")
    if measure == "adaptive":
        if norm not in (None, "adaptive") or christoffel not in (None, False):
            raise ValueError("the adaptive measure has no Riemannian norm or Christoffel step; use "
                             "measure='geodesic' with norm=/christoffel= for the ablations")
        return measure, metric, p, kind, "adaptive", False
    if p != "l2":
        raise ValueError("geodesic sharpness uses the ℓ2 (metric) ball; p='linf' is for the adaptive measure")
    return (measure, metric, p, kind, "riemannian" if norm is None else norm,
            True if christoffel is None else christoffel)


def _name(measure, metric, p, kind, norm, christoffel) -> str:
    if measure == "adaptive":
        return ("m_apgd_" if kind == "worst" else "avg_") + p
    name = f"geodesic_{metric}"
    if norm == "adaptive":
        name += "_christoffel_only" if christoffel else "_adaptive_norm_straight"
    elif not christoffel:
        name += "_no_christoffel"
    elif christoffel == "exact":
        name += "_exact"
    return name if kind == "worst" else "avg_" + name


def sharpness(model: nn.Module, batches: Iterable, *, measure: str = "geodesic",
              metric: str = "invariant", rho: float = 0.1, n_iters: int = 20,
              norm: str | None = None, christoffel: bool | str | None = None, eps: float = 0.0,
              seed: int = 0, loss_fn: Callable | None = None,
              pairs: Sequence[SymmetryBlock] | None = None, p: str = "l2", kind: str = "worst",
              n_samples: int | None = None, random_start: bool = False,
              on_unsupported: str = "raise", exclude: Sequence[str] = (),
              autocast: str | torch.dtype | None = None,
              progress: bool = True, checks: bool = True) -> SharpnessResult:
    """Worst-case (Auto-PGD) or average-case sharpness of ``model`` on ``batches``.

    Parameters
    ----------
    model:
        In eval mode, finite weights.  Output: a tensor or an object with ``.logits``.
    batches:
        Iterable of ``(inputs, labels)``; ``inputs`` a tensor (passed positionally) or a dict
        (passed as keyword arguments).  Sharpness is computed per batch and averaged.
    measure:
        ``"geodesic"`` or ``"adaptive"`` (aliases: ``m_apgd_l2``, ``m_apgd_linf``, ``avg_l2``,
        ``avg_linf``, ``geodesic_invariant``, ``geodesic_mixed``).
    metric:
        ``"invariant"`` (paper Eq. 9) or ``"mixed"`` (Eq. 10), for ``measure="geodesic"``.
    rho:
        Radius of the ball.
    n_iters:
        Auto-PGD iterations (gradient evaluations) per batch.
    norm, christoffel:
        Ablation switches (geodesic only): ``norm`` ``"riemannian"`` (default) or
        ``"adaptive"``; ``christoffel`` ``True`` (default, second-order geodesic step),
        ``False`` (straight step) or ``"exact"`` (closed-form geodesics, GL(1) invariant only).
    eps:
        ε relaxation ``S ↦ S + εI`` of the Gram matrices that are inverted.
    seed:
        Seeds random starts and average-case draws; the result is deterministic given it.
    loss_fn:
        ``loss_fn(output, labels) -> scalar``; default mean cross-entropy on the logits.
    pairs:
        Extra user-declared symmetry blocks (:class:`~hideseek.symmetries.DiagonalPair`,
        :class:`~hideseek.symmetries.FactorPair`), added to the attention pairs found.
    p:
        ``"l2"`` or ``"linf"`` (adaptive only).
    kind:
        ``"worst"`` (Auto-PGD) or ``"average"`` (mean over the sphere, ``n_samples`` draws).
    random_start:
        Start Auto-PGD from a random point of the ball instead of ξ = 0.
    on_unsupported:
        ``"raise"`` or ``"adaptive"``: what to do with attention whose symmetry is unknown.
    exclude:
        Parameter names (or name prefixes) to leave unperturbed.
    autocast:
        ``None`` (full precision), ``"bfloat16"`` or ``"float16"``: run the model's forward
        and backward passes under ``torch.autocast`` in that dtype.  The geometry (metric,
        projection, geodesic step) always stays in the parameters' dtype.  With ``"float16"``
        the loss is scaled by 2¹⁰ before the backward pass so small gradients do not flush to
        zero (only the gradient's direction is used).  Sharpness is a difference of two
        losses, so low precision costs accuracy: ``reports/benchmarks.md`` gives the measured
        agreement with full precision.
    checks:
        Check eval mode, finite weights and a deterministic loss before starting.
    """
    measure, metric, p, kind, norm, christoffel = _resolve(measure, metric, p, kind, norm, christoffel)
    if not (isinstance(rho, (int, float)) and math.isfinite(rho) and rho > 0):
        raise ValueError(f"rho must be a positive number, got {rho!r}")
    if kind == "worst" and n_iters < 1:
        raise ValueError("n_iters must be at least 1")
    _check_model(model) if checks else None
    data = _check_batches(batches)
    loss_fn = loss_fn or _default_loss
    device = next(model.parameters()).device
    t_start = time.perf_counter()

    # Which parameters take part: those that get a gradient (an unused text tower does not).
    all_params = {n: p_.detach() for n, p_ in model.named_parameters()}
    x0, y0 = _to(data[0][0], device), _to(data[0][1], device)

    amp_dtype = _autocast_dtype(autocast)
    if amp_dtype is not None and any(p_.dtype != torch.float32 for p_ in model.parameters()
                                     if p_.is_floating_point()):
        raise ValueError(f"autocast={autocast!r} needs a float32 model (torch.autocast leaves other dtypes "
                         f"alone), but this one has {sorted({str(p_.dtype) for p_ in model.parameters()})} "
                         "parameters; call model.float() first or drop autocast")
    grad_scale = 1024.0 if amp_dtype == torch.float16 else 1.0

    def run(params, x, y):
        # params are computed (geodesic step) before entering: only the model runs in amp_dtype
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            out = functional_call(model, params, (x,)) if isinstance(x, Tensor) else \
                functional_call(model, params, (), x)
            loss = loss_fn(out, y)
        return loss.float() if amp_dtype is not None and isinstance(loss, Tensor) else loss

    leaves = {n: t.detach().requires_grad_(True) for n, t in all_params.items()
              if not any(n == e or n.startswith(e.rstrip(".") + ".") for e in exclude)}
    with torch.enable_grad():
        loss0 = run(leaves, x0, y0)
        if not isinstance(loss0, Tensor) or loss0.numel() != 1:
            raise SharpnessInputError("loss_fn must return a scalar tensor")
        grads = torch.autograd.grad(loss0 * grad_scale, list(leaves.values()), allow_unused=True)
    used = {n for (n, _), g in zip(leaves.items(), grads) if g is not None}
    # The set-up pass is also Auto-PGD's start on the first batch (ξ = 0): keep its gradient.
    setup_grads = {n: g for n, g in zip(leaves, grads) if g is not None}
    del grads
    if checks:
        with torch.enable_grad():   # same kernels as the first pass (no inference fast path)
            again = run(leaves, x0, y0).detach()
        if float(again) != float(loss0.detach()):
            raise SharpnessInputError(
                "the loss differs between two identical forward passes "
                f"({float(loss0.detach())!r} vs {float(again)!r}): the model is not deterministic (dropout or "
                "another random layer still active?). Sharpness needs a deterministic loss.")

    loss0 = loss0.detach()
    del leaves
    blocks: list[SymmetryBlock] = []
    if measure == "geodesic":
        found = find_symmetries(model, on_unsupported=on_unsupported)
        extra = [blk.bind(all_params) for blk in (pairs or [])]
        blocks = [b for b in found + extra if all(n in used for n in b.param_names)]
        if not blocks:
            raise SharpnessInputError(
                "no GL(h) symmetry to measure on: the model has no attention that hideseek "
                "recognises" + (" (or it gets no gradient)" if found else "")
                + ". Declare pairs with pairs=[hideseek.DiagonalPair(...)/FactorPair(...)] "
                "or use measure='adaptive'.")
    params = {n: all_params[n] for n in all_params if n in used}
    geom = ProductGeometry(params, blocks, metric=metric, eps=eps, norm=norm,
                           christoffel=christoffel, p=p)

    values, bases, solver_results, ratios = [], [], [], []
    iterator = data
    if progress:
        from tqdm.auto import tqdm
        iterator = tqdm(data, desc=_name(measure, metric, p, kind, norm, christoffel), leave=False)
    for i, (x, y) in enumerate(iterator):
        x, y = _to(x, device), _to(y, device)
        gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + i)

        def objective(xi):
            xi = [t.detach().requires_grad_(True) for t in xi]
            with torch.enable_grad():
                loss = run(geom.point(xi), x, y)
                g = torch.autograd.grad(loss * grad_scale, xi)
            return loss.detach(), list(g)

        def value(xi):
            with torch.no_grad():
                return run(geom.point(xi), x, y)

        if kind == "worst":
            start = None
            if random_start:
                r = float(torch.rand((), generator=gen))
                start = [rho * r * t for t in geom.random_direction(gen)]
            first = None
            if i == 0 and start is None:
                first = (loss0, geom.pullback(setup_grads))
            res = apgd(objective, geom, rho, n_iters, x0=start, start=first)
        else:
            res = average_case(value, geom, rho, n_samples or n_iters, gen)
        setup_grads = None   # a model's worth of memory: not needed past batch 0
        values.append(res.value)
        bases.append(res.f0)
        solver_results.append(res)
        if blocks and christoffel is True and res.best:
            ratios.append(geom.correction_ratio(res.best))
    if ratios and max(ratios) > 0.5:
        warnings.warn(
            f"the second-order geodesic correction is large at rho={rho}: ‖½Γ(ξ,ξ)‖/‖ξ‖ reaches "
            f"{max(ratios):.3g} on some pair (near-zero or nearly rank-deficient weights allow huge "
            "relative steps). The second-order approximation of the geodesic is unreliable there; "
            "use a smaller rho, eps > 0, or christoffel='exact' where available.", RuntimeWarning,
            stacklevel=2)

    config = dict(measure=measure, metric=metric if measure == "geodesic" else None, rho=rho,
                  n_iters=n_iters, norm=norm, christoffel=christoffel, eps=eps, seed=seed, p=p,
                  kind=kind, n_samples=n_samples, random_start=random_start, n_batches=len(data),
                  autocast=None if amp_dtype is None else str(amp_dtype).removeprefix("torch."))
    return SharpnessResult(
        value=sum(values) / len(values), per_batch=values, base_losses=bases,
        name=_name(measure, metric, p, kind, norm, christoffel), config=config,
        seconds=time.perf_counter() - t_start, n_perturbed=geom.dimension(),
        pairs=[d for b in blocks for d in b.describe()], correction_ratio=ratios,
        solver=solver_results)
