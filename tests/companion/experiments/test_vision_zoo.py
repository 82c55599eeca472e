"""companion.experiments.vision_zoo: typed settings, model, augmentation, pre-training, members, streams, CLI."""
import json

import numpy as np
import pytest
import torch
import yaml
from torch import nn

import hideseek as hs
from companion.experiments import vision_zoo as vz
from companion.params import ParamsError
from tests import ROOT
from companion.params import load_yaml

TINY = ["n_models=2", "workers=1", "threads=1", "data.n_train=60", "data.n_test=50", "data.spec.image_size=8",
        "data.spec.render=16", "model.width=8", "model.heads=2", "model.embed_dim=8", "model.patch_size=4",
        "pretrain.epochs=1", "pretrain.batch_size=32", "ranges.epochs=[1,1]", "ranges.batch_size=[16,32]",
        "ranges.p_mixup=1.0", "cpu_kernels=null"]   # the processor's own kernels (the pinned path: its own test)


@pytest.fixture(scope="module")
def tiny():
    return vz.load_settings("cpu", TINY)


@pytest.fixture(scope="module")
def data(tiny):
    return vz.load_data(tiny.data)


def test_settings_are_typed_and_refuse_missing_or_mistyped_keys(tiny, tmp_path):
    assert isinstance(tiny.ranges.lr, tuple) and tiny.data.spec.image_size == 8 and tiny.n_models == 2
    with pytest.raises(ParamsError, match="ranges.lr"):
        vz.load_settings("cpu", TINY + ["ranges.lr=fast"])
    with pytest.raises(ParamsError, match="does not know"):
        vz.load_settings("cpu", TINY + ["ranges.label_noise=[0.1,0.2]"])  # the older design's range


def test_data_is_standardised_glyphs_and_sharpness_sets_are_disjoint(tiny, data):
    from companion.experiments.glyphs import generate

    raw, labels = generate(tiny.data.spec, 60, tiny.data.seed, "train")
    assert torch.allclose(data.x_pool * data.std + data.mean, raw, atol=1e-5) and torch.equal(data.y_pool, labels)
    assert abs(data.x_pool.mean().item()) < 1e-5 and len(data.y_test) == 50
    a = vz.sharpness_batches(data, 20, 10, 0)
    b = vz.sharpness_batches(data, 20, 10, 20)
    assert torch.equal(torch.cat([x for x, _ in a + b]), data.x_pool[:40])
    with pytest.raises(ValueError, match="exceed the pool"):
        vz.sharpness_batches(data, 40, 10, 40)
    with pytest.raises(ValueError, match="multiple"):
        vz.sharpness_batches(data, 15, 10)


def test_model_is_open_clip_with_packed_mha_and_symmetries_found(tiny):
    from open_clip.transformer import VisionTransformer

    model = vz.build_model(tiny, 0).eval()
    assert isinstance(model.visual, VisionTransformer)
    mhas = [n for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)]
    assert mhas == [f"visual.transformer.resblocks.{i}.attn" for i in range(2)]
    assert all(getattr(model.get_submodule(n), "_qkv_same_embed_dim") for n in mhas)
    assert model(torch.randn(5, 1, 8, 8)).shape == (5, 10)
    blocks = hs.find_symmetries(model)
    assert [b.module for b in blocks] == mhas and all(b.heads == 2 for b in blocks)


def test_augment_shifts_are_true_shifts_and_jitter_is_affine_per_image():
    x = torch.randn(40, 1, 6, 6, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)
    assert torch.equal(vz.augment(x, 0, 0.0, -1.0, g), x)
    y = vz.augment(x, 1, 0.0, -1.0, g)
    seen = set()
    for i in range(len(x)):  # independent reference: pad and slice each candidate offset
        pad = torch.nn.functional.pad(x[i, 0], (1, 1, 1, 1), value=-1.0)
        match = [(dy, dx) for dy in range(3) for dx in range(3) if torch.equal(pad[dy:dy + 6, dx:dx + 6], y[i, 0])]
        assert match, f"image {i} is not a one-pixel shift"
        seen.add(match[0])
    assert len(seen) > 3
    j = vz.jitter(x, 0.5, g)
    for i in range(len(x)):  # a least-squares line through (x, jitter(x)) fits exactly, slope in [0.5, 1.5]
        slope, icpt = np.polyfit(x[i].flatten().numpy(), j[i].flatten().numpy(), 1)
        assert np.allclose(slope * x[i].numpy() + icpt, j[i].numpy(), atol=1e-5) and 0.5 <= slope <= 1.5
    assert torch.equal(vz.jitter(x, 0.0, g), x)


