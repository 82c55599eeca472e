"""The Euclidean (SAM) ball: hs.sharpness(measure="euclidean") against a dense trust-region
solve, the ℓ∞ box against its closed form, and the geometry's pieces against plain tensors."""
import pytest
import torch
from torch import nn

import hideseek as hs
from hideseek.geometry.euclidean import EuclideanGeometry
from tests.models import MHAClassifier


def _quadratic(seed=0, d=6):
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    lam = torch.tensor([5.0, 3.0, 2.0, 1.0, 0.5, 0.1], dtype=torch.float64)
    A = Q @ torch.diag(lam) @ Q.T
    b = 0.3 * torch.randn(d, generator=g, dtype=torch.float64)
    w0 = torch.linspace(0.2, 3.0, d, dtype=torch.float64)   # unequal |θ|: adaptive ≠ Euclidean

    class Quad(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(w0.clone())

        def forward(self, x):
            delta = self.w - w0
            return 0.5 * delta @ A @ delta + b @ delta

    return Quad().eval(), A, b, Q, lam


def _trust_region(A, b, Q, lam, rho):
    """max over ‖δ‖₂ ≤ ρ of ½ δᵀAδ + bᵀδ: δ = (μI − A)⁻¹ b, μ > λ_max, ‖δ‖ = ρ (bisection)."""
    beta = Q.T @ b
    lo, hi = float(lam.max()) + 1e-12, float(lam.max()) + 100.0
    for _ in range(200):
        mu = 0.5 * (lo + hi)
        lo, hi = (mu, hi) if float(((beta / (mu - lam)) ** 2).sum()) > rho ** 2 else (lo, mu)
    delta = Q @ (beta / (mu - lam))
    return float(0.5 * delta @ A @ delta + b @ delta)


BATCH = [(torch.zeros(1), torch.zeros(1))]


def test_euclidean_sharpness_is_the_trust_region_maximum():
    model, A, b, Q, lam = _quadratic()
    kw = dict(rho=0.7, n_iters=50, loss_fn=lambda out, y: out, progress=False)
    res = hs.sharpness(model, BATCH, hs.Measure(geometry="euclidean"), **kw)
    exact = _trust_region(A, b, Q, lam, 0.7)
    assert res.value == pytest.approx(exact, rel=1e-4)
    assert res.name == "euclidean_l2" and res.measure.label == "euclidean ℓ2"
    assert float(res.solver[0].best[0].norm()) == pytest.approx(0.7, rel=1e-6)
    # the adaptive ball at this θ is another ball: another (here different) value
    adaptive = hs.sharpness(model, BATCH, "adaptive", **kw)
    assert abs(adaptive.value - exact) > 1e-2


def test_euclidean_linf_linear_loss_is_rho_times_l1_norm():
    """For a linear loss gᵀδ the worst case in the box ‖δ‖∞ ≤ ρ is ρ‖g‖₁ at δ = ρ sign(g)."""
    g = torch.tensor([0.5, -2.0, 0.1, -0.3], dtype=torch.float64)

    class Lin(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.tensor([3.0, -0.01, 1.0, 7.0], dtype=torch.float64))

        def forward(self, x):
            return g @ self.w

    res = hs.sharpness(Lin().eval(), BATCH, "euclidean_linf", rho=0.2, n_iters=5,
                       loss_fn=lambda out, y: out, progress=False)
    assert res.value == pytest.approx(0.2 * float(g.abs().sum()), rel=1e-12)
    assert torch.equal(res.solver[0].best[0], 0.2 * torch.sign(g))


def test_euclidean_geometry_pieces_are_the_plain_ones():
    gen = torch.Generator().manual_seed(1)
    theta = [torch.randn(3, 4, generator=gen, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)]
    geom = hs.Measure(geometry="euclidean").geometry_at({"a": theta[0], "b": theta[1]})
    assert isinstance(geom.adaptive, EuclideanGeometry)
    g = [torch.randn_like(t, generator=gen) for t in theta]
    flat = torch.cat([t.flatten() for t in g])
    assert float(geom.sqnorm(g)) == pytest.approx(float(flat @ flat))
    d = geom.direction(g)        # first-order SAM step: g / ‖g‖, also where θ = 0
    for di, gi in zip(d, g):
        assert torch.allclose(di, gi / flat.norm())
    pts = geom.point([0.1 * t for t in g])
    assert torch.allclose(pts["b"], 0.1 * g[1])
    assert torch.equal(geom.ball([10 * t for t in g], 0.5)[1], 10 * g[1] * (0.5 / float(10 * flat.norm())))


def test_euclidean_measure_rules_and_model_with_attention():
    m = hs.Measure.parse("euclidean")
    assert m == hs.Measure(geometry="euclidean") and m.ball == "euclidean" and m.step == "straight"
    assert hs.Measure.parse("avg_euclidean_l2").kind == "average"
    for bad in (dict(metric="mixed"), dict(eps=0.1), dict(step="second_order"), dict(ball="adaptive")):
        with pytest.raises(ValueError, match="euclidean geometry"):
            hs.Measure(geometry="euclidean", **bad)
    model = MHAClassifier().double().eval()
    x = torch.randn(4, 5, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 2, 0])
    res = hs.sharpness(model, [(x, y)], "euclidean", rho=0.05, n_iters=3, progress=False)
    assert res.value > 0 and not res.pairs          # no pairs: every parameter in the plain ball
    assert set(res.norm_share) >= {"qk", "vo", "free"} and sum(res.norm_share.values()) == pytest.approx(1.0)
