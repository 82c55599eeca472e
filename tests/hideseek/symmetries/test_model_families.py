"""Model families: the symmetry hideseek finds is the model's real symmetry.

One declarative table (``FAMILIES``): per family a tiny random-init float64 model, where its
attention weights are (written out here, independently of the library's split/merge), and
the pairs hideseek must find.  For each family a random element of the symmetry group is
applied *by hand* to the weights (docs/maths.md §1: query rows ← Aᵀ·rows, key rows ← A⁻¹·rows,
value rows ← Bᵀ·rows, output columns ← columns·B⁻ᵀ, biases alike) and the outputs must not
change; for rotary families A is block-diagonal ``a I + c J`` on the rotated column pairs
(Hugging Face ``rotate_half``: i with i + r/2) and a full GL(d) element must change them.
Non-rotary families: geodesic sharpness is unchanged by the action, adaptive sharpness is not.
Each refusal has its message checked.
"""
import copy
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hideseek as hs
from hideseek.symmetries import (AttentionSpec, UnsupportedAttentionError, apply_random_action,
                                 declare_attention, find_symmetries)

transformers = pytest.importorskip("transformers")
tr = transformers

VOCAB, SEQ, BATCH = 40, 6, 3


# ----------------------------------------------------------------------------- the by-hand action
@dataclass
class Att:
    """Where one attention's weights live.  ``q``/``k``/``v``: ``(weight, bias, rows)`` with
    ``rows(i)`` the output rows of query head i / key-value head i (out-convention);
    ``o``: output weight, ``o_cols(j)`` the input columns query head j feeds."""

    q: tuple
    k: tuple
    v: tuple
    o: torch.Tensor
    heads: int
    kv: int
    dk: int
    dv: int
    transposed: bool = False        # weights stored (in, out), GPT-2 Conv1D
    q_extra: list = field(default_factory=list)   # (weight, bias) with q's rows
    k_extra: list = field(default_factory=list)   # (weight, bias) with k's rows

    def o_cols(self, j):
        return torch.arange(j * self.dv, (j + 1) * self.dv)


def _rows_left(W, b, rows, M, transposed):
    """out-convention rows ← M · rows (bias entries alike)."""
    if transposed:
        W[:, rows] = W[:, rows] @ M.T
    else:
        W[rows] = M @ W[rows]
    if b is not None:
        b[rows] = M @ b[rows]


@torch.no_grad()
def act_by_hand(att: Att, A, B):
    """``A[g]`` (dk × dk) on query/key pair g, ``B[g]`` (dv × dv) on value/output pair g."""
    per = att.heads // att.kv
    for g in range(att.kv):
        Ainv, Binv = torch.linalg.inv(A[g]), torch.linalg.inv(B[g])
        for j in range(g * per, (g + 1) * per):
            W, b, rows = att.q
            _rows_left(W, b, rows(j), A[g].T, att.transposed)
            for We, be in att.q_extra:
                _rows_left(We, be, rows(j), A[g].T, att.transposed)
            cols = att.o_cols(j)
            if att.transposed:
                att.o[cols] = Binv @ att.o[cols]
            else:
                att.o[:, cols] = att.o[:, cols] @ Binv.T
        W, b, rows = att.k
        _rows_left(W, b, rows(g), Ainv, att.transposed)
        for We, be in att.k_extra:
            _rows_left(We, be, rows(g), Ainv, att.transposed)
        W, b, rows = att.v
        _rows_left(W, b, rows(g), B[g].T, att.transposed)


def rand_gl(n, gen, scale=0.5):
    """exp of a random matrix: invertible, condition number ~ e^{O(scale·√n)}."""
    return torch.linalg.matrix_exp(scale * torch.randn(n, n, generator=gen, dtype=torch.float64))


