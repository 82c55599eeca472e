"""A precision policy that never quantises the answer (issue 25, item 3).

References: the float32 copy of the same weights (a bfloat16 base upcast exactly), the loss
recomputed by hand from float32 logits, and the fresh-adapter / zero-weight messages.  The
LoRA layers are :class:`benchmarks.models.LoraLinear` stand-ins with what peft's ``LoraLayer``
holds and computes (peft is not a test dependency): hideseek recognises peft layers by that
structure."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hideseek as hs
from hideseek import SharpnessInputError
from hideseek.inputs import default_loss
from hideseek.precision import own_loss

from benchmarks import models

tr = pytest.importorskip("transformers")


def lora_llama(dtype, fresh=False, seed=0):
    """A tiny grouped-query Llama with LoRA stand-ins on its attention (benchmarks.models)."""
    return models.lora_llama(dtype, fresh=fresh, seed=seed, use_peft=False)


def float32_copy(model):
    """The same weights, the base upcast to float32 (exactly)."""
    return copy.deepcopy(model).float()


def batches():
    ids = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(0))
    return [({"input_ids": ids}, ids)]


def run(model, measure="geodesic", rho=0.05, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = hs.sharpness(model, batches(), measure, rho=rho, n_iters=10, progress=False, **kw)
    return res, [str(w.message) for w in caught]


@pytest.fixture(scope="module")
def bf16():
    return lora_llama(torch.bfloat16)


@pytest.mark.parametrize("measure", ["geodesic", "adaptive"])
def test_bfloat16_base_lora_within_5_percent_of_float32_copy_or_flagged(bf16, measure):
    res, msgs = run(bf16, measure)
    ref, ref_msgs = run(float32_copy(bf16), measure)
    assert ref.resolution is None and not ref.below_resolution       # full precision: no flag
    assert res.resolution is not None and res.resolution > 0
    assert res.value == pytest.approx(ref.value, rel=0.05) or res.below_resolution
    assert res.below_resolution == any("below the resolution of the bfloat16 forward pass" in m for m in msgs)
    assert res.to_dict()["resolution"] == res.resolution


def test_a_value_below_the_resolution_is_flagged(bf16):
    res, msgs = run(bf16, "adaptive", rho=1e-5)
    assert res.below_resolution and abs(res.value) < res.resolution
    assert any("cannot be told from rounding noise" in m for m in msgs)
    ref, _ = run(float32_copy(bf16), "adaptive", rho=1e-5)
    assert not ref.below_resolution and ref.resolution is None


def test_fresh_lora_adapter_named_by_geodesic_and_explained_by_adaptive():
    fresh = lora_llama(torch.float32, fresh=True)
    with pytest.raises(SharpnessInputError, match=r"LoRA adapter 'default' of model\.layers\.0\.self_attn\.q_proj "
                                                  r"is at its initialisation \(B = 0.*Train it a step, or use eps>0"):
        run(fresh, "geodesic")
    res, msgs = run(fresh, "geodesic", eps=0.1)          # the relaxed metric is defined
    assert res.value >= 0
    ada, msgs = run(fresh, "adaptive")
    assert ada.value == 0.0
    assert any("sharpness is exactly 0" in m and "LoRA adapter at its initialisation, B = 0" in m
               and "holds every weight at exactly 0 fixed" in m for m in msgs)


def test_zero_weights_explained_without_lora():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3)).double().eval()
    nn.init.zeros_(model[0].weight)
    model[0].bias.requires_grad_(False)
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1])
    with pytest.warns(RuntimeWarning, match=r"exactly 0: 1 perturbed tensors are all zeros \(e\.g\. '0\.weight'\)"):
        res = hs.sharpness(model, [(x, y)], "adaptive", rho=0.1, n_iters=3, progress=False)
    assert res.value == 0.0


def test_default_loss_reads_half_precision_logits_in_float32():
    g = torch.Generator().manual_seed(0)
    z, y = torch.randn(16, 7, generator=g).bfloat16(), torch.randint(0, 7, (16,), generator=g)
    loss = default_loss(z, y)
    assert loss.dtype == torch.float32
    assert torch.equal(loss, F.cross_entropy(z.float(), y))          # by hand, from the same logits
    assert F.cross_entropy(z, y).dtype == torch.bfloat16             # what it would have been


def test_a_models_own_bfloat16_loss_is_recomputed_from_float32_logits():
    """A Hugging Face BERT classifier in bfloat16 computes its own loss in bfloat16."""
    torch.manual_seed(0)
    cfg = tr.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=3)
    model = tr.BertForSequenceClassification(cfg).bfloat16().eval()
    ids, y = torch.randint(0, 40, (6, 7)), torch.tensor([0, 1, 2, 0, 1, 2])
    with torch.no_grad():
        out = model(input_ids=ids, labels=y)
    assert out.loss.dtype == torch.bfloat16
    loss = default_loss(out, y)
    assert loss.dtype == torch.float32 and torch.equal(loss, F.cross_entropy(out.logits.float(), y))
    with pytest.raises(SharpnessInputError, match=r"the model's own loss is bfloat16 .* Pass loss_fn="):
        own_loss(out.loss * 1.5, out.logits, y)                      # a form hideseek cannot tell


def test_a_loss_fn_returning_half_precision_is_refused(bf16):
    with pytest.raises(SharpnessInputError, match=r"loss_fn returned a bfloat16 loss.* float32 logits"):
        run(bf16, "adaptive", loss_fn=lambda out, y: out.loss.bfloat16())
