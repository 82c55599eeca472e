"""One property suite over every geometry part (float64, tiny shapes), in the spirit of geoopt's.

Parts: GL(h) pairs under every *registered* metric (:data:`hideseek.geometry.metrics.METRICS`,
so a newly registered metric is picked up without editing this file) plus :class:`BlendMetric`,
a metric defined here by its blocks only (it exercises the generic projection, dual and
Christoffel contraction that a new metric inherits), each at ε ∈ {0, 1e-3}; pairs under the
rotary subgroup; the adaptive part (ℓ2, ℓ∞) and the Euclidean part.

Properties, each against an independent reference:

* projection idempotent, its output horizontal: metric inner product with random vertical
  vectors ``(GΛ, −HΛᵀ)`` built by hand (Λ in the group's Lie algebra, entry by entry);
* metric symmetric and positive definite (on horizontal vectors), and equal to the dense
  metric tensor of :func:`hideseek.reference.pair_metric_tensor`;
* Riemannian gradient: ``g(rgrad f, η) = Df[η]`` for horizontal η, ``f`` a random smooth
  function, ``Df[η]`` by central finite differences;
* the step map ``t ↦ point(tξ)``: first and second derivatives at t = 0 (finite differences
  in t) equal ξ and ``−Γ(ξ, ξ)``, Γ from :func:`hideseek.reference.christoffel_contraction`
  (autograd derivatives of the dense metric tensor);
* invariance under the group action applied by hand: ``(G, H) ↦ (GA, HA⁻ᵀ)`` with tangent
  vectors moved alike (A general at ε = 0, orthogonal at ε > 0, where the relaxation
  ``S + εI`` is invariant under O(h) only); elementwise rescaling for the adaptive part,
  sign flips for the Euclidean one.

A metric that is only approximately its ε-relaxed geometry (``eps_exact = False``: the
mixed metric, whose ε regularises inverses that its tensor does not have) is held to an
O(ε) tolerance at ε > 0.
"""
from __future__ import annotations

import math

import pytest
import torch

from hideseek.geometry import METRICS, PairGeometry, ProductGeometry, RotaryPairGeometry
from hideseek.geometry.adaptive import AdaptiveGeometry
from hideseek.geometry.euclidean import EuclideanGeometry
from hideseek.geometry.metrics import PairMetric, gram
from hideseek.reference import christoffel_contraction, pair_metric_tensor

pytestmark = pytest.mark.usefixtures("float64_default")


class BlendMetric(PairMetric):
    """``M_G = S̃_G⁻¹ + S_H``, ``M_H = S̃_H⁻¹ + S_G``: GL(h)-invariant (each term is), defined
    by its blocks alone — every other method is the generic default of PairMetric."""

    name = "blend (test only)"

    @classmethod
    def blocks(cls, G, H, eps=0.0):
        SG, SH, SGt, SHt = gram(G, H, eps)
        return torch.linalg.inv(SGt) + SH, torch.linalg.inv(SHt) + SG


PAIR_METRICS = {**METRICS, BlendMetric.name: BlendMetric}
EPS = (0.0, 1e-3)
ROTARY = ((0, 2),)          # one rotated pair, columns 1 and 3 free (full GL(2) block)
B, N, M, H = 2, 4, 3, 2     # GL pairs
RN, RM, RH = 5, 4, 4        # rotary pairs

PAIR_CASES = [pytest.param(kind, name, eps, id=f"{kind}-{name.split()[0]}-eps{eps:g}")
              for kind in ("gl", "rotary") for name in PAIR_METRICS for eps in EPS]
FREE_CASES = [pytest.param(cls, p, id=f"{cls.__name__}-{p}")
              for cls in (AdaptiveGeometry, EuclideanGeometry) for p in ("l2", "linf")]


# ------------------------------------------------------------------------ pair cases
def _tol(name, eps, exact=1e-9):
    """Tolerance of a property that the metric's ε-relaxed formulas satisfy exactly or to O(ε)."""
    return exact if eps == 0.0 or PAIR_METRICS[name].eps_exact else 30 * eps


