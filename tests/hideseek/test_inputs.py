"""What `sharpness` accepts (Hugging Face batch conventions) and what it refuses, with the
message it gives.  Every refusal here used to produce a wrong number or a misleading error
(bfloat16 weights: exactly 0.0; eps=-1: "singular Gram matrix"; n_iters=0 average-case:
ZeroDivisionError; ...)."""
import math

import pytest
import torch
import torch.nn.functional as F

from hideseek import SharpnessInputError, sharpness

from tests.models import MHAClassifier, bert_batch, tiny_bert

FAST = dict(rho=0.05, n_iters=2, progress=False)


@pytest.fixture(scope="module")
def mha():
    return MHAClassifier()


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 5, 12, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)


# ------------------------------------------------------------------ Hugging Face batches
def test_dict_batch_with_labels_uses_the_models_loss():
    """A batch ``{..., "labels": y}``: labels go into the model, its ``.loss`` is the loss.
    Regression head (num_labels=1, float labels): HF's loss is MSE, not cross-entropy."""
    model = tiny_bert(labels=1)
    x, _ = bert_batch()
    y = torch.linspace(-1, 1, 6, dtype=torch.float64)
    res = sharpness(model, [dict(x, labels=y)], **FAST)
    with torch.no_grad():
        ref = F.mse_loss(model(**x).logits.squeeze(-1), y)
    assert res.base_losses[0] == pytest.approx(float(ref), rel=1e-12)


def test_dict_batches_equal_tuple_batches_and_dataloader():
    model = tiny_bert()
    x, y = bert_batch()
    a = sharpness(model, [(x, y)], **FAST)
    b = sharpness(model, [dict(x, labels=y)], **FAST)
    rows = [{k: v[i] for k, v in dict(x, labels=y).items()} for i in range(6)]
    loader = torch.utils.data.DataLoader(rows, batch_size=3)
    c = sharpness(model, loader, **FAST)
    with torch.no_grad():
        ref = F.cross_entropy(model(**x).logits, y)
    assert a.base_losses[0] == pytest.approx(float(ref), rel=1e-12)
    assert b.value == pytest.approx(a.value, rel=1e-9) and b.base_losses == pytest.approx(a.base_losses)
    assert len(c.per_batch) == 2
    with torch.no_grad():
        halves = [float(F.cross_entropy(model(**{k: v[s] for k, v in x.items()}).logits, y[s]))
                  for s in (slice(0, 3), slice(3, 6))]
    assert c.base_losses == pytest.approx(halves, rel=1e-12)


def test_loss_fn_reading_out_loss():
    model = tiny_bert()
    x, y = bert_batch()
    a = sharpness(model, [(x, y)], **FAST)
    b = sharpness(model, [(x, y)], loss_fn=lambda out, labels: out.loss, **FAST)
    c = sharpness(model, [dict(x, labels=y)], loss_fn=lambda out, labels: out.loss, **FAST)
    assert b.value == pytest.approx(a.value, rel=1e-9) and c.value == pytest.approx(a.value, rel=1e-9)