def rand_rotary(dk, r, gen, pairing="half"):
    """``a I + c J`` on each pair (i, i + r/2), i < r/2 (``pairing="adjacent"``: (2i, 2i+1));
    GL on the columns r..dk−1."""
    A = torch.zeros(dk, dk, dtype=torch.float64)
    for i in range(r // 2):
        i, j = (i, i + r // 2) if pairing == "half" else (2 * i, 2 * i + 1)
        a, c = torch.randn(2, generator=gen, dtype=torch.float64)
        A[i, i] = A[j, j] = a
        A[i, j], A[j, i] = c, -c
    if dk > r:
        A[r:, r:] = rand_gl(dk - r, gen)
    return A


def act_family(fam, model, gen, full_gl=False, pairing=None):
    wrong = pairing is not None and pairing != fam.pairing
    pairing = pairing or fam.pairing
    for att in fam.layout(model):
        r = fam.rotary_dims(att.dk)
        A = [rand_gl(att.dk, gen) if (full_gl or not r) else rand_rotary(att.dk, r, gen, pairing)
             for _ in range(att.kv)]
        B = [rand_gl(att.dv, gen) for _ in range(att.kv)]
        if full_gl or wrong:
            B = [torch.eye(att.dv, dtype=torch.float64)] * att.kv
        act_by_hand(att, A, B)


# ----------------------------------------------------------------------------- layouts
def sep(lin, width):
    """Separate nn.Linear: head i owns rows i·width … (i+1)·width."""
    return (lin.weight, lin.bias, lambda i: torch.arange(i * width, (i + 1) * width))


def packed_blocks(W, b, start, width):
    return (W, b, lambda i: torch.arange(start + i * width, start + (i + 1) * width))


def packed_per_head(W, b, which, width):
    return (W, b, lambda i: torch.arange(i * 3 * width + which * width, i * 3 * width + (which + 1) * width))


def qkvo_layout(attn, heads, kv, dk, o, q="q_proj", k="k_proj", v="v_proj", **kw):
    return Att(sep(getattr(attn, q), dk), sep(getattr(attn, k), dk), sep(getattr(attn, v), dk),
               o.weight, heads, kv, dk, dk, **kw)


def decoder_layout(heads, kv, o="o_proj"):
    def layout(m):
        out = []
        for layer in m.model.layers:
            a = layer.self_attn
            dk = a.q_proj.out_features // heads
            out.append(qkvo_layout(a, heads, kv, dk, getattr(a, o)))
        return out
    return layout


def gpt2_layout(m):
    out = []
    for blk in m.transformer.h:
        W, b = blk.attn.c_attn.weight, blk.attn.c_attn.bias
        E = W.shape[0]
        d = E // 4
        out.append(Att(packed_blocks(W, b, 0, d), packed_blocks(W, b, E, d), packed_blocks(W, b, 2 * E, d),
                       blk.attn.c_proj.weight, 4, 4, d, d, transposed=True))
    return out


def gpt2_cross_layout(m):
    out = gpt2_layout(m)
    for blk in m.transformer.h:
        a = blk.crossattention
        Wq, bq = a.q_attn.weight, a.q_attn.bias
        W, b = a.c_attn.weight, a.c_attn.bias           # packed [K; V], Conv1D (in, out)
        E = Wq.shape[0]
        d = E // 4
        out.append(Att(packed_blocks(Wq, bq, 0, d), packed_blocks(W, b, 0, d), packed_blocks(W, b, E, d),
                       a.c_proj.weight, 4, 4, d, d, transposed=True))
    return out


def bigcode_mqa_layout(m):
    out = []
    for blk in m.transformer.h:
        W, b = blk.attn.c_attn.weight, blk.attn.c_attn.bias
        d = 4
        E = W.shape[1]
        out.append(Att(packed_blocks(W, b, 0, d), packed_blocks(W, b, E, d), packed_blocks(W, b, E + d, d),
                       blk.attn.c_proj.weight, 4, 1, d, d))
    return out


def packed_gqa_layout(lin, o, heads, kv, d):
    """``[Q; K; V]`` packed, ``heads`` query and ``kv`` key/value heads of width d."""
    W, b = lin.weight, lin.bias
    return Att(packed_blocks(W, b, 0, d), packed_blocks(W, b, heads * d, d),
               packed_blocks(W, b, (heads + kv) * d, d), o.weight, heads, kv, d, d)


def per_head_layout(path, heads):
    def layout(m):
        out = []
        for layer in path(m):
            W, b = layer.query_key_value.weight, layer.query_key_value.bias
            d = W.shape[0] // (3 * heads)
            out.append(Att(packed_per_head(W, b, 0, d), packed_per_head(W, b, 1, d), packed_per_head(W, b, 2, d),
                           layer.dense.weight, heads, heads, d, d))
        return out
    return layout


def t5_layout(m):
    return [qkvo_layout(a, 4, 4, 4, a.o, q="q", k="k", v="v")
            for a in m.modules() if isinstance(a, tr.models.t5.modeling_t5.T5Attention)]


def albert_layout(m):
    (a,) = [a for a in m.modules() if type(a).__name__ == "AlbertAttention"]   # shared by all layers
    return [qkvo_layout(a, 4, 4, 4, a.dense, q="query", k="key", v="value")]


def deberta_layout(m):
    out = []
    for layer in m.deberta.encoder.layer:
        s = layer.attention.self
        att = qkvo_layout(s, 4, 4, 4, layer.attention.output.dense, q="query_proj", k="key_proj",
                          v="value_proj")
        if hasattr(s, "pos_query_proj"):
            att.q_extra.append((s.pos_query_proj.weight, s.pos_query_proj.bias))
        if hasattr(s, "pos_key_proj"):
            att.k_extra.append((s.pos_key_proj.weight, s.pos_key_proj.bias))
        out.append(att)
    return out


def timm_layout(m):
    out = []
    for blk in m.blocks:
        W, b = blk.attn.qkv.weight, blk.attn.qkv.bias
        E = W.shape[1]
        out.append(Att(packed_blocks(W, b, 0, 4), packed_blocks(W, b, E, 4), packed_blocks(W, b, 2 * E, 4),
                       blk.attn.proj.weight, 4, 4, 4, 4))
    return out


class TinyGQAttention(nn.Module):
    """A model no adapter knows: packed [Q; K; V] with 4 query heads over 2 key/value heads,
    no rotary; declared by hand with declare_attention."""

    def __init__(self, dim=16, heads=4, kv=2, classes=3):
        super().__init__()
        self.heads, self.kv, self.d = heads, kv, dim // heads
        self.wqkv = nn.Linear(dim, (heads + 2 * kv) * self.d)
        self.wo = nn.Linear(heads * self.d, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        B, T, _ = x.shape
        H, KV, d = self.heads, self.kv, self.d
        q, k, v = self.wqkv(x).split([H * d, KV * d, KV * d], -1)
        q = q.view(B, T, H, d).transpose(1, 2)
        k = k.view(B, T, KV, d).transpose(1, 2).repeat_interleave(H // KV, 1)
        v = v.view(B, T, KV, d).transpose(1, 2).repeat_interleave(H // KV, 1)
        att = torch.softmax(q @ k.transpose(-1, -2) / d ** 0.5, -1)
        y = (att @ v).transpose(1, 2).reshape(B, T, H * d)
        return self.head(torch.tanh(self.wo(y)).mean(1))


def tinygqa_layout(m):
    W, b = m.wqkv.weight, m.wqkv.bias
    return [Att(packed_blocks(W, b, 0, 4), packed_blocks(W, b, 16, 4), packed_blocks(W, b, 24, 4),
                m.wo.weight, 4, 2, 4, 4)]


# ----------------------------------------------------------------------------- batches and losses
def lm_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids}, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def cross_batch(seed=0):
    x, y = lm_batch(seed)
    g = torch.Generator().manual_seed(seed + 100)
    x["encoder_hidden_states"] = torch.randn(BATCH, 5, 16, generator=g, dtype=torch.float64)
    return x, y


def s2s_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    dec = torch.randint(0, VOCAB, (BATCH, 4), generator=g)
    return {"input_ids": ids, "decoder_input_ids": dec}, torch.randint(0, VOCAB, (BATCH, 4), generator=g)


def image_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, 1, 8, 8, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (BATCH,), generator=g))


def seq_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, 5, 16, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (BATCH,), generator=g))


