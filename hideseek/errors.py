"""The library's exceptions, in a module that imports nothing of the library (so that any
module may raise them without an import circle).  Re-exported where they have always been
(``hideseek.SharpnessInputError``, ``hideseek.inputs``, ``hideseek.sharpness``,
``hideseek.symmetries``)."""
from __future__ import annotations

__all__ = ["SharpnessInputError", "UnsupportedAttentionError"]


class SharpnessInputError(ValueError):
    """The model, its weights or the batches are not fit for a sharpness measurement.

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Dropout(0.5))   # left in training mode
    >>> try:
    ...     hs.sharpness(model, [(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))], progress=False)
    ... except hs.SharpnessInputError as err:
    ...     print(str(err).split(" (")[0])
    the model is in training mode
    """


class UnsupportedAttentionError(ValueError):
    """The model has attention whose GL(h) symmetry is broken or unknown to hideseek.

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> attn = torch.nn.MultiheadAttention(8, 2, add_bias_kv=True)     # learned extra keys break GL(h)
    >>> try:
    ...     hs.find_symmetries(attn)
    ... except hs.UnsupportedAttentionError as err:
    ...     print(str(err).splitlines()[1].strip())
    - : nn.MultiheadAttention(add_bias_kv=True) appends learned keys/values that are not part of a GL(h) pair; ...
    >>> hs.find_symmetries(attn, on_unsupported="adaptive")           # or measure it elementwise
    []
    """
