"""The GL(h) group action on a model's parameters (for invariance checks and demos)."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

from .base import PairGroup, SymmetryBlock
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


def random_group_element(group: PairGroup, count: int, generator: torch.Generator, *,
                         log_cond: float = 1.0, dtype=torch.float64) -> Tensor:
    """``count`` random elements of the group acting on ``group``'s pairs: GL(h)
    (:func:`random_gl`) or, for rotary pairs, ``a I + c J`` on each rotary column pair
    (``a + i c = e^{s + iφ}``, ``s ~ U(−log_cond/2, log_cond/2)``) and GL on the free columns."""
    if not group.rotary:
        return random_gl(count, group.h, generator, log_cond=log_cond, dtype=dtype)
    A = torch.zeros(count, group.h, group.h, dtype=torch.float64)
    for i, j in group.rotary:
        s = (torch.rand(count, generator=generator, dtype=torch.float64) - 0.5) * log_cond
        phi = torch.rand(count, generator=generator, dtype=torch.float64) * 2 * torch.pi
        a, c = s.exp() * phi.cos(), s.exp() * phi.sin()
        A[:, i, i], A[:, j, j], A[:, i, j], A[:, j, i] = a, a, c, -c
    if group.rotary_free:
        f = torch.tensor(group.rotary_free)
        A[:, f.unsqueeze(1), f.unsqueeze(0)] = random_gl(count, len(f), generator, log_cond=log_cond)
    return A.to(dtype)


@torch.no_grad()
def apply_random_action(model: nn.Module, blocks: Sequence[SymmetryBlock] | None = None, *,
                        generator: torch.Generator | None = None, log_cond: float = 1.0) -> nn.Module:
    """Move every pair ``(G, H)`` of ``model`` to ``(G A, H A⁻ᵀ)`` with its own random ``A``
    of the pair's group (:func:`random_group_element`), in place.  The function the model
    computes does not change."""
    generator = generator or torch.Generator().manual_seed(0)
    blocks = find_symmetries(model) if blocks is None else list(blocks)
    params = dict(model.named_parameters())
    for blk in blocks:
        new_pairs = []
        for grp, (G, H) in zip(blk.groups, blk.split({n: params[n] for n in blk.param_names})):
            A = random_group_element(grp, G.shape[0], generator, log_cond=log_cond, dtype=G.dtype)
            new_pairs.append((G @ A, H @ torch.linalg.inv(A).transpose(-1, -2)))
        for name, value in blk.merge(new_pairs).items():
            params[name].copy_(value)
    return model