def logits(out):
    return out.logits if hasattr(out, "logits") else out


def token_loss(out, y):
    z = logits(out)
    return F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1))


def forward(model, x):
    return logits(model(**x) if isinstance(x, dict) else model(x))


# ----------------------------------------------------------------------------- builders
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=32, max_position_embeddings=32)


def _hf(cls, cfg):
    def build():
        torch.manual_seed(0)
        m = cls(cfg()).double().eval()
        return m
    return build


def _timm(**kw):
    def build():
        from timm.models.vision_transformer import VisionTransformer
        torch.manual_seed(0)
        return VisionTransformer(img_size=8, patch_size=4, in_chans=1, num_classes=3, embed_dim=16,
                                 depth=2, num_heads=4, **kw).double().eval()
    return build


def _tinygqa():
    torch.manual_seed(0)
    m = TinyGQAttention().double().eval()
    declare_attention(m, "", heads=4, kv_heads=2, qkv="wqkv", o="wo")
    return m


@dataclass
class Family:
    name: str
    build: Callable
    layout: Callable
    batch: Callable
    blocks: int                     # attention blocks hideseek must find
    groups: list                    # (kind, count, h, query heads per pair) of the first block
    rotary: float = 0.0             # fraction of the head columns rotary rotates (0: none)
    loss: Callable | None = None
    pairing: str = "half"           # rotate_half: i ~ i + r/2; "adjacent" (GPT-J): 2i ~ 2i + 1
    tol: float = 1e-10              # invariance tolerance (relative, float64 model)

    def rotary_dims(self, dk):
        return int(dk * self.rotary)

    def rotary_pairs(self, dk):
        r = self.rotary_dims(dk)
        if self.pairing == "half":
            return tuple((i, i + r // 2) for i in range(r // 2))
        return tuple((2 * i, 2 * i + 1) for i in range(r // 2))


FAMILIES = [
    Family("llama_gqa", _hf(tr.LlamaForCausalLM, lambda: tr.LlamaConfig(**COMMON, num_key_value_heads=2)),
           decoder_layout(4, 2), lm_batch, 2, [("qk", 2, 8, 2), ("vo", 2, 8, 2)], rotary=1.0, loss=token_loss),
    Family("llama_mha", _hf(tr.LlamaForCausalLM, lambda: tr.LlamaConfig(**COMMON)),
           decoder_layout(4, 4), lm_batch, 2, [("qk", 4, 8, 1), ("vo", 4, 8, 1)], rotary=1.0, loss=token_loss),
    Family("mistral_mqa", _hf(tr.MistralForCausalLM, lambda: tr.MistralConfig(**COMMON, num_key_value_heads=1)),
           decoder_layout(4, 1), lm_batch, 2, [("qk", 1, 8, 4), ("vo", 1, 8, 4)], rotary=1.0, loss=token_loss),
    Family("qwen2_gqa_bias", _hf(tr.Qwen2ForCausalLM, lambda: tr.Qwen2Config(**COMMON, num_key_value_heads=2)),
           decoder_layout(4, 2), lm_batch, 2, [("qk", 2, 8, 2), ("vo", 2, 8, 2)], rotary=1.0, loss=token_loss),
    Family("gpt_neox_partial_rotary",
           _hf(tr.GPTNeoXForCausalLM, lambda: tr.GPTNeoXConfig(**COMMON, rotary_pct=0.5)),
           per_head_layout(lambda m: [l.attention for l in m.gpt_neox.layers], 4), lm_batch, 2,
           [("qk", 4, 8, 1), ("vo", 4, 8, 1)], rotary=0.5, loss=token_loss),
    Family("phi_partial_rotary",
           _hf(tr.PhiForCausalLM, lambda: tr.PhiConfig(**COMMON, partial_rotary_factor=0.5)),
           decoder_layout(4, 4, o="dense"), lm_batch, 2, [("qk", 4, 8, 1), ("vo", 4, 8, 1)], rotary=0.5,
           loss=token_loss),
    Family("gptj_adjacent_partial_rotary",
           _hf(tr.GPTJForCausalLM, lambda: tr.GPTJConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                                         rotary_dim=4, n_positions=32)),
           lambda m: [qkvo_layout(b.attn, 4, 4, 8, b.attn.out_proj) for b in m.transformer.h], lm_batch, 2,
           [("qk", 4, 8, 1), ("vo", 4, 8, 1)], rotary=0.5, loss=token_loss, pairing="adjacent",
           tol=1e-7),   # GPT-J computes q·k in float32 whatever the model's dtype
    Family("phi3_packed_gqa",
           _hf(tr.Phi3ForCausalLM, lambda: tr.Phi3Config(**COMMON, num_key_value_heads=2, pad_token_id=0)),
           lambda m: [packed_gqa_layout(l.self_attn.qkv_proj, l.self_attn.o_proj, 4, 2, 8) for l in m.model.layers],
           lm_batch, 2, [("qk", 2, 8, 2), ("vo", 2, 8, 2)], rotary=1.0, loss=token_loss),
    Family("cohere_interleaved_rotate_half",
           _hf(tr.CohereForCausalLM, lambda: tr.CohereConfig(**COMMON, num_key_value_heads=2)),
           decoder_layout(4, 2), lm_batch, 2, [("qk", 2, 8, 2), ("vo", 2, 8, 2)], rotary=1.0, loss=token_loss,
           pairing="adjacent", tol=1e-6),   # Cohere's rotate_half pairs neighbours; q, k rotated in float32
    Family("persimmon_packed_partial_rotary",
           _hf(tr.PersimmonForCausalLM, lambda: tr.PersimmonConfig(**COMMON, partial_rotary_factor=0.5, qk_layernorm=False)),
           per_head_layout(lambda m: [l.self_attn for l in m.model.layers], 4), lm_batch, 2,
           [("qk", 4, 8, 1), ("vo", 4, 8, 1)], rotary=0.5, loss=token_loss),
    Family("mpt_alibi_packed",
           _hf(tr.MptForCausalLM, lambda: tr.MptConfig(vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=4,
                                                       max_seq_len=32, expansion_ratio=2)),
           lambda m: [packed_gqa_layout(b.attn.Wqkv, b.attn.out_proj, 4, 4, 4) for b in m.transformer.blocks],
           lm_batch, 2, [("qk", 4, 4, 1), ("vo", 4, 4, 1)], loss=token_loss),
    Family("gpt2", _hf(tr.GPT2LMHeadModel, lambda: tr.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2,
                                                                 n_head=4, n_positions=32)),
           gpt2_layout, lm_batch, 2, [("qk", 4, 4, 1), ("vo", 4, 4, 1)], loss=token_loss),
    Family("gpt2_cross_attention",
           _hf(tr.GPT2LMHeadModel, lambda: tr.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=4,
                                                         n_positions=32, add_cross_attention=True)),
           gpt2_cross_layout, cross_batch, 4, [("qk", 4, 4, 1), ("vo", 4, 4, 1)], loss=token_loss),
    Family("gpt_bigcode_mqa",
           _hf(tr.GPTBigCodeForCausalLM, lambda: tr.GPTBigCodeConfig(vocab_size=VOCAB, n_embd=16, n_layer=2,
                                                                     n_head=4, n_positions=32, multi_query=True)),
           bigcode_mqa_layout, lm_batch, 2, [("qk", 1, 4, 4), ("vo", 1, 4, 4)], loss=token_loss),
    Family("bloom_alibi", _hf(tr.BloomForCausalLM, lambda: tr.BloomConfig(vocab_size=VOCAB, hidden_size=16,
                                                                          n_layer=2, n_head=4)),
           per_head_layout(lambda m: [b.self_attention for b in m.transformer.h], 4), lm_batch, 2,
           [("qk", 4, 4, 1), ("vo", 4, 4, 1)], loss=token_loss),
    Family("t5_relative_bias",
           _hf(tr.T5ForConditionalGeneration, lambda: tr.T5Config(vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32,
                                                                  num_layers=2, num_heads=4)),
           t5_layout, s2s_batch, 6, [("qk", 4, 4, 1), ("vo", 4, 4, 1)], loss=token_loss),
    Family("albert_shared_layers",
           _hf(tr.AlbertForMaskedLM, lambda: tr.AlbertConfig(vocab_size=VOCAB, embedding_size=8, hidden_size=16,
                                                             num_hidden_layers=3, num_attention_heads=4,
                                                             intermediate_size=32)),
           albert_layout, lm_batch, 1, [("qk", 4, 4, 1), ("vo", 4, 4, 1)], loss=token_loss),
    Family("deberta_v2_no_relative",
           _hf(tr.DebertaV2ForMaskedLM, lambda: tr.DebertaV2Config(**{**COMMON, "hidden_size": 16},
                                                                   relative_attention=False)),
           deberta_layout, lm_batch, 2, [("qk", 4, 4, 1), ("vo", 4, 4, 1)], loss=token_loss),
    Family("deberta_v2_relative",
           _hf(tr.DebertaV2ForMaskedLM, lambda: tr.DebertaV2Config(
               **{**COMMON, "hidden_size": 16}, relative_attention=True, pos_att_type=["c2p", "p2c"],
               max_relative_positions=8, share_att_key=False)),
           deberta_layout, lm_batch, 2, [("qk", 4, 4, 1), ("vo", 4, 4, 1)], loss=token_loss),
    Family("deberta_v2_relative_shared_key",
           _hf(tr.DebertaV2ForMaskedLM, lambda: tr.DebertaV2Config(
               **{**COMMON, "hidden_size": 16}, relative_attention=True, pos_att_type=["c2p", "p2c"],
               position_buckets=4, share_att_key=True)),
           deberta_layout, lm_batch, 2, [("qk", 4, 4, 1), ("vo", 4, 4, 1)], loss=token_loss),
    Family("timm_vit", _timm(), timm_layout, image_batch, 2, [("qk", 4, 4, 1), ("vo", 4, 4, 1)]),
    Family("declared_gqa", _tinygqa, tinygqa_layout, seq_batch, 1, [("qk", 2, 4, 2), ("vo", 2, 4, 2)]),
]
ROTARY = [f for f in FAMILIES if f.rotary]
PLAIN = [f for f in FAMILIES if not f.rotary]
ids = lambda f: f.name   # noqa: E731


@pytest.fixture(scope="module")
def built():
    cache = {}

    def get(fam):
        if fam.name not in cache:
            cache[fam.name] = fam.build()
        return cache[fam.name]
    return get


def rel(a, b):
    return float((a - b).detach().abs().max() / b.detach().abs().max())


@pytest.mark.parametrize("fam", FAMILIES, ids=ids)
def test_pairs_found(fam, built):
    model = built(fam)
    blocks = find_symmetries(model)
    assert len(blocks) == fam.blocks
    got = [(g.kind, g.count, g.h, g.group_size) for g in blocks[0].groups]
    assert got == fam.groups
    qk, vo = blocks[0].groups
    assert vo.rotary == () and vo.group_name == f"GL({vo.h})"
    r = fam.rotary_dims(qk.h)
    assert qk.rotary == fam.rotary_pairs(qk.h)
    assert qk.rotary_free == (tuple(range(r, qk.h)) if r else ())
    if r:
        assert "GL(1,C)" in repr(blocks[0]) and "rotary" in blocks[0].describe()[0]
    # split/merge round trip and the library's own random action
    params = dict(model.named_parameters())
    for blk in blocks:
        for n, t in blk.merge(blk.split(params)).items():
            assert torch.equal(t, params[n]), n


@pytest.mark.parametrize("fam", FAMILIES, ids=ids)
def test_group_action_by_hand_leaves_outputs_unchanged(fam, built):
    model = built(fam)
    x, _ = fam.batch()
    before = forward(model, x)
    moved = copy.deepcopy(model)
    act_family(fam, moved, torch.Generator().manual_seed(1))
    change = max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), moved.parameters()))
    assert change > 1e-2, "the action did not move the weights"
    assert rel(forward(moved, x), before) < fam.tol
    lib = apply_random_action(copy.deepcopy(model), generator=torch.Generator().manual_seed(2), log_cond=1.5)
    assert rel(forward(lib, x), before) < fam.tol


