"""sharpness(): invariance, solver correctness, ablation switches, errors, determinism."""
import copy
import math

import numpy as np
import pytest
import scipy.linalg
import torch
from torch import nn

import hideseek as hs
from hideseek.geometry.space import ProductGeometry
from hideseek.solvers import apgd, apgd_checkpoints, random_search
from hideseek.symmetries import apply_random_action, find_symmetries

from tests.models import ClipImageClassifier, MHAClassifier, bert_batch, tiny_bert, tiny_clip

FAST = dict(n_iters=4, progress=False)


def test_checkpoint_schedule_matches_reference():
    assert apgd_checkpoints(20) == [5, 9, 12, 15, 16, 18, 19]


@pytest.fixture(scope="module")
def bert_and_moved():
    model = tiny_bert(seed=1)
    moved = apply_random_action(copy.deepcopy(model), generator=torch.Generator().manual_seed(5),
                                log_cond=2.0)
    return model, moved, [bert_batch(seed=2)]


@pytest.mark.parametrize("metric", ["invariant", "mixed"])
@pytest.mark.parametrize("christoffel", [True, False])
def test_geodesic_sharpness_invariant_under_group_action(bert_and_moved, metric, christoffel):
    model, moved, batches = bert_and_moved
    kw = dict(measure="geodesic", metric=metric, christoffel=christoffel, rho=0.05, **FAST)
    a = hs.sharpness(model, batches, **kw).value
    b = hs.sharpness(moved, batches, **kw).value
    assert a > 0
    assert abs(a - b) < 1e-7 * abs(a)


def test_adaptive_sharpness_changes_under_group_action(bert_and_moved):
    """Perturbing only the attention weights (everything else excluded), so that the
    comparison is about the pairs: adaptive sharpness moves with the action, geodesic not."""
    model, moved, batches = bert_and_moved
    paired = {n for b in find_symmetries(model) for n in b.param_names}
    others = [n for n, _ in model.named_parameters() if n not in paired]
    kw = dict(rho=0.5, exclude=others, **FAST)
    for p in ("l2", "linf"):
        a = hs.sharpness(model, batches, measure="adaptive", p=p, **kw).value
        b = hs.sharpness(moved, batches, measure="adaptive", p=p, **kw).value
        assert abs(a - b) > 0.05 * abs(a), (p, a, b)
    a = hs.sharpness(model, batches, measure="geodesic", **kw).value
    b = hs.sharpness(moved, batches, measure="geodesic", **kw).value
    assert abs(a - b) < 1e-7 * abs(a)


def _bert_geometry(model, batches, metric="mixed"):
    params = {n: p.detach() for n, p in model.named_parameters()}
    geom = ProductGeometry(params, find_symmetries(model), metric=metric)
    x, y = batches[0]

    def value(xi):
        return nn.functional.cross_entropy(
            torch.func.functional_call(model, geom.point(xi), (), x).logits, y)

    def objective(xi):
        xi = [t.detach().requires_grad_(True) for t in xi]
        loss = value(xi)
        return loss.detach(), list(torch.autograd.grad(loss, xi))

    return geom, value, objective


@pytest.mark.parametrize("metric", ["invariant", "mixed"])
def test_apgd_stays_in_ball_and_horizontal_and_beats_random_search(bert_and_moved, metric):
    model, _, batches = bert_and_moved
    geom, value, objective = _bert_geometry(model, batches, metric)
    rho, seen = 0.05, []

    def watched(xi):
        seen.append([t.clone() for t in xi])
        return objective(xi)

    res = apgd(watched, geom, rho, n_iters=10)
    for xi in seen:
        assert float(geom.sqnorm(xi).sqrt()) <= rho * (1 + 1e-9)
        for pg, (xG, xH) in zip(geom.pairs, zip(xi[0:geom.n_pair_tensors:2], xi[1:geom.n_pair_tensors:2])):
            resid = pg.horizontal_residual(xG, xH).abs().max()
            scale = pg.horizontal_residual(*pg.egrad_to_rgrad(xG, xH, project=False)).abs().max() + 1e-30
            assert float(resid) < 1e-8 * max(1.0, float(scale))
    rs = random_search(value, geom, rho, n_samples=11, generator=torch.Generator().manual_seed(0))
    assert res.value >= rs.value
    assert res.value > 0