def test_sample_hparams_within_ranges(tiny):
    rng = np.random.default_rng(0)
    r = tiny.ranges
    hps = [vz.sample_hparams(rng, r) for _ in range(50)]
    assert all(r.lr[0] <= h.lr <= r.lr[1] and h.batch_size in r.batch_size and h.shift in r.shift for h in hps)
    assert all(r.mixup_alpha[0] <= h.mixup_alpha <= r.mixup_alpha[1] for h in hps)  # p_mixup = 1
    half = vz.load_settings("cpu", TINY + ["ranges.p_mixup=0.5"]).ranges
    zeros = sum(vz.sample_hparams(rng, half).mixup_alpha == 0.0 for _ in range(200))
    assert 60 < zeros < 140


def test_mixup_loss_is_the_convex_combination_by_hand(tiny):
    torch.manual_seed(0)
    x, y = torch.randn(6, 1, 8, 8, dtype=torch.float64), torch.tensor([0, 3, 3, 9, 1, 5])
    perm = torch.tensor([2, 0, 5, 1, 3, 4])
    lam, eps = 0.3, 0.1
    xm, ya, yb = vz.mixup_batch(x, y, lam, perm)
    for i in range(6):
        assert torch.allclose(xm[i], 0.3 * x[i] + 0.7 * x[perm[i]])
    model = vz.build_model(tiny, 0).double().eval()
    logits = model(xm)
    got = vz.mixup_loss(logits, ya, yb, lam, eps).item()
    z = logits.detach().numpy()
    logp = z - z.max(1, keepdims=True) - np.log(np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True))
    smooth = lambda lab: (1 - eps) * np.eye(10)[lab] + eps / 10  # noqa: E731
    target = lam * smooth(y.numpy()) + (1 - lam) * smooth(y[perm].numpy())
    assert got == pytest.approx(float(-(target * logp).sum(1).mean()), rel=1e-12, abs=1e-12)


def test_info_nce_matches_a_loop_reference():
    g = torch.Generator().manual_seed(1)
    z1, z2 = torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randn(5, 4, generator=g, dtype=torch.float64)
    got = vz.info_nce(z1, z2, 0.5).item()
    z = torch.cat([z1, z2])
    z = (z / z.norm(dim=1, keepdim=True)).numpy()
    terms = []
    for i in range(10):
        others = [j for j in range(10) if j != i]
        s = np.array([z[i] @ z[j] / 0.5 for j in others])
        terms.append(-(z[i] @ z[(i + 5) % 10] / 0.5) + np.log(np.exp(s).sum()))
    assert got == pytest.approx(np.mean(terms), rel=1e-12)


def test_pretrain_is_contrastive_without_labels_and_sets_a_centroid_head(tiny, data, monkeypatch):
    seen = {}
    real = vz.pretrain_contrastive

    def spy(model, x, p, **kw):
        seen["x"] = x
        return real(model, x, p, **kw)

    monkeypatch.setattr(vz, "pretrain_contrastive", spy)
    model, rec = vz.pretrain(tiny, data)
    assert rec["objective"] == "contrastive" and len(rec["loss"]) == 1
    assert torch.equal(seen["x"], data.x_pool)  # images only: the labels are never passed
    with torch.no_grad():
        f = torch.nn.functional.normalize(model.visual(data.x_pool), dim=-1).double()
    for c in range(10):
        cent = f[data.y_pool == c].mean(0)
        assert torch.allclose(model.head.weight[c].double(), cent / cent.norm(), atol=1e-5)
    assert torch.equal(model.head.bias, torch.zeros(10))


