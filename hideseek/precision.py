"""A precision policy that never quantises the answer (issue 25, item 3).

Sharpness is a small difference of two nearby losses (docs/maths.md §7.1).  Three things
would quietly turn it into rounding:

* **a loss computed in half precision.**  From bfloat16 logits, ``F.cross_entropy`` returns a
  bfloat16 loss, whose spacing near 2 is 2⁻⁶: every value would be a multiple of it.  The
  default loss therefore reads half-precision logits in float32 (:func:`upcast_logits`); a
  model's own ``.loss`` in half precision (a Hugging Face classifier on a bfloat16 base) is
  recomputed from float32 logits when hideseek can tell its form exactly — the same function
  on the model's own logits must give the model's loss *bit for bit* (:func:`own_loss`) — and
  refused in one line otherwise.  A ``loss_fn`` returning a half-precision loss is refused
  too.  The difference ``L(γ_ξ(1)) − L(θ)`` of two float32 losses within a factor 2 of each
  other is then exact (Sterbenz).
* **a forward pass in half precision.**  Even in float32, a loss computed from a pass whose
  layers round their outputs to bfloat16 moves by up to ``u Σ |∂L/∂a| |a|`` (``u`` the unit
  roundoff, 2⁻⁸ for bfloat16; ``a`` every rounded value: the half-precision outputs of the
  model's leaf modules and the logits) when the roundings do: a sharpness below twice that —
  the two losses of the difference — cannot be told from rounding.  This *resolution* is
  computed on the set-up pass (batch 0, one more backward pass) whenever the forward pass
  runs in half precision (half-precision weights, frozen ones included, or ``autocast=``),
  stored in ``SharpnessResult.resolution``, and a value below it is flagged
  (``SharpnessResult.below_resolution``) with a warning.  It is a first-order worst case
  over the layers' roundings (operations between modules round too and are not counted).
* **weights at exactly 0.**  The adaptive ball ``‖ξ ⊘ |θ|‖`` holds zero weights fixed
  (docs/maths.md §6); a LoRA adapter at peft's initialisation (B = 0) therefore cannot move
  ``B A`` at all and adaptive sharpness is exactly 0 — explained in a warning
  (:func:`warn_zero_weights`); its GL(r) pair has a singular Gram matrix ``BᵀB = 0``, which the
  geodesic measures refuse up front naming the adapter (:func:`check_fresh_lora`).
"""
from __future__ import annotations

import warnings
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import SharpnessInputError

__all__ = ["HALF", "ActivationProbe", "check_fresh_lora", "check_loss_dtype", "forward_dtype", "logits_of", "loss_resolution",
           "annotate", "own_loss", "upcast_logits", "warn_zero_weights"]

HALF = (torch.float16, torch.bfloat16)


def _input_error(msg: str) -> Exception:
    return SharpnessInputError(msg)


def logits_of(out) -> Tensor:
    """The logits in a model's output: the output itself, its ``.logits``, or its first entry."""
    if isinstance(out, Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    raise SharpnessInputError(f"the model returned {type(out).__name__}, not logits (a tensor or an "
                              "object with .logits); pass loss_fn(output, labels) -> scalar")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------- the loss
def upcast_logits(logits: Tensor) -> Tensor:
    """``logits`` in float32 when they are half precision (exact: every half value is a
    float32 value), as they are otherwise."""
    return logits.float() if logits.dtype in HALF else logits


def _flat_ce(z: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1))


