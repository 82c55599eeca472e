"""hideseek.optim.SAM: each ascent rule against a reference written here (the canonical SAM and
ASAM formulas, a dense constrained steepest ascent for the geodesic ball), the call shapes,
mixed precision, gradient accumulation and norm-layer statistics."""
import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev

import hideseek as hs
from hideseek.optim import SAM, frozen_norm_stats
from tests.conftest import mha_batches
from tests.models import MHAClassifier

RHO = 0.05


def _data(n=8, seed=0):
    return mha_batches(1, size=n, seed=seed)[0]


def _grads(model, x, y, params=None):
    """∇L at ``params`` (default: the model's own), by torch.func, name -> tensor."""
    params = params or {n: p.detach() for n, p in model.named_parameters()}
    return torch.func.grad(lambda q: F.cross_entropy(functional_call(model, q, (x,)), y))(params)


def _sam_once(model, measure, x, y, rho=RHO, lr=0.1):
    sam = SAM(model, torch.optim.SGD(model.parameters(), lr=lr), measure, rho=rho)
    F.cross_entropy(model(x), y).backward()
    sam.first_step(zero_grad=True)
    perturbed = {n: p.detach().clone() for n, p in model.named_parameters()}
    F.cross_entropy(model(x), y).backward()
    sam.second_step(zero_grad=True)
    return sam, perturbed


@pytest.mark.parametrize("geometry", ["euclidean", "adaptive"])
def test_sam_and_asam_match_the_canonical_formulas(geometry):
    """SAM: e = ρ g/‖g‖; ASAM (T_w = |w|, η = 0, davda54's adaptive=True): e = ρ |θ|²g / ‖|θ|g‖;
    then θ ← θ − lr ∇L(θ + e) (SGD)."""
    model = MHAClassifier()
    x, y = _data()
    theta = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = _grads(model, x, y)
    T = {n: (t.abs() if geometry == "adaptive" else torch.ones_like(t)) for n, t in theta.items()}
    norm = torch.sqrt(sum(((T[n] * g[n]) ** 2).sum() for n in g))
    e = {n: RHO * T[n] ** 2 * g[n] / norm for n in g}
    g_at = _grads(model, x, y, {n: theta[n] + e[n] for n in theta})
    _, perturbed = _sam_once(model, hs.Measure(geometry=geometry), x, y)
    for n, p in model.named_parameters():
        assert torch.allclose(perturbed[n], theta[n] + e[n], rtol=0, atol=1e-13)
        assert torch.allclose(p.detach(), theta[n] - 0.1 * g_at[n], rtol=0, atol=1e-13)