def test_apgd_finds_known_maximum_of_quadratic():
    """max over ‖δ‖ ≤ ρ of ½ δᵀAδ + bᵀδ (A PSD): the trust-region solution from a dense
    eigendecomposition and the secular equation."""
    g = torch.Generator().manual_seed(0)
    d = 6
    Q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    lam = torch.tensor([5.0, 3.0, 2.0, 1.0, 0.5, 0.1], dtype=torch.float64)
    A = Q @ torch.diag(lam) @ Q.T
    b = 0.3 * torch.randn(d, generator=g, dtype=torch.float64)
    rho = 1.0

    class Quad(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(d, dtype=torch.float64))   # |θ| = 1: adaptive = Euclidean

        def forward(self, x):
            delta = self.w - 1.0
            return 0.5 * delta @ A @ delta + b @ delta

    res = hs.sharpness(Quad().eval(), [(torch.zeros(1), torch.zeros(1))], measure="adaptive",
                       rho=rho, n_iters=50, loss_fn=lambda out, y: out, progress=False)
    # exact: δ = (μ I − A)⁻¹ b with μ > λ_max and ‖δ‖ = ρ
    beta = Q.T @ b
    lo, hi = float(lam[0]) + 1e-12, float(lam[0]) + 10.0
    for _ in range(200):
        mu = 0.5 * (lo + hi)
        if float(((beta / (mu - lam)) ** 2).sum()) > rho ** 2:
            lo = mu
        else:
            hi = mu
    delta = Q @ (beta / (mu - lam))
    exact = float(0.5 * delta @ A @ delta + b @ delta)
    assert res.value == pytest.approx(exact, rel=1e-3)
    # ℓ∞ ball: maximising a convex quadratic over a cube is NP-hard in general; Auto-PGD
    # must end on a vertex that is a first-order (KKT) point — the gradient points out of the
    # cube in every coordinate — and never above the brute-force best over all vertices
    corners = torch.tensor(np.array(np.meshgrid(*[[-1, 1]] * d)).reshape(d, -1).T, dtype=torch.float64)
    f = lambda c: float(0.5 * c @ A @ c + b @ c)  # noqa: E731
    best = max(f(c) for c in corners * rho)
    res_inf = hs.sharpness(Quad().eval(), [(torch.zeros(1), torch.zeros(1))], measure="m_apgd_linf",
                           rho=rho, n_iters=50, loss_fn=lambda out, y: out, progress=False)
    x = res_inf.solver[0].best[0]
    assert torch.allclose(x.abs(), torch.full((d,), rho, dtype=torch.float64))
    assert res_inf.value == pytest.approx(f(x)) and res_inf.value <= best + 1e-9
    assert torch.equal(torch.sign(A @ x + b), torch.sign(x))


