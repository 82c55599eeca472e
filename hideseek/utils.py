"""Small shared helpers."""
from __future__ import annotations

import ctypes
import functools
import os
import sys

import torch


def set_threads(n: int | None = None) -> int:
    """Set torch's intra-op threads (default: ``HIDESEEK_THREADS`` or all cores)."""
    if n is None:
        n = int(os.environ.get("HIDESEEK_THREADS", os.cpu_count() or 1))
    torch.set_num_threads(max(1, n))
    return torch.get_num_threads()


def resolve_device(device: str | None) -> torch.device:
    """``"auto"``/``None`` -> cuda when available, else cpu; a named cuda device must exist."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} requested but CUDA is not available")
    return dev


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    try:
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    except (OSError, TypeError):    # no C library to load by that name (Windows)
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_memory() -> bool:
    """Hand the memory freed inside the C library's heap back to the system (glibc's
    ``malloc_trim(0)``); ``False`` and nothing done where there is no such call (macOS, musl).

    glibc keeps freed blocks below its mmap threshold — a threshold that rises to the
    largest block freed, up to 32 MiB, so parameter-sized blocks of all but the largest
    models — in its heap, where they count in the resident memory until reused: a search
    that allocates and frees many of them in a varying order then holds more memory than it
    uses.  Changes no value.  Not free: the memory it gives back is faulted in again by the
    next allocation of that size, which on small models is a noticeable share of a pass — so
    :func:`hideseek.sharpness` calls it only from
    :data:`hideseek.sharpness.TRIM_FROM` perturbed weights on (``reports/benchmarks.md``)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class HostSyncCounter(torch.overrides.TorchFunctionMode):
    """Counts the tensor operations that copy a value to the host (``float(t)``,
    ``bool(t)``, ``int(t)``, ``t.item()``, ``t.tolist()``, ``t.numpy()``) inside a ``with``
    block — on a GPU each one waits for the device.  ``counts`` splits them by origin:
    ``"hideseek"`` (this library's code) and ``"other"`` (the model, the caller).

    >>> with HostSyncCounter() as c:                        # doctest: +SKIP
    ...     hs.sharpness(model, batches, rho=0.1)
    >>> c.counts                                            # doctest: +SKIP

    Every torch call inside the block goes through Python, so do not time under it.
    """

    _SYNCS = frozenset({torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.__int__,
                        torch.Tensor.__index__, torch.Tensor.item, torch.Tensor.tolist,
                        torch.Tensor.numpy})
    _TORCH_DIR = os.path.dirname(torch.__file__)
    _OWN_DIR = os.path.dirname(os.path.abspath(__file__))

    def __init__(self) -> None:
        super().__init__()
        self.counts = {"hideseek": 0, "other": 0}

    def _origin(self) -> str:
        frame = sys._getframe(2)
        while frame is not None:
            path = frame.f_code.co_filename
            if not (path.startswith(self._TORCH_DIR) or path == __file__):
                return "hideseek" if path.startswith(self._OWN_DIR) else "other"
            frame = frame.f_back
        return "other"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self._SYNCS:
            self.counts[self._origin()] += 1
        return func(*args, **(kwargs or {}))


def register_named(registry: dict, name: str, obj, what: str):
    """Add ``obj`` to ``registry`` under ``name`` and return it; a name already taken by another
    object is an error naming the ``what`` (the one rule of hideseek's registries: pair metrics,
    free parts, attention families)."""
    if registry.get(name, obj) is not obj:
        taken = registry[name]
        raise ValueError(f"a {what} named {name!r} is already registered ({getattr(taken, '__name__', taken)})")
    registry[name] = obj
    return obj
