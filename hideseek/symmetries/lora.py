"""LoRA adapters (peft) as GL(r) pairs (paper Example A.3).

A peft LoRA layer computes ``base(x) + s · B A x`` per adapter (``A = lora_A[name].weight``,
``r × in``; ``B = lora_B[name].weight``, ``out × r``; ``s = scaling[name]``, a constant).
The function uses ``B A`` only, so ``(A, B) ↦ (M A, B M⁻¹)`` for any ``M ∈ GL(r)`` leaves the
model unchanged, whatever ``s`` (it multiplies ``B A``, not either factor alone; DoRA's column
norm of ``W + s B A`` depends on ``B A`` only, too).  As a pair ``(G, H)`` with ``G Hᵀ = B A``:
``G = B`` (``out × r``), ``H = Aᵀ`` (``in × r``) — a :class:`~hideseek.symmetries.FactorPair`
with ``transpose_h=True``, one per adapter and target module.  Embedding adapters
(``lora_embedding_A`` ``r × num``, ``lora_embedding_B`` ``dim × r``, ``ΔWᵀ = B A``) are the same pair.

Layers are recognised by what peft's ``LoraLayer`` holds (``base_layer``, ``lora_A``,
``lora_B``, ``scaling``), not by importing peft.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from .base import FactorPair

__all__ = ["LoRAPair", "adapter_params", "base_of", "is_lora_layer", "lora_pairs"]


def is_lora_layer(mod) -> bool:
    """A peft LoRA layer (``lora.Linear``, ``lora.Embedding``, …): a wrapped ``base_layer``
    with ``lora_A`` / ``lora_B`` adapters."""
    return (isinstance(mod, nn.Module) and isinstance(getattr(mod, "base_layer", None), nn.Module)
            and isinstance(getattr(mod, "lora_A", None), nn.ModuleDict)
            and isinstance(getattr(mod, "scaling", None), dict))


def base_of(mod):
    """The layer a peft LoRA wrapper wraps; any other module as it is."""
    while is_lora_layer(mod):
        mod = mod.base_layer
    return mod


def _p(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@dataclass(repr=False, eq=False)
class LoRAPair(FactorPair):
    """One LoRA adapter of one target module as a GL(r) pair: ``g`` the ``lora_B`` weight
    (``out × r``), ``h`` the ``lora_A`` weight (``r × in``, transposed); kind ``"lora"``."""

    layer: str = ""
    adapter: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.module = f"{self.layer} (LoRA {self.adapter})" if self.layer else self.module

    def bind(self, params):
        super().bind(params)
        self.groups = tuple(replace(g, kind="lora") for g in self.groups)
        return self


def _linear_pairs(name: str, mod: nn.Module) -> list[LoRAPair]:
    out = []
    for key, a in mod.lora_A.items():
        b = mod.lora_B[key] if key in mod.lora_B else None
        if isinstance(a, nn.Linear) and isinstance(b, nn.Linear) and a.bias is None:
            out.append(LoRAPair(_p(name, f"lora_B.{key}.weight"), _p(name, f"lora_A.{key}.weight"),
                                transpose_h=True, layer=name, adapter=key))
    emb_a, emb_b = getattr(mod, "lora_embedding_A", None), getattr(mod, "lora_embedding_B", None)
    if isinstance(emb_a, nn.ParameterDict) and isinstance(emb_b, nn.ParameterDict):
        for key in emb_a.keys():
            if key in emb_b:
                out.append(LoRAPair(_p(name, f"lora_embedding_B.{key}"), _p(name, f"lora_embedding_A.{key}"),
                                    transpose_h=True, layer=name, adapter=key))
    return out


def lora_pairs(model: nn.Module) -> list[LoRAPair]:
    """One unbound :class:`LoRAPair` per adapter and LoRA layer of ``model``, in module order
    (convolutional adapters, whose factors are not matrices, are left out)."""
    return [p for name, mod in model.named_modules() if is_lora_layer(mod) for p in _linear_pairs(name, mod)]


def adapter_params(name: str, mod: nn.Module) -> tuple[str, ...]:
    """Full names of the adapter parameters of the LoRA layer ``mod`` at ``name`` (empty when
    ``mod`` is not one)."""
    if not is_lora_layer(mod):
        return ()
    return tuple(_p(name, n) for n, _ in mod.named_parameters()
                 if not n.startswith("base_layer."))
