"""The free parts and their registry: adaptive and Euclidean are siblings behind one interface,
and a newly registered free part is picked up by Measure, sharpness and the Hessian (checked
against closed forms on a linear and a quadratic loss)."""
import pytest
import torch
from torch import nn

import hideseek as hs
from hideseek.geometry.adaptive import AdaptiveGeometry
from hideseek.geometry.euclidean import EuclideanGeometry
from hideseek.geometry.free import FREE_PARTS, FreePart, free_part_names, get_free_part, register_free_part

BATCH = [(torch.zeros(1), torch.zeros(1))]


def test_adaptive_and_euclidean_are_registered_siblings():
    assert free_part_names()[:2] == ("adaptive", "euclidean")
    assert FREE_PARTS["adaptive"] is AdaptiveGeometry and FREE_PARTS["euclidean"] is EuclideanGeometry
    assert not issubclass(EuclideanGeometry, AdaptiveGeometry) and not issubclass(AdaptiveGeometry, EuclideanGeometry)
    for name, cls in (("adaptive", AdaptiveGeometry), ("euclidean", EuclideanGeometry), ("geodesic", AdaptiveGeometry)):
        m = hs.Measure(geometry=name)
        assert m.free_part is cls and m.has_pairs == (name == "geodesic")
        assert type(m.geometry_at({"w": torch.ones(3, dtype=torch.float64)}).adaptive) is cls
    assert hs.geometry.ProductGeometry({"w": torch.ones(2)}, free_part="euclidean").adaptive.name == "euclidean"


def test_registry_refuses_a_taken_name_and_a_non_part():
    class Other(FreePart):
        name = "adaptive"

    with pytest.raises(ValueError, match="already registered"):
        register_free_part(Other)
    with pytest.raises(TypeError, match="FreePart subclass"):
        register_free_part(object)
    with pytest.raises(ValueError, match="free part must be one of"):
        get_free_part("nope")


C = 2.0   # the test part's constant scale


class DoubledBall(FreePart):
    """The ball ‖ξ / 2‖_p ≤ ρ (constant scale 2): metric g = I/4, a test double of a new part."""

    name = "doubled_test"
    measure_prefix = {"worst": "doubled_", "average": "avg_doubled_"}

    @property
    def scale(self):
        return [torch.full((), C, dtype=t.dtype) for t in self.theta]

    def sqnorm_terms(self, x):
        return [(xi / C).square().sum() for xi in x]

    def linf_terms(self, x):
        return [(xi.abs() / C).amax() for xi in x if xi.numel()]

    def project(self, x):
        return list(x)

    def rgrad(self, egrad, inplace=False):
        return [C * C * g for g in egrad]

    def linf_direction(self, egrad, inplace=False):
        return [C * torch.sign(g) for g in egrad]

    def linf_ball(self, x, rho, inplace=False):
        return [xi.clamp(-rho * C, rho * C) for xi in x]

    def draw(self, randn):
        z = [randn(t) for t in self.theta]
        return [C * (torch.sign(zi) if self.p == "linf" else zi) for zi in z]

    def inv_metric(self, g):
        return [C * C * gi for gi in g]

    def inner_terms(self, x, y):
        return [(a * b).sum() / (C * C) for a, b in zip(x, y)]

    def whiten(self, x):
        return [xi / C for xi in x]

    def unwhiten(self, w):
        return [C * wi for wi in w]

    def hessian_terms(self, hv, x, egrad):
        return list(hv)


@pytest.fixture
def doubled():
    register_free_part(DoubledBall)
    try:
        yield DoubledBall.name
    finally:
        FREE_PARTS.pop(DoubledBall.name, None)


G = torch.tensor([0.5, -2.0, 0.1, -0.3], dtype=torch.float64)


class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([3.0, -0.01, 1.0, 7.0], dtype=torch.float64))

    def forward(self, x):
        return G @ self.w


class Quadratic(nn.Module):
    def __init__(self, A):
        super().__init__()
        self.A = A
        self.w = nn.Parameter(torch.linspace(0.2, 3.0, A.shape[0], dtype=torch.float64))

    def forward(self, x):
        return 0.5 * self.w @ self.A @ self.w


def test_a_registered_free_part_is_a_measure_with_sharpness_and_a_hessian(doubled):
    assert hs.Measure.parse("doubled_l2") == hs.Measure(geometry=doubled)
    assert hs.Measure.parse("avg_doubled_linf").kind == "average"
    assert hs.Measure.parse(doubled) == hs.Measure(geometry=doubled)     # the alias: worst case, ℓ2
    assert doubled in hs.measures.geometry_names()
    with pytest.raises(ValueError, match="doubled_test geometry has no metric"):
        hs.Measure(geometry=doubled, metric="mixed")
    kw = dict(rho=0.2, n_iters=5, loss_fn=lambda out, y: out, progress=False)
    # a linear loss gᵀδ: worst case 2ρ‖g‖₂ on the ℓ2 ball of radius 2ρ, 2ρ‖g‖₁ on the box
    l2 = hs.sharpness(Linear().eval(), BATCH, "doubled_l2", **kw).value
    linf = hs.sharpness(Linear().eval(), BATCH, "doubled_linf", **kw).value
    assert l2 == pytest.approx(C * 0.2 * float(G.norm()), rel=1e-10)
    assert linf == pytest.approx(C * 0.2 * float(G.abs().sum()), rel=1e-12)
    # the Hessian under g = I/4 is 4 ∇²f: trace 4 tr A, eigenvalues 4 eig A
    Q, _ = torch.linalg.qr(torch.randn(5, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    A = Q @ torch.diag(torch.tensor([3.0, 1.0, 0.5, -0.2, 2.0], dtype=torch.float64)) @ Q.T
    H = hs.RiemannianHessian(Quadratic(A).eval(), BATCH, hs.Measure(geometry=doubled), loss_fn=lambda out, y: out)
    assert H.trace().value == pytest.approx(C * C * float(torch.trace(A)), rel=1e-12)
    torch.testing.assert_close(H.dense(), C * C * A, rtol=1e-12, atol=1e-12)
