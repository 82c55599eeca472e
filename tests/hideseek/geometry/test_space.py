"""The product geometry and its parts (hideseek/geometry/space.py, adaptive.py), float64.

References computed by hand: the product norm is the ℓ2 norm of the parts' norms, each
part's norm from its definition (pair metric through ``PairGeometry.inner``, the adaptive
norm elementwise); the Riemannian gradient is the metric dual of the Euclidean one on
the allowed subspace; projection is idempotent and lands in the horizontal space.
"""
import pytest
import torch

from hideseek.geometry import AdaptiveGeometry, PairGeometry, PairStack, ProductGeometry
from hideseek.symmetries import find_symmetries

from tests.models import MHAClassifier


def _geom(norm="riemannian", metric="invariant", p="l2", blocks=True, **kw):
    model = MHAClassifier()
    g = torch.Generator().manual_seed(11)   # no exact zeros (zero biases): those are tested apart
    params = {n: t.detach() + 0.1 * torch.randn(t.shape, generator=g, dtype=t.dtype)
              for n, t in model.named_parameters()}
    return ProductGeometry(params, find_symmetries(model) if blocks else [], metric=metric, norm=norm, p=p, **kw)


def _rand(geom, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in geom.zeros()]


def _inner_by_hand(geom, x, y):
    """Sum of the parts' inner products written from their definitions."""
    k = geom.n_pair_tensors
    total = torch.zeros((), dtype=torch.float64)
    for i, pg in enumerate(geom.pairs):
        if geom.norm == "riemannian":
            total = total + pg.inner(x[2 * i], x[2 * i + 1], y[2 * i], y[2 * i + 1]).sum()
        else:
            cG, cH = pg.G.abs(), pg.H.abs()
            total = total + (x[2 * i] * y[2 * i] / cG ** 2).sum() + (x[2 * i + 1] * y[2 * i + 1] / cH ** 2).sum()
    for xi, yi, t in zip(x[k:], y[k:], geom.adaptive.theta):
        total = total + (xi * yi / t.abs() ** 2).sum()
    return total


@pytest.mark.parametrize("norm", ["riemannian", "adaptive"])
@pytest.mark.parametrize("metric", ["invariant", "mixed"])
def test_product_norm_is_the_sum_of_the_parts(norm, metric):
    geom = _geom(norm, metric)
    x = _rand(geom)
    torch.testing.assert_close(geom.sqnorm(x), _inner_by_hand(geom, x, x), rtol=1e-12, atol=0)


@pytest.mark.parametrize("norm", ["riemannian", "adaptive"])
@pytest.mark.parametrize("metric", ["invariant", "mixed"])
def test_projection_rgrad_ball_direction(norm, metric):
    geom = _geom(norm, metric)
    x, g = _rand(geom, 0), _rand(geom, 1)
    px = geom.project(x)
    for a, b in zip(geom.project(px), px):                                   # idempotent
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    if norm == "riemannian":                                                 # horizontal
        for i, pg in enumerate(geom.pairs):
            assert float(pg.horizontal_residual(px[2 * i], px[2 * i + 1]).abs().max()) < 1e-10
    # metric dual: <rgrad(g), v>_metric = <g, v> (Euclidean) for every allowed v
    r = geom.rgrad(g)
    lhs = _inner_by_hand(geom, r, px)
    rhs = sum((a * b).sum() for a, b in zip(g, px))
    torch.testing.assert_close(lhs, rhs, rtol=1e-10, atol=1e-12)
    d = geom.direction(g)
    assert float(geom.sqnorm(d)) == pytest.approx(1.0, rel=1e-12)
    b = geom.ball([10.0 * t for t in x], 0.3)
    assert float(geom.norm_of(b)) == pytest.approx(0.3, rel=1e-12)
    u = geom.random_direction(torch.Generator().manual_seed(3))
    assert float(geom.norm_of(u)) == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("metric", ["invariant", "mixed"])
