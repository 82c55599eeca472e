"""hideseek — geodesic sharpness on the quotient manifold of transformer symmetries.

Reference implementation of *Hide & Seek: Transformer Symmetries Obscure Sharpness &
Riemannian Geometry Finds It* (da Silva, Dangel, Oore, ICML 2025).

>>> import hideseek as hs
>>> res = hs.sharpness(model.eval(), batches, hs.Measure(metric="mixed"), rho=0.1)  # doctest: +SKIP
>>> res.value, res.per_batch, res.measure.label                              # doctest: +SKIP
"""
from .geometry import AdaptiveGeometry, PairGeometry, ProductGeometry
from .measures import Measure
from .problem import SharpnessProblem
from .relative_flatness import RelativeFlatnessResult, relative_flatness
from .rho import RhoSuggestion, suggest_rho
from .sharpness import SharpnessInputError, SharpnessResult, sharpness
from .solvers import SolverResult, SolverStep
from .zoo import sharpness_zoo
from .symmetries import (AttentionBlock, AttentionSpec, DiagonalPair, FactorPair, PairGroup, SymmetryBlock,
                         UnsupportedAttentionError, declare_attention, find_symmetries)

__version__ = "0.2.0"


def __getattr__(name: str):
    """``hs.optim`` (SAM, ASAM, geodesic SAM) is imported on first use: measuring sharpness
    does not load the training code."""
    if name == "optim":
        import importlib

        return importlib.import_module(".optim", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AdaptiveGeometry", "AttentionBlock", "AttentionSpec", "DiagonalPair", "FactorPair", "Measure",
           "PairGeometry", "PairGroup", "ProductGeometry", "RelativeFlatnessResult", "RhoSuggestion", "SharpnessInputError",
           "SharpnessProblem", "SharpnessResult", "SolverResult", "SolverStep", "SymmetryBlock", "UnsupportedAttentionError",
           "declare_attention", "find_symmetries", "optim", "relative_flatness", "sharpness", "sharpness_zoo",
           "suggest_rho"]
