"""Geometry: GL(h) pair quotient geometry, batched, and the whole-model product geometry."""
from .gl import (METRICS, PairGeometry, act, exact_geodesic_gl1, geodesic_acceleration,
                 horizontal_projection, metric_inner, riemannian_gradient)
from .space import NORMS, ProductGeometry

__all__ = ["METRICS", "NORMS", "PairGeometry", "ProductGeometry", "act", "exact_geodesic_gl1",
           "geodesic_acceleration", "horizontal_projection", "metric_inner", "riemannian_gradient"]