def test_diagonal_pair_exact_geodesics_match_direct_evaluation():
    """For GL(1) pairs with the invariant metric and exact geodesics, sharpness along a
    horizontal ξ is L(u e^{z}, v e^{z}); average-case over the sphere agrees with sampling
    z directly (‖ξ‖² = 2‖z‖² on horizontal vectors)."""
    torch.manual_seed(0)
    d, n = 5, 8
    X = torch.randn(n, d, dtype=torch.float64)
    y = torch.randn(n, dtype=torch.float64)

    class Diag(nn.Module):
        def __init__(self):
            super().__init__()
            self.u = nn.Parameter(torch.rand(d, dtype=torch.float64) + 0.5)
            self.v = nn.Parameter(torch.rand(d, dtype=torch.float64) + 0.5)

        def forward(self, x):
            return x @ (self.u * self.v)

    m = Diag().eval()
    mse = lambda out, t: ((out - t) ** 2).mean()  # noqa: E731
    geom = ProductGeometry(dict(m.named_parameters()), [hs.DiagonalPair("u", "v").bind(dict(m.named_parameters()))],
                           metric="invariant", christoffel="exact")
    gen = torch.Generator().manual_seed(1)
    xi = [0.3 * t for t in geom.random_direction(gen)]
    xG, xH = xi[0], xi[1]
    z = (xG / geom.pairs[0].G).reshape(-1)
    assert torch.allclose((xH / geom.pairs[0].H).reshape(-1), z)          # horizontal: ξ_u/u = ξ_v/v
    assert float(geom.sqnorm(xi)) == pytest.approx(2 * float(z @ z))
    pt = geom.point(xi)
    assert torch.allclose(pt["u"] * pt["v"], m.u * m.v * torch.exp(2 * z))
    res = hs.sharpness(m, [(X, y)], measure="geodesic", pairs=[hs.DiagonalPair("u", "v")],
                       christoffel="exact", rho=0.2, n_iters=30, loss_fn=mse, progress=False)
    # brute force over the z ball (‖z‖ ≤ ρ/√2): random search cannot beat APGD by much
    beta = (m.u * m.v).detach()
    base = float(mse(X @ beta, y))
    zs = torch.randn(20000, d, generator=gen, dtype=torch.float64)
    zs = zs / zs.norm(dim=1, keepdim=True) * (0.2 / math.sqrt(2))
    brute = float((((X @ (beta * torch.exp(2 * zs)).T).T - y) ** 2).mean(1).max()) - base
    assert res.value >= brute - 1e-6


def test_ablation_switches_and_names(bert_and_moved):
    model, _, batches = bert_and_moved
    names = set()
    for kw in (dict(), dict(christoffel=False), dict(norm="adaptive"), dict(metric="mixed"),
               dict(measure="m_apgd_l2"), dict(measure="m_apgd_linf"), dict(measure="avg_l2", n_samples=3),
               dict(kind="average", n_samples=3)):
        r = hs.sharpness(model, batches, rho=0.02, **{**FAST, **kw})
        names.add(r.name)
        assert math.isfinite(r.value) and len(r.per_batch) == 1
    assert names == {"geodesic_invariant", "geodesic_invariant_no_christoffel",
                     "geodesic_invariant_christoffel_only", "geodesic_mixed", "m_apgd_l2",
                     "m_apgd_linf", "avg_l2", "avg_geodesic_invariant"}


def test_christoffel_changes_the_value_and_eps_relaxation_is_continuous(bert_and_moved):
    model, _, batches = bert_and_moved
    kw = dict(rho=0.3, **FAST)
    on = hs.sharpness(model, batches, metric="mixed", **kw).value
    off = hs.sharpness(model, batches, metric="mixed", christoffel=False, **kw).value
    assert on != off
    e0 = hs.sharpness(model, batches, eps=0.0, **kw).value
    e_small = hs.sharpness(model, batches, eps=1e-9, **kw).value
    e_big = hs.sharpness(model, batches, eps=10.0, **kw).value
    assert abs(e_small - e0) < 1e-5 * abs(e0)
    assert abs(e_big - e0) > 1e-3 * abs(e0)


def test_deterministic_and_per_batch_mean():
    model = MHAClassifier()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 5, 12, generator=g, dtype=torch.float64), torch.randint(0, 3, (4,), generator=g))
               for _ in range(3)]
    kw = dict(measure="geodesic", metric="mixed", rho=0.1, random_start=True, seed=7, **FAST)
    a, b = hs.sharpness(model, batches, **kw), hs.sharpness(model, batches, **kw)
    assert a.per_batch == b.per_batch and len(a.per_batch) == 3
    assert a.value == pytest.approx(sum(a.per_batch) / 3)
    c = hs.sharpness(model, batches, **{**kw, "seed": 8})
    assert c.per_batch != a.per_batch