def test_direction_in_place_hands_the_result_to_the_callers_list(metric):
    """``direction(g, inplace=True)``: the same bits as on a copy, and the caller's list
    ends up holding the result (the pairs' old gradient is let go before the norm)."""
    geom = _geom("riemannian", metric)
    g = _rand(geom, 1)
    ref = geom.direction([t.clone() for t in g])
    old_pairs = g[:geom.n_pair_tensors]
    d = geom.direction(g, inplace=True)
    assert all(a is b for a, b in zip(g, d)) and len(g) == len(d)
    assert not any(a is b for a, b in zip(g, old_pairs))
    for a, b in zip(d, ref):
        assert torch.equal(a, b)


def test_linf_is_the_box_of_the_adaptive_part():
    geom = _geom(p="linf", blocks=False)
    x = _rand(geom)
    theta = geom.adaptive.theta
    by_hand = max(float((xi.abs() / t.abs()).max()) for xi, t in zip(x, theta))
    assert float(geom.norm_of(x)) == pytest.approx(by_hand, rel=1e-12)
    b = geom.ball(x, 0.01)
    assert all(bool((bi.abs() <= 0.01 * t.abs() * (1 + 1e-12)).all()) for bi, t in zip(b, theta))
    with pytest.raises(ValueError, match="l∞"):
        _geom(p="linf")


def test_adaptive_part_holds_exact_zeros():
    theta = [torch.tensor([1.0, 0.0, -2.0], dtype=torch.float64)]
    part = AdaptiveGeometry(["w"], theta)
    x = [torch.tensor([0.5, 3.0, 1.0], dtype=torch.float64)]
    assert part.project(x)[0].tolist() == [0.5, 0.0, 1.0]
    assert float(part.sqnorm_terms(x)[0]) == pytest.approx(0.5 ** 2 + 0.5 ** 2)
    with pytest.raises(ValueError, match="p must be"):
        AdaptiveGeometry(["w"], theta, p="l1")


def test_a_new_pair_part_is_one_class():
    """A pair part with another per-stack geometry plugs into the product unchanged."""
    class Relaxed(PairStack):
        def make_pair(self, G, H, key, metric, eps):
            return PairGeometry(G, H, metric, eps + 0.5)

    plain, relaxed = _geom(), _geom(pair_part=Relaxed)
    assert isinstance(relaxed.pair_part, Relaxed) and all(pg.eps == 0.5 for pg in relaxed.pairs)
    x = relaxed.project(_rand(relaxed))
    torch.testing.assert_close(relaxed.sqnorm(x), _inner_by_hand(relaxed, x, x), rtol=1e-12, atol=0)
    assert float(relaxed.sqnorm(x)) != float(plain.sqnorm(x))
    assert relaxed.dimension() == plain.dimension()


def test_with_free_part_keeps_the_parts_and_the_tangent_layout():
    """A wrapped free part (the sharded and row-restricted geometries use this) replaces both the
    ``adaptive`` attribute and the last of ``parts``; a point computed through the wrapper equals the
    unwrapped one; a part over other parameters is refused."""
    geom = _geom()
    x = _rand(geom)
    before = {n: t.clone() for n, t in geom.point(x).items()}
    calls = []

    class Spy:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def point(self, xs, out):
            calls.append(len(xs))
            return self.inner.point(xs, out)

    inner = geom.adaptive
    geom.with_free_part(Spy)
    assert geom.parts[-1] is geom.adaptive and geom.adaptive.inner is inner and len(geom.parts) == 2
    after = geom.point(x)
    assert calls == [inner.n_tensors] and inner.n_tensors > 0
    assert set(after) == set(before) and all(torch.equal(after[n], before[n]) for n in before)

    other = AdaptiveGeometry(inner.names[:-1], list(inner.theta[:-1]), "l2")
    with pytest.raises(ValueError, match="same parameters in the same order"):
        geom.with_free_part(lambda free: other)
    assert geom.adaptive.inner is inner           # a refused part leaves the geometry as it was
