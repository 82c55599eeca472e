"""Geometry: pair metrics as objects (one registry), GL(h) pair quotient geometry (batched),
the free parts (adaptive, Euclidean; one registry), and their product over a whole model."""
# the free parts register themselves on import (FREE_PARTS): one import line each
from .adaptive import AdaptiveGeometry
from .euclidean import EuclideanGeometry
from .free import FREE_PARTS, FreePart, free_part_names, get_free_part, register_free_part
from .gl import (PairGeometry, act, exact_geodesic_gl1, geodesic_acceleration, horizontal_projection,
                 metric_inner, riemannian_gradient)
from .metrics import METRICS, InvariantMetric, MixedMetric, PairMetric, get_metric, metric_names, register_metric
from .protocol import SolverGeometry
from .rotary import RotaryPairGeometry, random_rotary_element
from .space import NORMS, P_NORMS, PAIR_PARTS, AdaptiveBallPairStack, L2Norm, LinfNorm, PairStack, ProductGeometry

__all__ = ["FREE_PARTS", "FreePart", "free_part_names", "get_free_part", "register_free_part", "METRICS", "NORMS", "PAIR_PARTS", "P_NORMS", "AdaptiveBallPairStack", "AdaptiveGeometry",
           "EuclideanGeometry", "InvariantMetric", "L2Norm", "LinfNorm", "MixedMetric", "PairGeometry",
           "PairMetric", "PairStack", "ProductGeometry", "RotaryPairGeometry", "SolverGeometry", "act",
           "exact_geodesic_gl1", "geodesic_acceleration", "get_metric", "horizontal_projection", "metric_inner",
           "metric_names", "random_rotary_element", "register_metric", "riemannian_gradient"]
