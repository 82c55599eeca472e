"""companion.experiments.vision_zoo: data split, model, augmentation, member data, deterministic training."""
import json

import numpy as np
import pytest
import torch
import yaml
from sklearn.datasets import load_digits
from torch import nn

import hideseek as hs
from companion.experiments import vision_zoo as vz

TINY_TRAIN = dict(
    seed=3, split_seed=1, n_test=497, n_sharpness=16, n_models=2, threads=1,
    model=dict(width=8, layers=2, heads=2, patch_size=4, mlp_ratio=2.0, embed_dim=8, logit_scale=5.0),
    pretrain=dict(n_images=32, epochs=1, lr=3e-3, weight_decay=0.01, batch_size=16),
    ranges=dict(lr=[1e-3, 3e-3], weight_decay=[1e-3, 0.1], epochs=[1, 2], batch_size=[16, 32],
                label_smoothing=[0.0, 0.1], shift=[1], noise_std=[0.0, 0.2], subset_size=[16, 64],
                label_noise=[0.2, 0.4], p_label_noise=1.0),
)


@pytest.fixture(scope="module")
def data():
    return vz.load_digits_split(1, 497)


def test_split_is_a_partition_and_standardised(data):
    d = load_digits()
    assert len(data.y_pool) + len(data.y_test) == len(d.target) == 1797
    assert len(data.y_test) == 497
    # undo the standardisation and match every image to its original row (no leakage, no loss)
    raw = torch.cat([data.x_pool, data.x_test]).squeeze(1).double() * data.std + data.mean
    orig = torch.tensor(d.images / 16.0)
    perm = np.random.default_rng(1).permutation(1797)
    assert torch.allclose(raw, orig[perm], atol=1e-5)
    assert torch.equal(torch.cat([data.y_pool, data.y_test]), torch.tensor(d.target[perm]))
    assert abs(data.x_pool.double().mean().item()) < 1e-5 and abs(data.x_pool.double().std().item() - 1) < 1e-3


def test_model_is_open_clip_with_packed_mha_and_symmetries_found():
    model = vz.build_model(TINY_TRAIN["model"], 0).eval()
    from open_clip.transformer import VisionTransformer
    assert isinstance(model.visual, VisionTransformer)
    mhas = [n for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)]
    assert mhas == [f"visual.transformer.resblocks.{i}.attn" for i in range(2)]
    assert all(getattr(model.get_submodule(n), "_qkv_same_embed_dim") for n in mhas)  # packed in_proj_weight
    calls = []
    hooks = [model.get_submodule(n).register_forward_hook(lambda *a: calls.append(1)) for n in mhas]
    out = model(torch.randn(5, 1, 8, 8))
    for h in hooks:
        h.remove()
    assert out.shape == (5, 10) and len(calls) == 2
    blocks = hs.find_symmetries(model)
    assert [b.module for b in blocks] == mhas and all(b.heads == 2 for b in blocks)
    names = {n for b in blocks for n in b.param_names}
    assert {f"{m}.in_proj_weight" for m in mhas} <= names and {f"{m}.out_proj.weight" for m in mhas} <= names


def test_augment_shifts_are_true_shifts(data):
    x = data.x_pool[:40]
    g = torch.Generator().manual_seed(0)
    assert torch.equal(vz.augment(x, 0, 0.0, data.background, g), x)
    y = vz.augment(x, 1, 0.0, data.background, g)
    seen = set()
    for i in range(len(x)):
        # independent reference: pad and slice each candidate offset
        pad = torch.nn.functional.pad(x[i, 0], (1, 1, 1, 1), value=data.background)
        match = [(dy, dx) for dy in range(3) for dx in range(3) if torch.equal(pad[dy:dy + 8, dx:dx + 8], y[i, 0])]
        assert match, f"image {i} is not a one-pixel shift"
        seen.add(match[0])
    assert len(seen) > 3  # offsets really vary
    z = vz.augment(x, 0, 0.5, data.background, g)
    assert 0.4 < (z - x).std().item() < 0.6