def _conditioned(r, h, g):
    """A random (B, r, h) matrix with singular values in [0.7, 1.5] (so ε/λ_min stays O(ε))."""
    U = torch.linalg.qr(torch.randn(B, r, h, generator=g)).Q
    V = torch.linalg.qr(torch.randn(B, h, h, generator=g)).Q
    return U * (0.7 + 0.8 * torch.rand(B, 1, h, generator=g)) @ V.transpose(-1, -2)


def _point(kind, seed=0):
    """A point (G, H) (well conditioned) and a tangent vector (ξ_G, ξ_H)."""
    n, m, h = (N, M, H) if kind == "gl" else (RN, RM, RH)
    g = torch.Generator().manual_seed(seed)
    return [_conditioned(n, h, g), _conditioned(m, h, g), torch.randn(B, n, h, generator=g),
            torch.randn(B, m, h, generator=g)]


def _geometry(kind, name, eps, G, Hm):
    metric = PAIR_METRICS[name]
    if kind == "gl":
        return PairGeometry(G, Hm, metric, eps)
    return RotaryPairGeometry(G, Hm, metric, eps, rotary=ROTARY)


def _algebra_element(kind, h, gen):
    """A random Λ (B, h, h) of the symmetry group's Lie algebra, written entry by entry."""
    if kind == "gl":
        return torch.randn(B, h, h, generator=gen)
    Lam = torch.zeros(B, h, h)
    a, c = torch.randn(2, B, generator=gen)
    Lam[:, 0, 0] = Lam[:, 2, 2] = a                      # a I + c J on columns (0, 2)
    Lam[:, 2, 0], Lam[:, 0, 2] = c, -c
    free = torch.tensor([1, 3])
    Lam[:, free[:, None], free[None, :]] = torch.randn(B, 2, 2, generator=gen)
    return Lam


def _group_element(kind, h, eps, gen):
    """A random A (B, h, h) of the symmetry group; orthogonal when ε > 0."""
    if kind == "gl":
        X = torch.randn(B, h, h, generator=gen)
        if eps > 0:
            return torch.linalg.qr(X).Q
        return torch.eye(h) + 0.5 * X / math.sqrt(h)
    A = torch.zeros(B, h, h)
    phi = 2 * math.pi * torch.rand(B, generator=gen)
    r = torch.ones(B) if eps > 0 else torch.exp(torch.rand(B, generator=gen) - 0.5)
    A[:, 0, 0] = A[:, 2, 2] = r * torch.cos(phi)
    A[:, 2, 0], A[:, 0, 2] = r * torch.sin(phi), -r * torch.sin(phi)
    X = torch.randn(B, 2, 2, generator=gen)
    free = torch.tensor([1, 3])
    A[:, free[:, None], free[None, :]] = torch.linalg.qr(X).Q if eps > 0 else torch.eye(2) + 0.4 * X
    return A


def _act(A, G, Hm):
    """(G, H)·A = (G A, H A⁻ᵀ), by hand."""
    return G @ A, Hm @ torch.linalg.inv(A).transpose(-1, -2)


def _smooth_f(G, Hm):
    """A random-looking smooth function of the pair (fixed coefficients)."""
    cG = torch.linspace(-1, 1, G[0].numel()).reshape(G.shape[1:])
    cH = torch.linspace(0.5, -0.7, Hm[0].numel()).reshape(Hm.shape[1:])
    return (torch.sin(G * cG).sum() + torch.tanh(Hm * cH + 0.3).sum()
            + (G @ Hm.transpose(-1, -2)).square().sum() * 0.1)


