"""Model adapters: the pairs found are the model's real symmetries (random GL(h) actions
leave every output unchanged), split/merge round-trip, and clear errors otherwise."""
import copy

import pytest
import torch
from torch import nn

import hideseek as hs
from hideseek.symmetries import apply_random_action, find_symmetries

from tests.models import (ClipImageClassifier, MHAClassifier, bert_batch, tiny_bert, tiny_clip,
                          tiny_vit)


def rel(a, b):
    return float((a - b).detach().abs().max() / b.detach().abs().max())


def check_invariance(model, run, log_cond=1.5):
    before = run(model)
    moved = apply_random_action(copy.deepcopy(model), generator=torch.Generator().manual_seed(3),
                                log_cond=log_cond)
    changed = max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), moved.parameters()))
    assert changed > 1e-2, "the action did not move the weights"
    after = run(moved)
    assert rel(after, before) < 1e-10
    return moved


def test_bert_pairs_and_invariance():
    model = tiny_bert()
    blocks = find_symmetries(model)
    assert len(blocks) == 2
    kinds = [d["kind"] for b in blocks for d in b.describe()]
    assert kinds == ["qk", "vo", "qk", "vo"]
    d = blocks[0].describe()[0]
    assert d["heads"] == 4 and d["head_width"] == 4 and d["G_shape"] == (17, 4)
    assert blocks[0].describe()[1]["H_shape"] == (16, 4)
    x, _ = bert_batch()
    check_invariance(model, lambda m: m(**x).logits)


