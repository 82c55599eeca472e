"""The dense Hessian reference (hideseek/reference/hessian.py) against the full Christoffel
symbols of hideseek.reference by finite differences, and its vertical vectors against the
group action (docs/maths.md §14.1)."""
import torch

from hideseek.reference import christoffel_symbols
from hideseek.reference.hessian import dense_riemannian_hessian, pair_vertical_vectors, product_metric_tensor

PARTS = [("pairs", 2, 3, 2, 2, "mixed", 0.0), ("adaptive", 3)]


def _point(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2 * (3 + 2) * 2 + 3, generator=g, dtype=torch.float64)


def _loss(p):
    return (p.sin() * torch.arange(1, p.numel() + 1, dtype=p.dtype)).sum() + (p[:5] ** 2).sum() * p[-1]


def test_contraction_equals_the_christoffel_symbols():
    """Without vertical vectors K = ∇²f − Σ_k ∂_k f Γ^k in a g-orthonormal basis: compare
    with the symbols from central finite differences of the dense metric tensor."""
    theta = _point()
    metric = lambda p: product_metric_tensor(p, PARTS)  # noqa: E731
    K, E = dense_riemannian_hessian(_loss, theta, metric)
    Gam = christoffel_symbols(metric, theta, fd_step=1e-5)
    grad = torch.func.grad(_loss)(theta)
    low = torch.autograd.functional.hessian(_loss, theta) - torch.einsum("k,kij->ij", grad, Gam)
    torch.testing.assert_close(K, E.T @ low @ E, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(E.T @ metric(theta) @ E, torch.eye(E.shape[1], dtype=theta.dtype))


def test_vertical_vectors_are_tangent_to_the_orbits():
    """Moving along a vertical vector changes G Hᵀ of its pair only to second order."""
    theta = _point(1)
    V = pair_vertical_vectors(theta, PARTS)
    assert V.shape == (theta.numel(), 2 * 4)           # B = 2 pairs × h² = 4 generators

    def products(p):
        G = p[:12].reshape(2, 3, 2)
        H = p[12:20].reshape(2, 2, 2)
        return G @ H.transpose(1, 2)

    for j in range(V.shape[1]):
        step = products(theta + 1e-4 * V[:, j]) - products(theta)
        assert float(step.abs().max()) < 1e-6
        assert float(V[20:, j].abs().max()) == 0.0        # free parameters do not move
