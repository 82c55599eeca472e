"""Rotary-restricted pair geometry against dense references (float64, seeded).

References: the vertical space of the subgroup is built densely from a basis of its Lie
algebra (one column per generator), the metric tensor from its definition
(:func:`hideseek.reference.pair_metric_tensor`), and the projection from a dense weighted
least-squares solve in numpy — none of them uses the normal equations of
:mod:`hideseek.geometry.rotary`.
"""
import numpy as np
import pytest
import torch

from hideseek.geometry.gl import PairGeometry, act
from hideseek.geometry.rotary import RotaryPairGeometry, random_rotary_element
from hideseek.reference import pair_metric_tensor
from hideseek.symmetries.action import random_gl


pytestmark = pytest.mark.usefixtures("float64_default")   # every tensor here is float64


# (n, m, h, rotary pairs, free columns): HF rotate_half pairing i ↔ i + d/2, neighbour
# pairing, partial rotary with free columns first or last, one pair among free columns.
CASES = {
    "half": (5, 6, 4, ((0, 2), (1, 3)), ()),
    "neighbours": (7, 8, 6, ((0, 1), (2, 3), (4, 5)), ()),
    "partial": (7, 6, 6, ((0, 2), (1, 3)), (4, 5)),
    "partial_odd": (6, 5, 5, ((1, 4),), (0, 2, 3)),
}
SETTINGS = [("invariant", 0.0), ("invariant", 0.05), ("mixed", 0.0)]


def make(B, n, m, h, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, r, h, generator=g) for r in (n, m, n, m)]


def algebra_basis(h, rotary, free):
    """Dense basis of the subgroup's Lie algebra, written out entry by entry."""
    basis = []
    for i, j in rotary:
        a = np.zeros((h, h)); a[i, i] = a[j, j] = 1.0
        c = np.zeros((h, h)); c[i, j], c[j, i] = -1.0, 1.0
        basis += [a, c]
    for p in free:
        for q in free:
            e = np.zeros((h, h)); e[p, q] = 1.0
            basis.append(e)
    return basis


def vertical_matrix(G, H, basis):
    """Columns vec(GΛ, −HΛᵀ) (row-major) for every Λ of the basis."""
    return np.stack([np.concatenate([(G @ L).ravel(), (-H @ L.T).ravel()]) for L in basis], axis=1)


def dense_projection(G, H, xG, xH, metric, eps, rotary, free):
    """ξ − V c with c = argmin ‖ξ − V c‖_g: numpy least squares on the Cholesky-weighted system."""
    n, h = G.shape
    m = H.shape[0]
    gmat = pair_metric_tensor(torch.cat([G.reshape(-1), H.reshape(-1)]), n, m, h, metric, eps).numpy()
    W = np.linalg.cholesky(gmat).T                      # g = Wᵀ W
    V = vertical_matrix(G.numpy(), H.numpy(), algebra_basis(h, rotary, free))
    x = np.concatenate([xG.numpy().ravel(), xH.numpy().ravel()])
    c = np.linalg.lstsq(W @ V, W @ x, rcond=None)[0]
    p = x - V @ c
    return p[: n * h].reshape(n, h), p[n * h:].reshape(m, h), V, gmat


