"""The one input layer of :func:`hideseek.sharpness` and :func:`hideseek.relative_flatness`.

Both measures take the same model and the same batches, so they read them here and raise the
same :class:`SharpnessInputError` for the same bad input:

* :func:`unwrap_model` — ``nn.DataParallel`` / ``DistributedDataParallel`` / ``torch.compile``
  wrappers are measured through the module they wrap (functional calls need the plain
  module; a compiled model would recompile on every perturbed forward pass);
* :func:`check_model` — a module with materialised parameters, in eval mode, finite weights;
* :func:`check_batches` — batches as ``(inputs, labels)`` pairs, or Hugging Face dicts
  holding ``"labels"`` (a list of two dicts is two batches); integer images refused where
  the model expects floats; :func:`to_device` moves one batch;
* :func:`logits_of`, :func:`default_loss`, :func:`accepts_labels`, :class:`Loss` — the model's
  logits, the default loss and the functional loss at given parameters;
* :func:`check_finite_loss` — a NaN or infinite loss is refused naming the batch and the cause.
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from .embedding_rows import RowRecorder
from .errors import SharpnessInputError
from .precision import ActivationProbe, check_loss_dtype, forward_dtype, logits_of, own_loss, upcast_logits

__all__ = ["Loss", "SharpnessInputError", "accepts_labels", "check_batches", "check_finite_loss",
           "check_model", "default_loss", "logits_of", "to_device", "unwrap_model"]


# ---------------------------------------------------------------------------- the model
_WRAPPERS = ("DataParallel", "DistributedDataParallel")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside ``nn.DataParallel``, ``nn.parallel.DistributedDataParallel`` and
    ``torch.compile`` wrappers (nested ones too); any other model as it is.  Parameter
    names are then those of the wrapped module (no ``module.`` / ``_orig_mod.`` prefix)."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def check_model(model: nn.Module, *, eval_mode: bool = True) -> None:
    """A module with materialised parameters; with ``eval_mode``, in eval mode and with
    finite weights."""
    if not isinstance(model, nn.Module):
        raise SharpnessInputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    params = list(model.named_parameters())
    if not params:
        raise SharpnessInputError(f"the model ({type(model).__name__}) has no parameters")
    meta = [n for n, p_ in params if p_.is_meta]
    if meta:
        raise SharpnessInputError(
            f"the model's parameters are on the meta device ({len(meta)} of {len(params)}, e.g. {meta[0]!r}): "
            "they hold no values. Load real weights first (e.g. model.to_empty(device='cpu') then "
            "load_state_dict, or from_pretrained without a meta device_map)")
    if not eval_mode:
        return
    training = [n or type(model).__name__ for n, m in model.named_modules() if m.training]
    if training:
        dropouts = [n for n, m in model.named_modules()
                    if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0]
        why = (f" It has active dropout ({len(dropouts)} modules, e.g. {dropouts[0]!r}), which makes "
               "the loss random." if dropouts else "")
        raise SharpnessInputError(
            f"the model is in training mode ({len(training)} modules, e.g. {training[0]!r})." + why
            + " Call model.eval() first.")
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise SharpnessInputError(f"the model has NaN or infinite weights in {len(bad)} parameters: "
                                  f"{bad[:5]}{' …' if len(bad) > 5 else ''}. The measure is undefined there; "
                                  "check the checkpoint or the training run.")


# ---------------------------------------------------------------------------- batches
def _is_inputs(x) -> bool:
    return isinstance(x, (Tensor, Mapping))


def _one_batch(i: int, b) -> tuple[Any, Any]:
    """``(inputs, labels)`` of one batch: a pair, or a dict holding ``"labels"`` (the
    Hugging Face convention: the other entries are the model's keyword inputs)."""
    if isinstance(b, Mapping):
        if "labels" not in b:
            hint = " (rename 'label' to 'labels')" if "label" in b else ""
            raise SharpnessInputError(
                f"batch {i} is a dict without 'labels' (keys: {sorted(b)[:8]}){hint}; each batch must be a "
                "pair (inputs, labels) or a dict holding the labels under 'labels' (Hugging Face convention)")
        return {k: v for k, v in b.items() if k != "labels"}, b["labels"]
    if not isinstance(b, (tuple, list)) or len(b) != 2:
        raise SharpnessInputError(
            f"batch {i} is a {type(b).__name__}{'' if not hasattr(b, '__len__') else f' of length {len(b)}'}; "
            "each batch must be a pair (inputs, labels), where inputs is a tensor (passed "
            "positionally) or a dict (passed as keyword arguments), or a dict holding 'labels'")
    x, y = b
    if not _is_inputs(x):
        raise SharpnessInputError(f"batch {i}: inputs must be a tensor or a dict of tensors, got "
                                  f"{type(x).__name__}")
    return x, y


#: input names under which a model expects images (floats)
IMAGE_KEYS = ("pixel_values", "pixel_values_videos", "images", "image", "video", "videos")


def _check_images(i: int, x) -> None:
    """Integer images (uint8 / int64 pixels) where the model expects floats are refused: a
    model reads them as numbers 0 … 255, not as the normalised images it was trained on.
    Images: inputs named as in :data:`IMAGE_KEYS`, or a positional integer tensor of 4 or more
    dimensions (a batch of images), or of 3 or more in uint8."""
    named = x.items() if isinstance(x, Mapping) else [(None, x)]
    for key, v in named:
        if not isinstance(v, Tensor) or v.is_floating_point() or v.is_complex() or v.dtype == torch.bool:
            continue
        image = key in IMAGE_KEYS if key is not None else (v.dim() >= 4 or (v.dtype == torch.uint8 and v.dim() >= 3))
        if image:
            what = f"{key!r}" if key is not None else "the inputs"
            raise SharpnessInputError(
                f"batch {i}: {what} are integer images ({str(v.dtype).removeprefix('torch.')}, shape {tuple(v.shape)}) "
                "but the model expects floats: convert them as the model was trained (its image processor, or "
                "x.float() / 255 and its normalisation)")


def check_batches(batches: Iterable) -> list[tuple[Any, Any]]:
    """The batches as a list of ``(inputs, labels)``.  Accepted: an iterable (list,
    DataLoader) of pairs or of dicts holding ``"labels"``; one pair ``(inputs, labels)`` or
    one such dict on its own is one batch."""
    if isinstance(batches, Tensor):
        raise SharpnessInputError("batches must be an iterable of (inputs, labels) pairs, e.g. a "
                                  "DataLoader or [(x, y)], not a single tensor")
    # A list of batches never holds a bare tensor or a dict without labels: such a first
    # element means one (inputs, labels) pair was passed on its own.
    # Two dicts are two batches (labels are never a dict of inputs).
    if isinstance(batches, Mapping) or (isinstance(batches, (tuple, list)) and len(batches) == 2 and (
            isinstance(batches[0], Tensor) or (isinstance(batches[0], Mapping) and "labels" not in batches[0]
                                              and not isinstance(batches[1], Mapping)))):
        batches = [batches]
    try:
        items = list(batches)
    except TypeError:
        raise SharpnessInputError(f"batches must be an iterable of (inputs, labels) pairs, got "
                                  f"{type(batches).__name__}") from None
    out = [_one_batch(i, b) for i, b in enumerate(items)]
    if not out:
        raise SharpnessInputError("batches is empty")
    for i, (x, _) in enumerate(out):
        _check_images(i, x)
    return out


def to_device(obj, device):
    """A tensor, or a dict of them (nested), on ``device``; anything else as it is."""
    if isinstance(obj, Tensor):
        return obj.to(device)
    if isinstance(obj, Mapping):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


# ---------------------------------------------------------------------------- outputs, losses
def default_loss(out, y: Tensor) -> Tensor:
    """The model's own ``.loss`` when it returns one (Hugging Face models given
    ``labels``), else the mean cross-entropy of the logits — in float32 or wider whatever
    the model computes in (half-precision logits are read in float32; a half-precision
    ``.loss`` is recomputed from float32 logits, :func:`hideseek.precision.own_loss`)."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, Tensor):
        return own_loss(loss, getattr(out, "logits", None), y)
    return F.cross_entropy(upcast_logits(logits_of(out)), y)


def accepts_labels(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes a ``labels`` keyword (Hugging Face task models; a
    peft model forwards to its base model, whose signature is read)."""
    inner = getattr(model, "get_base_model", None)
    if callable(inner):
        try:
            model = inner()
        except Exception:  # noqa: BLE001 (not a peft model after all)
            pass
    try:
        return "labels" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _model_error(err: Exception, i: int) -> SharpnessInputError:
    """A model's own error on batch ``i`` as one line saying where to look."""
    msg = " ".join(str(err).split())
    hint = ""
    low = msg.lower()
    if "out of bounds" in low or ("index" in low and "range" in low):
        hint = " (labels must be class indices 0 … C−1, or −100 to ignore; token ids below the vocabulary size)"
    elif "long, int" in low or "expected tensor for argument" in low or ("scalar type" in low and "float" in low):
        hint = " (token ids such as input_ids must be an integer tensor)"
    elif "shape" in low or "size" in low:
        hint = " (check the shapes of inputs and labels)"
    return SharpnessInputError(f"the model (or loss_fn) raised {type(err).__name__} on batch {i}: "
                               f"{msg[:300]}{hint}")


class Loss:
    """``loss(params, x, y)``: the model's loss at ``params`` (a functional call; parameters
    not in ``params`` are the model's own), with the model's passes under ``torch.autocast``
    when asked.  A model whose ``forward`` takes ``labels`` (Hugging Face) gets them, so
    that its output carries its own ``.loss``."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None, amp_dtype: torch.dtype | None,
                 device: torch.device) -> None:
        self.model, self.amp_dtype, self.device = model, amp_dtype, device
        self.loss_fn = loss_fn or default_loss
        self.user_loss = loss_fn is not None
        #: the half-precision dtype of the forward pass (None: full precision) and, from the
        #: first call (the set-up pass), the resolution of a difference of two losses
        #: (hideseek.precision)
        self.forward_dtype = forward_dtype(model, amp_dtype)
        self.resolution: float | None = None
        #: rows of large embeddings looked up, recorded on the first call (hideseek.embedding_rows)
        self.rows = RowRecorder(model)
        self._first = True
        self.pass_labels = accepts_labels(model)
        #: the loss is multiplied by this before a backward pass (float16: keep small
        #: gradients from flushing to zero; only the gradient's direction is used)
        self.grad_scale = 1024.0 if amp_dtype == torch.float16 else 1.0

    def output(self, params: Mapping[str, Tensor], x, y):
        kw = {"labels": y} if self.pass_labels and y is not None else {}
        if isinstance(x, Tensor):
            return functional_call(self.model, params, (x,), kw)
        return functional_call(self.model, params, (), {**x, **kw})

    def __call__(self, params: Mapping[str, Tensor], x, y) -> Tensor:
        if self._first:
            return self._first_call(params, x, y)
        amp = self.amp_dtype
        with torch.autocast(self.device.type, dtype=amp, enabled=amp is not None):
            loss = self.loss_fn(self.output(params, x, y), y)
        if self.user_loss:
            check_loss_dtype(loss)
        return loss.float() if amp is not None and isinstance(loss, Tensor) else loss

    def _first_call(self, params: Mapping[str, Tensor], x, y) -> Tensor:
        """The first call (the set-up pass): also records the embedding rows looked up and,
        for a half-precision forward pass, the loss's resolution."""
        self._first = False
        amp = self.amp_dtype
        handles = self.rows.start() if self.rows else []
        probe = ActivationProbe(self.model) if self.forward_dtype is not None else None
        probing = probe.start() if probe is not None else []
        try:
            with torch.autocast(self.device.type, dtype=amp, enabled=amp is not None):
                out = self.output(params, x, y)
                loss = self.loss_fn(out, y)
        finally:
            if self.rows:
                self.rows.setup_rows = self.rows.stop(handles)
            ActivationProbe.stop(probing)
        if self.user_loss:
            check_loss_dtype(loss)
        if probe is not None and isinstance(loss, Tensor) and loss.numel() == 1:
            self.resolution = probe.resolution(loss, out, self.forward_dtype)
        del out, probe
        return loss.float() if amp is not None and isinstance(loss, Tensor) else loss

    def checked(self, params: Mapping[str, Tensor], x, y, i: int) -> Tensor:
        """The loss on batch ``i``, the model's own errors (labels out of range, float token
        ids, wrong shapes) turned into one :class:`SharpnessInputError` line, and checked to be
        a finite scalar."""
        try:
            loss = self(params, x, y)
        except SharpnessInputError:
            raise
        except (RuntimeError, IndexError, TypeError, ValueError) as err:
            raise _model_error(err, i) from err
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise SharpnessInputError("loss_fn must return a scalar tensor")
        check_finite_loss(i, loss, y)
        return loss


def check_deterministic(first: Tensor, again: Tensor, y=None) -> None:
    """The set-up check of every sharpness call: a second identical forward pass at θ must give
    a finite loss equal to the first, bit for bit (a model with dropout still on does not)."""
    check_finite_loss(0, again, y)
    if float(again) != float(first.detach()):
        raise SharpnessInputError(
            "the loss differs between two identical forward passes "
            f"({float(first.detach())!r} vs {float(again)!r}): the model is not deterministic (dropout or "
            "another random layer still active?). Sharpness needs a deterministic loss.")


def check_finite_loss(i: int, loss, y=None, where: str = "at θ") -> None:
    """Raise when the loss of batch ``i`` is NaN or infinite, saying why when it can tell
    (every label the ignore index −100: an empty mean is NaN)."""
    v = float(loss.detach()) if isinstance(loss, Tensor) else float(loss)
    if math.isfinite(v):
        return
    what = "NaN" if math.isnan(v) else "infinite"
    if where != "at θ":
        cause = "the perturbation drives the model past its dtype's range; use a smaller rho (hs.suggest_rho)"
    elif isinstance(y, Tensor) and y.numel() and not y.is_floating_point() and bool((y == -100).all()):
        cause = ("every label is -100 (the ignore index), so the mean loss has nothing to average; "
                 "drop the batch or give it real labels")
    else:
        cause = ("the model's output is NaN or infinite (overflowing inputs, or activations beyond the "
                 "dtype's range); check the inputs and the model on this batch")
    raise SharpnessInputError(f"the loss {where} on batch {i} is {what}: {cause}")


def check_batch_losses(i: int, base, value, y=None) -> None:
    """Batch ``i``'s loss at θ (``base``) and its sharpness (``value``) are finite."""
    check_finite_loss(i, base, y)
    check_finite_loss(i, value, y, where="inside the ball")
