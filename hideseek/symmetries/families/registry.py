"""The one registry of attention families (:data:`FAMILIES`).

A *family* is an adapter that recognises one kind of attention module and returns its
:class:`~hideseek.symmetries.base.SymmetryBlock` (or refuses it with an
:class:`~hideseek.symmetries.base.UnsupportedAttentionError` naming what breaks the symmetry):

* ``match(module)``: a cheap test of whether the family applies to the module;
* ``build(name, module, info)``: the bound block, or ``None`` when the module turns out not
  to be this family's after all (the next family is then tried); ``info`` is the
  :class:`~hideseek.symmetries.families.common.ModelInfo` of the whole model;
* ``priority``: families are tried from the highest priority down (equal priorities in
  registration order); the first block found wins.  A block declared by hand
  (:func:`~hideseek.symmetries.declare.declare_attention`) is taken before any family;
* ``adapters_inside``: peft LoRA layers on the module's own projections are the block's
  adapters (the Hugging Face families, whose projections peft wraps).

Adding a family (docs/architecture.md, "Adding a model family") is one module of
:mod:`hideseek.symmetries.families` that calls :func:`register_family`, and its import in the
package's ``__init__``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from ...utils import register_named
from ..base import SymmetryBlock


@dataclass(frozen=True)
class Family:
    """One attention family (module docstring)."""

    name: str
    priority: int
    match: Callable[[nn.Module], bool]
    build: Callable[..., "SymmetryBlock | None"]
    adapters_inside: bool = False


#: the families by name, in registration order
FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add ``family`` to :data:`FAMILIES`; a name already taken by another family is an error."""
    if not isinstance(family, Family) or not family.name:
        raise TypeError(f"register_family needs a Family with a name, got {family!r}")
    return register_named(FAMILIES, family.name, family, "family")


def family_order() -> list[Family]:
    """The families in the order discovery tries them: highest priority first, equal
    priorities in registration order."""
    return sorted(FAMILIES.values(), key=lambda f: -f.priority)