@pytest.mark.parametrize("kind,name,eps", PAIR_CASES)
def test_projection_idempotent_and_horizontal(kind, name, eps):
    G, Hm, xG, xH = _point(kind)
    pg = _geometry(kind, name, eps, G, Hm)
    pG, pH = pg.project(xG, xH)
    ppG, ppH = pg.project(pG, pH)
    tol = _tol(name, eps, 1e-10)
    torch.testing.assert_close(ppG, pG, rtol=0, atol=tol * float(pG.abs().max()))
    torch.testing.assert_close(ppH, pH, rtol=0, atol=tol * float(pH.abs().max()))
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        Lam = _algebra_element(kind, G.shape[-1], gen)
        vG, vH = G @ Lam, -(Hm @ Lam.transpose(-1, -2))          # vertical, by hand
        scale = (pg.sqnorm(pG, pH) * pg.sqnorm(vG, vH)).sqrt()
        ip = pg.inner(pG, pH, vG, vH)
        assert float((ip.abs() / scale).max()) < _tol(name, eps, 1e-10), (ip, scale)
    # what was removed is vertical: ξ − Pξ is orthogonal to every horizontal vector
    if eps == 0.0 or PAIR_METRICS[name].eps_exact:
        ip = pg.inner(xG - pG, xH - pH, pG, pH)
        assert float(ip.abs().max()) < 1e-10 * float(pg.sqnorm(xG, xH).max())


@pytest.mark.parametrize("kind,name,eps", PAIR_CASES)
def test_metric_symmetric_positive_definite_and_its_definition(kind, name, eps):
    G, Hm, xG, xH = _point(kind)
    yG, yH = _point(kind, seed=1)[2:]
    pg = _geometry(kind, name, eps, G, Hm)
    torch.testing.assert_close(pg.inner(xG, xH, yG, yH), pg.inner(yG, yH, xG, xH), rtol=1e-13, atol=0)
    pG, pH = pg.project(xG, xH)
    assert bool((pg.sqnorm(pG, pH) > 0).all()) and bool((pg.sqnorm(xG, xH) > 0).all())
    # against the dense metric tensor of the definition, pair by pair
    n, m, h = G.shape[1], Hm.shape[1], G.shape[2]
    for b in range(B):
        theta = torch.cat([G[b].reshape(-1), Hm[b].reshape(-1)])
        g = pair_metric_tensor(theta, n, m, h, PAIR_METRICS[name], eps)
        torch.testing.assert_close(g, g.T, rtol=0, atol=1e-14 * float(g.abs().max()))
        assert float(torch.linalg.eigvalsh(g).min()) > 0
        x = torch.cat([xG[b].reshape(-1), xH[b].reshape(-1)])
        y = torch.cat([yG[b].reshape(-1), yH[b].reshape(-1)])
        torch.testing.assert_close(pg.inner(xG, xH, yG, yH)[b], x @ g @ y, rtol=1e-11, atol=0)


@pytest.mark.parametrize("kind,name,eps", PAIR_CASES)
def test_riemannian_gradient_against_finite_differences(kind, name, eps):
    G, Hm, xG, xH = _point(kind)
    pg = _geometry(kind, name, eps, G, Hm)
    Gr, Hr = G.clone().requires_grad_(), Hm.clone().requires_grad_()
    gG, gH = torch.autograd.grad(_smooth_f(Gr, Hr), (Gr, Hr))
    rG, rH = pg.egrad_to_rgrad(gG, gH)
    etaG, etaH = pg.project(xG, xH)                                  # horizontal η
    d = 1e-5
    fd = (_smooth_f(G + d * etaG, Hm + d * etaH) - _smooth_f(G - d * etaG, Hm - d * etaH)) / (2 * d)
    lhs = pg.inner(rG, rH, etaG, etaH).sum()
    assert abs(float(lhs - fd)) < _tol(name, eps, 1e-7) * (1 + abs(float(fd)))
    # and the gradient itself is horizontal
    pG, pH = pg.project(rG, rH)
    torch.testing.assert_close(pG, rG, rtol=0, atol=_tol(name, eps, 1e-10) * float(rG.abs().max()))


STEPS = [pytest.param(True, id="second_order")]