@pytest.mark.parametrize("metric,eps", SETTINGS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_projection_matches_dense_least_squares_and_is_horizontal(case, metric, eps):
    n, m, h, rot, free = CASES[case]
    G, H, xG, xH = make(3, n, m, h, seed=1)
    geo = RotaryPairGeometry(G, H, metric, eps, rotary=rot)
    pG, pH = geo.project(xG, xH)
    for b in range(3):
        rG, rH, V, gmat = dense_projection(G[b], H[b], xG[b], xH[b], metric, eps, rot, free)
        np.testing.assert_allclose(pG[b].numpy(), rG, atol=1e-10)
        np.testing.assert_allclose(pH[b].numpy(), rH, atol=1e-10)
        # metric-orthogonal to every vertical vector of the subgroup
        p = np.concatenate([pG[b].numpy().ravel(), pH[b].numpy().ravel()])
        x = np.concatenate([xG[b].numpy().ravel(), xH[b].numpy().ravel()])
        scale = np.abs(V.T @ gmat @ x).max()
        assert np.abs(V.T @ gmat @ p).max() < 1e-11 * scale
    assert geo.horizontal_residual(pG, pH).abs().max() < 1e-11 * geo.horizontal_residual(xG, xH).abs().max()


@pytest.mark.parametrize("metric,eps", SETTINGS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_projection_idempotent_kills_subgroup_vertical_not_full_gl(case, metric, eps):
    n, m, h, rot, free = CASES[case]
    G, H, xG, xH = make(4, n, m, h, seed=2)
    geo = RotaryPairGeometry(G, H, metric, eps, rotary=rot)
    pG, pH = geo.project(xG, xH)
    ppG, ppH = geo.project(pG, pH)
    assert torch.allclose(ppG, pG, atol=1e-11) and torch.allclose(ppH, pH, atol=1e-11)
    # a random element of the subgroup's Lie algebra, assembled from the dense basis
    gen = torch.Generator().manual_seed(3)
    basis = torch.tensor(np.stack(algebra_basis(h, rot, free)))
    Lam = torch.einsum("bk,kij->bij", torch.randn(4, len(basis), generator=gen), basis)
    zG, zH = geo.project(*geo.vertical(Lam))
    assert zG.abs().max() < 1e-10 and zH.abs().max() < 1e-10
    # a full-GL vertical vector outside the subgroup survives (with its off-algebra part)
    Full = torch.randn(4, h, h, generator=gen)
    vG, vH = geo.vertical(Full)
    wG, wH = geo.project(vG, vH)
    assert (geo.sqnorm(wG, wH) > 1e-3 * geo.sqnorm(vG, vH)).all()
    # and the full-GL geometry does kill it
    full = PairGeometry(G, H, metric, eps)
    fG, fH = full.project(vG, vH)
    assert fG.abs().max() < 1e-9 * vG.abs().max() and fH.abs().max() < 1e-9 * vH.abs().max()


@pytest.mark.parametrize("metric,eps", SETTINGS + [("mixed", 0.05)])
def test_no_rotated_columns_equals_full_gl_projection(metric, eps):
    """Also pins the ε-relaxed mixed projection to gl.py's (horizontal and idempotent only up
    to O(ε) there, in both)."""
    G, H, xG, xH = make(3, 6, 5, 4, seed=4)
    geo = RotaryPairGeometry(G, H, metric, eps, rotary=())
    ref = PairGeometry(G, H, metric, eps)
    for a, b in zip(geo.project(xG, xH), ref.project(xG, xH)):
        assert torch.allclose(a, b, atol=1e-11)
    for a, b in zip(geo.egrad_to_rgrad(xG, xH), ref.egrad_to_rgrad(xG, xH)):
        assert torch.allclose(a, b, atol=1e-10)


def rope(h, rotary, angle_scale):
    """Block rotation of the rotary pairs by distinct frequencies times ``angle_scale``."""
    R = torch.eye(h)
    for k, (i, j) in enumerate(rotary):
        phi = angle_scale / (1.7 ** k)
        R[i, i] = R[j, j] = np.cos(phi)
        R[i, j], R[j, i] = -np.sin(phi), np.sin(phi)
    return R


@pytest.mark.parametrize("case", sorted(CASES))
def test_subgroup_element_keeps_rotary_scores_full_gl_does_not(case):
    n, m, h, rot, free = CASES[case]
    G, H, _, _ = make(2, n, m, h, seed=5)
    gen = torch.Generator().manual_seed(6)
    A = random_rotary_element(h, rot, free, (2,), generator=gen)
    G2, H2 = act(G, H, A)
    assert torch.allclose(G2 @ H2.transpose(-1, -2), G @ H.transpose(-1, -2), atol=1e-12)
    B = random_gl(2, h, gen, log_cond=1.0)
    G3, H3 = act(G, H, B)
    for s in (0.3, 1.1, 2.9):
        R = rope(h, rot, s)
        ref = G @ R @ H.transpose(-1, -2)          # score between relative positions s
        assert torch.allclose(G2 @ R @ H2.transpose(-1, -2), ref, atol=1e-11)
        assert not torch.allclose(G3 @ R @ H3.transpose(-1, -2), ref, atol=1e-3)


@pytest.mark.parametrize("metric,eps", SETTINGS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_metric_invariant_and_projection_equivariant_under_subgroup(case, metric, eps):
    n, m, h, rot, free = CASES[case]
    G, H, xG, xH = make(3, n, m, h, seed=7)
    A = random_rotary_element(h, rot, free, (3,), generator=torch.Generator().manual_seed(8))
    geo = RotaryPairGeometry(G, H, metric, eps, rotary=rot)
    G2, H2 = act(G, H, A)
    geo2 = RotaryPairGeometry(G2, H2, metric, eps, rotary=rot)
    yG, yH = xH.new_ones(xG.shape), xH.new_ones(xH.shape)
    x2, y2 = act(xG, xH, A), act(yG, yH, A)
    if eps == 0.0:
        assert torch.allclose(geo2.inner(*x2, *y2), geo.inner(xG, xH, yG, yH), rtol=1e-10)
        # moving ξ then projecting = projecting then moving (the subgroup maps verticals to verticals)
        for a, b in zip(geo2.project(*x2), act(*geo.project(xG, xH), A)):
            assert torch.allclose(a, b, atol=1e-10)
    else:
        # ε breaks invariance under scaling blocks but not under rotations: check O(ε) only
        rel = (geo2.inner(*x2, *y2) - geo.inner(xG, xH, yG, yH)).abs() / geo.inner(xG, xH, xG, xH)
        assert rel.max() < 10 * eps


@pytest.mark.parametrize("metric", ["invariant", "mixed"])
@pytest.mark.parametrize("case", ["partial", "half"])
def test_riemannian_gradient_is_horizontal_metric_dual(case, metric):
    """g(grad, η) = ⟨∇, η⟩_F for every horizontal η, and grad is horizontal."""
    n, m, h, rot, free = CASES[case]
    G, H, gG, gH = make(2, n, m, h, seed=9)
    geo = RotaryPairGeometry(G, H, metric, rotary=rot)
    rG, rH = geo.egrad_to_rgrad(gG, gH)
    assert geo.horizontal_residual(rG, rH).abs().max() < 1e-10 * (gG.abs().max() + gH.abs().max())
    gen = torch.Generator().manual_seed(10)
    for _ in range(3):
        eG, eH = geo.project(torch.randn(G.shape, generator=gen), torch.randn(H.shape, generator=gen))
        lhs = geo.inner(rG, rH, eG, eH)
        rhs = (gG * eG).sum((-1, -2)) + (gH * eH).sum((-1, -2))
        assert torch.allclose(lhs, rhs, rtol=1e-9)
    # differs from the full-GL gradient (that one is also orthogonal to non-rotary verticals)
    fG, fH = PairGeometry(G, H, metric).egrad_to_rgrad(gG, gH)
    assert not torch.allclose(fG, rG, atol=1e-4)


def test_float32_projection_close_to_float64():
    n, m, h, rot, free = CASES["partial"]
    G, H, xG, xH = make(2, n, m, h, seed=11)
    p64 = RotaryPairGeometry(G, H, "invariant", rotary=rot).project(xG, xH)
    p32 = RotaryPairGeometry(G.float(), H.float(), "invariant", rotary=rot).project(xG.float(), xH.float())
    assert p32[0].dtype == torch.float32
    for a, b in zip(p32, p64):
        assert torch.allclose(a.double(), b, atol=1e-4)


def test_bad_columns_rejected():
    G, H, _, _ = make(1, 5, 5, 4)
    with pytest.raises(ValueError, match="exactly once"):
        RotaryPairGeometry(G, H, rotary=((0, 1), (1, 2)))
    with pytest.raises(ValueError, match="exactly once"):
        RotaryPairGeometry(G, H, rotary=((0, 1),), rotary_free=(2,))


# ----------------------------------------------------------------------------- end to end
def test_geodesic_sharpness_of_rotary_models_invariant_adaptive_not():
    """Tiny float64 Llama (full rotary) and GPT-NeoX (partial rotary): a random element of the
    rotary subgroup, applied to the weights by hand (tests/hideseek/symmetries/test_model_families.py's
    independent action), leaves geodesic sharpness unchanged and changes adaptive sharpness."""
    pytest.importorskip("transformers")
    import copy

    import hideseek as hs
    from hideseek.symmetries import find_symmetries
    from tests.hideseek.symmetries.test_model_families import FAMILIES, act_family

    for name in ("llama_mha", "gpt_neox_partial_rotary"):
        fam = next(f for f in FAMILIES if f.name == name)
        model = fam.build()
        moved = copy.deepcopy(model)
        act_family(fam, moved, torch.Generator().manual_seed(1))
        blocks = find_symmetries(model)
        assert any(g.rotary for b in blocks for g in b.groups)
        paired = {n for b in blocks for n in b.param_names}
        others = [n for n, _ in model.named_parameters() if n not in paired]
        kw = dict(rho=0.5, n_iters=3, progress=False, exclude=others, loss_fn=fam.loss)
        batches = [fam.batch(seed=3)]
        a = hs.sharpness(model, batches, measure="geodesic", **kw).value
        b = hs.sharpness(moved, batches, measure="geodesic", **kw).value
        assert a > 0 and abs(a - b) <= 1e-7 * abs(a), (name, a, b)
        a = hs.sharpness(model, batches, measure="adaptive", **kw).value
        b = hs.sharpness(moved, batches, measure="adaptive", **kw).value
        assert abs(a - b) > 0.02 * abs(a), (name, a, b)
        # the product geometry gives rotary Q/K stacks the restricted geometry: a full-GL
        # vertical vector (not a symmetry of the rotary model) survives its projection
        res = hs.sharpness(model, batches, measure="geodesic", **kw)
        assert "qk_rotary" in res.norm_share and "qk" not in res.norm_share
        assert sum(res.norm_share.values()) == pytest.approx(1, abs=1e-12)
        params = {n: p.detach() for n, p in model.named_parameters()}
        geom = hs.ProductGeometry(params, blocks)
        kinds = [type(pg) for pg in geom.pairs]
        assert RotaryPairGeometry in kinds and PairGeometry in kinds
        x = geom.zeros()
        i = kinds.index(RotaryPairGeometry)
        pg = geom.pairs[i]
        Lam = torch.randn(pg.G.shape[0], pg.G.shape[-1], pg.G.shape[-1], generator=torch.Generator().manual_seed(2))
        x[2 * i], x[2 * i + 1] = pg.vertical(Lam)
        px = geom.project(x)
        assert geom.sqnorm(px) > 1e-3 * geom.sqnorm(x)
        full = PairGeometry(pg.G, pg.H)
        assert full.sqnorm(*full.project(x[2 * i], x[2 * i + 1])).max() < 1e-18 * geom.sqnorm(x)


def test_rank_deficient_head_with_eps_matches_dense():
    """G with fewer rows than columns (S_G singular): the ε-relaxed invariant projection is
    still the exact projection of the relaxed metric (the free block's operators stay SPD)."""
    G, H, xG, xH = make(2, 3, 7, 6, seed=12)
    G, xG = G[:, :3], xG[:, :3]
    rot, free = ((0, 2), (1, 3)), (4, 5)
    geo = RotaryPairGeometry(G, H, "invariant", 0.1, rotary=rot)
    pG, pH = geo.project(xG, xH)
    for b in range(2):
        rG, rH, _, _ = dense_projection(G[b], H[b], xG[b], xH[b], "invariant", 0.1, rot, free)
        np.testing.assert_allclose(pG[b].numpy(), rG, atol=1e-10)
        np.testing.assert_allclose(pH[b].numpy(), rH, atol=1e-10)
    with pytest.raises(ValueError, match="singular"):
        RotaryPairGeometry(G, H, "invariant", 0.0, rotary=rot)