@pytest.mark.parametrize("fam", ROTARY, ids=ids)
def test_full_gl_on_rotary_query_key_changes_outputs(fam, built):
    """The restriction is needed: a generic GL(d) element on the rotary Q/K pairs changes
    the function (value/output left alone)."""
    model = built(fam)
    x, _ = fam.batch()
    moved = copy.deepcopy(model)
    act_family(fam, moved, torch.Generator().manual_seed(1), full_gl=True)
    assert rel(forward(moved, x), forward(model, x)) > max(1e-6, 100 * fam.tol)
    wrong = copy.deepcopy(model)     # the right block form on the wrong column pairs
    act_family(fam, wrong, torch.Generator().manual_seed(1),
               pairing="adjacent" if fam.pairing == "half" else "half")
    assert rel(forward(wrong, x), forward(model, x)) > max(1e-6, 100 * fam.tol)


SHARP = dict(rho=0.5, n_iters=3, progress=False)


@pytest.mark.parametrize("fam", FAMILIES, ids=ids)
def test_geodesic_sharpness_invariant_adaptive_not(fam, built):
    """Rotary families use the rotary geometry (hideseek.geometry.rotary) for their Q/K pairs;
    families computing q·k in float32 (GPT-J, Cohere) are invariant only to that precision."""
    model = built(fam)
    moved = copy.deepcopy(model)
    act_family(fam, moved, torch.Generator().manual_seed(1))
    batches = [fam.batch(seed=3)]
    paired = {n for b in find_symmetries(model) for n in b.param_names}
    others = [n for n, _ in model.named_parameters() if n not in paired]
    kw = dict(SHARP, exclude=others, loss_fn=fam.loss)
    a = hs.sharpness(model, batches, measure="geodesic", **kw).value
    b = hs.sharpness(moved, batches, measure="geodesic", **kw).value
    assert a > 0 and abs(a - b) <= max(1e-7, 10 * fam.tol) * abs(a), (a, b)
    a = hs.sharpness(model, batches, measure="adaptive", **kw).value
    b = hs.sharpness(moved, batches, measure="adaptive", **kw).value
    assert abs(a - b) > 0.02 * abs(a), (a, b)


