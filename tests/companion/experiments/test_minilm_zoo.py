"""The MiniLM zoo (companion.experiments.minilm_zoo) on a tiny random BERT saved in MiniLM's layout."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

import hideseek as hs
from companion.experiments import minilm
from companion.experiments import minilm_zoo as mz
from companion.experiments import nli_corpus as nc
from tests.companion.minilm_standin import TINY_SPEC, save_standin


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    return save_standin(tmp_path_factory.mktemp("minilm"))


@pytest.fixture(scope="module")
def zoo(standin, tmp_path_factory):
    out = tmp_path_factory.mktemp("zoo") / "zoo"
    mz.train_zoo(mz.MiniLMSpec.from_dict({**TINY_SPEC, "base": str(standin)}), out, progress=False)
    return out


def _inputs(standin, n=12, max_length=40):
    tok = minilm.load_tokenizer(standin)
    exs = nc.make_corpus(nc.CorpusSpec(seed=3, n_train=n, n_dev=2, n_test=2))["train"]
    return nc.encode(tok, exs, max_length)


def test_top_equals_hugging_face_bert_on_the_frozen_features(standin):
    """The cached lower layers + the CLS-only top give the logits of Hugging Face's own BertModel forward (its
    mask handling, all positions of the last layer) followed by its pooler and the classifier."""
    base = mz.load_base(standin).double()
    inputs, _ = _inputs(standin)
    feats = mz.lower_features(base, 1, inputs, batch_size=5)
    ref_hidden = base(**inputs, output_hidden_states=True).hidden_states[1]
    mask = inputs["attention_mask"].bool()[:, : feats["hidden_states"].shape[1]]
    torch.testing.assert_close(feats["hidden_states"][mask], ref_hidden[:, : mask.shape[1]][mask])
    top = mz.top_from_base(base.float(), 1, seed=0).double().eval()
    base = base.double()
    with torch.no_grad():
        ref = top.classifier(base(**inputs).pooler_output)
        got = top(**feats)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_top_holds_the_pretrained_layers_and_its_attention_pairs(standin):
    base = mz.load_base(standin)
    top = mz.top_from_base(base, 1, seed=3)
    for i in range(2):
        for name, p in base.encoder.layer[1 + i].state_dict().items():
            assert torch.equal(top.layer[i].state_dict()[name], p), name
    assert torch.equal(top.pooler.dense.weight, base.pooler.dense.weight)
    blocks = hs.find_symmetries(top)
    assert [b.module for b in blocks] == ["layer.0.attention.self", "layer.1.attention.self"]
    # the GL(h) action on a pair leaves the logits unchanged (applied by hand: W_q A, W_k A^-T per head)
    feats = mz.lower_features(base, 1, _inputs(standin)[0])
    with torch.no_grad():
        before = top.eval()(**feats)
        sa = top.layer[1].attention.self
        d = sa.attention_head_size
        a = torch.eye(d) + 0.3 * torch.randn(d, d, generator=torch.Generator().manual_seed(0))
        for h in range(sa.num_attention_heads):
            rows = slice(h * d, (h + 1) * d)
            sa.query.weight[rows] = a.T @ sa.query.weight[rows]
            sa.query.bias[rows] = a.T @ sa.query.bias[rows]
            sa.key.weight[rows] = torch.linalg.inv(a) @ sa.key.weight[rows]
            sa.key.bias[rows] = torch.linalg.inv(a) @ sa.key.bias[rows]
        torch.testing.assert_close(top(**feats), before, rtol=1e-4, atol=1e-5)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="unknown minilm zoo settings"):
        mz.MiniLMSpec.from_dict({"n_frozn": 2})
    with pytest.raises(ValueError, match="missing"):
        mz.MiniLMSpec.from_params({"n_frozen": 2})
    with pytest.raises(ValueError, match="n_frozen=3"):
        mz.split_base(type("B", (), {"config": type("C", (), {"num_hidden_layers": 3})()})(), 3)


def test_zoo_members_are_fine_tunes_of_the_base(zoo, standin):
    meta = mz.load_zoo(zoo)
    assert meta["kind"] == mz.KIND and len(meta["models"]) == 4
    assert meta["setting"] == mz.SETTING.format(n_top=2)
    assert meta["base"]["weights_sha256"] == hashlib.sha256((standin / "model.safetensors").read_bytes()).hexdigest()
    src = mz.MiniLMZoo(zoo)
    tops = [load() for _, load in src.loaders()]
    assert not torch.equal(tops[0].classifier.weight, tops[1].classifier.weight)
    # recorded errors are those of the saved members on the cached features (recomputed from the corpus files)
    dev_err = src.eval_errors([m["name"] for m in meta["models"]]).mean(1)
    assert np.allclose(dev_err, [m["dev_error"] for m in meta["models"]])
    drift = mz.attention_drift(tops[0], mz.load_base(standin), 1)
    assert len(drift) == 8 and all(0 < r["relative_change"] for r in drift)


def test_zero_learning_rate_keeps_the_pretrained_weights(standin, tmp_path):
    spec = {**TINY_SPEC, "base": str(standin), "finetune": {**TINY_SPEC["finetune"], "n_models": 1, "lr": 0.0}}
    mz.train_zoo(mz.MiniLMSpec.from_dict(spec), tmp_path / "z", progress=False)
    top = mz.load_member(tmp_path / "z", "model_000")
    base = mz.load_base(standin)
    for name, p in base.encoder.layer[2].state_dict().items():
        assert torch.equal(top.layer[1].state_dict()[name], p), name


def test_sharpness_batches_are_the_frozen_output_of_training_pairs(zoo, standin):
    src = mz.MiniLMZoo(zoo)
    batches = src.sharpness_batches(16, 8, seed=0)
    assert len(batches) == 2 and all(b[0]["hidden_states"].shape[0] == 8 for b in batches)
    train = nc.load_split(zoo / "corpus" / "train.jsonl")
    idx = np.sort(np.random.default_rng(0).choice(len(train), size=16, replace=False))
    inputs, labels = nc.encode(minilm.load_tokenizer(standin), [train[i] for i in idx], 40)
    ref = mz.load_base(standin)(**inputs, output_hidden_states=True).hidden_states[1].detach()
    for j, (x, y) in enumerate(batches):
        assert torch.equal(y, labels[8 * j: 8 * j + 8])
        n = x["hidden_states"].shape[1]
        m = x["attention_mask"].bool()
        assert n == int(inputs["attention_mask"][8 * j: 8 * j + 8].sum(1).max())
        torch.testing.assert_close(x["hidden_states"][m], ref[8 * j: 8 * j + 8, :n][m], rtol=1e-5, atol=1e-5)
    # sharpness perturbs the top only, its attention included
    res = hs.sharpness(src.loaders()[0][1](), batches[:1], hs.Measure(metric="invariant"), rho=0.05, n_iters=1,
                       progress=False)
    assert any(".attention.self.query" in p for p in res.perturbed_params) and res.norm_share.get("qk", 0) >= 0


def test_another_base_model_is_refused(zoo, tmp_path):
    other = save_standin(tmp_path / "other", seed=1)
    meta = json.loads((zoo / "zoo.json").read_text())
    meta["spec"]["base"] = str(other)
    with pytest.raises(ValueError, match="not the one"):
        mz.MiniLMZoo(zoo, meta).sharpness_batches(8, 8, seed=0)


@pytest.mark.slow
def test_training_is_deterministic_and_workers_change_nothing(zoo, standin, tmp_path):
    spec = mz.MiniLMSpec.from_dict({**TINY_SPEC, "base": str(standin), "workers": 2})
    mz.train_zoo(spec, tmp_path / "z2", progress=False)
    for i in range(4):
        name = f"model_{i:03d}"
        assert (zoo / name / mz.WEIGHTS).read_bytes() == (tmp_path / "z2" / name / mz.WEIGHTS).read_bytes()
    assert not mz.features_file(tmp_path / "z2").exists()
    a, b = json.loads((zoo / "zoo.json").read_text()), json.loads((tmp_path / "z2" / "zoo.json").read_text())
    assert a["models"] == b["models"]


def test_an_interrupted_zoo_is_assembled_from_its_finished_members(zoo, tmp_path):
    import shutil

    part = tmp_path / "part"
    shutil.copytree(zoo, part)
    (part / "zoo.json").unlink()
    (part / "model_002" / mz.RECORD).unlink()       # member 2 did not finish: 0-1 are the finished run
    spec = mz.MiniLMSpec.from_dict({**TINY_SPEC, "base": json.loads((zoo / "zoo.json").read_text())["spec"]["base"]})
    meta = mz.finalize(spec, part)
    full = json.loads((zoo / "zoo.json").read_text())
    assert meta["complete"] is False and meta["n_planned"] == 4 and full["complete"] is True
    assert meta["models"] == full["models"][:2]
    assert sorted(p.name for p in part.glob("model_*")) == ["model_000", "model_001"]
    assert len(mz.MiniLMZoo(part).loaders()) == 2


def _tree_bytes(d):
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("finalized", [True, False])
def test_a_resumed_zoo_is_byte_identical_to_an_uninterrupted_one(zoo, tmp_path, finalized):
    """Members 2-3 interrupted (member 3 left half-written: weights without a record); ``resume`` in 2 worker
    processes retrains exactly them, and every file of the zoo equals the one ``train`` wrote in one serial run."""
    import shutil

    part = tmp_path / "part"
    shutil.copytree(zoo, part)
    (part / "zoo.json").unlink()
    shutil.rmtree(part / "model_002")
    (part / "model_003" / mz.RECORD).unlink()
    (part / "model_003" / mz.WEIGHTS).write_bytes(b"half-written")
    base = json.loads((zoo / "zoo.json").read_text())["spec"]["base"]
    spec = mz.MiniLMSpec.from_dict({**TINY_SPEC, "base": base})
    if finalized:
        assert mz.finalize(spec, part)["complete"] is False
    kept = {n: (part / n / mz.WEIGHTS).stat().st_mtime_ns for n in ("model_000", "model_001")}
    meta = mz.resume_zoo(mz.MiniLMSpec.from_dict({**TINY_SPEC, "base": base, "workers": 2}), part, progress=False)
    assert meta["complete"] is True and len(meta["models"]) == 4
    # the settings differ only in `workers`: zoo.json records it, every other byte is train's
    full, got = _tree_bytes(zoo), _tree_bytes(part)
    assert sorted(full) == sorted(got)
    for name in full:
        if name != "zoo.json":
            assert got[name] == full[name], name
    a, b = json.loads(full["zoo.json"]), json.loads(got["zoo.json"])
    assert b["spec"].pop("workers") == 2 and a["spec"].pop("workers") == 1
    assert a == b
    # finished members were not retrained; the timings name the resumed ones only
    assert {n: (part / n / mz.WEIGHTS).stat().st_mtime_ns for n in kept} == kept
    t = json.loads(mz.lz.timings_file(part).read_text())
    assert t["resumed"] == ["model_002", "model_003"] and sorted(t["members"]) == ["model_002", "model_003"]
    assert t["kept"] == 2 and not mz.features_file(part).exists()


def test_resume_writes_the_same_zoo_json_bytes_as_train(zoo, standin, tmp_path):
    """Same settings (serial): zoo.json itself is byte-identical, and resuming a complete zoo trains nothing."""
    import shutil

    part = tmp_path / "part"
    shutil.copytree(zoo, part)
    shutil.rmtree(part / "model_003")
    spec = mz.MiniLMSpec.from_dict({**TINY_SPEC, "base": str(standin)})
    mz.resume_zoo(spec, part, progress=False)
    assert _tree_bytes(part) == _tree_bytes(zoo)
    mz.resume_zoo(spec, part, progress=False)
    assert json.loads(mz.lz.timings_file(part).read_text())["resumed"] == []
    assert _tree_bytes(part) == _tree_bytes(zoo)


def test_resume_refuses_other_settings_and_an_unstarted_zoo(zoo, standin, tmp_path):
    import shutil

    with pytest.raises(FileNotFoundError, match="no started MiniLM zoo"):
        mz.resume_zoo(mz.MiniLMSpec.from_dict({**TINY_SPEC, "base": str(standin)}), tmp_path / "none", progress=False)
    part = tmp_path / "part"
    shutil.copytree(zoo, part)
    other = {**TINY_SPEC, "base": str(standin), "finetune": {**TINY_SPEC["finetune"], "lr": 2e-2}}
    with pytest.raises(ValueError, match="other settings"):
        mz.resume_zoo(mz.MiniLMSpec.from_dict(other), part, progress=False)
    (part / "zoo.json").unlink()                    # without zoo.json the members' records still tell
    with pytest.raises(ValueError, match="other settings"):
        mz.resume_zoo(mz.MiniLMSpec.from_dict(other), part, progress=False)
    corpus = {**TINY_SPEC, "base": str(standin), "corpus": {**TINY_SPEC["corpus"], "seed": 5}}
    with pytest.raises(ValueError, match="corpus or base configuration"):
        mz.resume_zoo(mz.MiniLMSpec.from_dict(corpus), part, progress=False)