def test_members_share_the_start_and_fit_the_whole_pool(tiny, tmp_path, monkeypatch):
    calls = []
    real = vz.fit

    def spy(model, x, y, hp, **kw):
        calls.append(({k: v.clone() for k, v in model.state_dict().items()}, x.clone(), y.clone(), hp))
        return real(model, x, y, hp, **kw)

    monkeypatch.setattr(vz, "fit", spy)
    meta = vz.train_zoo(tmp_path, tiny, progress=False)
    init = torch.load(tmp_path / "init.pt", weights_only=True)
    data = vz.zoo_data(meta)
    assert len(calls) == 2
    for (state, x, y, hp), m in zip(calls, meta["members"]):
        assert all(torch.equal(state[k], init[k]) for k in init)  # one shared pre-trained start
        assert torch.equal(x, data.x_pool) and torch.equal(y, data.y_pool)  # whole pool, true labels
        assert hp.mixup_alpha == m["hparams"]["mixup_alpha"] > 0


@pytest.mark.slow
def test_training_is_deterministic_saves_per_example_errors_and_no_timings(tiny, tmp_path):
    a = vz.train_zoo(tmp_path / "a", tiny, progress=False)
    two = vz.load_settings("cpu", TINY + ["workers=2"])
    b = vz.train_zoo(tmp_path / "b", two, progress=False)  # two processes: the same members
    text = (tmp_path / "a" / "zoo.json").read_text()
    assert "seconds" not in text and set(a["timings"]) == {"pretrain", "total", "members"}
    for ma, mb in zip(a["members"], b["members"]):
        sa = torch.load(tmp_path / "a" / ma["file"], weights_only=True)
        sb = torch.load(tmp_path / "b" / mb["file"], weights_only=True)
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    meta, loaders = vz.load_zoo(tmp_path / "a")
    errors = vz.test_errors(tmp_path / "a", meta)
    data = vz.zoo_data(meta)
    assert errors.shape == (2, 50) and errors.dtype == np.uint8
    for m, row, (name, load) in zip(meta["members"], errors, loaders):
        model = load()
        with torch.no_grad():
            wrong = (model(data.x_test).argmax(-1) != data.y_test).numpy()
        assert np.array_equal(row, wrong) and m["test_error"] == pytest.approx(wrong.mean())
        assert m["train_error"] == pytest.approx(vz.error_rate(model, data.x_pool, data.y_pool))
        assert m["gap"] == pytest.approx(m["test_error"] - m["train_error"])


def test_pilot_stream_draws_other_members(tiny):
    main = vz.member_draws(tiny, "main", 3)
    pilot = vz.member_draws(tiny, "pilot", 3)
    assert main == vz.member_draws(tiny, "main", 3)
    assert all(a[0] != b[0] and a[1] != b[1] for a, b in zip(main, pilot))
    with pytest.raises(ValueError, match="stream"):
        vz.member_draws(tiny, "other", 1)


def test_cli_reads_params_and_overrides_and_writes_timings_apart(tmp_path):
    full = load_yaml(open(ROOT / "params.yaml"))
    params = {"profile": "cpu", "vision_train": full["vision_train"]}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    rc = vz.main(["train", "--out", str(tmp_path / "zoo"), "--params", str(tmp_path / "params.yaml"),
                  "--timings", str(tmp_path / "timings.json"), "--no-progress"]
                 + [a for o in TINY + ["n_models=1"] for a in ("--set", o)])
    assert rc == 0
    meta = json.loads((tmp_path / "zoo" / "zoo.json").read_text())
    assert len(meta["members"]) == 1 and (tmp_path / "zoo" / "model_000.pt").is_file()
    assert "total" in json.loads((tmp_path / "timings.json").read_text())
    with pytest.raises(FileNotFoundError, match="train the zoo"):
        vz.load_zoo(tmp_path / "missing")


