"""Relative flatness (Petzka et al. 2021), the camera-ready paper's comparison (its Fig. 6).

For one feature layer with weight matrix ``W`` (rows ``w_s``; e.g. the classifier on top
of the pooled features ``φ``) and ``L`` the mean loss of a batch (docs/maths.md §11,
"Relative flatness")::

    κ_Tr(W) = Σ_{s,s'} ⟨w_s, w_s'⟩ · Tr(H_{s,s'}),     H_{s,s'} = ∂²L / ∂w_s ∂w_s'ᵀ

i.e. ``κ_Tr = Σ_{s,s',k} (W Wᵀ)_{s s'} · ∂²L/∂W_{sk}∂W_{s'k}``.  It is computed per batch
and averaged over batches, like :func:`hideseek.sharpness`.

Two ways to get it:

``closed_form``
    Softmax cross-entropy on logits ``z_i = W φ_i + b`` (the layer's output *is* the
    model's logits): the Hessian block of example ``i`` is ``(diag p_i − p_i p_iᵀ)_{s s'}
    φ_i φ_iᵀ``, so ``κ_Tr = mean_i ‖φ_i‖² · Tr(W Wᵀ (diag p_i − p_i p_iᵀ))``.
``autograd``
    Any loss (``loss_fn``) and any position of the layer: exact Hessian-vector products
    of ``L`` with respect to ``W`` alone.  With ``W Wᵀ = Σ_j λ_j u_j u_jᵀ`` (eigen
    decomposition, ``r`` rows), ``κ_Tr = Σ_j λ_j Σ_k (u_j ⊗ e_k)ᵀ H (u_j ⊗ e_k)``:
    ``r · d`` Hessian-vector products per batch for a ``r × d`` layer, each a double
    backward through the part of the network downstream of ``W`` only.

>>> import torch, hideseek as hs
>>> net = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
>>> x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
>>> res = hs.relative_flatness(net, [(x, y)], layer="2.weight")
>>> res.method
'closed_form'
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .inputs import Loss, check_batches, check_finite_loss, check_model, logits_of, to_device, unwrap_model

__all__ = ["RelativeFlatnessResult", "relative_flatness"]


@dataclass
class RelativeFlatnessResult:
    """``value`` is the mean of ``per_batch`` (κ_Tr of each batch's mean loss).

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> _ = torch.manual_seed(0)
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).eval()
    >>> batches = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(2)]
    >>> res = hs.relative_flatness(net, batches, layer="2.weight")
    >>> res.layer, res.method, res.shape
    ('2.weight', 'closed_form', (3, 5))
    >>> auto = hs.relative_flatness(net, batches, layer="2.weight", method="autograd")
    >>> abs(res.value - auto.value) < 1e-5 * res.value                 # the closed form, checked by autograd
    True
    """

    value: float
    per_batch: list[float]
    layer: str            # the parameter name of W
    method: str           # "closed_form" or "autograd"
    shape: tuple[int, int]
    seconds: float
    base_losses: list[float] = field(default_factory=list)


def _resolve_layer(model: nn.Module, layer: str | nn.Module) -> tuple[str, nn.Module | None]:
    """The parameter name of ``W`` and, when ``W`` is an ``nn.Linear``'s weight, that module."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    if isinstance(layer, nn.Module):
        names = [n for n, m in modules.items() if m is layer]
        if not names:
            raise ValueError("layer is a module that is not part of the model; pass one of the "
                             "model's own modules or a parameter name such as 'classifier.weight'")
        mod_name = names[0]
        if not isinstance(getattr(layer, "weight", None), nn.Parameter):
            raise ValueError(f"layer {mod_name!r} ({type(layer).__name__}) has no weight parameter; "
                             "pass a linear layer or a 2-D parameter name")
        name = f"{mod_name}.weight" if mod_name else "weight"
    elif isinstance(layer, str):
        if layer in params:
            name = layer
        elif layer in modules and isinstance(getattr(modules[layer], "weight", None), nn.Parameter):
            name = f"{layer}.weight" if layer else "weight"
        else:
            near = [n for n in params if n.endswith(".weight") and params[n].dim() == 2][-5:]
            raise ValueError(f"layer {layer!r} not found in the model: give a parameter name or a "
                             f"module name with a weight, e.g. one of {near}")
    else:
        raise TypeError(f"layer must be a parameter name, a module name or an nn.Module, got "
                        f"{type(layer).__name__}")
    W = params[name]
    if W.dim() != 2:
        raise ValueError(f"relative flatness needs a 2-D weight matrix, but {name!r} has shape "
                         f"{tuple(W.shape)}; pick a linear layer (e.g. the classifier)")
    mod_name = name.rsplit(".", 1)[0] if "." in name else ""
    owner = modules.get(mod_name)
    linear = owner if isinstance(owner, nn.Linear) and owner.weight is W else None
    return name, linear