# ----------------------------------------------------------------------------- declaring by hand
def gpt2_model():
    return next(f for f in FAMILIES if f.name == "gpt2").build()


def test_gpt2_declared_by_hand_equals_discovery():
    """docs/model_support.md's example: GPT-2 declared by hand gives the automatic pairs."""
    model = gpt2_model()
    auto = find_symmetries(model)
    by_hand = copy.deepcopy(model)
    for i in range(2):
        spec = declare_attention(by_hand, f"transformer.h.{i}.attn", heads=4, qkv="c_attn", o="c_proj")
        assert spec.transposed            # Conv1D detected: weights stored (in, out)
    declared = find_symmetries(by_hand)
    params = dict(model.named_parameters())
    assert len(declared) == len(auto) == 2
    for a, b in zip(auto, declared):
        assert a.module == b.module and a.param_names == b.param_names and a.groups == b.groups
        for (Ga, Ha), (Gb, Hb) in zip(a.split(params), b.split(params)):
            assert torch.equal(Ga, Gb) and torch.equal(Ha, Hb)
    # the same as a spec passed to bind (full parameter names, nothing registered)
    spec = AttentionSpec("transformer.h.0.attn", 4, qkv="c_attn", o="c_proj", transposed=True)
    for (Ga, Ha), (Gb, Hb) in zip(auto[0].split(params), spec.bind(params).split(params)):
        assert torch.equal(Ga, Gb) and torch.equal(Ha, Hb)


