"""hideseek.inputs, the one input layer of `sharpness` and `relative_flatness`: the same batches
accepted and the same errors raised by both; NaN/inf losses named with their batch and cause;
what gets perturbed (parameters that require gradients, frozen ones fixed, parts of pairs
refused); half-precision frozen weights; DataParallel / torch.compile wrappers unwrapped."""
import math

import pytest
import torch
from torch import nn

from hideseek import SharpnessInputError, relative_flatness, sharpness
from hideseek.inputs import unwrap_model

from tests.models import MHAClassifier, bert_batch, tiny_bert

FAST = dict(rho=0.05, n_iters=2, progress=False)


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 5, 12, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)


# ------------------------------------------------------------------ one input layer
def test_relative_flatness_accepts_hf_dict_batches_like_sharpness():
    model = tiny_bert()
    x, y = bert_batch()
    a = relative_flatness(model, [(x, y)], layer="classifier.weight")
    b = relative_flatness(model, [dict(x, labels=y)], layer="classifier.weight")
    c = relative_flatness(model, dict(x, labels=y), layer="classifier.weight")   # one batch on its own
    assert a.per_batch == b.per_batch == c.per_batch and a.per_batch[0] > 0
    s = sharpness(model, [dict(x, labels=y)], **FAST)
    assert s.base_losses[0] == pytest.approx(a.base_losses[0], rel=1e-12)


@pytest.mark.parametrize("batches, match", [
    (torch.zeros(3), "not a single tensor"),
    ([], "batches is empty"),
    ([(torch.zeros(2, 12),)], "batch 0 is a tuple of length 1"),
    ([{"input_ids": torch.zeros(2, 3, dtype=torch.long)}], "dict without 'labels'"),
    ([("text", torch.zeros(2))], "inputs must be a tensor or a dict"),
])
def test_both_measures_raise_the_same_error_for_bad_batches(batches, match):
    model = MHAClassifier()
    for fn in (lambda: sharpness(model, batches, **FAST), lambda: relative_flatness(model, batches, "head.weight")):
        with pytest.raises(SharpnessInputError, match=match):
            fn()


def test_both_measures_refuse_training_mode_and_non_modules(data):
    model = MHAClassifier().train()
    for fn in (lambda m: sharpness(m, [data], **FAST), lambda m: relative_flatness(m, [data], "head.weight")):
        with pytest.raises(SharpnessInputError, match=r"training mode .* Call model.eval\(\) first"):
            fn(model)
        with pytest.raises(SharpnessInputError, match="model must be a torch.nn.Module, got str"):
            fn("model")


def test_relative_flatness_no_private_copies():
    import hideseek.relative_flatness as rf
    assert not hasattr(rf, "_to") and not hasattr(rf, "_logits")


def test_model_errors_become_one_line_naming_the_batch(data):
    x, y = data
    with pytest.raises(SharpnessInputError, match=r"the model \(or loss_fn\) raised IndexError on batch 0: .*out of bounds.*class indices"):
        sharpness(MHAClassifier(), [(x, y + 5)], **FAST)
    model = tiny_bert()
    ids, yb = bert_batch()
    bad = dict(ids, input_ids=ids["input_ids"].double())
    with pytest.raises(SharpnessInputError, match=r"raised RuntimeError on batch 0: .*integer tensor"):
        sharpness(model, [(bad, yb)], **FAST)


# ------------------------------------------------------------------ non-finite losses
def test_all_labels_ignored_is_a_nan_loss_named_with_its_cause():
    model = tiny_bert()
    x, y = bert_batch()
    ignored = torch.full_like(y, -100)
    for i, batches in ((0, [(x, ignored), (x, y)]), (1, [(x, y), (x, ignored)])):
        with pytest.raises(SharpnessInputError, match=rf"loss at θ on batch {i} is NaN: every label is -100") as err:
            sharpness(model, batches, **FAST)
        assert "deterministic" not in str(err.value)


def test_overflowing_input_is_refused_on_every_batch_never_a_nan_value(data):
    x, y = data
    huge = x.clone()
    huge[0, 0, 0] = float("inf")
    model = MHAClassifier()
    with pytest.raises(SharpnessInputError, match=r"loss at θ on batch 2 is NaN: the model's output is NaN or infinite"):
        sharpness(model, [(x, y), (x, y), (huge, y)], **FAST)
    with pytest.raises(SharpnessInputError, match="batch 0 is NaN") as err:
        sharpness(model, [(huge, y)], **FAST)
    assert "deterministic" not in str(err.value)
    with pytest.raises(SharpnessInputError, match="batch 0 is NaN"):
        relative_flatness(model, [(huge, y)], "head.weight")


def test_overflow_inside_the_ball_is_named_never_an_inf_value():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3)).eval()        # float32: (out ** 16) overflows at large rho
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with pytest.raises(SharpnessInputError, match=r"loss inside the ball on batch 0 is infinite: .*smaller rho"):
        sharpness(model, [(x, y)], "m_apgd_l2", rho=1e3, n_iters=5, progress=False,
                  loss_fn=lambda out, _: (out ** 16).mean())


