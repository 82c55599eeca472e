"""``hs.sharpness(..., restarts=K)`` and ``low_memory=True`` (issue 17).

Restarts: the first search is today's single search (same bits), the others start from random
points of the ball; the result keeps the best per batch.  Checked against searches run by hand
with the public solver from the same starting points, and against the single search.
``low_memory``: the same values and histories as the default, more gradient evaluations.
"""
import importlib
import warnings

import pytest
import torch

import hideseek as hs
from hideseek.geometry.space import ProductGeometry
from hideseek.solvers import apgd
from hideseek.symmetries.discover import find_symmetries
from torch.func import functional_call

from tests.hideseek.test_sharpness import _mha_batches
from tests.models import MHAClassifier, bert_batch, tiny_bert

KW = dict(rho=0.2, n_iters=6, progress=False, seed=5)


_batches = _mha_batches


@pytest.mark.parametrize("kw", [dict(measure="adaptive"), dict(metric="mixed"), dict(metric="invariant")],
                         ids=["adaptive", "mixed", "invariant"])
def test_one_restart_is_the_single_search(kw):
    model = MHAClassifier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        one = hs.sharpness(model, _batches(), **KW, **kw)
        many = hs.sharpness(model, _batches(), restarts=3, **KW, **kw)
    assert one.restart_values == [[v] for v in one.per_batch]
    # the first start is the single search, bit for bit; the best is at least as high
    assert [v[0] for v in many.restart_values] == one.per_batch
    assert all(len(v) == 3 for v in many.restart_values)
    assert many.per_batch == [max(v) for v in many.restart_values]
    assert all(b >= a for a, b in zip(one.per_batch, many.per_batch))
    assert many.value == pytest.approx(sum(many.per_batch) / 2, rel=1e-15)
    assert many.config["restarts"] == 3 and one.config["restarts"] == 1
    # the random starts really differ from the start at zero
    assert all(len(set(v)) > 1 for v in many.restart_values)


def test_restarts_against_searches_by_hand():
    """Every start's value equals a search run with the public solver from the point the
    documentation describes: radius ρ·r (r uniform) times a uniform direction, drawn in order
    from the generator seeded by (seed, batch)."""
    model = MHAClassifier()
    batches = _batches()
    rho, n_iters, seed = 0.2, 6, 5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = hs.sharpness(model, batches, metric="mixed", restarts=4, rho=rho, n_iters=n_iters, seed=seed,
                           progress=False)
    params = {n: p.detach() for n, p in model.named_parameters()}
    geom = ProductGeometry(params, find_symmetries(model), metric="mixed")
    for i, (x, y) in enumerate(batches):
        def objective(xi):
            xi = [t.detach().requires_grad_(True) for t in xi]
            with torch.enable_grad():
                loss = torch.nn.functional.cross_entropy(functional_call(model, geom.point(xi), (x,)), y)
                return loss.detach(), list(torch.autograd.grad(loss, xi))

        gen = torch.Generator().manual_seed(seed * 1_000_003 + i)
        by_hand = [apgd(objective, geom, rho, n_iters).value]
        f0 = float(objective(geom.zeros())[0])
        for _ in range(3):
            r = float(torch.rand((), generator=gen))
            start = [rho * r * t for t in geom.random_direction(gen)]
            by_hand.append(apgd(objective, geom, rho, n_iters, x0=start, f0=f0).value)
        assert res.restart_values[i] == pytest.approx(by_hand, rel=1e-9, abs=1e-13)
        assert res.per_batch[i] == pytest.approx(max(by_hand), rel=1e-9, abs=1e-13)


def test_restarts_checked():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="restarts must be"):
            hs.sharpness(MHAClassifier(), _batches(1), restarts=bad, progress=False)


def test_average_case_has_one_value_per_batch():
    res = hs.sharpness(MHAClassifier(), _batches(), measure="adaptive", kind="average", rho=0.1,
                       n_samples=3, progress=False, restarts=2)
    assert res.restart_values == [[v] for v in res.per_batch]


