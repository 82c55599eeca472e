"""hideseek — geodesic sharpness on the quotient manifold of transformer symmetries.

Reference implementation of *Hide & Seek: Transformer Symmetries Obscure Sharpness &
Riemannian Geometry Finds It* (da Silva, Dangel, Oore, ICML 2025).

>>> import hideseek as hs
>>> res = hs.sharpness(model.eval(), batches, measure="geodesic", metric="mixed", rho=0.1)
>>> res.value, res.per_batch                                        # doctest: +SKIP
"""
from .geometry import PairGeometry, ProductGeometry
from .sharpness import SharpnessInputError, SharpnessResult, sharpness
from .symmetries import (AttentionBlock, DiagonalPair, FactorPair, SymmetryBlock,
                         UnsupportedAttentionError, find_symmetries)

__version__ = "0.1.0"
__all__ = ["AttentionBlock", "DiagonalPair", "FactorPair", "PairGeometry", "ProductGeometry",
           "SharpnessInputError", "SharpnessResult", "SymmetryBlock", "UnsupportedAttentionError",
           "find_symmetries", "sharpness"]
