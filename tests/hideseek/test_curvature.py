"""The Riemannian Hessian operator (hideseek/curvature.py, docs/maths.md §14) against
independent references: the dense Hessian of hideseek/reference/hessian.py (metric tensor
from the definition, Christoffel term by autograd, horizontal space by an SVD), second
derivatives of the loss along RK4 geodesics of the dense metric, the scalar pair's closed
forms derived by hand (docs/maths.md §14.4), a group action applied by hand, and SciPy."""
import copy

import numpy as np
import pytest
import torch
from scipy.sparse.linalg import eigsh
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import hideseek as hs
from hideseek.curvature import EuclideanHessian, RiemannianHessian
from hideseek.reference.hessian import (dense_riemannian_hessian, fixed_coordinate_vectors, pair_vertical_vectors,
                                        product_metric_tensor, second_derivative_along_geodesic)
from hideseek.symmetries import apply_random_action
from tests.models import MHAClassifier


# ---------------------------------------------------------------------------- models
class FactorNet(nn.Module):
    """tanh features, then logits through ``G Hᵀ`` (a GL(2) pair) and a bias: 29 weights."""

    def __init__(self, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        r = lambda *s: nn.Parameter(torch.randn(*s, generator=g, dtype=torch.float64))  # noqa: E731
        self.W, self.G, self.H, self.b = r(3, 4), r(4, 2), r(3, 2), r(3)
        self.eval()

    def forward(self, x):
        return torch.tanh(x @ self.W) @ self.G @ self.H.T + self.b


class ScalarPair(nn.Module):
    """``out = g h x`` (docs/maths.md §9)."""

    def __init__(self, g, h):
        super().__init__()
        self.g = nn.Parameter(torch.tensor([g], dtype=torch.float64))
        self.h = nn.Parameter(torch.tensor([h], dtype=torch.float64))
        self.eval()

    def forward(self, x):
        return self.g * self.h * x


def _sq_loss(out, y):
    return ((out - y) ** 2).sum()


def _factor_data(seed=1, n=7):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    return [(x[:4], torch.randint(0, 3, (4,), generator=g)), (x[4:], torch.randint(0, 3, (n - 4,), generator=g))]


def _mha_data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 3, 4, generator=g, dtype=torch.float64)
    return [(x, torch.randint(0, 3, (5,), generator=g))]


FACTOR_PAIR = [hs.FactorPair("G", "H")]


# ---------------------------------------------------------------------------- dense reference
def _reference(Hop: RiemannianHessian, algebras=None):
    """``(K, E, loss_flat, theta, metric_fn)``: the dense Hessian of the same loss in the
    operator's flat layout, built by hideseek/reference/hessian.py alone."""
    parts = []
    for pg in Hop.geometry.pairs:
        B, n, h = pg.G.shape
        parts.append(("pairs", B, n, pg.H.shape[1], h, Hop.measure.metric, Hop.measure.eps))
    free = "euclidean" if Hop.measure.geometry == "euclidean" else "adaptive"
    parts += [(free, t.numel()) for t in Hop.geometry.adaptive.theta]
    theta = torch.cat([t.reshape(-1) for pg in Hop.geometry.pairs for t in (pg.G, pg.H)]
                      + [t.reshape(-1) for t in Hop.geometry.adaptive.theta]).detach()

    def loss_flat(p):
        params = Hop.geometry.point(Hop.unflatten(p - theta))      # θ + ξ, re-arranged into the model
        with sdpa_kernel(SDPBackend.MATH):
            return sum(Hop.loss(params, x, y) for x, y in Hop.batches) / len(Hop.batches)

    metric_fn = lambda p: product_metric_tensor(p, parts)  # noqa: E731
    V = torch.cat([pair_vertical_vectors(theta, parts, algebras), fixed_coordinate_vectors(theta, parts)], dim=1)
    K, E = dense_riemannian_hessian(loss_flat, theta, metric_fn, V)
    return K, E, loss_flat, theta, metric_fn


def _random_tangent(Hop, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in Hop.shapes]


