"""Checks of a sharpness problem's inputs (the model, the perturbed parameters, the
symmetry blocks) and the warnings about a result (:mod:`hideseek.engine`)."""
from __future__ import annotations

import os
import sys
import warnings
from typing import Sequence

import torch
from torch import Tensor, nn

from ..errors import SharpnessInputError
from ..measures import Measure
from ..symmetries.base import SymmetryBlock
from ..symmetries.discover import find_symmetries

_LIBRARY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def outside_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by the caller of this function name the
    first frame outside :mod:`hideseek` (the user's call), however deep the engine's call."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY + os.sep):
        frame, level = frame.f_back, level + 1
    return level


HALF = (torch.float16, torch.bfloat16)


def check_weights(model: nn.Module, perturbed: Sequence[str]) -> None:
    """Always checked (``checks=False`` does not skip it): the parameters to perturb are in
    full precision.  Perturbing half-precision *weights* gives silently wrong numbers —
    sharpness is a small difference of two nearby losses, and a bfloat16 perturbation rounds
    it to exactly 0 — so they are refused; frozen half-precision weights (a LoRA base) are
    fine, and ``autocast=`` runs the passes in half precision."""
    params = dict(model.named_parameters())
    half = [n for n in perturbed if params[n].dtype in HALF]
    if half:
        dtypes = "/".join(sorted({str(params[n].dtype).removeprefix("torch.") for n in half}))
        raise SharpnessInputError(
            f"{len(half)} of the parameters to perturb are {dtypes} (e.g. {half[0]!r}): sharpness is a small "
            "difference of two losses and a perturbation in half precision rounds it away (bfloat16 gives "
            "exactly 0). Load the model in float32 (from_pretrained(..., dtype=torch.float32) or "
            "model.float(); on the command line --dtype float32) and pass autocast='bfloat16' (or "
            "'float16') to run the passes in half precision, or freeze those parameters "
            "(requires_grad_(False)) to measure the others (a LoRA fine-tune on a half-precision base)")


def autocast_dtype(autocast) -> torch.dtype | None:
    if autocast is None or autocast is False:
        return None
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, torch.bfloat16: torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
             torch.float16: torch.float16}
    if autocast not in table:
        raise ValueError(f"autocast must be None, 'bfloat16' or 'float16', got {autocast!r}")
    return table[autocast]




def check_exclude(exclude, names: Sequence[str]) -> tuple[str, ...]:
    """``exclude`` as a tuple of names / prefixes; a single string is one prefix.  Every
    entry must match a parameter (a typo would silently perturb what it meant to leave out)."""
    if isinstance(exclude, str):
        exclude = (exclude,)
    exclude = tuple(exclude)
    bad = [e for e in exclude if not isinstance(e, str)]
    if bad:
        raise ValueError(f"exclude must be parameter names or prefixes (strings), got {bad[0]!r}")
    for e in exclude:
        if not any(excluded(n, (e,)) for n in names):
            raise ValueError(f"exclude entry {e!r} matches no parameter of the model (names look like "
                             f"{list(names)[:3]}); give full names or dotted prefixes")
    return exclude


def check_amp(model: nn.Module, autocast, perturb: Sequence[str] = ()) -> torch.dtype | None:
    """The autocast dtype; the perturbed parameters must then be float32 (torch.autocast
    leaves other dtypes alone; frozen half-precision weights are fine)."""
    amp_dtype = autocast_dtype(autocast)
    params = dict(model.named_parameters())
    names = perturb or list(params)
    other = sorted({str(params[n].dtype) for n in names if params[n].dtype != torch.float32})
    if amp_dtype is not None and other:
        raise ValueError(f"autocast={autocast!r} needs a float32 model (its perturbed parameters in float32: "
                         f"torch.autocast leaves other dtypes alone), but some are {other}; call model.float() "
                         "first or drop autocast")
    return amp_dtype


def excluded(name: str, exclude: Sequence[str]) -> bool:
    return any(name == e or name.startswith(e.rstrip(".") + ".") for e in exclude)


def perturbed_names(model: nn.Module, exclude: Sequence[str]) -> list[str]:
    """The parameters to perturb: those that require gradients, minus ``exclude``."""
    params = list(model.named_parameters())
    names = [n for n, p_ in params if p_.requires_grad and not excluded(n, exclude)]
    if not names:
        why = "every parameter is frozen (requires_grad=False)" if not any(p_.requires_grad for _, p_ in params) \
            else "exclude leaves none of the parameters that require gradients"
        raise SharpnessInputError(f"nothing to perturb: {why}. Sharpness perturbs the parameters that require "
                                  "gradients; call requires_grad_(True) on those to measure")
    return names