def test_vit_pairs_and_invariance():
    model = tiny_vit()
    assert len(find_symmetries(model)) == 2
    x = torch.randn(5, 1, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    check_invariance(model, lambda m: m(x).logits)


def test_open_clip_both_towers_invariance():
    clip = tiny_clip()
    blocks = find_symmetries(clip)
    assert len(blocks) == 4   # two vision, two text ResidualAttentionBlocks (packed MHA)
    img = torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    txt = torch.randint(0, 30, (3, 6), generator=torch.Generator().manual_seed(2))
    check_invariance(clip, lambda m: torch.cat([m.encode_image(img), m.encode_text(txt)], 1))


def test_open_clip_custom_attention_module():
    from open_clip.transformer import Attention
    torch.manual_seed(0)
    att = Attention(16, num_heads=4).double().eval()
    model = nn.Sequential(att)
    assert len(find_symmetries(model)) == 1
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    check_invariance(model, lambda m: m(x))
    with pytest.raises(hs.UnsupportedAttentionError, match="scaled cosine"):
        find_symmetries(nn.Sequential(Attention(16, 4, scaled_cosine=True)))
    with pytest.raises(hs.UnsupportedAttentionError, match="QK normalisation"):
        find_symmetries(nn.Sequential(Attention(16, 4, qk_norm=True)))


@pytest.mark.parametrize("kw", [dict(), dict(kdim=5, vdim=7), dict(bias=False)])
def test_plain_multihead_attention(kw):
    model = MHAClassifier(**kw)
    (blk,) = find_symmetries(model)
    x = torch.randn(4, 6, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    check_invariance(model, lambda m: m(x))
    params = dict(model.named_parameters())
    merged = blk.merge(blk.split(params))
    assert set(merged) == set(blk.param_names)
    for n, t in merged.items():
        assert torch.equal(t, params[n])


def test_factor_and_diagonal_pairs_round_trip_and_invariance():
    class LoRA(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.A = nn.Parameter(torch.randn(3, 6, dtype=torch.float64))   # r × in
            self.B = nn.Parameter(torch.randn(5, 3, dtype=torch.float64))   # out × r

        def forward(self, x):
            return x @ (self.B @ self.A).T

    m = LoRA().eval()
    blk = hs.FactorPair("B", "A", transpose_h=True).bind(dict(m.named_parameters()))
    x = torch.randn(4, 6, dtype=torch.float64)
    moved = apply_random_action(copy.deepcopy(m), [blk], generator=torch.Generator().manual_seed(1))
    assert rel(moved(x), m(x)) < 1e-12 and rel(moved.A, m.A) > 1e-2
    dp = hs.DiagonalPair("u", "v").bind({"u": torch.randn(4), "v": torch.randn(4)})
    assert dp.groups[0].count == 4 and dp.groups[0].h == 1


def test_no_attention_and_unknown_attention_errors():
    mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert find_symmetries(mlp) == []

    class MyAttention(nn.Module):
        def __init__(self, packed="proj_in"):
            super().__init__()
            setattr(self, packed, nn.Linear(8, 24))

        def forward(self, x):
            return x

    model = nn.Sequential(MyAttention())
    with pytest.raises(hs.UnsupportedAttentionError, match="0: MyAttention looks like attention but no "
                       "hideseek adapter recognises its projections; declare it"):
        find_symmetries(model)
    assert find_symmetries(model, on_unsupported="adaptive") == []
    with pytest.raises(hs.UnsupportedAttentionError, match="0: MyAttention packs qkv in a layout "
                       "hideseek does not know"):
        find_symmetries(nn.Sequential(MyAttention("qkv")))


def test_rotary_embeddings_are_refused():
    model = tiny_bert()
    model.config.rope_theta = 10000.0
    with pytest.raises(hs.UnsupportedAttentionError, match="RoPE"):
        find_symmetries(model)


def test_add_bias_kv_refused():
    m = nn.Sequential(nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(hs.UnsupportedAttentionError, match="add_bias_kv"):
        find_symmetries(m)


@pytest.mark.slow
def test_discovery_does_not_import_open_clip_for_other_models():
    import subprocess
    import sys
    code = ("import sys, torch, hideseek as hs\n"
            "m = torch.nn.Sequential(torch.nn.MultiheadAttention(8, 2))\n"
            "assert len(hs.find_symmetries(m)) == 1\n"
            "assert 'open_clip' not in sys.modules, 'open_clip was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_rotary_group_elements_commute_with_rotations():
    """random_group_element on a rotary PairGroup: commutes with every rotation of the rotary
    column pairs (θ different per pair), is the identity-free GL block on the free columns."""
    from hideseek.symmetries import PairGroup, random_group_element
    grp = PairGroup("qk", 3, 5, 5, 6, rotary=((0, 2), (1, 3)), rotary_free=(4, 5))
    A = random_group_element(grp, 3, torch.Generator().manual_seed(0), log_cond=1.0)
    R = torch.eye(6, dtype=torch.float64)
    for (i, j), th in zip(grp.rotary, (0.7, 2.1)):
        R[i, i] = R[j, j] = torch.cos(torch.tensor(th, dtype=torch.float64))
        R[i, j] = -torch.sin(torch.tensor(th, dtype=torch.float64))
        R[j, i] = -R[i, j]
    assert torch.allclose(A @ R, R @ A, atol=1e-14)
    assert float(A[:, 4:, 4:].abs().min()) > 0 and float(A[:, :4, 4:].abs().max()) == 0
    assert grp.shape_key != PairGroup("qk", 3, 5, 5, 6).shape_key   # never stacked with GL(6)
    assert grp.group_name == "GL(1,C)^2 x GL(2)"
    with pytest.raises(ValueError, match="partition"):
        PairGroup("qk", 1, 5, 5, 6, rotary=((0, 2),), rotary_free=(4, 5))


def test_packed_rows_must_be_covered_exactly_once():
    """A block writes packed parameters back whole: rows it does not own (or owns twice) are
    refused at bind time, not silently dropped by merge."""
    from hideseek.symmetries import AttentionBlock, LinearRef
    params = {"qkv": torch.randn(36, 8, dtype=torch.float64), "o": torch.randn(8, 8, dtype=torch.float64)}
    q, k, v = (LinearRef("qkv", None, rows=(i * 8, (i + 1) * 8)) for i in range(3))   # rows 24..35 unowned
    with pytest.raises(hs.UnsupportedAttentionError, match="qkv: the declared rows do not cover the packed "
                       "parameter exactly once"):
        AttentionBlock("m", 2, q, k, v, "o").bind(params)
    params["qkv"] = params["qkv"][:24]
    blk = AttentionBlock("m", 2, q, k, v, "o").bind(params)
    for n, t in blk.merge(blk.split(params)).items():
        assert torch.equal(t, params[n])
