"""Inputs and feedback (issue 25, item 5): two dicts are two batches, integer images are
refused, progress for single-batch calls and for suggest_rho, and the CLI's JSON says which
version measured what and how ρ was chosen."""
import json
import warnings

import pytest
import torch

import hideseek as hs
from hideseek import SharpnessInputError, progress as prog
from hideseek.cli import main
from hideseek.inputs import check_batches

from tests.models import MHAClassifier, bert_batch, tiny_bert, tiny_vit


def _hf_dict(seed):
    x, y = bert_batch(seed=seed)
    return {**x, "labels": y}


def test_two_dicts_are_two_batches():
    a, b = _hf_dict(0), _hf_dict(1)
    out = check_batches([a, b])
    assert len(out) == 2 and torch.equal(out[1][1], b["labels"])
    model = tiny_bert().double()
    two = hs.sharpness(model, [a, b], "adaptive", rho=0.05, n_iters=2, progress=False)
    one_by_one = [hs.sharpness(model, [d], "adaptive", rho=0.05, n_iters=2, progress=False, seed=0).value
                  for d in (a, b)]
    assert len(two.per_batch) == 2 and two.per_batch[0] == one_by_one[0]
    no_labels = [{k: v for k, v in d.items() if k != "labels"} for d in (a, b)]
    with pytest.raises(SharpnessInputError, match=r"^batch 0 is a dict without 'labels'"):
        check_batches(no_labels)
    x, y = bert_batch()
    assert len(check_batches((x, y))) == 1                       # one (dict inputs, labels) pair


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64])
def test_integer_images_are_refused_in_one_line(dtype):
    imgs = torch.randint(0, 256, (2, 3, 16, 16)).to(dtype)
    y = torch.tensor([0, 1])
    with pytest.raises(SharpnessInputError, match=r"^batch 0: the inputs are integer images \(" + str(dtype)[6:]
                       + r", shape \(2, 3, 16, 16\)\) but the model expects floats: convert them"):
        hs.sharpness(tiny_vit(), [(imgs, y)], "adaptive", rho=0.05, n_iters=1, progress=False)
    with pytest.raises(SharpnessInputError, match=r"^batch 1: 'pixel_values' are integer images"):
        check_batches([({"pixel_values": imgs.float()}, y), ({"pixel_values": imgs}, y)])
    ids = torch.randint(0, 40, (2, 7))                           # token ids stay integers
    assert check_batches([({"input_ids": ids}, y), (ids, y)])


class _FakeBar:
    made = []

    def __init__(self, *a, **kw):
        self.kw, self.n, self.postfix, self.closed = kw, 0, {}, False
        self.items = a[0] if a else None
        _FakeBar.made.append(self)

    def __iter__(self):
        for item in self.items:
            self.n += 1
            yield item

    def update(self, k=1):
        self.n += k

    def set_postfix(self, refresh=True, **kw):
        self.postfix = kw

    def close(self):
        self.closed = True


@pytest.fixture
def bars(monkeypatch):
    _FakeBar.made = []
    monkeypatch.setattr(prog, "_tqdm", lambda: _FakeBar)
    return _FakeBar.made


def _mha_batches(n):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(5, 4, 12, generator=g, dtype=torch.float64), torch.randint(0, 3, (5,), generator=g))
            for _ in range(n)]


def test_a_single_batch_call_counts_auto_pgd_iterations(bars):
    seen = []
    res = hs.sharpness(MHAClassifier(), _mha_batches(1), "adaptive", rho=0.05, n_iters=6, callback=seen.append)
    (bar,) = bars
    assert bar.kw["total"] == 6 and bar.n == 6 and bar.closed and bar.kw["delay"] == prog.DELAY
    assert float(bar.postfix["best_loss"]) == pytest.approx(res.base_losses[0] + res.value, rel=1e-5)
    assert len(seen) == 7                                         # the user's callback still sees every step
    bars.clear()
    hs.sharpness(MHAClassifier(), _mha_batches(3), "adaptive", rho=0.05, n_iters=2)
    (bar,) = bars                                                  # several batches: a bar over batches
    assert bar.n == 3 and bar.items is not None
    bars.clear()
    hs.sharpness(MHAClassifier(), _mha_batches(1), "adaptive", rho=0.05, n_iters=2, progress=False)
    assert bars == []


def test_suggest_rho_shows_its_evaluations(bars):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sug = hs.suggest_rho(MHAClassifier(), _mha_batches(1), "adaptive", n_iters=2, steps=2)
    (bar,) = bars
    assert bar.n == len(sug.trace) and bar.closed
    assert set(bar.postfix) == {"rho", "quantity"}
    bars.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hs.suggest_rho(MHAClassifier(), _mha_batches(1), "adaptive", n_iters=2, steps=2, progress=False)
    assert bars == []


def test_cli_json_records_version_measure_and_how_rho_was_chosen(tmp_path):
    tiny_bert().float().save_pretrained(tmp_path / "bert")
    x, y = bert_batch(n=4)
    torch.save({"inputs": x, "labels": y}, tmp_path / "data.pt")
    common = ["sharpness", "--hf", str(tmp_path / "bert"), "--data", str(tmp_path / "data.pt"),
              "--n-iters", "2", "--metric", "mixed", "--quiet"]
    given, auto = tmp_path / "given.json", tmp_path / "auto.json"
    assert main([*common, "--rho", "0.05", "--out", str(given)]) == 0
    res = json.loads(given.read_text())
    assert res["hideseek_version"] == hs.__version__
    assert res["measure"]["name"] == "geodesic_mixed" and hs.Measure.from_dict(
        {k: v for k, v in res["measure"].items() if k != "name"}).name == "geodesic_mixed"
    assert res["rho_choice"] == {"rule": "given", "rho": 0.05}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main([*common, "--rho", "auto", "--out", str(auto)]) == 0
    res = json.loads(auto.read_text())
    choice = res["rho_choice"]
    assert choice["rule"] == "loss" and choice["increase"] == 0.1
    assert choice["rho"] == res["config"]["rho"] and len(choice["trace"]) >= 3
    assert [choice["rho"], choice["achieved"]] in choice["trace"]
