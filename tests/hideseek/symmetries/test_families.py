"""The attention families as registered adapters, under one case table: every registered family
has a case (a tiny model), each case's attention is found by the family named in the table and
only by it, and the blocks found are real symmetries (a random group action leaves the outputs
unchanged).  A declared block wins over every family; a family of higher priority is tried
first."""
import copy
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import transformers as tr
from torch import nn

from hideseek.symmetries import apply_random_action, declare_attention, find_symmetries
from hideseek.symmetries.base import AttentionBlock
from hideseek.symmetries.families import FAMILIES, Family, family_order, register_family
from tests.hideseek.symmetries import test_model_families as T
from tests.models import bert_batch, llama_batch, tiny_bert, tiny_clip, tiny_llama

VOCAB = 40
IDS = {"input_ids": torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))}
SEQ16 = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
IMG1 = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
IMG3 = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def _out(o):
    return o.logits if hasattr(o, "logits") else (o.last_hidden_state if hasattr(o, "last_hidden_state") else o)


def _open_clip_attention():
    from open_clip.transformer import Attention
    torch.manual_seed(0)
    return nn.Sequential(Attention(16, num_heads=4)).double().eval()


def _hf(cls, cfg):
    return T._hf(cls, lambda: cfg)


@dataclass
class Case:
    family: str                 # the family that must claim every attention module
    name: str
    build: Callable[[], nn.Module]
    x: object                   # the model's input (a dict: keyword arguments)
    blocks: int                 # attention blocks it must find
    heads: int                  # key/value pairs of each kind in the first block
    run: Callable | None = None  # model -> output tensor (default: the model on x)


CASES = [
    Case("torch_mha", "transformer_encoder",
         lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 2,
                                       enable_nested_tensor=False).double().eval(), SEQ16, 2, 4),
    Case("torch_mha", "open_clip_default_blocks", tiny_clip, IMG3, 4, 4,   # ResidualAttentionBlock: nn.MHA
         run=lambda m: m.encode_image(IMG3)),
    Case("open_clip", "open_clip_attention", _open_clip_attention, SEQ16, 1, 4),
    Case("timm", "timm_vit", T._timm(), IMG1, 2, 4),
    Case("hf_gpt2", "gpt2", _hf(tr.GPT2LMHeadModel, tr.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=4,
                                                                  n_positions=32)), IDS, 2, 4),
    Case("hf_gpt2", "gpt_bigcode_mqa", _hf(tr.GPTBigCodeForCausalLM, tr.GPTBigCodeConfig(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=4, n_positions=32, multi_query=True)), IDS, 2, 1),
    Case("hf_packed", "bloom", _hf(tr.BloomForCausalLM, tr.BloomConfig(vocab_size=VOCAB, hidden_size=16, n_layer=2,
                                                                       n_head=4)), IDS, 2, 4),
    Case("hf_packed", "gpt_neox_partial_rotary", _hf(tr.GPTNeoXForCausalLM, tr.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32,
        max_position_embeddings=32, rotary_pct=0.5)), IDS, 2, 4),
    Case("hf_qkv", "bert", tiny_bert, bert_batch()[0], 2, 4),
    Case("hf_qkv", "llama", lambda: tiny_llama(layers=2), llama_batch()[0], 2, 2),
    Case("hf_qkv", "t5", _hf(tr.T5Model, tr.T5Config(vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                                     num_heads=4)),
         dict(IDS, decoder_input_ids=IDS["input_ids"][:, :4]), 3, 4),
    Case("declared", "declared_gqa", T._tinygqa, SEQ16, 1, 2),
]


def test_every_registered_family_has_a_case():
    assert {c.family for c in CASES} == set(FAMILIES) | {"declared"}
    assert [f.name for f in family_order()] == sorted(FAMILIES, key=lambda n: -FAMILIES[n].priority)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.family}-{c.name}")
def test_case_table(case):
    model = case.build()
    blocks = [b for b in find_symmetries(model) if isinstance(b, AttentionBlock)]
    assert len(blocks) == case.blocks
    assert {b.family for b in blocks} == {case.family}
    assert [g.count for g in blocks[0].groups] == [case.heads, case.heads]

    def run(m):
        if case.run is not None:
            return case.run(m)
        return _out(m(**case.x) if isinstance(case.x, dict) else m(case.x))

    before = run(model)
    moved = apply_random_action(copy.deepcopy(model), generator=torch.Generator().manual_seed(3), log_cond=1.0)
    assert max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), moved.parameters())) > 1e-2
    after = run(moved)
    assert float((after - before).abs().max() / before.abs().max()) < 1e-7


class _QKVO(nn.Module):
    """q_proj/k_proj/v_proj/o_proj and num_heads = 4: the hf_qkv family's layout."""

    num_heads = 4

    def __init__(self, d=8):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))


def test_a_declared_block_wins_over_every_family():
    model = nn.Sequential(_QKVO()).double()
    assert find_symmetries(model)[0].family == "hf_qkv" and find_symmetries(model)[0].groups[0].count == 4
    declare_attention(model, "0", heads=2, q="q_proj", k="k_proj", v="v_proj", o="o_proj")
    (blk,) = find_symmetries(model)
    assert blk.family == "declared" and blk.groups[0].count == 2


def test_priority_orders_the_families_and_names_are_unique():
    seen = []

    def build(name, mod, info):
        seen.append(name)
        return None          # not this family's after all: discovery goes on to the next

    probe = register_family(Family("probe_test", priority=1000, match=lambda mod: isinstance(mod, _QKVO), build=build))
    try:
        assert family_order()[0] is probe
        (blk,) = find_symmetries(nn.Sequential(_QKVO()).double())
        assert seen == ["0"] and blk.family == "hf_qkv"
        with pytest.raises(ValueError, match="already registered"):
            register_family(Family("probe_test", priority=0, match=lambda mod: False, build=build))
    finally:
        FAMILIES.pop("probe_test", None)
    assert "probe_test" not in [f.name for f in family_order()]
