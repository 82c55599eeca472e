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
    pretrain=dict(objective="contrastive", epochs=1, lr=3e-3, weight_decay=0.01, batch_size=256, temperature=0.2),
    ranges=dict(lr=[1e-3, 3e-3], weight_decay=[1e-3, 0.1], epochs=[1, 1], batch_size=[256, 512],
                label_smoothing=[0.0, 0.1], shift=[1], noise_std=[0.0, 0.2], mixup_alpha=[0.2, 0.4], p_mixup=1.0),
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


def test_sample_hparams_within_ranges_and_old_design_rejected():
    rng = np.random.default_rng(0)
    r = TINY_TRAIN["ranges"]
    alphas = []
    for _ in range(50):
        hp = vz.sample_hparams(rng, r)
        assert r["lr"][0] <= hp["lr"] <= r["lr"][1]
        assert r["epochs"][0] <= hp["epochs"] <= r["epochs"][1]
        assert hp["batch_size"] in r["batch_size"] and hp["shift"] in r["shift"]
        assert "subset_size" not in hp and "label_noise" not in hp
        alphas.append(hp["mixup_alpha"])
    assert all(r["mixup_alpha"][0] <= a <= r["mixup_alpha"][1] for a in alphas)  # p_mixup = 1
    half = [vz.sample_hparams(rng, dict(r, p_mixup=0.5))["mixup_alpha"] for _ in range(200)]
    assert 60 < sum(a == 0.0 for a in half) < 140
    with pytest.raises(ValueError, match="no longer supported"):
        vz.sample_hparams(rng, dict(r, label_noise=[0.1, 0.2]))


def test_mixup_loss_is_the_convex_combination_by_hand():
    torch.manual_seed(0)
    x, y = torch.randn(6, 1, 8, 8, dtype=torch.float64), torch.tensor([0, 3, 3, 9, 1, 5])
    perm = torch.tensor([2, 0, 5, 1, 3, 4])
    lam, eps = 0.3, 0.1
    xm, ya, yb = vz.mixup_batch(x, y, lam, perm)
    for i in range(6):  # every image by hand
        assert torch.allclose(xm[i], 0.3 * x[i] + 0.7 * x[perm[i]])
    assert torch.equal(ya, y) and torch.equal(yb, y[perm])
    model = vz.build_model(TINY_TRAIN["model"], 0).double().eval()
    logits = model(xm)
    got = vz.mixup_loss(logits, ya, yb, lam, eps).item()
    # reference: cross-entropy against the mixed, smoothed target distribution, in numpy float64
    z = logits.detach().numpy()
    logp = z - z.max(1, keepdims=True) - np.log(np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True))
    smooth = lambda lab: (1 - eps) * np.eye(10)[lab] + eps / 10  # noqa: E731
    target = lam * smooth(y.numpy()) + (1 - lam) * smooth(y[perm].numpy())
    ref = float(-(target * logp).sum(1).mean())
    assert got == pytest.approx(ref, rel=1e-12, abs=1e-12)


def test_info_nce_matches_a_loop_reference():
    g = torch.Generator().manual_seed(1)
    z1, z2 = torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randn(5, 4, generator=g, dtype=torch.float64)
    got = vz.info_nce(z1, z2, 0.5).item()
    z = torch.cat([z1, z2])
    z = (z / z.norm(dim=1, keepdim=True)).numpy()
    terms = []
    for i in range(10):
        pos = (i + 5) % 10
        others = [j for j in range(10) if j != i]
        s = np.array([z[i] @ z[j] / 0.5 for j in others])
        terms.append(-(z[i] @ z[pos] / 0.5) + np.log(np.exp(s).sum()))
    assert got == pytest.approx(np.mean(terms), rel=1e-12)


def test_pretrain_is_contrastive_without_labels_and_sets_a_centroid_head(data, monkeypatch):
    seen = {}
    real = vz.pretrain_contrastive

    def spy(model, x, **kw):
        seen["x"] = x
        return real(model, x, **kw)

    monkeypatch.setattr(vz, "pretrain_contrastive", spy)
    model, rec = vz.pretrain(TINY_TRAIN["model"], data, TINY_TRAIN["pretrain"], seed=0)
    assert rec["objective"] == "contrastive" and rec["n_images"] == len(data.y_pool) and len(rec["loss"]) == 1
    assert torch.equal(seen["x"], data.x_pool)  # images only: the labels are never passed
    # the head: unit-norm class centroids of the normalised embeddings, independent recomputation
    with torch.no_grad():
        f = torch.nn.functional.normalize(model.visual(data.x_pool), dim=-1).double()
    for c in range(10):
        cent = f[data.y_pool == c].mean(0)
        assert torch.allclose(model.head.weight[c].double(), cent / cent.norm(), atol=1e-5)
    assert torch.equal(model.head.bias, torch.zeros(10))
    with pytest.raises(ValueError, match="objective"):
        vz.pretrain(TINY_TRAIN["model"], data, dict(objective="masked"), seed=0)