def test_llama_declared_by_hand_equals_discovery():
    """Grouped-query attention with rotary embeddings declared by hand (rotary_dims,
    the default "half" pairing) gives the discovered pairs and groups."""
    model = next(f for f in FAMILIES if f.name == "llama_gqa").build()
    auto = find_symmetries(model)
    for i in range(2):
        declare_attention(model, f"model.layers.{i}.self_attn", heads=4, kv_heads=2, q="q_proj", k="k_proj",
                          v="v_proj", o="o_proj", rotary_dims=8)
    declared = find_symmetries(model)
    params = dict(model.named_parameters())
    for a, b in zip(auto, declared, strict=True):
        assert a.groups == b.groups and a.groups[0].rotary == ((0, 4), (1, 5), (2, 6), (3, 7))
        for (Ga, Ha), (Gb, Hb) in zip(a.split(params), b.split(params)):
            assert torch.equal(Ga, Gb) and torch.equal(Ha, Hb)


def test_spec_in_pairs_equals_registered_declaration():
    torch.manual_seed(0)
    plain = TinyGQAttention().double().eval()
    declared = _tinygqa()
    batches = [seq_batch(seed=4)]
    with pytest.raises(UnsupportedAttentionError, match="TinyGQAttention looks like attention"):
        hs.sharpness(plain, batches, measure="geodesic", **SHARP)
    spec = AttentionSpec("", 4, qkv="wqkv", o="wo", kv_heads=2)
    a = hs.sharpness(plain, batches, measure="geodesic", pairs=[spec], on_unsupported="adaptive", **SHARP)
    b = hs.sharpness(declared, batches, measure="geodesic", **SHARP)
    assert a.value == b.value and a.pairs == b.pairs


