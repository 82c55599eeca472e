"""Small shared helpers."""
from __future__ import annotations

import os

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
