"""The Hessian through stacked LayerNorms against central finite differences (issue 32 item 4).

Forward-over-reverse second derivatives of ``layer_norm`` are silently wrong in torch
(pytorch issues 196700 and 198017), so hideseek's Hessian-vector products are reverse over
reverse (double backward).  Here every entry of the Hessian of a tiny pre-norm transformer
block with two LayerNorms (float64, random LayerNorm weights and biases so that their cross
terms are generic) is checked against central differences of the autograd gradient — an
independent reference that uses first derivatives only:

* :class:`hideseek.EuclideanHessian`: ``∇²f``, column ``j`` against
  ``(∇f(θ + h e_j) − ∇f(θ − h e_j)) / 2h``;
* :class:`hideseek.RiemannianHessian` with the adaptive metric ``Σ ξ_i² / θ_i²``: that metric is
  flat — in log coordinates ``θ_i = s_i exp(u_i)`` (``s_i`` the sign) it is ``Σ du_i²`` — so
  the Riemannian Hessian in orthonormal coordinates is the plain Hessian of
  ``u ↦ f(s ⊙ exp u)``, again by central differences of its gradient.  The operator's
  whitened coordinates are ``w = ξ / |θ| = s ⊙ du``, hence the comparison with ``S A S``.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import hideseek as hs

H_FD = 1e-5        # central differences: error O(h²·f''') + O(eps/h), both far below the tolerance
RTOL = 1e-6


class TwoNormBlock(nn.Module):
    """Pre-norm attention and MLP with a LayerNorm before each, then a linear read-out."""

    def __init__(self, dim=4, heads=2, classes=3, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)
        with torch.no_grad():       # away from LayerNorm's (1, 0) initialisation and from 0
            for ln in (self.ln1, self.ln2):
                ln.weight.copy_(1 + 0.5 * torch.rand(dim))
                ln.bias.copy_(0.3 + 0.2 * torch.rand(dim))
            for q in self.parameters():      # no weight exactly 0 (the attention biases start at 0)
                q.add_(0.05 * torch.rand_like(q) + 0.05)
        self.double().eval()

    def forward(self, x):
        h = self.ln1(x)
        h = x + self.attn(h, h, h, need_weights=False)[0]
        h = h + self.fc(torch.tanh(self.ln2(h)))
        return self.head(h.mean(1))


@pytest.fixture(scope="module")
def block_and_data():
    model = TwoNormBlock()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(5, 3, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (5,), generator=g))
               for _ in range(2)]
    return model, batches


def _flat_loss(model, batches, names, shapes):
    """``v ↦ f(θ)`` with θ the flat vector ``v`` in the order ``names`` (mean over batches)."""
    sizes = [torch.Size(s).numel() for s in shapes]

    def f(v):
        params = {n: t.reshape(s) for n, t, s in zip(names, torch.split(v, sizes), shapes)}
        return sum(F.cross_entropy(functional_call(model, params, (x,)), y) for x, y in batches) / len(batches)
    return f


def _fd_hessian(f, v0):
    """Central differences of the autograd gradient of ``f`` at ``v0``, column by column."""
    def grad(v):
        v = v.detach().requires_grad_(True)
        return torch.autograd.grad(f(v), v)[0]
    cols = []
    for j in range(v0.numel()):
        e = torch.zeros_like(v0)
        e[j] = H_FD
        cols.append((grad(v0 + e) - grad(v0 - e)) / (2 * H_FD))
    return torch.stack(cols, dim=1)


def _layout_of(H):
    names = [n for n, _ in H.layout]
    return names, [s for _, s in H.layout]


def _assert_close(A, R):
    err = (A - R).abs().max() / R.abs().max()
    assert err < RTOL, f"max |Hessian − finite differences| / max |entry| = {float(err):.3g}"


def test_euclidean_hessian_matches_finite_differences_through_two_layernorms(block_and_data):
    model, batches = block_and_data
    H = hs.EuclideanHessian(model, batches)
    names, shapes = _layout_of(H)
    params = dict(model.named_parameters())
    assert {"ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias"} <= set(names) and set(names) == set(params)
    theta = torch.cat([params[n].detach().reshape(-1) for n in names])
    A = H.whitened_matmat(torch.eye(H.dim, dtype=torch.float64))     # the identity metric: A = ∇²f
    R = _fd_hessian(_flat_loss(model, batches, names, shapes), theta)
    _assert_close(A, R)
    # the LayerNorm weight cross terms (where forward-over-reverse goes wrong) are not all ~0
    start = {n: sum(torch.Size(s).numel() for s in shapes[:i]) for i, (n, s) in enumerate(zip(names, shapes))}
    w1, w2 = slice(start["ln1.weight"], start["ln1.weight"] + 4), slice(start["ln2.weight"], start["ln2.weight"] + 4)
    assert R[w1, w2].abs().max() > 1e-3
    _assert_close(A[w1, w2], R[w1, w2])


def test_adaptive_riemannian_hessian_is_the_hessian_in_log_coordinates(block_and_data):
    model, batches = block_and_data
    H = hs.RiemannianHessian(model, batches, hs.Measure(geometry="adaptive"))
    names, shapes = _layout_of(H)
    params = dict(model.named_parameters())
    theta = torch.cat([params[n].detach().reshape(-1) for n in names])
    assert (theta != 0).all()
    sign = theta.sign()
    f = _flat_loss(model, batches, names, shapes)
    R = _fd_hessian(lambda u: f(sign * u.exp()), theta.abs().log())
    A = H.whitened_matmat(torch.eye(H.dim, dtype=torch.float64))
    _assert_close(sign[:, None] * A * sign[None, :], R)
    # not the Euclidean Hessian rescaled alone: the gradient term diag(θ ⊙ ∇f) is in it
    E = hs.EuclideanHessian(model, batches).whitened_matmat(torch.eye(H.dim, dtype=torch.float64))
    scaled = theta[:, None] * E * theta[None, :]
    assert (R - scaled).diagonal().abs().max() > 1e-4