MEASURES = [hs.Measure(), hs.Measure(metric="mixed"), hs.Measure(eps=0.3), hs.Measure(geometry="adaptive"),
            hs.Measure(geometry="euclidean")]


@pytest.mark.parametrize("measure", MEASURES, ids=lambda m: m.label)
def test_factor_net_matches_the_dense_reference(measure):
    """matvec, exact trace, top eigenvalue (eigsh on to_scipy) and the dense symmetric form
    against the dense reference, 1e-8, for both metrics, ε > 0, the adaptive and the plain
    geometry; self-adjoint in g."""
    model = FactorNet()
    pairs = FACTOR_PAIR if measure.geometry == "geodesic" else None
    Hop = RiemannianHessian(model, _factor_data(), measure, pairs=pairs, keep_graph=True)
    K, E, *_ = _reference(Hop)
    ref = torch.linalg.eigvalsh(K)
    # lift(Hess[E a]) = E K a
    a = torch.randn(E.shape[1], generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got = Hop.matvec(E @ a)
    torch.testing.assert_close(got, E @ (K @ a), rtol=1e-8, atol=1e-10)
    tr = Hop.trace()
    assert tr.value == pytest.approx(float(ref.sum()), rel=1e-8, abs=1e-10) and tr.stderr == 0.0
    assert tr.n_matvecs == Hop.dim
    top = Hop.eigenvalues(2)
    np.testing.assert_allclose(top, ref.flip(0)[:2].numpy(), rtol=1e-8, atol=1e-10)
    vals = eigsh(Hop.to_scipy(), k=3, which="LA", return_eigenvectors=False)
    np.testing.assert_allclose(np.sort(vals)[::-1], ref.flip(0)[:3].numpy(), rtol=1e-8, atol=1e-10)
    # the symmetric form: the Hessian's spectrum plus one zero per vertical direction
    dense = torch.linalg.eigvalsh(Hop.dense())
    n_vert = Hop.dim - E.shape[1]
    expect = torch.sort(torch.cat([ref, torch.zeros(n_vert, dtype=ref.dtype)])).values
    torch.testing.assert_close(dense, expect, rtol=1e-8, atol=1e-10)
    # self-adjoint in the metric, on arbitrary (not horizontal) vectors
    x, y = _random_tangent(Hop, 4), _random_tangent(Hop, 5)
    lhs, rhs = Hop.inner(x, Hop.matvec(y)), Hop.inner(Hop.matvec(x), y)
    assert float(lhs) == pytest.approx(float(rhs), rel=1e-10)


@pytest.mark.parametrize("metric", ["invariant", "mixed"])
def test_attention_model_matches_the_dense_reference(metric):
    """nn.MultiheadAttention (Q/K and V/O pairs found by discovery): trace and the top two
    eigenvalues against the dense reference, 1e-8."""
    Hop = RiemannianHessian(MHAClassifier(dim=4, heads=2), _mha_data(), hs.Measure(metric=metric), keep_graph=True)
    K, E, *_ = _reference(Hop)
    ref = torch.linalg.eigvalsh(K)
    assert Hop.trace().value == pytest.approx(float(ref.sum()), rel=1e-8, abs=1e-10)
    np.testing.assert_allclose(Hop.eigenvalues(2), ref.flip(0)[:2].numpy(), rtol=1e-8, atol=1e-10)


class _Blend:
    """A metric defined by its blocks alone (``M_G = S̃_G⁻¹ + S_H``, ``M_H = S̃_H⁻¹ + S_G``),
    registered for one test: everything of the operator then comes from the generic
    defaults of :class:`~hideseek.geometry.metrics.PairMetric`."""

    @staticmethod
    def make():
        from hideseek.geometry.metrics import PairMetric, gram

        class HessianBlend(PairMetric):
            name = "hessian_test_blend"

            @classmethod
            def blocks(cls, G, H, eps=0.0):
                SG, SH, SGt, SHt = gram(G, H, eps)
                return torch.linalg.inv(SGt) + SH, torch.linalg.inv(SHt) + SG

        return HessianBlend


@pytest.fixture
def blend_metric():
    from hideseek.geometry.metrics import METRICS, register_metric

    cls = register_metric(_Blend.make())
    try:
        yield cls.name
    finally:
        METRICS.pop(cls.name, None)


def test_a_registered_blocks_only_metric_gets_its_hessian(blend_metric):
    """Adding a metric (one class, one registry line) adds its Hessian: against the dense
    reference built from the metric's definition alone, 1e-8."""
    Hop = RiemannianHessian(FactorNet(), _factor_data(), hs.Measure(metric=blend_metric), pairs=FACTOR_PAIR,
                            keep_graph=True)
    K, E, *_ = _reference(Hop)
    ref = torch.linalg.eigvalsh(K)
    a = torch.randn(E.shape[1], generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    torch.testing.assert_close(Hop.matvec(E @ a), E @ (K @ a), rtol=1e-8, atol=1e-10)
    assert Hop.trace().value == pytest.approx(float(ref.sum()), rel=1e-8, abs=1e-10)


def _tiny_rotary_lm():
    """GPT-NeoX with rotary on half of each head's columns (one rotated pair, two free
    columns): float64 throughout (unlike Llama, whose RMSNorm computes in float32)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPTNeoXConfig(vocab_size=11, hidden_size=4, num_hidden_layers=1, num_attention_heads=1,
                                     intermediate_size=8, max_position_embeddings=16, rotary_pct=0.5)
    model = transformers.GPTNeoXForCausalLM(cfg).double().eval()
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    return model, [(ids, ids)]


def _next_token_loss(out, y):
    return nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), y[:, 1:].reshape(-1))


def test_rotary_attention_matches_the_dense_reference():
    """A GPT-NeoX block with partial rotary (Q/K under GL(1, ℂ) × GL(2), V/O under GL(4)):
    trace and top eigenvalues against the dense reference whose vertical space on Q/K is
    spanned by that subgroup's Lie algebra; only the attention weights are perturbed."""
    from hideseek.geometry.rotary import RotaryPairGeometry, rotary_generators

    model, data = _tiny_rotary_lm()
    keep = ("query_key_value", "attention.dense")
    exclude = [n for n, _ in model.named_parameters() if not any(k in n for k in keep)]
    Hop = RiemannianHessian(model, data, hs.Measure(metric="mixed"), loss_fn=_next_token_loss, exclude=exclude,
                            keep_graph=True)
    rot = [i for i, pg in enumerate(Hop.geometry.pairs) if isinstance(pg, RotaryPairGeometry)]
    assert len(rot) == 1 and Hop.geometry.adaptive.names == ["gpt_neox.layers.0.attention.dense.bias"]
    pg = Hop.geometry.pairs[rot[0]]
    h = pg.G.shape[-1]
    units = [torch.zeros(h, h, dtype=torch.float64) for _ in pg.rotary_free for _ in pg.rotary_free]
    for k, (i, j) in enumerate((i, j) for i in pg.rotary_free for j in pg.rotary_free):
        units[k][i, j] = 1.0
    algebra = torch.cat([rotary_generators(h, pg.rotary, torch.float64)] + ([torch.stack(units)] if units else []))
    K, E, *_ = _reference(Hop, algebras={rot[0]: algebra})
    ref = torch.linalg.eigvalsh(K)
    fixed = int((Hop.geometry.adaptive.theta[0] == 0).sum())   # b_O starts at 0: held fixed (§6)
    assert len(algebra) == 2 + 4 and E.shape[1] == Hop.dim - len(algebra) - h * h - fixed   # Q/K loses 6, V/O 16
    assert Hop.trace().value == pytest.approx(float(ref.sum()), rel=1e-8, abs=1e-10)
    np.testing.assert_allclose(Hop.eigenvalues(2), ref.flip(0)[:2].numpy(), rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("metric", ["invariant", "mixed"])
def test_quadratic_form_is_the_second_derivative_along_the_geodesic(metric):
    """⟨Hess f[ξ], ξ⟩_g = d²/dt² f(γ_ξ(t)) at 0, γ the geodesic of the dense metric tensor
    integrated by RK4 (no Christoffel formula of the library), for random horizontal ξ."""
    Hop = RiemannianHessian(FactorNet(), _factor_data(), hs.Measure(metric=metric), pairs=FACTOR_PAIR)
    _, _, loss_flat, theta, metric_fn = _reference(Hop)
    for seed in (0, 1):
        xi = Hop.project(_random_tangent(Hop, seed))
        xi = [t / float(Hop.inner(xi, xi)).__pow__(0.5) for t in xi]
        want = second_derivative_along_geodesic(loss_flat, theta, metric_fn, Hop.flatten(xi), steps=4)
        got = float(Hop.inner(xi, Hop.matvec(xi)))
        assert got == pytest.approx(want, rel=1e-6, abs=1e-8)


def test_euclidean_hessian_is_the_autograd_hessian():
    model = FactorNet()
    Hop = EuclideanHessian(model, _factor_data())
    names = [n for n, _ in model.named_parameters()]
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    shapes = [p.shape for p in model.parameters()]

    def f(v):
        parts, s = {}, 0
        for n, sh in zip(names, shapes):
            k = int(np.prod(sh))
            parts[n] = v[s:s + k].reshape(sh)
            s += k
        return sum(Hop.loss(parts, x, y) for x, y in Hop.batches) / len(Hop.batches)

    ref = torch.autograd.functional.hessian(f, theta)
    assert [label for label, _ in Hop.layout] == names
    torch.testing.assert_close(Hop.dense(), ref, rtol=1e-10, atol=1e-12)
    assert Hop.trace().value == pytest.approx(float(torch.trace(ref)), rel=1e-10)


# ---------------------------------------------------------------------------- closed forms
@pytest.mark.parametrize("metric", ["invariant", "mixed"])
@pytest.mark.parametrize("g,h,x,y", [(0.7, 1.3, 1.3, 0.8), (-1.1, 0.4, 0.5, -2.0), (2.0, -0.3, 1.0, 1.0),
                                     (0.3, 0.25, 1.0, 1.0)])
def test_scalar_pair_closed_forms(metric, g, h, x, y):
    """L = (g h x − y)²: the quotient is one-dimensional and the Hessian is the number
    invariant 4βx(2βx − y), mixed 4x² (β = gh; derived in docs/maths.md §14.4), on the
    horizontal direction (g, h); the Euclidean trace is 2x²(g² + h²)."""
    model = ScalarPair(g, h)
    data = [(torch.tensor([x], dtype=torch.float64), torch.tensor([y], dtype=torch.float64))]
    Hop = RiemannianHessian(model, data, hs.Measure(metric=metric), loss_fn=_sq_loss,
                            pairs=[hs.DiagonalPair("g", "h")])
    beta = g * h
    want = 4 * beta * x * (2 * beta * x - y) if metric == "invariant" else 4 * x * x
    assert Hop.trace().value == pytest.approx(want, rel=1e-12)
    xi = Hop.unflatten(torch.tensor([g, h], dtype=torch.float64))         # horizontal: ξ_g/g = ξ_h/h
    torch.testing.assert_close(Hop.flatten(Hop.matvec(xi)), want * Hop.flatten(xi), rtol=1e-12, atol=1e-12)
    vertical = Hop.unflatten(torch.tensor([g, -h], dtype=torch.float64))  # (g λ, −h λ)
    assert float(Hop.flatten(Hop.matvec(vertical)).abs().max()) < 1e-12
    E = EuclideanHessian(model, data, loss_fn=_sq_loss)
    assert E.trace().value == pytest.approx(2 * x * x * (g * g + h * h), rel=1e-12)


# ---------------------------------------------------------------------------- identities
@pytest.mark.parametrize("measure", [hs.Measure(), hs.Measure(metric="mixed"), hs.Measure(geometry="adaptive")],
                         ids=lambda m: m.label)
def test_critical_point_leaves_only_the_projected_euclidean_hessian(measure):
    """Where ∇f = 0 (squared error to the model's own outputs) the Hessian is P^h g⁻¹ ∇²f ξ:
    the Euclidean Hessian-vector product through the geometry's own Riemannian gradient map."""
    model = FactorNet(seed=2)
    x = _factor_data()[0][0]
    data = [(x, model(x).detach())]
    loss = lambda out, y: ((out - y) ** 2).mean()  # noqa: E731
    pairs = FACTOR_PAIR if measure.geometry == "geodesic" else None
    Hop = RiemannianHessian(model, data, measure, loss_fn=loss, pairs=pairs)
    assert max(float(g.abs().max()) for g in Hop.egrad) == 0.0
    for seed in (0, 1):
        xi = Hop.project(_random_tangent(Hop, seed))
        want = Hop.geometry.rgrad(Hop.euclidean_hvp(xi))
        for a, b in zip(Hop.matvec(xi), want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_vertical_directions_map_to_zero_and_outputs_are_horizontal():
    Hop = RiemannianHessian(FactorNet(), _factor_data(), hs.Measure(metric="mixed"), pairs=FACTOR_PAIR)
    pg = Hop.geometry.pairs[0]
    Lam = torch.randn(1, 2, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    vert = [*pg.vertical(Lam)] + [torch.zeros(s, dtype=torch.float64) for s in Hop.shapes[2:]]
    assert max(float(t.abs().max()) for t in Hop.matvec(vert)) < 1e-12
    out = Hop.matvec(_random_tangent(Hop, 0))
    assert float(pg.horizontal_residual(out[0], out[1]).abs().max()) < 1e-12


@pytest.mark.parametrize("metric", ["invariant", "mixed"])
def test_trace_and_eigenvalues_are_invariant_under_the_group_action(metric):
    """A random GL(2) element applied to the pair by hand (apply_random_action) leaves the
    trace and the top eigenvalues unchanged; the adaptive geometry's trace changes."""
    model = FactorNet()
    moved = copy.deepcopy(model)
    block = FACTOR_PAIR[0].bind(dict(moved.named_parameters()))
    apply_random_action(moved, [block], generator=torch.Generator().manual_seed(7), log_cond=2.0)
    assert not torch.allclose(moved.G, model.G)
    data = _factor_data()
    a = RiemannianHessian(model, data, hs.Measure(metric=metric), pairs=FACTOR_PAIR, keep_graph=True)
    b = RiemannianHessian(moved, data, hs.Measure(metric=metric), pairs=FACTOR_PAIR, keep_graph=True)
    assert b.trace().value == pytest.approx(a.trace().value, rel=1e-9)
    np.testing.assert_allclose(b.eigenvalues(3), a.eigenvalues(3), rtol=1e-9)
    ad = [RiemannianHessian(m, data, "adaptive").trace().value for m in (model, moved)]
    assert abs(ad[0] - ad[1]) > 1e-3 * abs(ad[0])


# ---------------------------------------------------------------------------- estimators
def test_hutchinson_and_hutchpp_converge_to_the_exact_trace():
    """Error within a few standard errors of the exact trace, the standard error shrinking
    like 1/√probes; Hutch++ with a sketch at least the dimension is exact."""
    Hop = RiemannianHessian(FactorNet(), _factor_data(), hs.Measure(), pairs=FACTOR_PAIR, keep_graph=True)
    exact = Hop.trace().value
    small, large = Hop.trace("hutchinson", n_probes=40, seed=0), Hop.trace("hutchinson", n_probes=400, seed=1)
    for est in (small, large):
        assert abs(est.value - exact) <= 4 * est.stderr
    assert large.stderr < small.stderr / 2                        # √10 in expectation
    assert large.n_matvecs == 400 and large.method == "hutchinson"
    pp = Hop.trace("hutch++", n_probes=3 * Hop.dim, seed=0)       # sketch spans the whole space
    assert pp.value == pytest.approx(exact, rel=1e-9, abs=1e-12)
    pp = Hop.trace("hutch++", n_probes=30, seed=2)
    assert abs(pp.value - exact) <= 4 * pp.stderr and pp.n_matvecs == 30


def test_the_whitened_hessian_is_an_operator_of_the_estimators():
    """hideseek.estimators runs on the Hessian's symmetric form as on any operator: the exact
    trace of the dense matrix built column by column equals the chunked exact trace, and a
    dense copy gives the stochastic estimates of the operator itself (same probes)."""
    from hideseek.estimators import DenseOperator, Operator, exact_trace, hutchpp_trace

    Hop = RiemannianHessian(FactorNet(), _factor_data(), hs.Measure(metric="mixed"), pairs=FACTOR_PAIR,
                            keep_graph=True)
    W = Hop.whitened()
    assert isinstance(W, Operator) and W.shape == Hop.shape == (Hop.dim, Hop.dim)
    dense = DenseOperator(Hop.dense())
    assert exact_trace(dense).value == pytest.approx(Hop.trace().value, rel=1e-10, abs=1e-12)
    a, b = Hop.trace("hutch++", n_probes=9, seed=4), hutchpp_trace(dense, n_probes=9, seed=4)
    assert a.value == pytest.approx(b.value, rel=1e-8, abs=1e-10) and a.stderr == pytest.approx(b.stderr, rel=1e-6)


def test_kept_graph_and_batched_products_give_the_same_values():
    """keep_graph (one backward pass per product) and chunked products (one vectorised
    backward pass per chunk) change nothing but the cost."""
    data = _factor_data()
    plain = RiemannianHessian(FactorNet(), data, hs.Measure(metric="mixed"), pairs=FACTOR_PAIR, chunk=1)
    fast = RiemannianHessian(FactorNet(), data, hs.Measure(metric="mixed"), pairs=FACTOR_PAIR, keep_graph=True,
                             chunk=7)
    X = torch.randn(plain.dim, 9, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    torch.testing.assert_close(fast.matmat(X), plain.matmat(X), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(fast.matvec(X[:, 0]), plain.matvec(X[:, 0]), rtol=1e-12, atol=1e-14)
    assert fast.trace().value == pytest.approx(plain.trace().value, rel=1e-12)


# ---------------------------------------------------------------------------- layout, errors
def test_flat_layout_and_bad_input():
    Hop = RiemannianHessian(FactorNet(), _factor_data(), hs.Measure(), pairs=FACTOR_PAIR)
    assert Hop.layout == [("pairs[0].G", (1, 4, 2)), ("pairs[0].H", (1, 3, 2)), ("W", (3, 4)), ("b", (3,))]
    assert Hop.dim == 29
    x = _random_tangent(Hop, 0)
    assert all(torch.equal(a, b) for a, b in zip(Hop.unflatten(Hop.flatten(x)), x))
    torch.testing.assert_close(Hop.flatten(Hop.matvec(x)), Hop.matvec(Hop.flatten(x)))
    X = torch.stack([Hop.flatten(x), Hop.flatten(_random_tangent(Hop, 1))], dim=1)
    torch.testing.assert_close(Hop.matmat(X)[:, 1], Hop.matvec(X[:, 1]))
    with pytest.raises(ValueError, match="29 entries"):
        Hop.matvec(torch.zeros(5, dtype=torch.float64))
    with pytest.raises(ValueError, match="trace method"):
        Hop.trace("xtrace")
    with pytest.raises(ValueError, match="n_probes"):
        Hop.trace("hutchinson", n_probes=1)
    with pytest.raises(ValueError, match="k must be"):
        Hop.eigenvalues(29)
    with pytest.raises(ValueError, match="max_dim"):
        Hop.trace(max_dim=10)
    with pytest.raises(ValueError, match="mixed metric at eps > 0"):
        RiemannianHessian(FactorNet(), _factor_data(), hs.Measure(metric="mixed", eps=0.1), pairs=FACTOR_PAIR)
    with pytest.raises(ValueError, match="Christoffel-only"):
        RiemannianHessian(FactorNet(), _factor_data(), hs.Measure(ball="adaptive"), pairs=FACTOR_PAIR)
    with pytest.raises(hs.SharpnessInputError, match="training mode"):
        RiemannianHessian(FactorNet().train(), _factor_data(), "adaptive")