def test_unused_text_tower_is_left_out():
    model = ClipImageClassifier(tiny_clip()).eval()
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 2, 0])
    r = hs.sharpness(model, [(x, y)], metric="mixed", rho=0.05, **FAST)
    assert {d["module"].split(".")[1] for d in r.pairs} == {"visual"}
    used = sum(p.numel() for n, p in model.named_parameters()
               if n.startswith("clip.visual") or n.startswith("head"))
    assert r.n_perturbed == used   # every visual/head parameter, no text-tower parameter


def test_errors_are_clear():
    model = tiny_bert()
    batch = bert_batch()
    with pytest.raises(hs.SharpnessInputError, match=r"model.eval\(\)") as err:
        hs.sharpness(model.train(), [batch], **FAST)
    assert "dropout" in str(err.value)
    model.eval()
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.classifier.weight[0, 0] = float("nan")
    with pytest.raises(hs.SharpnessInputError, match="NaN or infinite weights.*classifier.weight"):
        hs.sharpness(broken, [batch], **FAST)
    with pytest.raises(hs.SharpnessInputError, match=r"pair \(inputs, labels\)"):
        hs.sharpness(model, [batch[0]], **FAST)
    with pytest.raises(hs.SharpnessInputError, match="iterable of"):
        hs.sharpness(model, batch[0]["input_ids"], **FAST)
    with pytest.raises(hs.SharpnessInputError, match="inputs must be a tensor or a dict"):
        hs.sharpness(model, [([1, 2], batch[1])], **FAST)
    mlp = nn.Sequential(nn.Linear(3, 2)).eval()
    with pytest.raises(hs.SharpnessInputError, match="no GL\\(h\\) symmetry"):
        hs.sharpness(mlp, [(torch.randn(2, 3), torch.tensor([0, 1]))], **FAST)
    with pytest.raises(ValueError, match="rho"):
        hs.sharpness(model, [batch], rho=-1.0, **FAST)
    with pytest.raises(ValueError, match="linf"):
        hs.sharpness(model, [batch], p="linf", **FAST)


def test_nondeterministic_model_is_caught():
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            return self.lin(x) + torch.randn(x.shape[0], 2)

    with pytest.raises(hs.SharpnessInputError, match="not deterministic"):
        hs.sharpness(Noisy().eval(), [(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))],
                     measure="adaptive", **FAST)


def test_large_second_order_correction_is_reported():
    """A diagonal network with a near-zero coordinate: the mixed metric allows a huge
    relative step there and the second-order step overshoots; the user is warned."""
    class Diag(nn.Module):
        def __init__(self):
            super().__init__()
            self.u = nn.Parameter(torch.tensor([1.0, 1e-3, 0.8], dtype=torch.float64))
            self.v = nn.Parameter(torch.tensor([0.5, 1e-3, 1.2], dtype=torch.float64))

        def forward(self, x):
            return x @ (self.u * self.v)

    X = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = X @ torch.tensor([0.5, 0.0, 0.96], dtype=torch.float64)
    mse = lambda out, t: ((out - t) ** 2).mean()  # noqa: E731
    kw = dict(measure="geodesic", metric="mixed", pairs=[hs.DiagonalPair("u", "v")], loss_fn=mse,
              n_iters=5, progress=False)
    with pytest.warns(RuntimeWarning, match="second-order geodesic correction is large"):
        big = hs.sharpness(Diag().eval(), [(X, y)], rho=0.1, **kw)
    assert max(big.correction_ratio) > 0.5
    import warnings as w
    with w.catch_warnings():
        w.simplefilter("error")
        small = hs.sharpness(Diag().eval(), [(X, y)], rho=1e-8, **kw)
    assert max(small.correction_ratio) < 0.5


