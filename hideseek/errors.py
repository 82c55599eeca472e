"""The library's exceptions, in a module that imports nothing of the library (so that any
module may raise them without an import circle).  Re-exported where they have always been
(``hideseek.SharpnessInputError``, ``hideseek.inputs``, ``hideseek.sharpness``,
``hideseek.symmetries``)."""
from __future__ import annotations

__all__ = ["SharpnessInputError", "UnsupportedAttentionError"]


class SharpnessInputError(ValueError):
    """The model, its weights or the batches are not fit for a sharpness measurement."""


class UnsupportedAttentionError(ValueError):
    """The model has attention whose GL(h) symmetry is broken or unknown to hideseek."""