# ------------------------------------------------------------------ what gets perturbed
def test_frozen_parameters_stay_fixed_and_are_reported(data):
    model = MHAClassifier()
    model.head.requires_grad_(False)
    try:
        res = sharpness(model, [data], measure="adaptive", **FAST)
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        assert res.perturbed_params == names and res.n_perturbed_params == len(names)
        assert not any(n.startswith("head.") for n in res.perturbed_params)
        assert res.n_perturbed == sum(p.numel() for p in model.parameters() if p.requires_grad)
        model.requires_grad_(False)
        with pytest.raises(SharpnessInputError, match=r"nothing to perturb: every parameter is frozen"):
            sharpness(model, [data], **FAST)
    finally:
        model.requires_grad_(True)


def test_exclude_of_one_side_of_a_pair_is_refused_naming_it(data):
    model = MHAClassifier()
    with pytest.raises(SharpnessInputError,
                       match=r"symmetry pair\(s\) of attn would be perturbed in part \('attn.out_proj.weight' left "
                             r"fixed.*Exclude all of its parameters \('attn.in_proj_weight'"):
        sharpness(model, [data], exclude=["attn.out_proj.weight"], **FAST)
    whole = sharpness(model, [data], exclude=["attn"], measure="adaptive", **FAST)
    assert not any(n.startswith("attn.") for n in whole.perturbed_params)


def test_pair_frozen_in_part_warns_naming_it(data):
    model = MHAClassifier()
    model.attn.out_proj.weight.requires_grad_(False)
    try:
        with pytest.warns(RuntimeWarning, match=r"pair\(s\) of attn are frozen in part \('attn.out_proj.weight'"):
            with pytest.raises(SharpnessInputError, match="no GL\\(h\\) symmetry"):
                sharpness(model, [data], **FAST)
    finally:
        model.attn.out_proj.weight.requires_grad_(True)


# ------------------------------------------------------------------ half precision
def test_frozen_half_precision_weights_are_accepted(data):
    x, y = data
    ref = MHAClassifier().float()
    half = MHAClassifier().float()
    half.kproj.to(torch.bfloat16).requires_grad_(False)
    ref.kproj.load_state_dict({k: v.float() for k, v in half.kproj.state_dict().items()})
    ref.kproj.requires_grad_(False)

    class Cast(nn.Module):     # the frozen bf16 layer's output back to float32
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(x.to(self.m.weight.dtype)).float()
    half.kproj, ref.kproj = Cast(half.kproj).eval(), Cast(ref.kproj).eval()
    a = sharpness(half, [(x.float(), y)], measure="adaptive", rho=0.5, n_iters=5, progress=False)
    b = sharpness(ref, [(x.float(), y)], measure="adaptive", rho=0.5, n_iters=5, progress=False)
    assert "kproj.m.weight" not in a.perturbed_params and a.perturbed_params == b.perturbed_params
    assert a.value > 0 and a.value == pytest.approx(b.value, rel=0.05)


def test_perturbed_half_precision_refused_with_advice_that_works_from_the_cli(data):
    model = MHAClassifier().to(torch.bfloat16)
    x, y = data
    with pytest.raises(SharpnessInputError, match=r"(?s)bfloat16 .*--dtype float32.*autocast=.*requires_grad_\(False\)"):
        sharpness(model, [(x.to(torch.bfloat16), y)], **FAST)


# ------------------------------------------------------------------ wrapped models
def test_data_parallel_is_unwrapped(data):
    model = MHAClassifier()
    ref = sharpness(model, [data], **FAST)
    wrapped = nn.DataParallel(model)
    res = sharpness(wrapped, [data], **FAST)
    assert res.value == ref.value and res.perturbed_params == ref.perturbed_params
    rf = relative_flatness(wrapped, [data], "head.weight")
    assert rf.value == relative_flatness(model, [data], "head.weight").value


@pytest.mark.slow
def test_compiled_model_is_measured_through_its_original_module(data):
    model = MHAClassifier()
    compiled = torch.compile(model)     # compilation is lazy: nothing compiles until a call
    assert unwrap_model(compiled) is model and compiled._orig_mod is model
    assert unwrap_model(nn.DataParallel(compiled)) is model
    res = sharpness(compiled, [data], **FAST)
    assert res.value == sharpness(model, [data], **FAST).value
    assert math.isfinite(res.value)


def test_distributed_data_parallel_is_unwrapped(data, tmp_path):
    dist = torch.distributed
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = MHAClassifier()
        ddp = nn.parallel.DistributedDataParallel(model)
        assert unwrap_model(ddp) is model
        assert sharpness(ddp, [data], **FAST).value == sharpness(model, [data], **FAST).value
    finally:
        dist.destroy_process_group()
