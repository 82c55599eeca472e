"""``hs.sharpness_zoo`` equals separate ``hs.sharpness`` calls (issue 17).

The zoo runs every (member, radius, start) search in lockstep and evaluates their points in
one vmapped pass; the reference is the plain per-model call, computed independently here.
"""
import warnings

import pytest
import torch

import hideseek as hs

from benchmarks.models import MODELS, build, make_batches
from tests.models import MHAClassifier, bert_batch, tiny_bert

KW = dict(n_iters=6, seed=3)


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def _check(zoo_rows, models, batches, rhos, tol, **kw):
    for model, row in zip(models, zoo_rows):
        assert len(row) == len(rhos)
        for rho, res in zip(rhos, row):
            ref = hs.sharpness(model, batches, rho=rho, progress=False, **KW, **kw)
            assert res.name == ref.name and res.config == {**ref.config, "n_batches": len(batches)}
            got = res.per_batch + res.base_losses + [v for s in res.restart_values for v in s]
            want = ref.per_batch + ref.base_losses + [v for s in ref.restart_values for v in s]
            assert len(got) == len(want)
            assert max(_rel(a, b) for a, b in zip(got, want)) < tol
            assert res.value == pytest.approx(ref.value, rel=tol)


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(measure="adaptive"), dict(metric="mixed"), dict(metric="invariant"),
                                dict(measure="adaptive", p="linf"), dict(metric="mixed", norm="adaptive")],
                         ids=["adaptive", "mixed", "invariant", "linf", "mixed-adaptive-ball"])
def test_bert_zoo_equals_separate_calls_float64(kw):
    models = [tiny_bert(seed=s) for s in range(3)]
    batches = [bert_batch(seed=s) for s in range(2)]
    rhos = [0.05, 0.2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        rows = hs.sharpness_zoo(models, batches, rho=rhos, restarts=2, chunk=2, **KW, **kw)
        _check(rows, models, batches, rhos, 1e-10, restarts=2, **kw)


def test_vit_zoo_equals_separate_calls_float32():
    """The vision zoo's architecture: an open_clip ViT with a linear head, float32."""
    models = [build("tiny-vit", seed=s) for s in range(3)]
    batches = make_batches(MODELS["tiny-vit"], 6, n_batches=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = hs.sharpness_zoo(models, batches, metric="mixed", rho=0.1, **KW)
        assert all(isinstance(r, hs.SharpnessResult) for r in res)     # one radius: one result each
        _check([[r] for r in res], models, batches, [0.1], 1e-5, metric="mixed")


@pytest.mark.slow
def test_low_memory_in_the_zoo():
    models = [tiny_bert(seed=s) for s in range(2)]
    batches = [bert_batch(seed=0)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        a = hs.sharpness_zoo(models, batches, metric="mixed", rho=0.1, n_iters=12)
        b = hs.sharpness_zoo(models, batches, metric="mixed", rho=0.1, n_iters=12, low_memory=True, chunk=1)
    for ra, rb in zip(a, b):
        assert ra.per_batch == pytest.approx(rb.per_batch, rel=1e-10)


def test_zoo_refusals():
    with pytest.raises(hs.SharpnessInputError, match="one architecture"):
        hs.sharpness_zoo([tiny_bert(), tiny_bert(hidden=8, heads=2)], [bert_batch()], n_iters=2)
    with pytest.raises(hs.SharpnessInputError, match="empty"):
        hs.sharpness_zoo([], [bert_batch()])
    with pytest.raises(ValueError, match="worst case"):
        hs.sharpness_zoo([tiny_bert()], [bert_batch()], kind="average")
    with pytest.raises(ValueError, match="chunk must be"):
        hs.sharpness_zoo([tiny_bert()], [bert_batch()], chunk=0)

    class Branchy(torch.nn.Module):   # control flow on a weight's value: vmap cannot batch it
        def __init__(self):
            super().__init__()
            self.inner = MHAClassifier()

        def forward(self, x):
            w = next(self.inner.parameters())
            return self.inner(x) if bool(w.sum() > -1e9) else -self.inner(x)

    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(5, 4, 12, generator=g, dtype=torch.float64), torch.randint(0, 3, (5,), generator=g))
    with pytest.raises(hs.SharpnessInputError, match="cannot batch this model with torch.func.vmap"):
        hs.sharpness_zoo([Branchy().eval(), Branchy().eval()], [batch], measure="adaptive", n_iters=2)