def _cross_entropy(out, y) -> Tensor:
    """The default loss: mean softmax cross-entropy of the logits (not the model's own ``.loss``)."""
    return F.cross_entropy(logits_of(out), y)


def _closed_form(W: Tensor, phi: Tensor, logits: Tensor) -> Tensor:
    """mean_i ‖φ_i‖² Tr(W Wᵀ (diag p_i − p_i p_iᵀ)), accumulated in float64."""
    W64, phi64 = W.detach().double(), phi.detach().double()
    p = torch.softmax(logits.detach().double(), dim=-1)              # (B, r)
    WWt = W64 @ W64.T                                                # (r, r)
    # Tr(WWᵀ diag p) − pᵀ WWᵀ p, per example
    tr = p @ torch.diagonal(WWt) - torch.einsum("bs,st,bt->b", p, WWt, p)
    return ((phi64 * phi64).sum(-1) * tr).mean()


def _autograd(loss_of_W: Callable[[Tensor], Tensor], W: Tensor) -> tuple[Tensor, Tensor]:
    """κ_Tr by r·d exact Hessian-vector products of ``loss_of_W`` at ``W``."""
    Wl = W.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        loss = loss_of_W(Wl)
        (g,) = torch.autograd.grad(loss, Wl, create_graph=True)
        if not g.requires_grad:     # the loss is linear in W: zero Hessian
            return torch.zeros((), dtype=torch.float64), loss.detach()
        W64 = W.detach().double()
        lam, U = torch.linalg.eigh(W64 @ W64.T)                      # W Wᵀ = U diag(λ) Uᵀ
        r, d = W.shape
        total = torch.zeros((), dtype=torch.float64)
        for j in range(r):
            if lam[j] == 0:
                continue
            u = U[:, j].to(W.dtype)
            for k in range(d):
                v = torch.zeros_like(Wl)
                v[:, k] = u
                (hv,) = torch.autograd.grad(g, Wl, v, retain_graph=True)
                total = total + lam[j] * (hv[:, k].double() @ u.double())
    return total, loss.detach()