def _shifted_ce(z: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(z[..., :-1, :].reshape(-1, z.shape[-1]), y[..., 1:].reshape(-1))


def _mse(z: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(z.squeeze(), y.squeeze().to(z.dtype))


def _bce(z: Tensor, y: Tensor) -> Tensor:
    return F.binary_cross_entropy_with_logits(z, y.to(z.dtype))


#: the forms of a model's own loss that :func:`own_loss` recognises (Hugging Face's
#: classification, token-level and causal-LM losses)
FORMS: tuple[tuple[str, Callable[[Tensor, Tensor], Tensor]], ...] = (
    ("cross-entropy", _flat_ce), ("shifted cross-entropy", _shifted_ce), ("mse", _mse), ("bce", _bce))


def own_loss(loss: Tensor, logits: Tensor | None, y) -> Tensor:
    """A model's own ``.loss``, in float32 or wider: as it is when it is, else recomputed from
    float32 logits by the one form of :data:`FORMS` that reproduces it bit for bit on the
    model's own logits; refused in one line when none does."""
    if loss.dtype not in HALF:
        return loss
    if isinstance(logits, Tensor) and isinstance(y, Tensor):
        for _, form in FORMS:
            try:
                same = bool(form(logits, y).detach() == loss.detach())
            except (RuntimeError, ValueError, IndexError):
                continue
            if same:
                return form(logits.float(), y)
    raise _input_error(
        f"the model's own loss is {_name(loss.dtype)} (computed from {_name(loss.dtype)} logits): sharpness, a "
        "difference of two losses, would be rounded to its spacing, and hideseek cannot recompute it in float32 "
        "(not a plain, shifted or binary cross-entropy or an MSE of the logits). Pass "
        "loss_fn=lambda out, y: <the loss>(out.logits.float(), y)")


def check_loss_dtype(loss) -> None:
    """A ``loss_fn``'s value must be float32 or wider."""
    if isinstance(loss, Tensor) and loss.dtype in HALF:
        raise _input_error(
            f"loss_fn returned a {_name(loss.dtype)} loss: sharpness, a difference of two losses, would be "
            f"rounded to {_name(loss.dtype)}'s spacing. Compute the loss from float32 logits "
            "(e.g. F.cross_entropy(out.logits.float(), y))")


# ---------------------------------------------------------------------------- resolution
def forward_dtype(model: nn.Module, amp_dtype: torch.dtype | None) -> torch.dtype | None:
    """The half-precision dtype the forward pass computes in (``autocast``, or weights —
    frozen ones included — in float16/bfloat16; bfloat16 when both), else ``None``."""
    if amp_dtype in HALF:
        return amp_dtype
    dtypes = {p.dtype for p in model.parameters()} & set(HALF)
    if torch.bfloat16 in dtypes:
        return torch.bfloat16
    return torch.float16 if dtypes else None


class ActivationProbe:
    """Holds, during one forward pass (:meth:`start` … :meth:`stop`), the half-precision
    outputs of the model's leaf modules (each a rounding of the forward pass)."""

    def __init__(self, model: nn.Module) -> None:
        self.leaves = [m for m in model.modules() if not any(True for _ in m.children())]
        self.acts: list[Tensor] = []

    def _hook(self, mod, args, out) -> None:
        if isinstance(out, Tensor) and out.dtype in HALF and out.requires_grad:
            self.acts.append(out)

    def start(self):
        self.acts = []
        return [m.register_forward_hook(self._hook) for m in self.leaves]

    @staticmethod
    def stop(handles) -> None:
        for h in handles:
            h.remove()

    def resolution(self, loss: Tensor, out, dtype: torch.dtype) -> float | None:
        """:func:`loss_resolution` over the logits of ``out`` and the held activations."""
        acts, self.acts = self.acts, []
        return loss_resolution(loss, out, dtype, acts)


def loss_resolution(loss: Tensor, out, dtype: torch.dtype, activations: Sequence[Tensor] = ()) -> float | None:
    """``2 u Σ |∂L/∂a| |a|`` over the logits ``a`` of ``out`` and the ``activations`` (the
    outputs of the pass's half-precision layers), ``u`` the unit roundoff of ``dtype``:
    twice the first-order change of the loss when every one of those values moves by one
    rounding of ``dtype`` in the direction that raises the loss — a bound, to first order, on
    what rounding them can do to a difference of two losses.  One more backward pass (the
    set-up's, with its graph kept).  ``None`` when nothing rounded takes part in the graph."""
    try:
        z = [logits_of(out)]
    except ValueError:
        z = []
    ts = list({id(t): t for t in [*z, *activations] if t.requires_grad}.values())   # each value once
    if not (loss.requires_grad and ts):
        return None
    grads = torch.autograd.grad(loss, ts, retain_graph=True, allow_unused=True)
    total = sum(float((g.detach().float().abs() * t.detach().float().abs()).sum())
                for g, t in zip(grads, ts) if g is not None)
    return 2 * (torch.finfo(dtype).eps / 2) * total


def annotate(result, resolution: float | None, dtype: torch.dtype | None, geometry) -> None:
    """Set ``result.resolution`` / ``below_resolution`` and warn: a value below what the
    forward pass resolves, an exact 0 from weights at exactly 0."""
    result.resolution = resolution
    result.below_resolution = bool(resolution is not None and abs(result.value) < resolution)
    if result.below_resolution:
        warnings.warn(
            f"sharpness {result.value:.3g} is below the resolution of the {_name(dtype)} forward pass "
            f"(≈ {resolution:.2g}: the loss can move by that much when the layers' outputs round to "
            f"{_name(dtype)}), so it cannot be told from rounding noise (SharpnessResult.below_resolution). Use "
            "a larger rho, or run the model in float32 (model.float(), the base included)", RuntimeWarning,
            stacklevel=4)
    if result.value == 0:
        warn_zero_weights(geometry)


def _zero_tensors(geometry) -> list[str]:
    free = getattr(geometry, "adaptive", None)
    if free is None:
        return []
    return [n for n, t in zip(free.names, free.theta) if t.numel() and not bool(t.any())]


def warn_zero_weights(geometry) -> None:
    """Explain an exact 0: perturbed tensors at exactly 0 cannot move in the adaptive ball."""
    zeros = _zero_tensors(geometry)
    if not zeros:
        return
    lora = [n for n in zeros if ".lora_B." in n or ".lora_embedding_B." in n]
    why = (f" ({lora[0]!r} is a LoRA adapter at its initialisation, B = 0: B A stays 0 whatever A does)"
           if lora else "")
    warnings.warn(
        f"sharpness is exactly 0: {len(zeros)} perturbed tensors are all zeros (e.g. {zeros[0]!r}){why}, and the "
        "adaptive ball ‖ξ ⊘ |θ|‖ holds every weight at exactly 0 fixed. Train the model (the adapter) a step "
        "first, or measure those weights with geodesic sharpness and eps>0", RuntimeWarning, stacklevel=5)


def check_fresh_lora(blocks: Sequence, params) -> None:
    """Refuse, naming it, a LoRA pair whose B factor is exactly 0 (peft's initialisation):
    its Gram matrix ``BᵀB`` is singular and its GL(r) geometry undefined (``eps=0``)."""
    for b in blocks:
        if not (hasattr(b, "adapter") and hasattr(b, "layer")):
            continue
        g = params.get(getattr(b, "g", None))
        if isinstance(g, Tensor) and g.numel() and not bool(g.any()):
            raise _input_error(
                f"LoRA adapter {b.adapter!r} of {b.layer} is at its initialisation (B = 0, {b.g!r} is all zeros): "
                "its GL(r) pair has a singular Gram matrix BᵀB and nothing to measure yet. Train it a step, or "
                "use eps>0 (geodesic) or measure='adaptive' (which gives exactly 0 there)")
