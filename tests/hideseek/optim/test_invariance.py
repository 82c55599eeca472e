"""The geodesic ascent step commutes with the GL(h) symmetry of attention; SAM's and ASAM's do not.

The action is written here by hand for ``nn.MultiheadAttention`` (packed in-projection):
per head, ``W_q ← Aᵀ W_q``, ``W_k ← A⁻¹ W_k`` (biases alike), ``W_v ← Bᵀ W_v``,
``W_o[:, head] ← W_o[:, head] B⁻ᵀ`` — the function is unchanged.  After one ascent step
from θ and from the moved θ, the two perturbed models compute the same function (float64)
for geodesic SAM, different ones for SAM and ASAM."""
import copy

import pytest
import torch
import torch.nn.functional as F

import hideseek as hs
from tests.conftest import mha_batches
from tests.models import MHAClassifier


def _random_invertible(h, gen, spread=1.5):
    q1, _ = torch.linalg.qr(torch.randn(h, h, generator=gen, dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(h, h, generator=gen, dtype=torch.float64))
    s = torch.exp(spread * (torch.rand(h, generator=gen, dtype=torch.float64) - 0.5))
    return q1 @ torch.diag(s) @ q2


@torch.no_grad()
def _act_by_hand(model, seed=0):
    attn, gen = model.attn, torch.Generator().manual_seed(seed)
    d, heads = attn.embed_dim, attn.num_heads
    dk = d // heads
    W, b, Wo = attn.in_proj_weight, attn.in_proj_bias, attn.out_proj.weight
    for i in range(heads):
        q, k, v = (slice(j * d + i * dk, j * d + (i + 1) * dk) for j in range(3))
        A, B = _random_invertible(dk, gen), _random_invertible(dk, gen)
        Ai, Bi = torch.linalg.inv(A), torch.linalg.inv(B)
        W[q], b[q] = A.T @ W[q], A.T @ b[q]
        W[k], b[k] = Ai @ W[k], Ai @ b[k]
        W[v], b[v] = B.T @ W[v], B.T @ b[v]
        cols = slice(i * dk, (i + 1) * dk)
        Wo[:, cols] = Wo[:, cols] @ Bi.T
    return model


def _ascend(model, measure, x, y, rho):
    sam = hs.optim.SAM(model, torch.optim.SGD(model.parameters(), lr=0.1), measure, rho=rho)
    F.cross_entropy(model(x), y).backward()
    sam.first_step(zero_grad=True)
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("measure,invariant", [
    ("geodesic_invariant", True), ("geodesic_mixed", True),
    ("euclidean", False), ("adaptive", False)])
def test_ascent_step_and_group_action(measure, invariant):
    x, y = mha_batches(1, size=8, seed=5)[0]
    base = MHAClassifier()
    moved = _act_by_hand(copy.deepcopy(base))
    with torch.no_grad():
        out0 = base(x)
        assert torch.allclose(moved(x), out0, rtol=0, atol=1e-12)            # the action is a symmetry
        assert max(float((p - q).abs().max()) for p, q in zip(base.parameters(), moved.parameters())) > 0.1
    rho = 0.3
    a, b = _ascend(base, measure, x, y, rho), _ascend(moved, measure, x, y, rho)
    change = float((a - out0).abs().max())
    assert change > 1e-3                                 # the ascent step moved the function
    gap = float((a - b).abs().max())
    if invariant:
        assert gap < 1e-10 * max(1.0, change)
    else:
        assert gap > 0.05 * change