def _dense_geodesic_direction(model, metric, g):
    """argmax ⟨g, ξ⟩ over ‖ξ‖ ≤ 1 with ξ horizontal, densely: the pair coordinates with the
    metric as an explicit matrix (I ⊗ M per pair row block), the vertical space spanned by
    (G E_ij, −H E_ji), the free parameters with the diagonal metric 1/θ²."""
    blocks = hs.find_symmetries(model)
    names = [n for n, _ in model.named_parameters()]
    theta = {n: p.detach() for n, p in model.named_parameters()}
    sizes = [theta[n].numel() for n in names]
    flat = torch.cat([theta[n].flatten() for n in names])

    def unflat(v):
        return {n: t.view_as(theta[n]) for n, t in zip(names, torch.split(v, sizes))}

    def pair_coords(v):
        out = []
        for blk in blocks:
            for G, H in blk.split(unflat(v)):
                out += [G.flatten(), H.flatten()]
        return torch.cat(out)

    J = jacrev(pair_coords)(flat)                         # a 0/1 re-arrangement
    assert torch.equal(J @ J.T, torch.eye(J.shape[0], dtype=J.dtype))
    owned = J.abs().sum(0) > 0
    blocks_M, vert = [], []
    offset = 0
    for blk in blocks:
        for G, H in blk.split(theta):
            h, stepG = G.shape[-1], G.numel()
            SG, SH = G.mT @ G, H.mT @ H
            MG, MH = (torch.linalg.inv(SG), torch.linalg.inv(SH)) if metric == "invariant" else (SH, SG)
            for b in range(G.shape[0]):   # row-major vec(ξ): ⟨ξ, ξ M⟩_F = vec(ξ)ᵀ (I ⊗ M) vec(ξ)
                blocks_M.append((offset + b * G[b].numel(), torch.kron(torch.eye(G.shape[1]), MG[b].contiguous())))
                blocks_M.append((offset + stepG + b * H[b].numel(),
                                 torch.kron(torch.eye(H.shape[1]), MH[b].contiguous())))
            for b in range(G.shape[0]):
                for i in range(h):
                    for j in range(h):
                        E = torch.zeros(h, h)
                        E[i, j] = 1
                        v = torch.zeros(J.shape[0])
                        v[offset + b * G[b].numel():offset + (b + 1) * G[b].numel()] = (G[b] @ E).flatten()
                        s = offset + stepG + b * H[b].numel()
                        v[s:s + H[b].numel()] = -(H[b] @ E.T).flatten()
                        vert.append(v)
            offset += G.numel() + H.numel()
    n_pair = J.shape[0]
    Mp = torch.zeros(n_pair, n_pair, dtype=flat.dtype)
    for start, M in blocks_M:
        Mp[start:start + M.shape[0], start:start + M.shape[0]] = M
    # whole space: [pair coordinates, free parameters]; a free θ_i = 0 may not move (1/θ² = ∞)
    free = (~owned & (flat != 0)).nonzero().flatten()
    Mfree = torch.diag(1.0 / flat[free] ** 2)
    M = torch.block_diag(Mp, Mfree)
    C = torch.cat([torch.stack(vert, 1), torch.zeros(len(free), len(vert), dtype=flat.dtype)])
    gflat = torch.cat([g[n].flatten() for n in names])
    gz = torch.cat([J @ gflat, gflat[free]])
    u = torch.linalg.solve(M, gz)
    u = u - C @ torch.linalg.solve(C.T @ M @ C, C.T @ M @ u)
    u = u / torch.sqrt(u @ M @ u)
    assert float((C.T @ M @ u).abs().max()) < 1e-10     # horizontal
    xi = torch.zeros_like(flat)
    xi[owned] = (J.T @ u[:n_pair])[owned]
    xi[free] = u[n_pair:]
    return unflat(xi), blocks


@pytest.mark.parametrize("metric", ["invariant", "mixed"])
def test_geodesic_ascent_is_the_dense_steepest_ascent_then_the_geodesic_step(metric, float64_default):
    model = MHAClassifier()
    x, y = _data()
    theta = {n: p.detach().clone() for n, p in model.named_parameters()}
    d, blocks = _dense_geodesic_direction(model, metric, _grads(model, x, y))
    # the step: θ + ρd on free parameters; the second-order geodesic on the pairs (its
    # acceleration is checked against the metric's Christoffel symbols in test_geometry_gl)
    expect = {n: theta[n] + RHO * d[n] for n in theta}
    for blk in blocks:
        pairs = []
        for (G, H), (dG, dH) in zip(blk.split(theta), blk.split(d)):
            pg = hs.PairGeometry(G, H, metric)
            pairs.append(pg.step(RHO * dG, RHO * dH, christoffel=True))
        expect.update(blk.merge(pairs))
    _, perturbed = _sam_once(model, hs.Measure(metric=metric), x, y)
    for n in theta:
        assert torch.allclose(perturbed[n], expect[n], rtol=0, atol=1e-11), n
    # the straight-step ablation moves by ρd exactly
    model = MHAClassifier()
    _, perturbed = _sam_once(model, hs.Measure(metric=metric, step="straight"), x, y)
    for n in theta:
        assert torch.allclose(perturbed[n], theta[n] + RHO * d[n], rtol=0, atol=1e-11), n