def test_causal_lm_dict_batch():
    """A causal LM: labels = input_ids, the model shifts them itself (cross-entropy on the
    unshifted logits would not even have matching shapes)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=30, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg).double().eval()
    ids = torch.randint(0, 30, (3, 8), generator=torch.Generator().manual_seed(1))
    res = sharpness(model, [{"input_ids": ids, "labels": ids}], **FAST)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, 30), ids[:, 1:].reshape(-1))
    # Hugging Face computes causal-LM losses on logits cast to float32, even in a float64 model
    assert res.base_losses[0] == pytest.approx(float(ref), rel=1e-6)
    assert res.base_losses[0] != pytest.approx(float(F.cross_entropy(logits.reshape(-1, 30), ids.reshape(-1))),
                                               rel=1e-3)
    assert math.isfinite(res.value) and res.value >= 0


def test_one_pair_not_in_a_list_is_one_batch(mha, data):
    a = sharpness(mha, [data], **FAST)
    b = sharpness(mha, data, **FAST)
    c = sharpness(mha, tuple(data), **FAST)
    assert a.per_batch == b.per_batch == c.per_batch and len(b.per_batch) == 1


def test_one_dict_pair_and_one_dict_batch_not_in_a_list():
    model = tiny_bert()
    x, y = bert_batch()
    a = sharpness(model, [(x, y)], **FAST)
    assert sharpness(model, (x, y), **FAST).per_batch == a.per_batch
    assert sharpness(model, dict(x, labels=y), **FAST).per_batch == a.per_batch


def test_dict_batch_without_labels_is_refused():
    model = tiny_bert()
    x, y = bert_batch()
    with pytest.raises(SharpnessInputError, match="'labels'"):
        sharpness(model, [x], **FAST)
    with pytest.raises(SharpnessInputError, match="rename 'label' to 'labels'"):
        sharpness(model, [dict(x, label=y)], **FAST)


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_weights_refused_pointing_to_autocast(dtype, data):
    model = MHAClassifier().to(dtype)
    x, y = data
    with pytest.raises(SharpnessInputError, match=r"(?s)half precision.*autocast="):
        sharpness(model, [(x.to(dtype), y)], **FAST)


@pytest.mark.parametrize("eps", [-1.0, float("nan"), -1e-3, float("inf")])
def test_bad_eps_refused(mha, data, eps):
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        sharpness(mha, [data], eps=eps, **FAST)


def test_metric_for_adaptive_measure_refused(mha, data):
    with pytest.raises(ValueError, match="metric"):
        sharpness(mha, [data], measure="adaptive", metric="mixed", **FAST)


def test_exclude_string_is_one_prefix(mha, data):
    whole = sharpness(mha, [data], measure="adaptive", **FAST)
    a = sharpness(mha, [data], measure="adaptive", exclude="head", **FAST)
    b = sharpness(mha, [data], measure="adaptive", exclude=["head"], **FAST)
    n_head = sum(p.numel() for n, p in mha.named_parameters() if n.startswith("head."))
    assert a.n_perturbed == b.n_perturbed == whole.n_perturbed - n_head


def test_exclude_matching_nothing_refused(mha, data):
    with pytest.raises(ValueError, match="matches no parameter"):
        sharpness(mha, [data], measure="adaptive", exclude=["haed"], **FAST)


@pytest.mark.parametrize("seed", [None, 1.5, "0"])
def test_bad_seed_refused(mha, data, seed):
    with pytest.raises(ValueError, match="seed must be an integer"):
        sharpness(mha, [data], seed=seed, **FAST)


@pytest.mark.parametrize("kw", [dict(n_iters=0), dict(n_samples=0), dict(n_iters=5, n_samples=-1)])
def test_average_case_with_no_samples_refused(mha, data, kw):
    opts = dict(FAST, **kw)
    with pytest.raises(ValueError, match="n_samples|n_iters"):
        sharpness(mha, [data], kind="average", **opts)


def test_meta_device_model_refused(data):
    model = MHAClassifier().to("meta")
    with pytest.raises(SharpnessInputError, match="meta device"):
        sharpness(model, [data], **FAST)


def test_model_loss_equals_cross_entropy_on_classifiers():
    """Passing labels to a Hugging Face classifier and using its .loss gives bit-identical
    sharpness to cross-entropy on the logits (what every report so far was computed with)."""
    model = tiny_bert()
    x, y = bert_batch()
    a = sharpness(model, [(x, y)], **FAST)
    b = sharpness(model, [(x, y)], loss_fn=lambda out, labels: F.cross_entropy(out.logits, labels), **FAST)
    assert a.value == b.value and a.base_losses == b.base_losses


# ------------------------------------------------------------------ where the worst case lives
def _dense_pair_sqnorm(G, H, xG, xH, metric):
    from hideseek.reference import pair_metric_tensor
    n, h = G.shape
    g = pair_metric_tensor(torch.cat([G.reshape(-1), H.reshape(-1)]), n, H.shape[0], h, metric)
    v = torch.cat([xG.reshape(-1), xH.reshape(-1)])
    return float(v @ g @ v)


def test_norm_share_of_a_hand_made_perturbation(mha):
    """Shares against a direct computation: the dense metric tensor per head for the pairs
    (heads read off the packed in_proj rows by hand), Σ (ξ/θ)² for the rest."""
    from hideseek.geometry import ProductGeometry
    from hideseek.sharpness import norm_share
    from hideseek.symmetries import find_symmetries
    params = {n: p.detach() for n, p in mha.named_parameters()}
    blocks = find_symmetries(mha)
    geom = ProductGeometry(params, blocks, metric="mixed")
    gen = torch.Generator().manual_seed(5)
    xi = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in geom.zeros()]
    share = norm_share(geom, xi)
    assert set(share) == {"qk", "vo", "free"} and sum(share.values()) == pytest.approx(1, abs=1e-12)
    # the same perturbation as parameters: ξ at θ + ξ with straight steps
    geom_straight = ProductGeometry(params, blocks, metric="mixed", christoffel=False)
    moved = geom_straight.point(xi)
    d = {n: moved[n] - params[n] for n in params}
    W, b, O = params["attn.in_proj_weight"], params["attn.in_proj_bias"], params["attn.out_proj.weight"]
    dW, db, dO = d["attn.in_proj_weight"], d["attn.in_proj_bias"], d["attn.out_proj.weight"]
    dim, heads, dk = 12, 3, 4
    qk = vo = 0.0
    for i in range(heads):
        r = slice(i * dk, (i + 1) * dk)
        rq, rk, rv = r, slice(dim + i * dk, dim + (i + 1) * dk), slice(2 * dim + i * dk, 2 * dim + (i + 1) * dk)
        Gq = torch.cat([W[rq].T, b[rq][None]]); Gk = torch.cat([W[rk].T, b[rk][None]])
        xq = torch.cat([dW[rq].T, db[rq][None]]); xk = torch.cat([dW[rk].T, db[rk][None]])
        qk += _dense_pair_sqnorm(Gq, Gk, xq, xk, "mixed")
        Gv = torch.cat([W[rv].T, b[rv][None]]); xv = torch.cat([dW[rv].T, db[rv][None]])
        vo += _dense_pair_sqnorm(Gv, O[:, r], xv, dO[:, r], "mixed")
    paired = {"attn.in_proj_weight", "attn.in_proj_bias", "attn.out_proj.weight"}
    # where θ = 0 the adaptive scale vanishes and the coordinate is not allowed to move
    free = sum(float(torch.where(params[n] != 0, d[n] / params[n], 0).square().sum())
               for n in params if n not in paired)
    total = qk + vo + free
    assert share["qk"] == pytest.approx(qk / total, rel=1e-9)
    assert share["vo"] == pytest.approx(vo / total, rel=1e-9)
    assert share["free"] == pytest.approx(free / total, rel=1e-9)


def test_norm_share_reported_for_geodesic_and_adaptive(mha, data):
    x, y = data
    batches = [(x[:3], y[:3]), (x[3:], y[3:])]
    geo = sharpness(mha, batches, measure="geodesic_mixed", **FAST)
    assert set(geo.norm_share) == {"qk", "vo", "free"}
    assert sum(geo.norm_share.values()) == pytest.approx(1, abs=1e-12)
    assert all(v >= 0 for v in geo.norm_share.values())
    # adaptive: the elementwise norm Σ (ξ/θ)², Q/K = the first 2·dim rows of the packed
    # projection, V/O = its last dim rows and the output weight, read off by hand
    ada = sharpness(mha, batches, measure="adaptive", **FAST)
    names = [n for n, _ in mha.named_parameters()]
    params = dict(mha.named_parameters())
    per_batch = []
    for res in ada.solver:
        z = {n: torch.where(params[n] != 0, t / params[n].detach(), 0).square()
             for n, t in zip(names, res.best)}
        qk = float(z["attn.in_proj_weight"][:24].sum() + z["attn.in_proj_bias"][:24].sum())
        vo = float(z["attn.in_proj_weight"][24:].sum() + z["attn.in_proj_bias"][24:].sum()
                   + z["attn.out_proj.weight"].sum())
        total = float(sum(v.sum() for v in z.values()))
        per_batch.append((qk / total, vo / total))
    assert ada.norm_share["qk"] == pytest.approx(sum(p[0] for p in per_batch) / 2, rel=1e-9)
    assert ada.norm_share["vo"] == pytest.approx(sum(p[1] for p in per_batch) / 2, rel=1e-9)
    assert sum(ada.norm_share.values()) == pytest.approx(1, abs=1e-12)
    assert sharpness(mha, batches, measure="avg_l2", **FAST).norm_share == {}
    assert sharpness(mha, batches, measure="m_apgd_linf", **FAST).norm_share == {}