@pytest.mark.parametrize("christoffel", STEPS)
@pytest.mark.parametrize("kind,name,eps", PAIR_CASES)
def test_step_derivatives_are_velocity_and_christoffel(kind, name, eps, christoffel):
    G, Hm, xG, xH = _point(kind)
    pg = _geometry(kind, name, eps, G, Hm)
    xG, xH = pg.project(0.3 * xG, 0.3 * xH)

    def gamma(t):
        return torch.cat([a.reshape(B, -1) for a in pg.step(t * xG, t * xH, christoffel)], dim=1)

    d = 1e-3
    v = (gamma(d) - gamma(-d)) / (2 * d)
    acc = (gamma(d) - 2 * gamma(0.0) + gamma(-d)) / d ** 2
    x = torch.cat([xG.reshape(B, -1), xH.reshape(B, -1)], dim=1)
    torch.testing.assert_close(v, x, rtol=0, atol=1e-5 * float(x.abs().max()))
    n, m, h = G.shape[1], Hm.shape[1], G.shape[2]
    for b in range(B):
        theta = torch.cat([G[b].reshape(-1), Hm[b].reshape(-1)])
        ref = -christoffel_contraction(lambda th: pair_metric_tensor(th, n, m, h, PAIR_METRICS[name], eps),
                                       theta, x[b])
        err = float((acc[b] - ref).abs().max() / ref.abs().max())
        assert err < max(_tol(name, eps, 0.0), 1e-4), err       # 1e-4: finite differences in t
    # the closed form itself, without finite differences
    aG, aH = pg.acceleration(xG, xH)
    a = torch.cat([aG.reshape(B, -1), aH.reshape(B, -1)], dim=1)
    for b in range(B):
        theta = torch.cat([G[b].reshape(-1), Hm[b].reshape(-1)])
        ref = -christoffel_contraction(lambda th: pair_metric_tensor(th, n, m, h, PAIR_METRICS[name], eps),
                                       theta, x[b])
        assert float((a[b] - ref).abs().max() / ref.abs().max()) < _tol(name, eps, 1e-10)


@pytest.mark.parametrize("kind,name,eps", PAIR_CASES)
def test_invariance_under_the_group_action(kind, name, eps):
    G, Hm, xG, xH = _point(kind)
    yG, yH = _point(kind, seed=2)[2:]
    A = _group_element(kind, G.shape[-1], eps, torch.Generator().manual_seed(9))
    Ai_t = torch.linalg.inv(A).transpose(-1, -2)
    pg = _geometry(kind, name, eps, G, Hm)
    qg = _geometry(kind, name, eps, *_act(A, G, Hm))
    mv = lambda u, w: (u @ A, w @ Ai_t)  # noqa: E731 — tangent vectors move like points

    def close(got, want, tol=1e-10):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=tol * (1 + float(b.abs().max())))

    torch.testing.assert_close(qg.inner(*mv(xG, xH), *mv(yG, yH)), pg.inner(xG, xH, yG, yH), rtol=1e-10, atol=0)
    close(qg.project(*mv(xG, xH)), mv(*pg.project(xG, xH)))
    close(qg.acceleration(*mv(xG, xH)), mv(*pg.acceleration(xG, xH)))
    close(qg.step(*mv(xG, xH)), mv(*pg.step(xG, xH)))
    # a Euclidean gradient at (GA, HA⁻ᵀ) of f∘(·A⁻¹) is (g_G A⁻ᵀ, g_H A); its rgrad moves like ξ
    gG, gH = yG, yH
    close(qg.egrad_to_rgrad(gG @ Ai_t, gH @ A), mv(*pg.egrad_to_rgrad(gG, gH)))


# ------------------------------------------------------------------------ free parts
def _free(cls, p, seed=0, scale=None):
    g = torch.Generator().manual_seed(seed)
    theta = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
    theta[1][2] = 0.0                                    # an exact zero: held fixed by the adaptive part
    if scale is not None:
        theta = [t * s for t, s in zip(theta, scale)]
    params = {f"w{i}": t for i, t in enumerate(theta)}
    return ProductGeometry(params, (), p=p, free_part=cls), theta


def _free_rand(theta, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=g) for t in theta]


