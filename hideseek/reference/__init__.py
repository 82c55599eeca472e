"""Slow, obviously-correct references for tests and notebooks (float64, small sizes).

Nothing here is used by the fast path.  The metric tensor is written from the definitions
of docs/maths.md §2 in coordinates ``θ = (vec G, vec H)``; Christoffel symbols come from its
derivatives (autograd, checked against finite differences), and geodesics from integrating
``θ̈ = −Γ(θ̇, θ̇)`` with RK4.  None of it uses the closed forms of
:mod:`hideseek.geometry.gl`.
"""
from .pairs import christoffel_contraction, christoffel_symbols, geodesic_rk4, pair_metric_tensor, \
    taylor_remainder_slope  # noqa: F401
from .hessian import dense_riemannian_hessian, fixed_coordinate_vectors, pair_vertical_vectors, product_metric_tensor, \
    second_derivative_along_geodesic  # noqa: F401