def test_source_of_a_generated_zoo_reads_what_the_stages_read(tiny, tmp_path):
    """The ZooSource of a generated zoo (the cpu path of the vision stage): the saved members, set 1 and
    set 2 as the pool's first and second slices, the recorded members and per-example test errors."""
    from companion.experiments.zoo import ZooSource

    meta = vz.train_zoo(tmp_path, tiny, progress=False)
    src = vz.source(tmp_path)
    assert isinstance(src, vz.GlyphZoo) and isinstance(src, ZooSource) and src.kind == "vision"
    assert src.description() == "glyph ViT zoo (2 open_clip ViTs)"
    data = vz.zoo_data(meta)
    first, second = src.sharpness_batches(20, 10, 0), src.retest_batches(20, 10, 0)
    for k, (x, y) in enumerate(first + second):
        assert torch.equal(x, data.x_pool[10 * k:10 * k + 10]) and torch.equal(y, data.y_pool[10 * k:10 * k + 10])
    with pytest.raises(ValueError, match="data_seed"):
        src.sharpness_batches(20, 10, 1)
    names = [m["name"] for m in meta["members"]]
    loaded = src.loaders()
    assert [n for n, _ in loaded] == names and [n for n, _ in src.loaders(names[::-1])] == names[::-1]
    for (name, load), m in zip(loaded, meta["members"]):
        ref = torch.load(tmp_path / m["file"], weights_only=True)
        model = load()
        assert not model.training and all(torch.equal(t, ref[k]) for k, t in model.state_dict().items())
    assert [n for n, _ in vz.load_zoo(tmp_path)[1]] == names
    assert list(src.member_table().index) == names and src.member_table()["gap"].tolist() == [m["gap"] for m in meta["members"]]
    stored = np.load(tmp_path / "test_errors.npy")
    assert np.array_equal(src.eval_errors(names), stored) and np.array_equal(src.eval_errors(names[::-1]), stored[::-1])


def test_lr_schedule_warm_up_then_cosine_by_hand(tiny):
    import math

    # no warm-up: the recipe before the setting existed, 0.5 (1 + cos(pi s / total)) at every step
    for s in range(12):
        assert vz.lr_factor(s, 10, 0) == pytest.approx(0.5 * (1 + math.cos(math.pi * min(s, 10) / 10)), abs=0)
    # warm-up of 2 of 10 steps: 1/2, 2/2, then the cosine over the remaining 8 steps
    got = [vz.lr_factor(s, 10, 2) for s in range(10)]
    want = [0.5, 1.0] + [0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(8)]
    assert got == pytest.approx(want, abs=1e-15)
    assert vz.warmup_steps(0.1, 192) == 19 and vz.warmup_steps(0.0, 50) == 0
    with pytest.raises(ValueError, match="warmup"):
        vz.warmup_steps(1.0, 10)


def test_fit_applies_the_warm_up_to_the_optimiser(tiny, data, monkeypatch):
    """The learning rates the optimiser steps with are the drawn rate times the schedule, counted by hand."""
    seen = []
    real_step = torch.optim.AdamW.step

    def step(self, *a, **k):
        seen.append(self.param_groups[0]["lr"])
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    hp = vz.Hparams(lr=0.01, weight_decay=0.0, epochs=2, batch_size=16, label_smoothing=0.0, shift=0,
                    noise_std=0.0, mixup_alpha=0.0)
    vz.fit(vz.build_model(tiny, 0), data.x_pool, data.y_pool, hp, background=data.background, seed=0, warmup=0.25)
    total = 2 * 4                          # 60 images in batches of 16: 4 steps per epoch
    assert len(seen) == total
    assert seen[:2] == pytest.approx([0.005, 0.01])            # 2 warm-up steps: 1/2, 2/2 of the rate
    assert seen[2] == pytest.approx(0.01) and seen[-1] < seen[2] / 4
    seen.clear()
    vz.fit(vz.build_model(tiny, 0), data.x_pool, data.y_pool, hp, background=data.background, seed=0)
    assert seen[0] == pytest.approx(0.01) and seen[1] < 0.01   # no warm-up: the cosine from the first step


def test_settings_record_the_warm_up_and_old_zoos_read_as_none(tiny):
    assert vz.load_settings("cpu", TINY + ["warmup=0.0"]).warmup == 0.0
    assert vz.load_settings("cpu", TINY + ["warmup=0.25"]).warmup == 0.25
    meta = {"settings": {k: v for k, v in json.loads(json.dumps(vz.asdict(tiny))).items() if k != "warmup"}}
    assert vz.zoo_settings(meta).warmup == 0.0
    assert vz.member_draws(tiny, "minima_pilot", 2) != vz.member_draws(tiny, "pilot", 2)