def test_step_closure_scheduler_state_dict_and_frozen_parameters():
    x, y = _data()
    a, b = MHAClassifier(), MHAClassifier()
    for m in (a, b):
        m.head.bias.requires_grad_(False)
    frozen = a.head.bias.detach().clone()
    sams = [SAM(m, torch.optim.SGD, hs.Measure(metric="mixed"), rho=RHO, lr=0.1, momentum=0.9) for m in (a, b)]
    scheds = [torch.optim.lr_scheduler.StepLR(s.base_optimizer, 1, gamma=0.5) for s in sams]
    for _ in range(2):
        F.cross_entropy(a(x), y).backward()
        sams[0].first_step(zero_grad=True)
        F.cross_entropy(a(x), y).backward()
        sams[0].second_step(zero_grad=True)
        F.cross_entropy(b(x), y).backward()
        sams[1].step(lambda: F.cross_entropy(b(x), y).backward())
        sams[1].zero_grad()
        for s in scheds:
            s.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert torch.equal(a.head.bias, frozen) and sams[0].param_groups[0]["lr"] == pytest.approx(0.025)
    assert sams[0].param_groups is sams[0].base_optimizer.param_groups
    # state_dict round trip: a fresh SAM continues exactly (momentum buffers, lr, rho)
    sams[0].rho = 0.03
    state = copy.deepcopy(sams[0].state_dict())
    c = copy.deepcopy(a)
    sam_c = SAM(c, torch.optim.SGD, hs.Measure(metric="mixed"), lr=0.1, momentum=0.9)
    sam_c.load_state_dict(state)
    assert sam_c.rho == 0.03 and sam_c.param_groups[0]["lr"] == pytest.approx(0.025)
    for m, s in ((a, sams[0]), (c, sam_c)):
        F.cross_entropy(m(x), y).backward()
        s.step(lambda m=m: F.cross_entropy(m(x), y).backward())
    for p, q in zip(a.parameters(), c.parameters()):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="saved by SAM with measure"):
        SAM(c, torch.optim.SGD, "adaptive", lr=0.1, momentum=0.9).load_state_dict(state)


def test_pairs_are_discovered_once_and_reusable(monkeypatch):
    x, y = _data()
    a = MHAClassifier()
    first = SAM(a, torch.optim.SGD(a.parameters(), lr=0.1))
    assert len(first.blocks) == 1
    import hideseek.optim.sam as sam_module

    def no_discovery(*args, **kw):
        raise AssertionError("discovery ran again")

    monkeypatch.setattr(sam_module, "find_symmetries", no_discovery)
    b = MHAClassifier()
    second = SAM(b, torch.optim.SGD(b.parameters(), lr=0.1), pairs=first.blocks)
    for m, s in ((a, first), (b, second)):
        F.cross_entropy(m(x), y).backward()
        s.step(lambda m=m: F.cross_entropy(m(x), y).backward())
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_errors_are_clear():
    m = MHAClassifier()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="average case"):
        SAM(m, opt, "avg_l2")
    with pytest.raises(ValueError, match="no GL\\(h\\) pair"):
        SAM(nn.Sequential(nn.Linear(3, 2)), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="rho"):
        SAM(m, opt, rho=-1)
    sam = SAM(m, opt, "euclidean")
    with pytest.raises(RuntimeError, match="backward"):
        sam.first_step()
    x, y = _data()
    F.cross_entropy(m(x), y).backward()
    sam.first_step()
    with pytest.raises(RuntimeError, match="twice"):
        sam.first_step()
    with pytest.raises(ValueError, match="closure"):
        sam.step()


# ------------------------------------------------------------------ practical paths
def _float32_model():
    return MHAClassifier().float().train()


def _dist(a, b):
    """‖θ_a − θ_b‖ over all parameters."""
    return float(torch.sqrt(sum(((p - q).detach() ** 2).sum() for p, q in zip(a.parameters(), b.parameters()))))


