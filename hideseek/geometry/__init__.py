"""Geometry: GL(h) pair quotient geometry (batched), the elementwise adaptive geometry, and
their product over a whole model."""
from .adaptive import AdaptiveGeometry
from .gl import (METRICS, PairGeometry, act, exact_geodesic_gl1, geodesic_acceleration,
                 horizontal_projection, metric_inner, riemannian_gradient)
from .rotary import RotaryPairGeometry, random_rotary_element
from .space import NORMS, PAIR_PARTS, AdaptiveBallPairStack, PairStack, ProductGeometry

__all__ = ["METRICS", "NORMS", "PAIR_PARTS", "AdaptiveBallPairStack", "AdaptiveGeometry", "PairGeometry",
           "PairStack", "ProductGeometry", "RotaryPairGeometry", "act", "exact_geodesic_gl1", "geodesic_acceleration",
           "horizontal_projection", "metric_inner", "random_rotary_element", "riemannian_gradient"]
