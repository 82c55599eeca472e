"""Finding, declaring and reading the attention symmetries of a model (see :mod:`.discover`,
:mod:`.declare` and ``docs/model_support.md``)."""
from .base import (AttentionBlock, DiagonalPair, FactorPair, LinearRef, PairGroup, SymmetryBlock,
                   UnsupportedAttentionError, heads_from_linear, heads_from_out_proj,
                   linear_from_heads, out_proj_from_heads)
from .action import apply_random_action, random_gl, random_group_element
from .declare import AttentionSpec, declare_attention
from .discover import find_symmetries
from .lora import LoRAPair, is_lora_layer, lora_pairs

__all__ = ["apply_random_action", "random_gl", "random_group_element", "AttentionBlock",
           "AttentionSpec", "DiagonalPair", "FactorPair", "LinearRef", "PairGroup", "SymmetryBlock",
           "UnsupportedAttentionError", "declare_attention", "find_symmetries", "heads_from_linear",
           "heads_from_out_proj", "linear_from_heads", "out_proj_from_heads", "LoRAPair", "is_lora_layer",
           "lora_pairs"]