def test_member_data_keeps_sharpness_set_clean(data):
    hp = dict(subset_size=300, label_noise=0.3)
    x, y, y_clean, corrupted, idx = vz.member_data(data, hp, n_sharpness=50, seed=4)
    assert len(idx) == 300 and len(set(idx.tolist())) == 300
    assert np.array_equal(idx[:50], np.arange(50))  # the sharpness set is always in
    assert torch.equal(x, data.x_pool[idx]) and torch.equal(y_clean, data.y_pool[idx])
    assert not corrupted[:50].any() and torch.equal(y[:50], y_clean[:50])
    assert corrupted.sum().item() == round(0.3 * 250)
    assert (y[corrupted] != y_clean[corrupted]).all() and torch.equal(y[~corrupted], y_clean[~corrupted])
    x2, y2, *_ = vz.member_data(data, hp, n_sharpness=50, seed=4)
    assert torch.equal(y, y2)


def test_sample_hparams_within_ranges():
    rng = np.random.default_rng(0)
    r = TINY_TRAIN["ranges"]
    for _ in range(50):
        hp = vz.sample_hparams(rng, r, n_pool=1300, n_sharpness=16)
        assert r["lr"][0] <= hp["lr"] <= r["lr"][1]
        assert r["epochs"][0] <= hp["epochs"] <= r["epochs"][1]
        assert hp["batch_size"] in r["batch_size"] and hp["shift"] in r["shift"]
        assert 16 <= hp["subset_size"] <= 64
        assert r["label_noise"][0] <= hp["label_noise"] <= r["label_noise"][1]


def test_training_is_deterministic_and_records_are_consistent(tmp_path):
    a = vz.train_zoo(tmp_path / "a", TINY_TRAIN, progress=False)
    b = vz.train_zoo(tmp_path / "b", TINY_TRAIN, progress=False)
    for ma, mb in zip(a["members"], b["members"]):
        sa = torch.load(tmp_path / "a" / ma["file"], weights_only=True)
        sb = torch.load(tmp_path / "b" / mb["file"], weights_only=True)
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
        strip = lambda m: {k: v for k, v in m.items() if k != "train_seconds"}  # noqa: E731
        assert strip(ma) == strip(mb)
    init = torch.load(tmp_path / "a" / "init.pt", weights_only=True)
    meta, loaders = vz.load_zoo(tmp_path / "a")
    assert len(loaders) == 2 and meta == json.loads((tmp_path / "a" / "zoo.json").read_text())
    data = vz.zoo_data(meta)
    for m, (name, load) in zip(meta["members"], loaders):
        model = load()
        assert not model.training and name == m["name"]
        assert any(not torch.equal(init[k], v) for k, v in model.state_dict().items())  # it was fine-tuned
        # the recorded errors are reproduced from the saved weights
        assert m["test_error"] == pytest.approx(vz.error_rate(model, data.x_test, data.y_test))
        x, y, y_clean, corrupted, _ = vz.member_data(data, m["hparams"], meta["n_sharpness"], m["seed"])
        assert m["train_error"] == pytest.approx(vz.error_rate(model, x[~corrupted], y[~corrupted]))
        assert m["gap"] == pytest.approx(m["test_error"] - m["train_error"])
        assert m["n_corrupted"] == corrupted.sum().item() > 0


def test_cli_reads_params_and_overrides(tmp_path):
    params = {"profile": "cpu", "vision_train": {"cpu": TINY_TRAIN, "gpu": {}}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    rc = vz.main(["train", "--out", str(tmp_path / "zoo"), "--params", str(tmp_path / "params.yaml"),
                  "--set", "n_models=1", "--no-progress"])
    assert rc == 0
    meta = json.loads((tmp_path / "zoo" / "zoo.json").read_text())
    assert len(meta["members"]) == 1 and (tmp_path / "zoo" / "model_000.pt").is_file()


def test_measure_rejects_images_outside_the_sharpness_set(tmp_path):
    vz.train_zoo(tmp_path, dict(TINY_TRAIN, n_models=1), progress=False)
    with pytest.raises(ValueError, match="sharpness set"):
        vz.measure_vision_zoo(dict(zoo_dir=str(tmp_path), n_images=32, batch_size=16, n_iters=1,
                                   rho_grid=[0.1], seed=0), progress=False)
    with pytest.raises(FileNotFoundError, match="train the zoo"):
        vz.load_zoo(tmp_path / "missing")
