"""model-soups CLIP fine-tunes: a state dict in the release's layout loads, and its logits are right.

The stand-ins are written from a shape table of OpenAI's CLIP (not from
open_clip), in the release's layout: CLIP keys under ``model.``, the text
transformer removed, ``classification_head.{weight,bias}``. The reference
forward pass below is written out with plain tensor operations in float64.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import hideseek as hs
from companion.assets import MissingAssetsError
from hideseek.open_clip_finetune import CheckpointError
from companion.assets.clip_soups import load_clip_finetune, load_clip_soup


def openai_clip_soup_state_dict(width, layers, patch, image_size, out_dim, classes, *, seed=0,
                                text_vocab=64, text_ctx=7, text_width=32):
    """Random weights with the keys and shapes of a model-soups ``model_{i}.pt``."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s, std=0.02: torch.randn(*s, generator=g) * std
    grid = image_size // patch
    sd = {
        "model.positional_embedding": rnd(text_ctx, text_width),   # text side, unused
        "model.text_projection": rnd(text_width, out_dim),
        "model.logit_scale": torch.tensor(math.log(1 / 0.07)),
        "model.visual.class_embedding": rnd(width, std=0.5),
        "model.visual.positional_embedding": rnd(grid * grid + 1, width, std=0.5),
        "model.visual.proj": rnd(width, out_dim, std=width ** -0.5),
        "model.visual.conv1.weight": rnd(width, 3, patch, patch, std=0.05),
        "model.visual.ln_pre.weight": 1 + rnd(width, std=0.1),
        "model.visual.ln_pre.bias": rnd(width, std=0.1),
    }
    for l in range(layers):
        p = f"model.visual.transformer.resblocks.{l}."
        sd |= {
            p + "ln_1.weight": 1 + rnd(width, std=0.1), p + "ln_1.bias": rnd(width, std=0.1),
            p + "attn.in_proj_weight": rnd(3 * width, width, std=width ** -0.5),
            p + "attn.in_proj_bias": rnd(3 * width, std=0.1),
            p + "attn.out_proj.weight": rnd(width, width, std=width ** -0.5),
            p + "attn.out_proj.bias": rnd(width, std=0.1),
            p + "ln_2.weight": 1 + rnd(width, std=0.1), p + "ln_2.bias": rnd(width, std=0.1),
            p + "mlp.c_fc.weight": rnd(4 * width, width, std=width ** -0.5),
            p + "mlp.c_fc.bias": rnd(4 * width, std=0.1),
            p + "mlp.c_proj.weight": rnd(width, 4 * width, std=(4 * width) ** -0.5),
            p + "mlp.c_proj.bias": rnd(width, std=0.1),
        }
    sd |= {
        "model.visual.ln_post.weight": 1 + rnd(width, std=0.1),
        "model.visual.ln_post.bias": rnd(width, std=0.1),
        "model.token_embedding.weight": rnd(text_vocab, text_width),
        "model.ln_final.weight": torch.ones(text_width),
        "model.ln_final.bias": torch.zeros(text_width),
        "classification_head.weight": rnd(classes, out_dim, std=1.0),
        "classification_head.bias": rnd(classes, std=0.1),
    }
    return sd


def reference_logits(sd, images, heads, patch):
    """OpenAI CLIP's image tower + model soups' head, written out (float64)."""
    v = {k[len("model.visual."):]: t.double() for k, t in sd.items() if k.startswith("model.visual.")}
    x = images.double()
    b = x.shape[0]
    x = F.conv2d(x, v["conv1.weight"], stride=patch)           # (B, W, g, g), no bias
    x = x.flatten(2).transpose(1, 2)                             # (B, g*g, W), row-major patches
    width = x.shape[-1]
    x = torch.cat([v["class_embedding"].expand(b, 1, width), x], dim=1) + v["positional_embedding"]

    def ln(t, name):
        mu = t.mean(-1, keepdim=True)
        var = ((t - mu) ** 2).mean(-1, keepdim=True)
        return (t - mu) / torch.sqrt(var + 1e-5) * v[name + ".weight"] + v[name + ".bias"]

    x = ln(x, "ln_pre")
    d = width // heads
    layers = len({k.split(".")[2] for k in v if k.startswith("transformer.resblocks.")})
    for l in range(layers):
        p = f"transformer.resblocks.{l}."
        h = ln(x, p + "ln_1")
        qkv = h @ v[p + "attn.in_proj_weight"].T + v[p + "attn.in_proj_bias"]
        q, k, val = qkv.split(width, dim=-1)                       # rows Q | K | V
        split = lambda t: t.reshape(b, -1, heads, d).transpose(1, 2)
        att = torch.softmax(split(q) @ split(k).transpose(-1, -2) / math.sqrt(d), dim=-1)
        o = (att @ split(val)).transpose(1, 2).reshape(b, -1, width)
        x = x + o @ v[p + "attn.out_proj.weight"].T + v[p + "attn.out_proj.bias"]
        h = ln(x, p + "ln_2") @ v[p + "mlp.c_fc.weight"].T + v[p + "mlp.c_fc.bias"]
        h = h * torch.sigmoid(1.702 * h)                           # QuickGELU, as OpenAI's CLIP
        x = x + h @ v[p + "mlp.c_proj.weight"].T + v[p + "mlp.c_proj.bias"]
    f = ln(x[:, 0], "ln_post") @ v["proj"]
    f = f / f.norm(dim=-1, keepdim=True)
    return f @ sd["classification_head.weight"].double().T + sd["classification_head.bias"].double()


SMALL = dict(width=128, layers=2, patch=8, image_size=32, out_dim=24, classes=10)  # 2 heads of width 64


