"""peft LoRA adapters as GL(r) pairs (paper Example A.3), on a tiny grouped-query Llama.

The group action is applied by hand in the test (A → M A, B → B M⁻¹ on every adapter's
``lora_A`` / ``lora_B`` weights), not through the library."""
import copy
import warnings

import pytest
import torch

import hideseek as hs
from hideseek import FactorPair, SharpnessInputError

peft = pytest.importorskip("peft")
tr = pytest.importorskip("transformers")

RANK = 4


def llama(dtype, targets=("q_proj", "k_proj", "v_proj", "o_proj"), seed=0):
    torch.manual_seed(seed)
    cfg = tr.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    base = tr.LlamaForCausalLM(cfg).to(dtype)
    torch.manual_seed(seed + 1)
    # lora_alpha != r: the scaling s = alpha / r is not 1; init_lora_weights=False: random A and B
    cfg = peft.LoraConfig(r=RANK, lora_alpha=3 * RANK, target_modules=list(targets), init_lora_weights=False)
    return peft.get_peft_model(base, cfg).eval()


def batches():
    ids = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(0))
    return [({"input_ids": ids}, ids)]


def act_by_hand(model, seed=3, expect=8):
    """A copy of ``model`` with A → M A, B → B M⁻¹ on every LoRA adapter (one M per adapter)."""
    moved = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    n = 0
    with torch.no_grad():
        for _, mod in moved.named_modules():
            if isinstance(getattr(mod, "lora_A", None), torch.nn.ModuleDict):
                for key in mod.lora_A:
                    A, B = mod.lora_A[key].weight, mod.lora_B[key].weight
                    M = (torch.eye(RANK, dtype=torch.float64)
                         + 0.5 * torch.randn(RANK, RANK, generator=gen, dtype=torch.float64))
                    A.copy_((M @ A.double()).to(A.dtype))
                    B.copy_((B.double() @ torch.linalg.inv(M)).to(B.dtype))
                    n += 1
    assert n == expect       # target modules × 2 layers
    return moved


def run(model, measure="geodesic", **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hs.sharpness(model, batches(), measure, rho=1.0, n_iters=10, progress=False, **kw)


@pytest.fixture(scope="module")
def bf16():
    return llama(torch.bfloat16)


def test_lora_on_a_bfloat16_base_done_when(bf16):
    """No pairs=, exactly the trainable parameters perturbed, invariant under GL(r) on every
    adapter, adaptive moves, within 5 % of the float32 copy of the same weights."""
    res = run(bf16)
    trainable = [n for n, p in bf16.named_parameters() if p.requires_grad]
    assert res.perturbed_params == trainable and len(trainable) == 16
    assert all(".lora_" in n for n in res.perturbed_params)
    assert {d["kind"] for d in res.pairs} == {"lora"} and len(res.pairs) == 8
    assert res.value > 0
    moved = act_by_hand(bf16)
    with torch.no_grad():      # the action is a symmetry: same logits (bf16 rounding aside)
        x = batches()[0][0]
        assert torch.allclose(bf16(**x).logits.float(), moved(**x).logits.float(), atol=0.05)
    geo = run(moved)
    assert geo.value == pytest.approx(res.value, rel=1e-2)
    ada, ada_moved = run(bf16, "adaptive"), run(moved, "adaptive")
    assert abs(ada_moved.value / ada.value - 1) > 0.1
    f32 = copy.deepcopy(bf16).float()       # the same weights, base upcast exactly
    assert run(f32).value == pytest.approx(res.value, rel=0.05)


def test_lora_invariance_is_exact_in_float64():
    model = copy.deepcopy(llama(torch.float32)).double()
    a, b = run(model), run(act_by_hand(model))
    assert b.value == pytest.approx(a.value, rel=1e-7)
    assert abs(run(act_by_hand(model), "adaptive").value / run(model, "adaptive").value - 1) > 0.1


def test_lora_pairs_beside_the_base_attentions_own_pairs():
    """Adapters on the MLP, attention trainable: attention pairs and LoRA pairs together."""
    model = llama(torch.float64, targets=("gate_proj", "up_proj"))
    for n, p in model.named_parameters():
        if ".self_attn." in n:
            p.requires_grad_(True)
    res = run(model)
    kinds = {d["kind"] for d in res.pairs}
    assert kinds == {"qk", "vo", "lora"}
    assert run(act_by_hand(model, expect=4)).value == pytest.approx(res.value, rel=1e-7)


def test_attention_discovered_through_lora_wrappers_and_adapters_with_trainable_base_refused():
    model = llama(torch.float64, targets=("q_proj", "v_proj"))
    blocks = hs.find_symmetries(model)
    attn = [b for b in blocks if isinstance(b, hs.AttentionBlock)]
    assert len(attn) == 2 and all("q_proj.base_layer.weight" in " ".join(b.param_names) for b in attn)
    model.requires_grad_(True)
    with pytest.raises(SharpnessInputError, match=r"self_attn: its projections carry LoRA adapters .* Freeze the "
                                                  r"base weights"):
        run(model)
    frozen_attention = run(model, exclude=[n for n, _ in model.named_parameters() if ".lora_" in n])
    assert {d["kind"] for d in frozen_attention.pairs} >= {"qk", "vo"}


def test_factor_pair_accepts_the_names_a_user_sees():
    model = llama(torch.float64, targets=("q_proj",))
    short = FactorPair("layers.0.self_attn.q_proj.lora_B.weight", "layers.0.self_attn.q_proj.lora_A.weight",
                       transpose_h=True)
    res = run(model, pairs=[short])
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight~" \
           "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight" in [d["module"] for d in res.pairs]
    assert len(res.pairs) == 2      # the declared pair replaces the one found, layer 1's is found
    with pytest.raises(ValueError, match=r"FactorPair: 'lora_B.weight' matches 2 parameters .* hideseek finds"):
        run(model, pairs=[FactorPair("lora_B.weight", "lora_A.weight", transpose_h=True)])
    with pytest.raises(ValueError, match=r"FactorPair: no parameter named 'nope.weight'"):
        run(model, pairs=[FactorPair("nope.weight", "lora_A.weight", transpose_h=True)])


def test_autocast_on_a_half_precision_base_with_float32_adapters(bf16):
    """autocast needs float32 *perturbed* parameters only: a LoRA on a bf16 base runs."""
    res = run(bf16, autocast="bfloat16")
    assert res.config["autocast"] == "bfloat16" and res.value > 0


def test_lora_on_gpt2_packed_conv1d_attention():
    """GPT-2: LoRA on the packed Conv1D c_attn (fan_in_fan_out); the attention is still found
    on the base layers, and the adapters' GL(r) pairs are invariant by hand."""
    torch.manual_seed(0)
    cfg = tr.GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    base = tr.GPT2LMHeadModel(cfg).double()
    torch.manual_seed(1)
    model = peft.get_peft_model(base, peft.LoraConfig(r=RANK, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                                                      fan_in_fan_out=True, init_lora_weights=False)).eval()
    blocks = hs.find_symmetries(model)
    attn = [b for b in blocks if isinstance(b, hs.AttentionBlock)]
    assert len(attn) == 2 and "attn.c_attn.base_layer.weight" in attn[0].param_names[0]
    assert any("lora_A" in n for n in attn[0].adapters)
    lora = [b for b in blocks if b.groups[0].kind == "lora"]
    assert len(lora) == 6       # c_attn, attn.c_proj, mlp.c_proj per layer
    a = run(model)
    assert a.value == pytest.approx(run(act_by_hand(model, expect=6)).value, rel=1e-7)
