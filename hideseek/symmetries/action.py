"""The GL(h) group action on a model's parameters (for invariance checks and demos)."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

from .base import SymmetryBlock
from .discover import find_symmetries


def random_gl(count: int, h: int, generator: torch.Generator, *, log_cond: float = 1.0,
              dtype=torch.float64) -> Tensor:
    """``count`` random invertible ``h × h`` matrices ``U diag(e^s) V`` with orthogonal
    ``U, V`` and ``s ~ U(−log_cond/2, log_cond/2)`` (condition number ≤ e^log_cond)."""
    def orth():
        q, r = torch.linalg.qr(torch.randn(count, h, h, generator=generator, dtype=torch.float64))
        return q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)

    s = (torch.rand(count, h, generator=generator, dtype=torch.float64) - 0.5) * log_cond
    return (orth() * s.exp().unsqueeze(-2) @ orth()).to(dtype)


@torch.no_grad()
def apply_random_action(model: nn.Module, blocks: Sequence[SymmetryBlock] | None = None, *,
                        generator: torch.Generator | None = None, log_cond: float = 1.0) -> nn.Module:
    """Move every pair ``(G, H)`` of ``model`` to ``(G A, H A⁻ᵀ)`` with its own random ``A``,
    in place.  The function the model computes does not change."""
    generator = generator or torch.Generator().manual_seed(0)
    blocks = find_symmetries(model) if blocks is None else list(blocks)
    params = dict(model.named_parameters())
    for blk in blocks:
        new_pairs = []
        for G, H in blk.split({n: params[n] for n in blk.param_names}):
            A = random_gl(G.shape[0], G.shape[-1], generator, log_cond=log_cond, dtype=G.dtype)
            new_pairs.append((G @ A, H @ torch.linalg.inv(A).transpose(-1, -2)))
        for name, value in blk.merge(new_pairs).items():
            params[name].copy_(value)
    return model
