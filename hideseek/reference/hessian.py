r"""Dense, slow references for the Riemannian Hessian operator (tests only; docs/maths.md §14).

Nothing here calls :mod:`hideseek.curvature` or the closed forms of
:mod:`hideseek.geometry`: the metric tensor is written from its definition (§2, §6) in flat
coordinates, the Christoffel term comes from autograd derivatives of that tensor, the
Euclidean Hessian from ``torch.autograd.functional.hessian`` of the loss on a flat vector,
the vertical space from the derivative of the group action ``(G e^{tΛ}, H e^{−tΛᵀ})`` at
``t = 0``, and the horizontal space as the metric-orthogonal complement of it, by an SVD.

* :func:`dense_riemannian_hessian` — the matrix ``K_ij = Hess f(e_i, e_j)`` in a
  g-orthonormal basis ``E`` of the horizontal space, with
  ``Hess f(ξ, η) = ξᵀ ∇²f η − Σ_k ∂_k f Γ^k(ξ, η)``;
* :func:`second_derivative_along_geodesic` — ``d²/dt² f(γ_ξ(t))`` at 0 along the geodesic of
  the dense metric (RK4, Richardson-extrapolated second differences): the quadratic form of
  the Hessian, ``⟨Hess f[ξ], ξ⟩_g``, without any Christoffel formula;
* :func:`product_metric_tensor`, :func:`pair_vertical_vectors` — the metric and the vertical
  space of a stack of pairs and free parameters in the flat layout of
  :class:`~hideseek.curvature.RiemannianHessian` (``[ξ_G (B,n,h), ξ_H (B,m,h)]`` per stack
  row-major, then the free parameters).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from ..geometry.metrics import get_metric
from .pairs import geodesic_rk4


def dense_riemannian_hessian(loss: Callable[[Tensor], Tensor], theta: Tensor,
                             metric_fn: Callable[[Tensor], Tensor],
                             vertical: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(K, E)``: the Riemannian Hessian of ``loss`` at ``theta`` on the horizontal space,
    as the symmetric matrix ``K = Eᵀ (∇²f − Σ_k ∂_k f Γ^k) E`` in a basis ``E`` (columns)
    with ``Eᵀ g E = I`` spanning ``{ξ : Vᵀ g ξ = 0}`` (``V = vertical``, columns; ``None``:
    the whole space).  For ξ = E a horizontal, ``lift(Hess f[ξ]) = E K a``.

    ``Σ_k ∂_k f Γ^k_ij = ½ (∂_i (g u)_j + ∂_j (g u)_i − (D_u g)_ij)`` with ``u = g⁻¹ ∇f`` held
    fixed: Levi-Civita's formula contracted with the gradient, each derivative of the dense
    metric tensor by autograd (a Jacobian and a JVP, O(D²) memory)."""
    theta = theta.detach()
    Hf = torch.autograd.functional.hessian(loss, theta)
    grad = torch.func.grad(loss)(theta)
    g = metric_fn(theta)
    u = torch.linalg.solve(g, grad)
    A = torch.autograd.functional.jacobian(lambda th: metric_fn(th) @ u, theta)   # A[j, i] = ∂_i (g u)_j
    _, Dug = torch.func.jvp(metric_fn, (theta,), (u,))
    C = 0.5 * (A + A.T - Dug)
    low = Hf - C
    low = 0.5 * (low + low.T)
    if vertical is None or vertical.shape[1] == 0:
        B = torch.eye(theta.numel(), dtype=theta.dtype)
    else:
        M = vertical.T @ g                                   # horizontal: M ξ = 0
        _, s, Vh = torch.linalg.svd(M, full_matrices=True)
        rank = int((s > s.max() * 1e-10).sum())
        B = Vh[rank:].T
    gram = B.T @ g @ B
    w, U = torch.linalg.eigh(0.5 * (gram + gram.T))
    E = B @ (U * w.rsqrt()) @ U.T
    return (E.T @ low @ E).detach(), E.detach()


def product_metric_tensor(theta: Tensor, parts: Sequence[tuple]) -> Tensor:
    """The dense metric tensor at the flat point ``theta`` of a product of parts, in order:
    ``("pairs", B, n, m, h, metric, eps)`` (a stack: ``B·n·h`` entries of ``G``, then
    ``B·m·h`` of ``H``; per pair ``tr(M_G ξ_Gᵀ η_G) + tr(M_H ξ_Hᵀ η_H)`` with ``(M_G, M_H)``
    the registered metric's definition,
    :meth:`~hideseek.geometry.metrics.PairMetric.blocks`: ``((S_G+εI)⁻¹, (S_H+εI)⁻¹)``
    invariant, ``(S_H, S_G)`` mixed, docs/maths.md §2), ``("adaptive", k)`` (``diag(1/θ²)``, §6; weight 1 where θ is exactly 0, a
    coordinate the adaptive geometry holds fixed: :func:`fixed_coordinate_vectors`) or
    ``("euclidean", k)`` (identity)."""
    blocks, start = [], 0
    for part in parts:
        kind = part[0]
        if kind == "pairs":
            _, B, n, m, h, metric, eps = part
            G = theta[start:start + B * n * h].reshape(B, n, h)
            H = theta[start + B * n * h:start + B * (n + m) * h].reshape(B, m, h)
            start += B * (n + m) * h
            MG, MH = get_metric(metric).blocks(G, H, eps)     # the definition only, no closed form
            # tr(M ξᵀ η) = Σ_{a,b,c} ξ_ab M_bc η_ac: block I_rows ⊗ M on the row-major vec
            blocks += [torch.kron(torch.eye(n, dtype=theta.dtype), MG[b].contiguous()) for b in range(B)]
            blocks += [torch.kron(torch.eye(m, dtype=theta.dtype), MH[b].contiguous()) for b in range(B)]
        elif kind == "adaptive":
            k = part[1]
            t = theta[start:start + k]
            zero = t == 0                      # held fixed (see fixed_coordinate_vectors): any weight
            safe = torch.where(zero, torch.ones_like(t), t)
            blocks.append(torch.diag(torch.where(zero, torch.ones_like(t), 1.0 / safe ** 2)))
            start += k
        elif kind == "euclidean":
            k = part[1]
            blocks.append(torch.eye(k, dtype=theta.dtype))
            start += k
        else:
            raise ValueError(kind)
    if start != theta.numel():
        raise ValueError(f"the parts cover {start} coordinates, theta has {theta.numel()}")
    return torch.block_diag(*blocks)


