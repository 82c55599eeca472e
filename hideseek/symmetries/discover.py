"""Finding the GL symmetries of attention in a model.

Every attention module found gives, per key/value head, one query/key pair and one
value/output pair (``docs/maths.md`` §1.2; grouped-query attention stacks the query heads of
a group, §12).  Supported (``docs/model_support.md`` has the full table):

* ``torch.nn.MultiheadAttention`` (packed or separate q/k/v), which covers open_clip's
  default ``ResidualAttentionBlock``; open_clip's own ``Attention``; timm's ViT ``Attention``
  (packed ``qkv``, without QK-norm, scale-norm or gating);
* Hugging Face attention with ``query/key/value`` (BERT, RoBERTa, ELECTRA, ALBERT, older ViT),
  ``q_proj/k_proj/v_proj`` (ViT, CLIP, BART, Llama, Mistral, Qwen2, Phi, …), ``q_lin/k_lin/
  v_lin`` (DistilBERT), ``q/k/v/o`` (T5: its relative position bias keeps GL),
  ``query_proj/key_proj/value_proj`` (DeBERTa-v2, with its position projections stacked), and
  an output ``o_proj/out_proj/out_lin/dense/o`` or a sibling ``output.dense``;
* packed ``c_attn`` + ``c_proj`` (GPT-2, Conv1D weights stored (in, out); GPT-BigCode), per-head
  packed ``query_key_value`` + ``dense`` (GPT-NeoX, BLOOM: ALiBi is a score bias and keeps GL,
  Persimmon), Phi-3's ``qkv_proj`` and MPT's ``Wqkv`` (without ``clip_qkv``);
* grouped-query and multi-query attention (``num_key_value_heads``);
* rotary position embeddings (Llama, Mistral, Qwen2, GPT-NeoX, Phi, Phi-3, GPT-J, incl.
  partial rotary; ``docs/maths.md`` §12):
  their query/key pairs carry the rotary subgroup (:class:`PairGroup`, ``rotary``), read from
  the model's rotary module and its ``rotate_half``, value/output pairs keep full GL;
* anything declared by hand with :func:`~hideseek.symmetries.declare_attention`;
* peft LoRA adapters: one GL(r) pair per adapter and target module (:mod:`.lora`), and
  attention whose projections are LoRA-wrapped (its pairs on the base layers).

Attention whose symmetry is broken (QK-norm, scaled cosine attention, relative-key position
embeddings, norms or gates between heads and output, learned bias keys/values) or whose layout
no adapter knows raises :class:`UnsupportedAttentionError` with one line per module naming
what was found, unless ``on_unsupported="adaptive"``: then those parameters are left to the
elementwise (adaptive) geometry.

Each family is an adapter module of :mod:`hideseek.symmetries.families` registered with a match
rule and a priority (:data:`~hideseek.symmetries.families.registry.FAMILIES`); a block declared
by hand is taken before any of them.
"""
from __future__ import annotations

from torch import nn

from .base import SymmetryBlock, UnsupportedAttentionError
from .declare import declared_spec
from .families import family_order
from .families.common import ATTN_LIKE, ModelInfo, qualified
from .lora import adapter_params, lora_pairs

__all__ = ["UnsupportedAttentionError", "find_symmetries"]


def _block_for(name: str, mod: nn.Module, info: ModelInfo) -> SymmetryBlock | None:
    """The block of module ``name``: its declared spec, else the first registered family (highest
    priority first) that matches it and builds a block; ``None`` if none does."""
    spec = declared_spec(name, mod)
    if spec is not None:
        blk = spec.bind(info.params)
        blk.family = "declared"
        return blk
    for family in family_order():
        if not family.match(mod):
            continue
        blk = family.build(name, mod, info)
        if blk is None:
            continue
        if family.adapters_inside:
            # peft LoRA layers on the block's projections: their adapters are not in the block
            blk.adapters = tuple(blk.adapters) + tuple(
                n for sub, m in mod.named_modules() for n in adapter_params(qualified(name, sub), m))
        blk.family = family.name
        return blk
    return None


def _inside(a: str, b: str) -> bool:
    """Module/parameter path ``a`` is ``b`` or below it (``""`` is the model itself)."""
    return b == "" or a == b or a.startswith(b + ".")


def find_symmetries(model: nn.Module, on_unsupported: str = "raise") -> list[SymmetryBlock]:
    """The attention symmetry blocks of ``model``, in module order, then one
    :class:`~hideseek.symmetries.lora.LoRAPair` per peft LoRA adapter and target module.

    Each block is readable (``print(block)``, ``block.describe()``): module path, kind
    (``qk`` or ``vo``), number of pairs, head width, group (``GL(h)`` or the rotary subgroup)
    and, for grouped-query attention, the query heads per pair.

    ``on_unsupported``: ``"raise"`` (default) for attention whose symmetry is broken or
    unknown, or ``"adaptive"`` to leave those parameters to the elementwise geometry.

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> _ = torch.manual_seed(0)
    >>> attn = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()   # width 8, 2 heads of width 4
    >>> hs.find_symmetries(attn)
    [AttentionBlock(''; qk: 2×GL(4) G9×4 H9×4, vo: 2×GL(4) G9×4 H8×4)]
    >>> from hideseek.symmetries import apply_random_action
    >>> x = torch.randn(2, 5, 8)
    >>> before, w = attn(x, x, x)[0], attn.in_proj_weight.detach().clone()
    >>> _ = apply_random_action(attn, generator=torch.Generator().manual_seed(1))   # a random group element
    >>> torch.allclose(attn(x, x, x)[0], before, atol=1e-5), torch.allclose(attn.in_proj_weight, w)
    (True, False)
    """
    if on_unsupported not in ("raise", "adaptive"):
        raise ValueError("on_unsupported must be 'raise' or 'adaptive'")
    info = ModelInfo(model)
    blocks: list[SymmetryBlock] = []
    problems: list[str] = []
    handled: list[str] = []
    for name, mod in info.modules.items():
        if any(_inside(name, h) and name != h for h in handled):
            continue          # inside an attention module already found or refused
        try:
            blk = _block_for(name, mod, info)
        except UnsupportedAttentionError as err:
            problems.append(str(err))
            handled.append(name)
            continue
        if blk is not None:
            blocks.append(blk)
            handled.append(name)
    for name, mod in info.modules.items():
        if not ATTN_LIKE.search(type(mod).__name__):
            continue
        if not any(_inside(p, name) for p in info.params):
            continue  # parameter-free helper (e.g. a softmax wrapper)
        if any(_inside(h, name) or _inside(name, h) for h in handled):
            continue
        problems.append(f"{name or '<the model>'}: {type(mod).__name__} looks like attention but no hideseek adapter "
                        "recognises its projections; declare it with hideseek.symmetries.declare_attention(...)")
        handled.append(name)
    if problems and on_unsupported == "raise":
        raise UnsupportedAttentionError(
            "cannot apply the GL(h) attention geometry to this model:\n  - " + "\n  - ".join(problems)
            + "\nPass on_unsupported='adaptive' to treat these parameters elementwise (adaptive "
            "geometry), or declare the blocks yourself (hideseek.symmetries.declare_attention).")
    return blocks + [p.bind(info.params) for p in lora_pairs(model)]