@pytest.mark.parametrize("cls,p", FREE_CASES)
def test_free_part_projection_norm_and_gradient(cls, p):
    geo, theta = _free(cls, p)
    x, y = _free_rand(theta, 1), _free_rand(theta, 2)
    px = geo.project(x)
    for a, b in zip(geo.project(px), px):                                        # idempotent
        assert torch.equal(a, b)
    scale = [t.abs() if cls is AdaptiveGeometry else torch.ones_like(t) for t in theta]
    if cls is AdaptiveGeometry:
        assert float(px[1][2]) == 0.0                                            # zero scale: fixed
    # the norm from its definition, ‖ξ ⊘ s‖_p, with s = |θ| (adaptive) or 1 (Euclidean)
    z = [torch.where(s > 0, a / torch.where(s > 0, s, 1), 0) for a, s in zip(px, scale)]
    if p == "l2":
        want = torch.cat([t.reshape(-1) for t in z]).norm()
    else:
        want = torch.cat([t.reshape(-1) for t in z]).abs().max()
    torch.testing.assert_close(geo.norm_of(px), want, rtol=1e-13, atol=0)
    # steepest ascent: the direction is a unit vector with ⟨g, d⟩ = dual norm of g
    g = y
    d = geo.direction([t.clone() for t in g])
    torch.testing.assert_close(geo.norm_of(d), torch.tensor(1.0), rtol=1e-12, atol=0)
    gs = [torch.where(s > 0, a * s, 0) for a, s in zip(g, scale)]
    dual = torch.cat([t.reshape(-1) for t in gs]).norm(1 if p == "linf" else 2)
    torch.testing.assert_close(sum((a * b).sum() for a, b in zip(g, d)), dual, rtol=1e-12, atol=0)
    # the ball: within radius, and a point inside is unchanged
    rho = 0.1
    bx = geo.ball(x, rho)
    assert float(geo.norm_of(bx)) <= rho * (1 + 1e-12)
    small = [t * 1e-3 for t in px]
    for a, b in zip(geo.ball(small, rho), small):
        torch.testing.assert_close(a, b, rtol=1e-15, atol=0)


@pytest.mark.parametrize("cls,p", FREE_CASES)
def test_free_part_step_derivatives(cls, p):
    geo, theta = _free(cls, p)
    x = geo.project(_free_rand(theta, 3))

    def gamma(t):
        pt = geo.point([t * a for a in x])
        return torch.cat([pt[f"w{i}"].reshape(-1) for i in range(len(theta))])

    d = 1e-3
    xs = torch.cat([a.reshape(-1) for a in x])
    torch.testing.assert_close((gamma(d) - gamma(-d)) / (2 * d), xs, rtol=0, atol=1e-10)
    torch.testing.assert_close((gamma(d) - 2 * gamma(0.0) + gamma(-d)) / d ** 2, torch.zeros_like(xs),
                               rtol=0, atol=1e-6)   # straight step: no acceleration


@pytest.mark.parametrize("cls,p", FREE_CASES)
def test_free_part_invariance(cls, p):
    """Adaptive: invariant under elementwise rescaling θ ↦ s ⊙ θ (s > 0); Euclidean: under
    elementwise sign flips (orthogonal).  Tangent vectors move like θ, gradients inversely."""
    g = torch.Generator().manual_seed(4)
    shapes = [(3, 4), (5,)]
    if cls is AdaptiveGeometry:
        s = [torch.exp(torch.randn(sh, generator=g)) for sh in shapes]
    else:
        s = [torch.where(torch.rand(sh, generator=g) < 0.5, -1.0, 1.0) for sh in shapes]
    geo, theta = _free(cls, p)
    geo_s, _ = _free(cls, p, scale=s)
    x, gr = _free_rand(theta, 5), _free_rand(theta, 6)
    xs = [a * b for a, b in zip(x, s)]
    torch.testing.assert_close(geo_s.norm_of(xs), geo.norm_of(x), rtol=1e-12, atol=0)
    for a, b, c in zip(geo_s.direction([a / b for a, b in zip(gr, s)]), geo.direction(gr), s):
        torch.testing.assert_close(a, b * c, rtol=1e-12, atol=1e-15)
    for a, b, c in zip(geo_s.ball(xs, 0.2), geo.ball(x, 0.2), s):
        torch.testing.assert_close(a, b * c, rtol=1e-12, atol=1e-15)


def test_the_suite_covers_every_registered_metric():
    """The parametrisation is built from the registry: every metric appears, for both kinds
    of pair and every ε."""
    covered = {(p.values[0], p.values[1], p.values[2]) for p in PAIR_CASES}
    for name in METRICS:
        for kind in ("gl", "rotary"):
            for eps in EPS:
                assert (kind, name, eps) in covered