def test_christoffel_only_ball_contains_the_free_parameter_ball(bert_and_moved):
    """The Christoffel-only ball (adaptive norm on every parameter) contains every
    perturbation that leaves the pairs alone, so its worst case is at least the adaptive
    sharpness with the pair parameters excluded (up to the solver; the same budget)."""
    model, _, batches = bert_and_moved
    paired = [n for b in find_symmetries(model) for n in b.param_names]
    kw = dict(rho=0.1, n_iters=10, progress=False)
    free_only = hs.sharpness(model, batches, measure="adaptive", exclude=paired, **kw).value
    for metric in ("invariant", "mixed"):
        co = hs.sharpness(model, batches, metric=metric, norm="adaptive", **kw).value
        assert co >= 0.9 * free_only, (metric, co, free_only)
    # with a straight step the ablation is exactly adaptive ℓ2 sharpness
    straight = hs.sharpness(model, batches, norm="adaptive", christoffel=False, **kw).value
    adaptive = hs.sharpness(model, batches, measure="adaptive", **kw).value
    assert straight == pytest.approx(adaptive, rel=1e-9)


def _mha_batches(n=2):
    out = []
    for s in range(n):
        g = torch.Generator().manual_seed(s)
        out.append((torch.randn(4, 5, 12, generator=g, dtype=torch.float64), torch.randint(0, 3, (4,), generator=g)))
    return out


@pytest.mark.parametrize("measure", ["geodesic_mixed", "m_apgd_linf", "avg_l2"])
def test_callback_sees_every_iteration_of_every_batch(measure):
    steps = []
    res = hs.sharpness(MHAClassifier(), _mha_batches(), measure, rho=0.05, n_iters=6, n_samples=5,
                       progress=False, callback=steps.append)
    for b, sr in enumerate(res.solver):
        mine = [s for s in steps if s.batch == b]
        if measure.startswith("avg"):
            # one record per draw; the running mean ends at the batch's mean loss
            assert [s.iteration for s in mine] == list(range(1, 6))
            assert [s.value for s in mine] == sr.history
            assert mine[-1].best - sr.f0 == pytest.approx(sr.value, rel=1e-12, abs=1e-15)
            continue
        assert [s.iteration for s in mine] == list(range(7))       # the start, then 6 iterations
        assert [s.value for s in mine] == sr.history
        assert [s.step_size for s in mine] == sr.step_sizes
        assert max(s.best for s in mine) - sr.f0 == sr.value == mine[-1].best - sr.f0
        assert mine[-1].n_evals == sr.n_evals
        assert all(a.seconds <= b.seconds for a, b in zip(mine, mine[1:]))


def test_progress_bar_is_optional(monkeypatch, capsys):
    import sys
    monkeypatch.setitem(sys.modules, "tqdm", None)          # tqdm not installed
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with_bar = hs.sharpness(MHAClassifier(), _mha_batches(1), "m_apgd_l2", rho=0.05, n_iters=2, progress=True)
    without = hs.sharpness(MHAClassifier(), _mha_batches(1), "m_apgd_l2", rho=0.05, n_iters=2, progress=False)
    assert with_bar.per_batch == without.per_batch
    assert capsys.readouterr().err == ""


def test_result_carries_the_measure():
    m = hs.Measure(metric="mixed", step="straight", eps=0.01)
    r = hs.sharpness(MHAClassifier(), _mha_batches(1), m, rho=0.05, n_iters=2, progress=False)
    assert r.measure == m and r.name == "geodesic_mixed_no_christoffel"
    assert r.config["christoffel"] is False and r.config["norm"] == "riemannian" and r.config["eps"] == 0.01
    d = r.to_dict()
    assert hs.Measure.from_dict(d["measure"]) == m