def check_whole(blocks: Sequence[SymmetryBlock], used: set[str], exclude: Sequence[str],
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
        if any(b is d for d in declared) or any(excluded(n, exclude) for n in missing):
            state = f"{missing[0]!r} left fixed, {moving[0]!r} perturbed" if moving else \
                f"{missing[0]!r} and the rest left fixed"
            names = ", ".join(repr(n) for n in b.param_names[:4]) + (" …" if len(b.param_names) > 4 else "")
            raise SharpnessInputError(
                f"the symmetry pair(s) of {b.module} would be perturbed in part ({state}): a GL(h) pair is "
                f"measured as a whole. Exclude all of its parameters ({names}) or none of them")
        warnings.warn(f"the symmetry pair(s) of {b.module} are frozen in part ({missing[0]!r} does not require "
                      f"gradients, {moving[0]!r} does): its perturbed parameters get the adaptive geometry, "
                      "without GL(h) invariance", RuntimeWarning, stacklevel=outside_stacklevel())
    for b in keep:
        shadow = [n for n in getattr(b, "adapters", ()) if n in used]
        if shadow:
            raise SharpnessInputError(
                f"{b.module}: its projections carry LoRA adapters ({shadow[0]!r}, …) and their base weights are "
                "perturbed too; the attention's GL(h) action would also have to move the adapters. Freeze the "
                "base weights (peft's default) to measure the adapters' GL(r) pairs, or exclude the adapters")
    return keep


def symmetry_blocks(model: nn.Module, measure: Measure, all_params: dict[str, Tensor], used: set[str],
                     pairs: Sequence[SymmetryBlock] | None, on_unsupported: str,
                     exclude: Sequence[str] = ()) -> list[SymmetryBlock]:
    """The GL(h) blocks to measure on (geodesic only): those found in the model (attention,
    peft LoRA adapters) and those declared, restricted to blocks whose parameters are all
    perturbed (:func:`check_whole`)."""
    if measure.geometry != "geodesic":
        return []
    found = find_symmetries(model, on_unsupported=on_unsupported)
    extra = [bind_declared(blk, all_params) for blk in (pairs or [])]
    declared = {n for b in extra for n in b.param_names}
    found = [b for b in found if not declared & set(b.param_names)]   # a declaration wins
    blocks = check_whole(found + extra, used, exclude, extra)
    if not blocks:
        raise SharpnessInputError(
            "no GL(h) symmetry to measure on: the model has no attention or LoRA adapter that hideseek "
            "recognises" + (" among the perturbed parameters (frozen ones stay fixed)" if found else "")
            + ". Declare pairs with pairs=[hideseek.DiagonalPair(...)/FactorPair(...)] "
            "or use measure='adaptive'.")
    return blocks


def bind_declared(blk: SymmetryBlock, all_params: dict[str, Tensor]) -> SymmetryBlock:
    resolve = getattr(blk, "resolve", None)
    if callable(resolve):
        blk = resolve(list(all_params))
    return blk.bind(all_params)




def warn_large_correction(ratios: list[float], rho: float) -> None:
    if ratios and max(ratios) > CORRECTION_BOUND:
        warnings.warn(
            f"the second-order geodesic correction is large at rho={rho}: ‖½Γ(ξ,ξ)‖/‖ξ‖ reaches "
            f"{max(ratios):.3g} on some pair (near-zero or nearly rank-deficient weights allow huge "
            "relative steps), so the second-order approximation of the geodesic is unreliable there. "
            "Use step='exact' (the integrated geodesic), or a smaller rho: hs.suggest_rho(model, batches, "
            f"measure) (command line: --rho auto) gives the largest one whose correction stays below {CORRECTION_BOUND}",
            RuntimeWarning, stacklevel=outside_stacklevel())


#: the largest ‖½Γ(ξ,ξ)‖/‖ξ‖ the second-order step is trusted with (warning above it;
#: :func:`hideseek.rho.suggest_rho`'s ``"correction"`` rule stays below it)
CORRECTION_BOUND = 0.5
#: a mean loss increase above this many times ``max(L(θ), 1)`` is saturation (warning)
SATURATION = 10.0


def warn_saturated(values: list[float], bases: list[float], rho: float) -> None:
    value, base = sum(values) / len(values), sum(bases) / len(bases)
    if value > SATURATION * max(base, 1.0):
        warnings.warn(
            f"rho={rho} is so large that the measure saturates: the loss rises by {value:.4g} from "
            f"{base:.4g} at θ (more than {SATURATION:g}× max(loss, 1)); the ball reaches far past the "
            "model's neighbourhood and the value reflects the perturbation, not the model. Use a "
            "smaller rho: hs.suggest_rho(model, batches, measure) (command line: --rho auto)",
            RuntimeWarning, stacklevel=outside_stacklevel())