def relative_flatness(model: nn.Module, batches: Iterable, layer: str | nn.Module = "classifier.weight",
                      loss_fn: Callable | None = None, *, method: str = "auto") -> RelativeFlatnessResult:
    """Relative flatness κ_Tr of ``model``'s layer ``layer`` on ``batches`` (mean over batches).

    Parameters
    ----------
    model:
        In eval mode (dropout would make the Hessian random); ``DataParallel`` /
        ``DistributedDataParallel`` / ``torch.compile`` wrappers are unwrapped.
    batches:
        As for :func:`hideseek.sharpness` (:mod:`hideseek.inputs`): ``(inputs, labels)`` pairs,
        ``inputs`` a tensor (positional) or a dict (keywords), or Hugging Face dicts holding
        ``"labels"``; one batch on its own is one batch.  Bad batches raise the same
        :class:`~hideseek.SharpnessInputError` as :func:`hideseek.sharpness`.
    layer:
        The parameter name of ``W`` (``"classifier.weight"``), a module name (``"classifier"``)
        or the module itself; ``W`` must be 2-D.
    loss_fn:
        ``loss_fn(output, labels) -> scalar``; default: mean cross-entropy on the logits
        (the model must then return a tensor or an object with ``.logits``).
    method:
        ``"auto"`` (closed form when the default cross-entropy is used and the layer is an
        ``nn.Linear`` on ``(batch, features)`` inputs whose output is the model's logits;
        autograd otherwise), ``"closed_form"`` (error when it does not apply) or ``"autograd"``.

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Linear(3, 1, bias=False).eval()               # f(x) = w·x, mean squared error
    >>> x, y = torch.randn(16, 3), torch.randn(16, 1)
    >>> res = hs.relative_flatness(model, [(x, y)], layer="weight", loss_fn=torch.nn.functional.mse_loss)
    >>> hessian_trace = 2 * (x ** 2).sum().item() / 16                # ∇²L = 2 XᵀX / n, by hand
    >>> by_hand = model.weight.pow(2).sum().item() * hessian_trace     # κ = ‖w‖² Tr(∇²L) for one row
    >>> abs(res.value - by_hand) < 1e-5 * by_hand
    True
    """
    if method not in ("auto", "closed_form", "autograd"):
        raise ValueError(f"method must be 'auto', 'closed_form' or 'autograd', got {method!r}")
    model = unwrap_model(model)
    check_model(model)            # eval mode: dropout would make the Hessian random
    data = check_batches(batches)
    if method == "closed_form" and loss_fn is not None:
        raise ValueError("the closed form is for the default softmax cross-entropy; drop loss_fn "
                         "or use method='autograd'")
    name, linear = _resolve_layer(model, layer)
    params = {n: p.detach() for n, p in model.named_parameters()}
    W = params[name]
    device = W.device
    t0 = time.perf_counter()

    loss = Loss(model, loss_fn or _cross_entropy, None, device)
    values, bases, used = [], [], []
    for i, (x, y) in enumerate(data):
        x, y = to_device(x, device), to_device(y, device)
        kind = "autograd" if method == "autograd" or loss_fn is not None else None
        if kind is None and linear is not None:
            captured: dict[str, Tensor] = {}

            def hook(mod, inp, out):
                captured["calls"] = captured.get("calls", 0) + 1
                captured["phi"], captured["z"] = inp[0], out
            handle = linear.register_forward_hook(hook)
            try:
                with torch.no_grad():
                    out = loss.output(params, x, y)
            finally:
                handle.remove()
            logits = logits_of(out)
            ok = (captured.get("calls") == 1 and captured["phi"].dim() == 2
                  and captured["z"].shape == logits.shape and torch.equal(captured["z"], logits))
            if ok:
                values.append(_closed_form(W, captured["phi"], logits))
                bases.append(float(F.cross_entropy(logits, y)))
                check_finite_loss(i, bases[-1], y)
                used.append("closed_form")
                continue
        if method == "closed_form":
            raise ValueError(f"the closed form needs {name!r} to be an nn.Linear on (batch, features) "
                             "inputs whose output is the model's logits; use method='autograd'")

        def loss_of_W(Wl, x=x, y=y, i=i):
            return loss.checked({**params, name: Wl}, x, y, i)
        val, base = _autograd(loss_of_W, W)
        values.append(val)
        bases.append(float(base))
        used.append("autograd")
    per_batch = [float(v) for v in values]
    return RelativeFlatnessResult(
        value=sum(per_batch) / len(per_batch), per_batch=per_batch, layer=name,
        method=used[0] if len(set(used)) == 1 else "mixed", shape=tuple(W.shape),
        seconds=time.perf_counter() - t0, base_losses=bases)