def test_declaration_errors():
    model = gpt2_model()
    with pytest.raises(ValueError, match="has no module 'transformer.h.9.attn'"):
        declare_attention(model, "transformer.h.9.attn", heads=4, qkv="c_attn", o="c_proj")
    with pytest.raises(UnsupportedAttentionError, match="no projection 'qkv'"):
        declare_attention(model, "transformer.h.0.attn", heads=4, qkv="qkv", o="c_proj")
    with pytest.raises(UnsupportedAttentionError, match="not a multiple of 15 head widths"):
        declare_attention(model, "transformer.h.0.attn", heads=5, qkv="c_attn", o="c_proj")
    with pytest.raises(UnsupportedAttentionError, match="not a multiple of 12 head widths.*transposed"):
        declare_attention(model, "transformer.h.0.attn", heads=4, qkv="c_attn", o="c_proj", transposed=False)
    with pytest.raises(UnsupportedAttentionError, match="do not split into 3 query heads and 3 key/value"):
        AttentionSpec("transformer.h.0.attn", 3, q=("c_attn.weight", None), k=("c_proj.weight", None),
                      v=("c_proj.weight", None), o="c_proj").bind(dict(model.named_parameters()))
    with pytest.raises(ValueError, match="either q, k and v, or qkv"):
        AttentionSpec("a", 4, o="o", q="q", qkv="qkv")
    with pytest.raises(ValueError, match="kv_heads=3 must divide heads=4"):
        AttentionSpec("a", 4, o="o", qkv="qkv", kv_heads=3)


# ----------------------------------------------------------------------------- refusals
def _timm_attention(**kw):
    def build():
        from timm.layers.attention import Attention
        return nn.Sequential(Attention(16, num_heads=4, **kw)).double().eval()
    return build


SMALL = dict(COMMON, hidden_size=16, num_attention_heads=4, intermediate_size=16)
REFUSALS = [
    ("qwen3_qk_norm", _hf(tr.Qwen3ForCausalLM, lambda: tr.Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=4)),
     r"QK normalisation \(q_norm, k_norm: Qwen3RMSNorm\)"),
    ("olmo2_qk_norm", _hf(tr.Olmo2ForCausalLM, lambda: tr.Olmo2Config(**SMALL)),
     r"QK normalisation \(q_norm, k_norm: Olmo2RMSNorm\)"),
    ("gemma3_qk_norm", _hf(tr.Gemma3ForCausalLM, lambda: tr.Gemma3TextConfig(**SMALL, head_dim=4, num_key_value_heads=2)),
     r"QK normalisation \(q_norm, k_norm: Gemma3RMSNorm\)"),
    ("phi_qk_layernorm", _hf(tr.PhiForCausalLM, lambda: tr.PhiConfig(**SMALL, qk_layernorm=True)),
     r"QK normalisation \(q_layernorm, k_layernorm: LayerNorm\)"),
    ("timm_qk_norm", _timm(qk_norm=True), r"QK normalisation \(q_norm, k_norm: LayerNorm\)"),
    ("timm_scale_norm", _timm_attention(scale_norm=True, norm_layer=nn.LayerNorm), r"scale_norm=True\) normalises the heads"),
    ("timm_gated", _timm_attention(gated=True), r"gated=True\) multiplies each head output"),
    ("bert_relative_key", _hf(tr.BertModel, lambda: tr.BertConfig(**SMALL, position_embedding_type="relative_key")),
     r"relative-key position embeddings \(position_embedding_type='relative_key'\)"),
    ("longformer_global_projections",
     _hf(tr.LongformerModel, lambda: tr.LongformerConfig(**{**SMALL, "max_position_embeddings": 40}, attention_window=4)),
     r"LongformerSelfAttention has linear projections besides query/key/value/output.dense \(query_global, "
     r"key_global, value_global"),
    ("bitnet_sub_norm", _hf(tr.BitNetForCausalLM, lambda: tr.BitNetConfig(**SMALL, num_key_value_heads=2)),
     r"a normalisation inside the attention module \(attn_sub_norm: BitNetRMSNorm\)"),
    ("roformer_rotary_width_unknown",
     _hf(tr.RoFormerModel, lambda: tr.RoFormerConfig(**SMALL, embedding_size=16)),
     r"RoFormerSelfAttention defines apply_rotary_position_embeddings: rotary position embeddings \(RoPE\) "
     r"leave only a subgroup of GL\(h\) on its query/key pairs, and hideseek finds no rotary width"),
    ("mpt_clip_qkv", _hf(tr.MptForCausalLM, lambda: tr.MptConfig(vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=4,
                                                                  max_seq_len=32, attn_config={"clip_qkv": 6.0})),
     r"clip_qkv=6.0 clamps queries, keys and values elementwise"),
    ("falcon_packed", _hf(tr.FalconForCausalLM, lambda: tr.FalconConfig(vocab_size=VOCAB, hidden_size=16,
                                                                        num_hidden_layers=2, num_attention_heads=4)),
     r"FalconAttention packs query_key_value in a layout hideseek does not know"),
]