def pair_vertical_vectors(theta: Tensor, parts: Sequence[tuple],
                          algebras: dict[int, Tensor] | None = None) -> Tensor:
    """The vertical vectors (columns) of the product: for each pair ``b`` of each stack and
    each basis matrix ``Λ`` of the Lie algebra, ``d/dt (G e^{tΛ}, H e^{−tΛᵀ})`` at 0 — the
    tangent of the group orbit, placed in the flat layout.  ``algebras[i]``: a ``(k, h, h)``
    basis for the i-th part (default: all of gl(h), the ``h²`` matrix units)."""
    cols, start, D = [], 0, theta.numel()
    for i, part in enumerate(parts):
        if part[0] != "pairs":
            start += part[1]
            continue
        _, B, n, m, h, _, _ = part
        G = theta[start:start + B * n * h].reshape(B, n, h)
        H = theta[start + B * n * h:start + B * (n + m) * h].reshape(B, m, h)
        basis = (algebras or {}).get(i)
        if basis is None:
            basis = torch.eye(h * h, dtype=theta.dtype).reshape(h * h, h, h)
        for b in range(B):
            for Lam in basis:
                def orbit(t, b=b, Lam=Lam):
                    Gb = G[b] @ torch.linalg.matrix_exp(t * Lam)
                    Hb = H[b] @ torch.linalg.matrix_exp(-t * Lam.T)
                    v = torch.zeros(D, dtype=theta.dtype)
                    gG = torch.zeros(B, n, h, dtype=theta.dtype)
                    gH = torch.zeros(B, m, h, dtype=theta.dtype)
                    gG[b], gH[b] = Gb, Hb
                    v[start:start + B * (n + m) * h] = torch.cat([gG.reshape(-1), gH.reshape(-1)])
                    return v
                zero = torch.zeros((), dtype=theta.dtype)
                _, d = torch.func.jvp(orbit, (zero,), (torch.ones((), dtype=theta.dtype),))
                cols.append(d)
        start += B * (n + m) * h
    return torch.stack(cols, dim=1) if cols else torch.zeros(D, 0, dtype=theta.dtype)


def fixed_coordinate_vectors(theta: Tensor, parts: Sequence[tuple]) -> Tensor:
    """Unit vectors (columns) of the coordinates of ``("adaptive", k)`` parts where θ is
    exactly 0: the adaptive geometry does not move them (docs/maths.md §6).  The metric is
    diagonal there, so appending them to the vertical vectors of
    :func:`dense_riemannian_hessian` removes exactly these coordinates from the space."""
    cols, start, D = [], 0, theta.numel()
    for part in parts:
        k = part[1] if part[0] != "pairs" else part[1] * (part[2] + part[3]) * part[4]
        if part[0] == "adaptive":
            for i in (theta[start:start + k] == 0).nonzero().flatten().tolist():
                e = torch.zeros(D, dtype=theta.dtype)
                e[start + i] = 1.0
                cols.append(e)
        start += k
    return torch.stack(cols, dim=1) if cols else torch.zeros(D, 0, dtype=theta.dtype)


def second_derivative_along_geodesic(loss: Callable[[Tensor], Tensor], theta: Tensor,
                                     metric_fn: Callable[[Tensor], Tensor], xi: Tensor,
                                     t: float = 2e-2, steps: int = 8) -> float:
    """``d²/dt² f(γ_ξ(t))`` at ``t = 0`` along the geodesic of ``metric_fn`` with
    ``γ(0) = θ``, ``γ'(0) = ξ`` (integrated by RK4 from the Christoffel symbols of the dense
    tensor, :func:`hideseek.reference.geodesic_rk4`), from second differences at ``±t`` and
    ``±t/2`` combined by Richardson extrapolation (error O(t⁴)).  For horizontal ξ this is
    ``⟨Hess f[ξ], ξ⟩_g`` (docs/maths.md §14)."""
    f0 = float(loss(theta))

    def d2(s):
        fwd = geodesic_rk4(metric_fn, theta, xi, t=s, steps=steps)[0][-1]
        bwd = geodesic_rk4(metric_fn, theta, -xi, t=s, steps=steps)[0][-1]
        return (float(loss(fwd)) - 2 * f0 + float(loss(bwd))) / s ** 2

    coarse, fine = d2(t), d2(t / 2)
    return (4 * fine - coarse) / 3
