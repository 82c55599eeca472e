"""``Measure(step="exact")`` through :func:`hideseek.sharpness` on transformers (docs/maths.md §5.6).

The integrated geodesic runs on the tiny BERT, ViT and rotary Llama models of
``tests/models.py``; the value is invariant under a random group action applied to the
model (:func:`hideseek.symmetries.apply_random_action`), and it converges to the
second-order value as ρ → 0 with a difference shrinking like ρ³ (the step differs at third
order; average case over the same directions, so that the search does not add noise).
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

import hideseek as hs
from hideseek.geometry import geodesic as geo
from hideseek.symmetries import apply_random_action

from tests.models import bert_batch, llama_batch, tiny_bert, tiny_llama, tiny_vit


def _vit_batch(seed=0, n=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


MODELS = {"bert": (lambda: tiny_bert(seed=1), lambda: bert_batch(seed=2)),
          "vit": (lambda: tiny_vit(seed=1), lambda: _vit_batch(seed=2)),
          "llama": (lambda: tiny_llama(seed=1), lambda: llama_batch(seed=2))}
#: radii at which every geodesic of the search stays inside the mixed metric's domain
RHO = {"invariant": 0.2, "mixed": 0.01}




@pytest.mark.parametrize("metric", ["invariant", "mixed"])
@pytest.mark.parametrize("family", list(MODELS))
def test_exact_step_runs_and_is_invariant_under_the_action(family, metric):
    make, batch = MODELS[family]
    model = make()
    moved = apply_random_action(copy.deepcopy(model), generator=torch.Generator().manual_seed(5), log_cond=1.0)
    m = hs.Measure(metric=metric, step="exact")
    kw = dict(rho=RHO[metric], n_iters=2, progress=False)
    a = hs.sharpness(model, [batch()], m, **kw)
    b = hs.sharpness(moved, [batch()], m, **kw)
    assert a.measure.step == "exact" and a.name == f"geodesic_{metric}_exact"
    assert a.value > 0
    assert abs(a.value - b.value) < 1e-7 * abs(a.value)
    # and it is not the second-order value (the step differs)
    c = hs.sharpness(model, [batch()], hs.Measure(metric=metric), **kw)
    assert c.value != a.value


@pytest.mark.parametrize("metric,rhos", [("invariant", (0.8, 0.4, 0.2)), ("mixed", (0.005, 0.0025))])
def test_exact_step_converges_to_second_order_like_rho_cubed(metric, rhos, monkeypatch):
    monkeypatch.setattr(geo, "GEODESIC_RTOL", 1e-10)      # integration error far below ρ³
    model, batches = tiny_bert(seed=1), [bert_batch(seed=2)]
    diffs = []
    for rho in rhos:
        kw = dict(rho=rho, n_iters=4, progress=False)
        exact = hs.sharpness(model, batches, hs.Measure(metric=metric, step="exact", kind="average"), **kw).value
        second = hs.sharpness(model, batches, hs.Measure(metric=metric, kind="average"), **kw).value
        diffs.append(abs(exact - second))
    orders = [math.log2(a / b) for a, b in zip(diffs, diffs[1:])]
    assert all(2.5 < o < 3.5 for o in orders), (diffs, orders)


def test_exact_step_with_eps_and_the_ablation_refusal():
    model, batches = tiny_bert(seed=1), [bert_batch(seed=2)]
    r = hs.sharpness(model, batches, hs.Measure(metric="invariant", step="exact", eps=1e-3), rho=0.2, n_iters=2,
                     progress=False)
    assert r.value > 0 and r.measure.eps == 1e-3
    with pytest.raises(ValueError, match="ball='riemannian'"):
        hs.Measure(ball="adaptive", step="exact")
