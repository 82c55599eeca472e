"""Relative flatness against a dense autograd Hessian (float64) and Petzka et al.'s
feature-rescaling invariance."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from hideseek.relative_flatness import relative_flatness


def _mlp(seed=0, d_in=4, hidden=5, out=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, out)).double().eval()


def _data(seed=1, n=7, d_in=4, out=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g, dtype=torch.float64), torch.randint(0, out, (n,), generator=g)


def _dense_kappa(model, name, loss_of_output, x, y):
    """Σ_{s,s',k} (W Wᵀ)_{ss'} ∂²L/∂W_{sk}∂W_{s'k} from the full dense Hessian w.r.t. W."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    W = params[name]

    def f(Wv):
        return loss_of_output(torch.func.functional_call(model, {**params, name: Wv}, (x,)), y)

    H = torch.autograd.functional.hessian(f, W)            # (r, d, r, d)
    WWt = W @ W.T
    return float(torch.einsum("st,sktk->", WWt, H))


def _ce(out, y):
    return nn.functional.cross_entropy(out, y)


def _mse(out, y):   # a loss that is not softmax cross-entropy
    target = nn.functional.one_hot(y, out.shape[-1]).double()
    return ((out.tanh() - target) ** 2).sum(-1).mean()


@pytest.mark.parametrize("method", ["auto", "closed_form", "autograd"])
def test_cross_entropy_matches_dense_hessian(method):
    model = _mlp()
    x, y = _data()
    ref = _dense_kappa(model, "2.weight", _ce, x, y)
    res = relative_flatness(model, [(x, y)], layer="2.weight", method=method)
    assert res.method == ("autograd" if method == "autograd" else "closed_form")
    assert res.value == pytest.approx(ref, rel=1e-10, abs=1e-12)
    assert ref > 0


def test_generic_path_non_softmax_loss_and_inner_layer():
    model = _mlp(seed=3)
    x, y = _data(seed=4)
    for name in ("2.weight", "0.weight"):            # the last layer and one below a ReLU
        ref = _dense_kappa(model, name, _mse, x, y)
        res = relative_flatness(model, [(x, y)], layer=name, loss_fn=_mse)
        assert res.method == "autograd"
        assert res.value == pytest.approx(ref, rel=1e-10, abs=1e-12), name
    # an inner layer with the default loss is not the logits layer: autograd, still exact
    ref = _dense_kappa(model, "0.weight", _ce, x, y)
    res = relative_flatness(model, [(x, y)], layer=model[0])
    assert (res.method, res.layer) == ("autograd", "0.weight")
    assert res.value == pytest.approx(ref, rel=1e-10)


def test_mean_over_batches_and_module_name():
    model = _mlp(seed=5)
    batches = [_data(seed=s) for s in (6, 7)]
    res = relative_flatness(model, batches, layer="2")
    refs = [_dense_kappa(model, "2.weight", _ce, x, y) for x, y in batches]
    assert res.per_batch == pytest.approx(refs, rel=1e-10)
    assert res.value == pytest.approx(sum(refs) / 2, rel=1e-10)
    assert res.shape == (3, 5)


def test_invariant_to_feature_rescaling():
    """ReLU is positively homogeneous: (W1, b1) -> λ(W1, b1) scales φ by λ; W2 -> W2/λ keeps
    the function.  κ_Tr does not change (Petzka et al. 2021), while ‖W2‖ does."""
    model = _mlp(seed=8)
    x, y = _data(seed=9)
    before = relative_flatness(model, [(x, y)], layer="2.weight").value
    lam = 7.3
    with torch.no_grad():
        out0 = model(x)
        model[0].weight.mul_(lam), model[0].bias.mul_(lam), model[2].weight.div_(lam)
        assert torch.allclose(model(x), out0, atol=1e-12)
    after = relative_flatness(model, [(x, y)], layer="2.weight").value
    assert after == pytest.approx(before, rel=1e-10)


class _HFLike(nn.Module):
    """Returns an object with .logits, or a plain dict when ``bare``."""

    def __init__(self, bare=False):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.classifier, self.bare = nn.Linear(4, 6), nn.Linear(6, 3), bare

    def forward(self, input_ids):
        z = self.classifier(torch.tanh(self.body(input_ids)))
        if self.bare:
            return {"scores": z}
        from types import SimpleNamespace
        return SimpleNamespace(logits=z)


def test_keyword_inputs_and_logits_attribute():
    model = _HFLike().double().eval()
    x, y = _data(seed=10)
    res = relative_flatness(model, [({"input_ids": x}, y)])        # default layer classifier.weight
    ref = _dense_kappa(model, "classifier.weight", lambda o, t: _ce(o.logits, t), x, y)
    assert res.method == "closed_form"
    assert res.value == pytest.approx(ref, rel=1e-10)


def test_clear_errors():
    model = _mlp()
    x, y = _data()
    with pytest.raises(ValueError, match="not found"):
        relative_flatness(model, [(x, y)], layer="classifier.weight")
    with pytest.raises(ValueError, match="2-D"):
        relative_flatness(model, [(x, y)], layer="2.bias")
    with pytest.raises(ValueError, match="not logits"):
        relative_flatness(_HFLike(bare=True).double().eval(), [(x, y)])
    bare = _HFLike(bare=True).double().eval()    # ... fine with a loss_fn
    assert relative_flatness(bare, [(x, y)], loss_fn=lambda o, t: _ce(o["scores"], t)).value > 0
    with pytest.raises(ValueError, match="closed form"):
        relative_flatness(model, [(x, y)], layer="0.weight", method="closed_form")
    with pytest.raises(ValueError, match="eval"):
        relative_flatness(model.train(), [(x, y)], layer="2.weight")
    with pytest.raises(ValueError, match="empty"):
        relative_flatness(model.eval(), [], layer="2.weight")