@pytest.mark.parametrize("kw", [dict(measure="adaptive"), dict(measure="adaptive", p="linf"),
                                dict(metric="mixed"), dict(metric="invariant", christoffel=False)],
                         ids=["adaptive", "linf", "mixed", "invariant-straight"])
def test_low_memory_changes_no_value(kw):
    model = tiny_bert(seed=2)
    batches = [bert_batch(seed=s) for s in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        a = hs.sharpness(model, batches, rho=0.1, n_iters=12, progress=False, **kw)
        b = hs.sharpness(model, batches, rho=0.1, n_iters=12, progress=False, low_memory=True, **kw)
    assert a.per_batch == b.per_batch and a.base_losses == b.base_losses
    assert [s.history for s in a.solver] == [s.history for s in b.solver]
    assert [s.step_sizes for s in a.solver] == [s.step_sizes for s in b.solver]
    # restarts from an older best point take its gradient again
    extra = [sb.n_evals - sa.n_evals for sa, sb in zip(a.solver, b.solver)]
    assert all(e >= 0 for e in extra) and sum(extra) > 0


@pytest.mark.slow
def test_low_memory_none_chooses_by_model_size(monkeypatch):
    """``low_memory=None`` is ``True`` from LOW_MEMORY_FROM perturbed elements on (the extra
    gradient passes appear), ``False`` below (none); the values are the same either way."""
    sh = importlib.import_module("hideseek.engine.settings")   # the engine's thresholds

    model = tiny_bert(seed=2)
    batches = [bert_batch(seed=s) for s in range(2)]
    n = sum(p.numel() for p in model.parameters())
    kw = dict(rho=0.1, n_iters=12, progress=False, metric="mixed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        keep = hs.sharpness(model, batches, low_memory=False, **kw)
        low = hs.sharpness(model, batches, low_memory=True, **kw)
        monkeypatch.setattr(sh, "LOW_MEMORY_FROM", n + 1)         # the model is below: keep
        below = hs.sharpness(model, batches, **kw)
        monkeypatch.setattr(sh, "LOW_MEMORY_FROM", n)             # at the threshold: low memory
        above = hs.sharpness(model, batches, **kw)
    assert sum(s.n_evals for s in low.solver) > sum(s.n_evals for s in keep.solver)
    assert [s.n_evals for s in below.solver] == [s.n_evals for s in keep.solver]
    assert [s.n_evals for s in above.solver] == [s.n_evals for s in low.solver]
    assert below.per_batch == above.per_batch == keep.per_batch


def test_low_memory_refuses_other_values():
    for bad in (0, 1, "yes", "auto"):
        with pytest.raises(ValueError, match="low_memory must be True, False or None"):
            hs.sharpness(MHAClassifier(), _batches(1), low_memory=bad, progress=False)


def test_heap_trimmed_only_from_trim_from(monkeypatch):
    """Each CPU pass hands freed heap memory back only for models from TRIM_FROM elements."""
    sh = importlib.import_module("hideseek.engine.settings")   # the engine's thresholds

    calls = []
    # the set-up's start and each pass hand memory back in the engine's loss module
    monkeypatch.setattr(importlib.import_module("hideseek.engine.loss"), "release_freed_memory",
                        lambda: calls.append(1) or True)
    model = tiny_bert(seed=2)
    n = sum(p.numel() for p in model.parameters())
    kw = dict(rho=0.1, n_iters=3, progress=False, measure="adaptive")
    monkeypatch.setattr(sh, "TRIM_FROM", n + 1)
    hs.sharpness(model, [bert_batch(seed=0)], **kw)
    assert calls == []
    monkeypatch.setattr(sh, "TRIM_FROM", n)
    hs.sharpness(model, [bert_batch(seed=0)], **kw)
    assert len(calls) >= 3      # one per pass of the search, and the set-up's