@pytest.mark.parametrize("name,build,pattern", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_name_the_feature(name, build, pattern):
    model = build()
    with pytest.raises(UnsupportedAttentionError, match=pattern) as err:
        find_symmetries(model)
    lines = [ln for ln in str(err.value).splitlines() if ln.startswith("  - ")]
    modules = [ln[4:].split(":")[0] for ln in lines]
    assert len(modules) == len(set(modules)), "a module is reported twice"
    assert all(__import__("re").search(pattern, ln) for ln in lines), "contradictory reasons"
    assert find_symmetries(model, on_unsupported="adaptive") == []


# ----------------------------------------------------------------------------- families supported before
TXT = {"input_ids": torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))}
IMG = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
SMALL_ENC = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=32, max_position_embeddings=32)
EARLIER = [
    ("roberta", lambda: tr.RobertaModel(tr.RobertaConfig(**SMALL_ENC)), TXT, 2),
    ("electra", lambda: tr.ElectraModel(tr.ElectraConfig(**SMALL_ENC, embedding_size=16)), TXT, 2),
    ("distilbert", lambda: tr.DistilBertModel(tr.DistilBertConfig(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=4,
                                                                  hidden_dim=32, max_position_embeddings=32)), TXT, 2),
    ("bart", lambda: tr.BartModel(tr.BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
                                                encoder_attention_heads=4, decoder_attention_heads=4,
                                                encoder_ffn_dim=32, decoder_ffn_dim=32,
                                                max_position_embeddings=32)), TXT, 3),
    ("deit", lambda: tr.DeiTModel(tr.DeiTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                                intermediate_size=32, image_size=8, patch_size=4)), IMG, 2),
    ("swin", lambda: tr.SwinModel(tr.SwinConfig(image_size=8, patch_size=2, embed_dim=8, depths=[1, 1],
                                                num_heads=[2, 4], window_size=2)), IMG, 2),
    ("hf_clip_text", lambda: tr.CLIPTextModel(tr.CLIPTextConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                                                num_hidden_layers=2, num_attention_heads=4,
                                                                max_position_embeddings=32)), TXT, 2),
    ("transformer_encoder", lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 2,
                                                          enable_nested_tensor=False),
     torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64), 2),
]


@pytest.mark.parametrize("name,build,x,n_blocks", EARLIER, ids=[e[0] for e in EARLIER])
def test_earlier_families_still_found_and_invariant(name, build, x, n_blocks):
    torch.manual_seed(0)
    model = build().double().eval()

    def run(m):
        out = m(**x) if isinstance(x, dict) else m(x)
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out

    blocks = find_symmetries(model)
    assert len(blocks) == n_blocks and all(g.group_name == f"GL({g.h})" for b in blocks for g in b.groups)
    moved = apply_random_action(copy.deepcopy(model), blocks, generator=torch.Generator().manual_seed(1),
                                log_cond=1.5)
    assert rel(run(moved), run(model)) < 1e-10


class VisionAndLM(nn.Module):
    """A ViT (no rotary) beside a Llama (rotary): only the Llama's Q/K get the rotary group."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.vit = tr.ViTModel(tr.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                                            intermediate_size=32, image_size=8, patch_size=4, num_channels=1))
        self.lm = tr.LlamaForCausalLM(tr.LlamaConfig(**COMMON))

    def forward(self, img, ids):
        return torch.cat([self.vit(img).last_hidden_state.flatten(1), self.lm(input_ids=ids).logits.flatten(1)], 1)


def test_rotary_only_where_the_attention_applies_it():
    model = VisionAndLM().double().eval()
    blocks = find_symmetries(model)
    rotary = {b.module: bool(b.groups[0].rotary) for b in blocks}
    assert rotary == {"vit.layers.0.attention": False, "lm.model.layers.0.self_attn": True,
                      "lm.model.layers.1.self_attn": True}, rotary
    img, _ = image_batch()
    ids = lm_batch()[0]["input_ids"]
    moved = apply_random_action(copy.deepcopy(model), blocks, generator=torch.Generator().manual_seed(1))
    assert rel(moved(img, ids), model(img, ids)) < 1e-10
