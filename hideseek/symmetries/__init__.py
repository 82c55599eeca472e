"""Finding and reading the GL(h) symmetries of a model (see :mod:`.discover`)."""
from .base import (AttentionBlock, DiagonalPair, FactorPair, LinearRef, PairGroup, SymmetryBlock,
                   heads_from_linear, heads_from_out_proj, linear_from_heads, out_proj_from_heads)
from .action import apply_random_action, random_gl
from .discover import UnsupportedAttentionError, find_symmetries

__all__ = ["apply_random_action", "random_gl", "AttentionBlock", "DiagonalPair", "FactorPair", "LinearRef", "PairGroup",
           "SymmetryBlock", "UnsupportedAttentionError", "find_symmetries", "heads_from_linear",
           "heads_from_out_proj", "linear_from_heads", "out_proj_from_heads"]