def _reference_step(measure, x, y):
    m = _float32_model()
    _sam_once(m, measure, x, y)
    return m


@pytest.mark.parametrize("measure", ["euclidean", "adaptive", "geodesic_invariant", "geodesic_mixed"])
def test_bfloat16_autocast_step_is_close_to_float32(measure):
    x, y = _data()
    x = x.float()
    ref, theta = _reference_step(measure, x, y), _float32_model()
    m = _float32_model()
    sam = SAM(m, torch.optim.SGD(m.parameters(), lr=0.1), measure, rho=RHO)
    for stage in ("first", "second"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(m(x), y)
        loss.backward()
        sam.first_step(zero_grad=True) if stage == "first" else sam.second_step(zero_grad=True)
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in m.parameters())
    # the update agrees with float32's to bfloat16 accuracy (8 bits of mantissa)
    assert _dist(m, ref) <= 0.05 * _dist(ref, theta)


def test_float16_gradscaler_recipe_matches_float32_and_skips_on_overflow():
    x, y = _data()
    x = x.float()
    measure = hs.Measure(metric="mixed")
    ref, theta = _reference_step(measure, x, y), _float32_model()
    m = _float32_model()
    sam = SAM(m, torch.optim.SGD(m.parameters(), lr=0.1), measure, rho=RHO)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)

    def backward():
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(m(x), y)
        scaler.scale(loss).backward()

    backward()
    sam.first_step(zero_grad=True)       # scale-free direction: no unscaling needed
    backward()
    sam.second_step(zero_grad=True, scaler=scaler)
    scaler.update()
    assert _dist(m, ref) <= 0.02 * _dist(ref, theta)
    # overflow: the scaled loss is inf in float16 → no ascent, no step, the scale backs off
    before = [p.detach().clone() for p in m.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 120)
    backward()
    sam.first_step(zero_grad=True)
    assert sam.ascent_skipped
    backward()
    sam.second_step(zero_grad=True, scaler=scaler)
    scaler.update()
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before))
    assert scaler.get_scale() < 2.0 ** 120


def test_gradient_accumulation_equals_the_full_batch():
    """Micro-batches (loss / k) accumulated in both passes: the same step as the whole batch."""
    x, y = _data(n=12)
    for measure in ("euclidean", "adaptive", "geodesic_mixed"):
        full, acc = MHAClassifier(), MHAClassifier()
        _sam_once(full, measure, x, y)
        sam = SAM(acc, torch.optim.SGD(acc.parameters(), lr=0.1), measure, rho=RHO)
        chunks = list(zip(x.split(4), y.split(4)))
        for xb, yb in chunks:
            (F.cross_entropy(acc(xb), yb) / len(chunks)).backward()
        sam.first_step(zero_grad=True)
        for xb, yb in chunks:
            (F.cross_entropy(acc(xb), yb) / len(chunks)).backward()
        sam.second_step(zero_grad=True)
        for p, q in zip(full.parameters(), acc.parameters()):
            assert torch.allclose(p, q, rtol=0, atol=1e-13)


def test_frozen_norm_stats_updates_batchnorm_statistics_once_per_step():
    torch.manual_seed(0)
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 2, (16,))
    for momentum in (0.1, None):
        net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6, momentum=momentum), nn.ReLU(), nn.Linear(6, 2)).double()
        once = copy.deepcopy(net)
        once(x)                                  # one training-mode forward at θ
        for frozen in (True, False):
            m = copy.deepcopy(net)
            sam = SAM(m, torch.optim.SGD(m.parameters(), lr=0.1), "adaptive", rho=RHO)
            F.cross_entropy(m(x), y).backward()
            sam.first_step(zero_grad=True)
            with frozen_norm_stats(m) if frozen else contextlib.nullcontext():
                F.cross_entropy(m(x), y).backward()
            sam.second_step(zero_grad=True)
            same = [torch.equal(b, dict(once[1].named_buffers())[k]) for k, b in m[1].named_buffers()]
            assert all(same) if frozen else not all(same)
