"""Attention families as registered adapters: one module per family, each registering a
:class:`~hideseek.symmetries.families.registry.Family` (a match rule, a builder and a priority)
in :data:`~hideseek.symmetries.families.registry.FAMILIES`.
:func:`hideseek.symmetries.discover.find_symmetries` takes a declared block first, then asks
the families in :func:`~hideseek.symmetries.families.registry.family_order`."""
from .registry import FAMILIES, Family, family_order, register_family

# the families register themselves on import: one line each
from . import torch_mha  # noqa: E402,F401  (nn.MultiheadAttention, open_clip's default blocks)
from . import open_clip  # noqa: E402,F401  (open_clip's own Attention)
from . import timm  # noqa: E402,F401  (timm's ViT Attention)
from . import hf_gpt2  # noqa: E402,F401  (GPT-2, GPT-BigCode: c_attn + c_proj)
from . import hf_packed  # noqa: E402,F401  (GPT-NeoX, BLOOM, Persimmon, Phi-3, MPT: one packed projection)
from . import hf_qkv  # noqa: E402,F401  (BERT, Llama, T5, DeBERTa-v2, … : separate q/k/v projections)

__all__ = ["FAMILIES", "Family", "family_order", "register_family"]