def test_members_share_the_start_and_fit_the_whole_pool_with_true_labels(tmp_path, monkeypatch):
    calls = []
    real = vz.fit

    def spy(model, x, y, **kw):
        calls.append(({k: v.clone() for k, v in model.state_dict().items()}, x.clone(), y.clone(), kw))
        return real(model, x, y, **kw)

    monkeypatch.setattr(vz, "fit", spy)
    meta = vz.train_zoo(tmp_path, dict(TINY_TRAIN, n_models=3), progress=False)
    init = torch.load(tmp_path / "init.pt", weights_only=True)
    data = vz.zoo_data(meta)
    assert len(calls) == 3
    for (state, x, y, kw), m in zip(calls, meta["members"]):
        assert all(torch.equal(state[k], init[k]) for k in init)  # one shared pre-trained start
        assert torch.equal(x, data.x_pool) and torch.equal(y, data.y_pool)  # whole pool, no label noise
        assert kw["mixup_alpha"] == m["hparams"]["mixup_alpha"] > 0
        assert m["n_train"] == len(data.y_pool) == meta["n_pool"]


def test_stability_zoos_have_their_own_seeds(tmp_path):
    p = dict(TINY_TRAIN, stability=dict(seeds=[5, 6], n_models=3))
    specs = vz.stability_specs(p)
    assert [n for n, _ in specs] == ["zoo_5", "zoo_6"] and all(q["n_models"] == 3 for _, q in specs)
    assert "stability" not in specs[0][1]
    metas = vz.train_stability(tmp_path, p, progress=False)
    inits = [torch.load(tmp_path / "stability" / f"zoo_{s}" / "init.pt", weights_only=True) for s in (5, 6)]
    assert [m["seed"] for m in metas] == [5, 6] and all(len(m["members"]) == 3 for m in metas)
    assert any(not torch.equal(inits[0][k], inits[1][k]) for k in inits[0])  # different pre-training
    with pytest.raises(ValueError, match="distinct"):
        vz.stability_specs(dict(TINY_TRAIN, stability=dict(seeds=[3, 4], n_models=3)))  # 3 is the main seed


def test_tau_spread_summarises_the_zoos():
    import pandas as pd

    from companion.metrics import tau_spread

    taus = pd.DataFrame(dict(zoo=["a", "b", "c", "a", "b", "c"], measure=["m"] * 3 + ["k"] * 3,
                             tau=[0.1, -0.2, 0.4, 0.0, float("nan"), 0.2], n=[20, 20, 21, 20, 20, 21]))
    s = tau_spread(taus)
    assert list(s) == ["m", "k"]
    assert s["m"]["mean"] == pytest.approx(0.1) and s["m"]["std"] == pytest.approx(np.std([0.1, -0.2, 0.4], ddof=1))
    assert (s["m"]["min"], s["m"]["max"], s["m"]["n_zoos"], s["m"]["n_models"]) == (-0.2, 0.4, 3, [20, 20, 21])
    assert s["k"]["mean"] == pytest.approx(0.1) and s["k"]["n_zoos"] == 3  # the undefined tau is not averaged


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
        assert m["train_error"] == pytest.approx(vz.error_rate(model, data.x_pool, data.y_pool))
        assert m["gap"] == pytest.approx(m["test_error"] - m["train_error"])


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


def test_cli_workers_train_the_stability_zoos_in_a_second_process_unchanged(tmp_path):
    p = dict(TINY_TRAIN, n_models=1, stability=dict(seeds=[5], n_models=1))
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"profile": "cpu", "vision_train": {
        "defaults": {}, "cpu": dict(p, workers=2), "gpu": {}, "paper": {}}}))
    rc = vz.main(["train", "--out", str(tmp_path / "zoo"), "--params", str(tmp_path / "params.yaml"), "--no-progress"])
    assert rc == 0
    meta = json.loads((tmp_path / "zoo" / "zoo.json").read_text())
    assert "workers" not in meta["params"] and len(meta["members"]) == 1
    # the stability zoo trained in the other process equals one trained here, serially
    ref = vz.train_stability(tmp_path / "ref", p, progress=False)[0]
    got = json.loads((tmp_path / "zoo" / "stability" / "zoo_5" / "zoo.json").read_text())
    strip = lambda m: {k: v for k, v in m.items() if k != "train_seconds"}  # noqa: E731
    assert [strip(m) for m in got["members"]] == [strip(m) for m in ref["members"]]
    a = torch.load(tmp_path / "zoo" / "stability" / "zoo_5" / "model_000.pt", weights_only=True)
    b = torch.load(tmp_path / "ref" / "stability" / "zoo_5" / "model_000.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
