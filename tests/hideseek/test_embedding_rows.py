"""Embedding rows no token of a batch touches are left out of the search (issue 25, item 4).

Reference: the same call with the restriction switched off (``ROWS_FROM`` above any model):
the left-out rows have an exactly zero gradient, so every per-batch value must be the same."""
import warnings

import pytest
import torch
from torch import nn

import hideseek as hs
import hideseek.engine.engine as sh
import hideseek.engine.settings as thresholds
from hideseek import embedding_rows as er
from tests.models import bert_batch, tiny_bert

MEASURES = ["adaptive", "geodesic", "geodesic_mixed", "m_apgd_linf"]


@pytest.fixture(scope="module")
def model():
    return tiny_bert().double()


def _batches():
    return [bert_batch(seed=s) for s in range(2)]


def _run(model, measure, on: bool, monkeypatch, **kw):
    monkeypatch.setattr(er, "ROWS_FROM", 0 if on else 1 << 60)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return hs.sharpness(model, kw.pop("batches", _batches()), measure, rho=0.1, n_iters=8, progress=False, **kw)


@pytest.fixture
def restricted(monkeypatch):
    """The rows each restricted geometry was made with (a spy on RowsGeometry.restrict)."""
    seen = []
    orig = er.RowsGeometry.restrict.__func__

    def spy(cls, full, rows):
        seen.append({n: r.clone() for n, r in rows.items()})
        return orig(cls, full, rows)
    monkeypatch.setattr(er.RowsGeometry, "restrict", classmethod(spy))
    return seen


@pytest.mark.parametrize("measure", MEASURES)
def test_values_equal_with_and_without_the_row_restriction(model, measure, monkeypatch, restricted):
    off = _run(model, measure, False, monkeypatch)
    assert restricted == []
    on = _run(model, measure, True, monkeypatch)
    assert len(restricted) == 2                  # one restricted search per batch
    assert on.per_batch == off.per_batch         # bit for bit on this model
    assert on.base_losses == off.base_losses
    assert on.solver[0].history == off.solver[0].history
    for k, v in off.norm_share.items():          # a sum over fewer exact zeros: same to rounding
        assert on.norm_share[k] == pytest.approx(v, rel=1e-12, abs=1e-15)
    best_on, best_off = on.solver[1].best, off.solver[1].best
    assert [t.shape for t in best_on] == [t.shape for t in best_off]     # expanded back to full shape
    # the maximiser: equal up to the rounding of the norm that scales it onto the sphere
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-12 * float(b.abs().max())) for a, b in zip(best_on, best_off))


def test_rows_are_those_the_batch_looks_up(model, monkeypatch, restricted):
    batches = _batches()
    _run(model, "adaptive", True, monkeypatch, batches=batches)
    for (x, _), rows in zip(batches, restricted):
        assert torch.equal(rows["bert.embeddings.word_embeddings.weight"], torch.unique(x["input_ids"]))
        assert torch.equal(rows["bert.embeddings.position_embeddings.weight"],
                           torch.arange(x["input_ids"].shape[1]))       # positions, looked up inside the model
        assert torch.equal(rows["bert.embeddings.token_type_embeddings.weight"], torch.tensor([0]))  # default type


@pytest.mark.parametrize("kw", [dict(random_start=True), dict(restarts=2), dict(kind="average")])
def test_no_restriction_where_a_random_draw_would_reach_the_rows(model, kw, monkeypatch, restricted):
    _run(model, "adaptive", True, monkeypatch, **kw)
    assert restricted == []


class TiedHead(nn.Module):
    """An embedding whose weight is also the output layer (used outside the lookup)."""

    def __init__(self, vocab=60, dim=8, tie=True):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.out = None if tie else nn.Linear(dim, vocab)

    def forward(self, ids):
        h = torch.tanh(self.mix(self.emb(ids).mean(1)))
        return h @ self.emb.weight.T if self.out is None else self.out(h)


def _ids(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 10, (6, 5), generator=g), torch.randint(0, 60, (6,), generator=g)


def test_a_weight_used_outside_its_lookup_is_never_restricted(monkeypatch, restricted):
    tied = TiedHead().double().eval()
    a = _run(tied, "adaptive", True, monkeypatch, batches=[_ids(0), _ids(1)])
    assert restricted == []                     # the set-up gradient is not zero outside the rows
    b = _run(tied, "adaptive", False, monkeypatch, batches=[_ids(0), _ids(1)])
    assert a.per_batch == b.per_batch
    untied = TiedHead(tie=False).double().eval()
    _run(untied, "adaptive", True, monkeypatch, batches=[_ids(0), _ids(1)])
    assert len(restricted) == 2 and restricted[0]["emb.weight"].numel() <= 10


def test_low_memory_default_counts_what_the_search_holds(model, monkeypatch):
    """low_memory=None compares the elements of the restricted tangent with LOW_MEMORY_FROM."""
    kept = []
    real = sh.apgd

    def spy(*a, **kw):
        kept.append(kw["keep_best_grad"])
        return real(*a, **kw)
    monkeypatch.setattr(sh, "apgd", spy)
    n = sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(thresholds, "LOW_MEMORY_FROM", n - 100)     # all weights: over; the searched rows: under
    _run(model, "adaptive", False, monkeypatch)
    _run(model, "adaptive", True, monkeypatch)
    assert kept == [False, False, True, True]


def test_below_rows_from_nothing_is_restricted(model, monkeypatch, restricted):
    """The default threshold keeps small models' searches (and their bits) as they were."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        hs.sharpness(model, _batches(), "adaptive", rho=0.1, n_iters=2, progress=False)
    assert restricted == []
