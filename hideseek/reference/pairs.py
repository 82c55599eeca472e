"""The references on one GL(h) pair (package docstring: :mod:`hideseek.reference`): the dense metric
tensor, its Christoffel symbols, RK4 geodesics and the Taylor-remainder check.  A leaf of the
package, so that :mod:`hideseek.reference.hessian` can build on it without an import circle."""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ..geometry.metrics import get_metric


def pair_metric_tensor(theta: Tensor, n: int, m: int, h: int, metric="invariant", eps: float = 0.0) -> Tensor:
    """Dense metric tensor ``g_ij(θ)`` of one GL(h) pair, ``θ = (vec G, vec H)`` (row-major).

    ``metric``: a registered name (:data:`hideseek.geometry.metrics.METRICS`) or a
    :class:`~hideseek.geometry.metrics.PairMetric` class; only its *definition*
    (:meth:`~hideseek.geometry.metrics.PairMetric.blocks`, the matrices ``M_G, M_H`` of
    ``g(ξ, η) = tr(M_G ξ_Gᵀη_G) + tr(M_H ξ_Hᵀη_H)``) is used, none of its closed forms."""
    G = theta[: n * h].reshape(n, h)
    H = theta[n * h:].reshape(m, h)
    MG, MH = get_metric(metric).blocks(G.unsqueeze(0), H.unsqueeze(0), eps)
    MG, MH = MG[0], MH[0]
    # tr(M ξᵀ η) = Σ_{a,b,c} ξ_{a b} M_{b c} η_{a c}  →  block  I_rows ⊗ M  on vec (row-major)
    gG = torch.kron(torch.eye(n, dtype=theta.dtype), MG.contiguous())
    gH = torch.kron(torch.eye(m, dtype=theta.dtype), MH.contiguous())
    return torch.block_diag(gG, gH)


def christoffel_symbols(metric_fn: Callable[[Tensor], Tensor], theta: Tensor,
                        fd_step: float | None = None) -> Tensor:
    """``Γ^k_ij = ½ g^{kl} (∂_i g_lj + ∂_j g_li − ∂_l g_ij)`` at ``θ``; shape (k, i, j).

    Derivatives of the metric tensor by autograd, or by central finite differences with
    step ``fd_step`` when given.
    """
    D = theta.numel()
    if fd_step is None:
        dg = torch.autograd.functional.jacobian(metric_fn, theta)        # (l, j, i) = ∂_i g_lj
    else:
        cols = []
        for i in range(D):
            e = torch.zeros_like(theta)
            e[i] = fd_step
            cols.append((metric_fn(theta + e) - metric_fn(theta - e)) / (2 * fd_step))
        dg = torch.stack(cols, dim=-1)
    ginv = torch.linalg.inv(metric_fn(theta))
    # T_lij = ∂_i g_lj + ∂_j g_li − ∂_l g_ij
    T = dg.permute(0, 2, 1) + dg - dg.permute(2, 0, 1)
    return 0.5 * torch.einsum("kl,lij->kij", ginv, T)


def christoffel_contraction(metric_fn: Callable[[Tensor], Tensor], theta: Tensor, v: Tensor) -> Tensor:
    """``Γ(v, v)`` without forming all symbols:
    ``Γ^k(v, v) = g^{kl} [(∂_i g_lj) vⁱ vʲ − ½ ∂_l (vᵀ g v)]`` (one JVP and one gradient)."""
    _, dgv = torch.func.jvp(lambda th: metric_fn(th) @ v, (theta,), (v,))
    grad_quad = torch.func.grad(lambda th: v @ metric_fn(th) @ v)(theta)
    return torch.linalg.solve(metric_fn(theta), dgv - 0.5 * grad_quad)


def geodesic_rk4(metric_fn: Callable[[Tensor], Tensor], theta: Tensor, velocity: Tensor,
                 t: float = 1.0, steps: int = 200) -> tuple[Tensor, Tensor]:
    """Integrate ``θ̈ = −Γ(θ̇, θ̇)`` from ``(θ, v)`` to time ``t`` with RK4.

    Returns the trajectory of positions and velocities, shapes ``(steps+1, D)``.
    """
    def f(state):
        x, v = state
        return v, -christoffel_contraction(metric_fn, x, v)

    dt = t / steps
    x, v = theta.clone(), velocity.clone()
    xs, vs = [x], [v]
    for _ in range(steps):
        k1 = f((x, v))
        k2 = f((x + 0.5 * dt * k1[0], v + 0.5 * dt * k1[1]))
        k3 = f((x + 0.5 * dt * k2[0], v + 0.5 * dt * k2[1]))
        k4 = f((x + dt * k3[0], v + dt * k3[1]))
        x = x + dt / 6 * (k1[0] + 2 * k2[0] + 2 * k3[0] + k4[0])
        v = v + dt / 6 * (k1[1] + 2 * k2[1] + 2 * k3[1] + k4[1])
        xs.append(x)
        vs.append(v)
    return torch.stack(xs), torch.stack(vs)


def taylor_remainder_slope(f: Callable[[Tensor], Tensor], x: Tensor, direction: Tensor,
                           directional_derivative: float, ts: Tensor | None = None) -> float:
    """Slope of ``log |f(x + t d) − f(x) − t Df[d]|`` against ``log t``: 2 when the
    claimed directional derivative is right, 1 when it is wrong (pymanopt-style check)."""
    ts = torch.logspace(-4, -1, 8, dtype=torch.float64) if ts is None else ts
    f0 = f(x)
    rem = torch.stack([(f(x + t * direction) - f0 - t * directional_derivative).abs() for t in ts])
    A = torch.stack([ts.log(), torch.ones_like(ts)], 1)
    sol = torch.linalg.lstsq(A, rem.log().unsqueeze(1)).solution
    return float(sol[0, 0])