@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    sd = openai_clip_soup_state_dict(**SMALL)
    path = tmp_path_factory.mktemp("soups") / "model_3.pt"
    torch.save(sd, path)
    return path, sd


def test_small_stand_in_loads_and_logits_equal_the_written_out_forward(small_file):
    path, sd = small_file
    model = load_clip_finetune(path, expect=None, num_classes=10, dtype=torch.float64)
    assert not model.training
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        ours = model(images)
    ref = reference_logits(sd, images, heads=2, patch=8)
    assert ours.shape == (3, 10)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)
    # the features fed to the head are unit vectors
    with torch.no_grad():
        assert torch.allclose(model.features(images).norm(dim=-1), torch.ones(3, dtype=torch.float64))


def test_only_the_image_tower_and_head_are_parameters(small_file):
    model = load_clip_finetune(small_file[0], expect=None, num_classes=10)
    names = [n for n, _ in model.named_parameters()]
    assert all(n.startswith(("visual.", "classification_head.")) for n in names)
    assert "classification_head.weight" in names
    assert not any("token_embedding" in n or n.startswith("transformer.") for n in names)
    n_mha = sum(isinstance(m, torch.nn.MultiheadAttention) for m in model.modules())
    assert n_mha == SMALL["layers"]  # the packed attention the symmetry finder looks for


@pytest.mark.slow
def test_real_vit_b32_layout_loads_with_the_default_expectation(tmp_path):
    torch.manual_seed(0)
    # The image tower and head at full size; the (ignored) text parameters small, to save time.
    sd = openai_clip_soup_state_dict(width=768, layers=12, patch=32, image_size=224, out_dim=512, classes=1000)
    path = tmp_path / "model_0.pt"
    torch.save(sd, path)
    del sd
    model = load_clip_finetune(path)  # expects ViT-B/32 with 1000 classes
    n_visual = sum(p.numel() for n, p in model.named_parameters() if n.startswith("visual."))
    # conv 768*3*32*32, class token, 50 positions, ln_pre, 12 blocks, ln_post, proj 768 x 512
    block = 2 * 2 * 768 + 3 * 768 * 768 + 3 * 768 + 768 * 768 + 768 + 2 * 768 * 3072 + 3072 + 768
    assert n_visual == 768 * 3 * 32 * 32 + 768 + 50 * 768 + 2 * 768 + 12 * block + 2 * 768 + 768 * 512
    assert model.classification_head.weight.shape == (1000, 512)
    sd = torch.load(path, weights_only=True)
    images = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model(images).double()
    ref = reference_logits(sd, images, heads=12, patch=32)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)  # float32 model vs float64 reference


def test_wrong_files_are_rejected_with_the_reason(small_file, tmp_path):
    path, sd = small_file
    with pytest.raises(CheckpointError, match=r"not the expected architecture.*'width': \(128, 768\)"):
        load_clip_finetune(path)  # a stand-in is not a ViT-B/32
    with pytest.raises(CheckpointError, match="head has 10 classes, expected 1000"):
        load_clip_finetune(path, expect=None)

    def save(d, name):
        p = tmp_path / name
        torch.save(d, p)
        return p

    no_head = {k: t for k, t in sd.items() if not k.startswith("classification_head")}
    with pytest.raises(CheckpointError, match="not a model-soups fine-tune: no classification_head.weight"):
        load_clip_finetune(save(no_head, "no_head.pt"), expect=None, num_classes=None)
    gap = dict(sd)
    del gap["model.visual.transformer.resblocks.1.ln_2.bias"]
    with pytest.raises(CheckpointError, match=r"missing \['visual.transformer.resblocks.1.ln_2.bias'\]"):
        load_clip_finetune(save(gap, "gap.pt"), expect=None, num_classes=None)
    extra = dict(sd, **{"model.visual.mystery": torch.zeros(3)})
    with pytest.raises(CheckpointError, match=r"unexpected \['visual.mystery'\]"):
        load_clip_finetune(save(extra, "extra.pt"), expect=None, num_classes=None)
    odd = dict(sd, **{"optimizer_state": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="unexpected keys \\['optimizer_state'\\]"):
        load_clip_finetune(save(odd, "odd.pt"), expect=None, num_classes=None)
    bad_head = dict(sd, **{"classification_head.weight": torch.zeros(10, 23)})
    with pytest.raises(CheckpointError, match="does not fit image features of size 24"):
        load_clip_finetune(save(bad_head, "bad_head.pt"), expect=None, num_classes=None)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"<html>404 Not Found</html>")
    with pytest.raises(CheckpointError, match="cannot be read as a torch state dict"):
        load_clip_finetune(junk)
    with pytest.raises(FileNotFoundError):
        load_clip_finetune(tmp_path / "absent.pt")


def test_the_loaded_model_exposes_its_attention_symmetries(small_file):
    model = load_clip_finetune(small_file[0], expect=None, num_classes=10, dtype=torch.float64)
    blocks = hs.find_symmetries(model)
    assert len(blocks) == SMALL["layers"]
    assert all("visual.transformer.resblocks" in repr(b) for b in blocks)


def test_load_clip_soup_by_index(small_file, tmp_path):
    (tmp_path / "clip_soups").mkdir()
    with pytest.raises(MissingAssetsError, match=r"model_\{i\}.pt  for i in 3 \(1 file\)"):
        load_clip_soup(3, root=tmp_path)
    (tmp_path / "clip_soups" / "model_3.pt").write_bytes(small_file[0].read_bytes())
    with pytest.raises(CheckpointError, match="not the expected architecture"):  # a stand-in, not ViT-B/32
        load_clip_soup(3, root=tmp_path)
