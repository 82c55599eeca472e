"""The language zoo: masking, trimming, deterministic training, the zoo folder, the CLI."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from companion.experiments import language_zoo as lz
from companion.experiments import nli_corpus as nc

TINY = {
    "corpus": {"seed": 1, "n_train": 96, "n_dev": 30, "n_test": 45, "hard_rate": 0.1},
    "model": {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32},
    "pretrain": {"steps": 4, "batch_size": 16},
    "finetune": {"n_models": 2, "epochs": 1.0, "batch_size": 16, "base_seed": 7},
}


@pytest.fixture(scope="module")
def tiny_zoo(tmp_path_factory):
    out = tmp_path_factory.mktemp("zoo") / "language"
    zoo = lz.train_zoo(lz.ZooSpec.from_dict(TINY), out, progress=False)
    return out, zoo


def test_spec_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown finetune settings"):
        lz.ZooSpec.from_dict({"finetune": {"n_modles": 3}})
    with pytest.raises(ValueError, match="unknown language zoo settings"):
        lz.ZooSpec.from_dict({"finetuning": {}})
    spec = lz.ZooSpec.from_dict(TINY)
    assert spec.model.hidden_size == 16 and spec.finetune.n_models == 2 and spec.max_length == 40


def test_spec_checks_gap_threads_workers():
    assert lz.ZooSpec.from_dict({}).gap == "test" and lz.ZooSpec.from_dict({}).threads is None
    spec = lz.ZooSpec.from_dict({"gap": "dev", "threads": 1, "workers": 2})
    assert (spec.gap, spec.threads, spec.workers) == ("dev", 1, 2)
    assert lz.ZooSpec.from_dict(spec.to_dict()) == spec      # zoo.json's spec reads back
    with pytest.raises(ValueError, match="gap must be one of"):
        lz.ZooSpec.from_dict({"gap": "hans"})
    with pytest.raises(ValueError, match=">= 1"):
        lz.ZooSpec.from_dict({"workers": 0})
    with pytest.raises(ValueError, match="cpu"):
        lz.ZooSpec.from_dict({"workers": 2, "device": "cuda"})


def test_evaluate_gap_choice(tiny_zoo):
    out, zoo = tiny_zoo
    spec = lz.ZooSpec.from_dict(zoo["spec"])
    data = lz.prepare_data(spec, out / "corpus", save=False)
    model = lz.load_model(out, "model_000")
    dev, test = lz.evaluate(model, data, "dev"), lz.evaluate(model, data, "test")
    assert dev["gap"] == dev["dev_error"] - dev["train_error"] == dev["gap_in_distribution"]
    assert test["gap"] == test["test_error"] - test["train_error"] == dev["gap_hans"]
    assert dev["train_error"] == zoo["models"][0]["train_error"]   # saved model = recorded errors


@pytest.mark.slow  # two spawned processes import torch and transformers: ~20 s on a quiet machine
def test_workers_and_threads_change_no_member(tmp_path):
    """Two spawned worker processes train the same members as the serial loop, bitwise;
    the thread count in force is restored afterwards."""
    # the serial reference at the workers' thread count (1): members depend on the thread
    # count, so the fixture's zoo (torch's default threads) is not the reference here
    was = torch.get_num_threads()
    out = tmp_path / "ser"
    zoo = lz.train_zoo(lz.ZooSpec.from_dict({**TINY, "threads": 1}), out, progress=False)
    assert torch.get_num_threads() == was
    spec = lz.ZooSpec.from_dict({**TINY, "workers": 2, "threads": 1})
    par = lz.train_zoo(spec, tmp_path / "par", progress=False)
    assert torch.get_num_threads() == was
    for a, b in zip(zoo["models"], par["models"]):
        assert (a["name"], a["train_error"], a["final_train_loss"]) == (b["name"], b["train_error"],
                                                                      b["final_train_loss"])
        s1 = lz.load_model(out, a["name"]).state_dict()
        s2 = lz.load_model(tmp_path / "par", b["name"]).state_dict()
        assert all(torch.equal(s1[k], s2[k]) for k in s1), a["name"]


@pytest.mark.slow
def test_pinned_cpu_kernels_are_checked(tiny_zoo, tmp_path):
    import os
    import platform
    import subprocess
    import sys

    out, zoo = tiny_zoo
    assert zoo["cpu_kernels"]["capability"] == torch.backends.cpu.get_cpu_capability()
    with pytest.raises(ValueError, match="cpu_kernels must be"):
        lz.ZooSpec.from_dict({"cpu_kernels": "avx9"})
    pinned = all(os.environ.get(k) == v for k, v in lz.KERNEL_ENV["avx2"].items())
    if not pinned:   # this test process was started without the environment: refused
        with pytest.raises(RuntimeError, match="ATEN_CPU_CAPABILITY=avx2"):
            lz.train_zoo(lz.ZooSpec.from_dict({**TINY, "cpu_kernels": "avx2"}), tmp_path / "z", progress=False)
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("AVX2 kernels exist on x86-64 only")
    code = "from companion.experiments import language_zoo as lz; lz.check_cpu_kernels('avx2'); print(lz.cpu_kernels())"
    env = {**os.environ, **lz.KERNEL_ENV["avx2"]}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-500:]
    assert "'capability': 'AVX2'" in res.stdout


def test_relative_flatness_over_the_zoo(tiny_zoo):
    import hideseek as hs
    from companion.experiments.relative import run_relative

    out, zoo = tiny_zoo
    batches = lz.sharpness_batches(out, 32, 16, 0)
    values, taus = run_relative(out, ["model_000", "model_001"], batches, lz.member_table(out),
                                layer="classifier.weight", device="cpu", n_boot=0, seed=0)
    direct = hs.relative_flatness(lz.load_model(out, "model_001"), batches, layer="classifier")
    assert values.set_index("model").loc["model_001", "value"] == pytest.approx(direct.value, rel=1e-12)
    assert (values["method"] == "closed_form").all()
    np.testing.assert_array_equal(values["gap_hans"], [m["gap_hans"] for m in zoo["models"]])
    assert taus.empty            # two members: no rank correlation (tau is tested in test_stability)


def test_mask_tokens_follows_bert_recipe():
    gen = torch.Generator().manual_seed(0)
    n_special, vocab, mask_id = len(nc.SPECIAL_TOKENS), 51, 4
    ids = torch.randint(n_special, vocab, (400, 30), generator=gen)
    ids[:, 0], ids[:, 20] = 2, 3  # [CLS], [SEP]
    attn = torch.ones_like(ids)
    attn[:, 25:] = 0
    ids[:, 25:] = 0
    new, labels = lz.mask_tokens(ids, attn, 0.15, mask_id, vocab, n_special, gen)
    chosen = labels != -100
    # only real words are chosen, and their labels are the original words
    assert not chosen[:, [0, 20]].any() and not chosen[:, 25:].any()
    assert torch.equal(labels[chosen], ids[chosen])
    frac = chosen.float().sum() / (attn.sum() - 2 * 400)
    assert abs(float(frac) - 0.15) < 0.01
    # 80 % [MASK], 10 % another word, 10 % unchanged; untouched elsewhere
    is_mask = (new == mask_id) & chosen
    same = (new == ids) & chosen
    assert abs(float(is_mask.sum() / chosen.sum()) - 0.8) < 0.03
    assert abs(float(same.sum() / chosen.sum()) - 0.1) < 0.03 + 1 / vocab
    assert torch.equal(new[~chosen], ids[~chosen])


def test_trim_changes_no_output():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=51, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=40, num_labels=3)
    model = BertForSequenceClassification(cfg).double().eval()
    ids = torch.randint(5, 51, (4, 40))
    attn = torch.zeros_like(ids)
    for i, n in enumerate((12, 20, 7, 15)):
        attn[i, :n] = 1
    ids = ids * attn
    inputs = {"input_ids": ids, "attention_mask": attn, "token_type_ids": torch.zeros_like(ids)}
    short = lz.trim(inputs)
    assert short["input_ids"].shape == (4, 20)
    with torch.no_grad():
        a, b = model(**inputs).logits, model(**short).logits
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_finetune_is_deterministic_and_seeded(tmp_path):
    spec = lz.ZooSpec.from_dict(TINY)
    data = lz.prepare_data(spec, tmp_path / "corpus")
    lz.pretrain(spec, data, tmp_path / "pre", progress=False)
    m1, l1 = lz.finetune(spec, data, tmp_path / "pre", seed=3)
    m2, l2 = lz.finetune(spec, data, tmp_path / "pre", seed=3)
    m3, _ = lz.finetune(spec, data, tmp_path / "pre", seed=4)
    assert l1 == l2
    s1, s2, s3 = m1.state_dict(), m2.state_dict(), m3.state_dict()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert not torch.equal(s1["classifier.weight"], s3["classifier.weight"])
    # the recipe's dropout override reaches the model; default: the pre-trained config's
    assert m1.config.hidden_dropout_prob == 0.1 and m1.config.attention_probs_dropout_prob == 0.1
    spec0 = lz.ZooSpec.from_dict({**TINY, "finetune": {**TINY["finetune"], "dropout": 0.0}})
    m4, l4 = lz.finetune(spec0, data, tmp_path / "pre", seed=3)
    assert m4.config.hidden_dropout_prob == 0.0 and m4.config.attention_probs_dropout_prob == 0.0
    assert l4 != l1
    # and the pre-training itself is reproducible
    p1, _ = lz.pretrain(spec, data, None, progress=False)
    p2, _ = lz.pretrain(spec, data, None, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(p1.parameters(), p2.parameters()))


def test_zoo_folder(tiny_zoo):
    out, zoo = tiny_zoo
    on_disk = lz.load_zoo(out)
    assert on_disk == json.loads(json.dumps(zoo))
    assert zoo["corpus"] == {"train": 96, "dev": 30, "test": 45}
    assert (out / "corpus" / "vocab.txt").read_text().split() == nc.vocabulary()
    assert (out / "pretrained" / "config.json").is_file()
    assert [m["seed"] for m in zoo["models"]] == [7, 8]
    timings = json.loads(lz.timings_file(out).read_text())
    assert lz.timings_file(out).parent == out.parent and set(timings["members"]) == {"model_000", "model_001"}
    assert all(t["cpu_seconds"] > 0 for t in timings["members"].values()) and "seconds_total" not in zoo
    for rec in zoo["models"]:
        assert rec["gap"] == pytest.approx(rec["test_error"] - rec["train_error"])  # default gap: "test"
        assert rec["gap_hans"] == rec["gap"]
        assert rec["gap_in_distribution"] == pytest.approx(rec["dev_error"] - rec["train_error"])
        assert "seconds" not in rec and "cpu_seconds" not in rec   # timings live beside the DVC output
        assert 0.0 <= rec["train_error"] <= 1.0 and 0.0 <= rec["test_error"] <= 1.0
        assert set(rec["test_error_by_template"]) <= set(nc.TEST_WEIGHTS)
        # the saved model reproduces the recorded test error, counted independently here
        model = lz.load_model(out, rec["name"])
        assert not model.training
        test = nc.load_split(out / "corpus" / "test.jsonl")
        tok = nc.make_tokenizer(out / "corpus" / "vocab.txt")
        wrong = 0
        with torch.no_grad():
            for ex in test:
                enc = tok(ex["premise"], ex["hypothesis"], return_tensors="pt")
                wrong += int(model(**enc).logits.argmax(-1).item() != ex["label"])
        assert wrong / len(test) == pytest.approx(rec["test_error"], abs=1e-9)


def test_sharpness_batches_are_fixed_training_pairs(tiny_zoo):
    out, _ = tiny_zoo
    b1 = lz.sharpness_batches(out, 32, 16, seed=0)
    b2 = lz.sharpness_batches(out, 32, 16, seed=0)
    assert len(b1) == 2
    for (x1, y1), (x2, y2) in zip(b1, b2):
        assert torch.equal(y1, y2) and all(torch.equal(x1[k], x2[k]) for k in x1)
        assert x1["input_ids"].shape[0] == 16 and int(x1["attention_mask"][:, -1].max()) == 1
    train = {(e["premise"], e["hypothesis"]) for e in nc.load_split(out / "corpus" / "train.jsonl")}
    tok = nc.make_tokenizer(out / "corpus" / "vocab.txt")
    for x, _ in b1:
        for row, tt in zip(x["input_ids"], x["token_type_ids"]):
            words = tok.convert_ids_to_tokens(row.tolist())
            sep = words.index("[SEP]")
            prem = " ".join(words[1:sep])
            hyp = " ".join(w for w in words[sep + 1:] if w not in ("[SEP]", "[PAD]"))
            assert (prem, hyp) in train
    with pytest.raises(ValueError, match="exceeds"):
        lz.sharpness_batches(out, 160, 16, 0)
    with pytest.raises(ValueError, match="multiple"):
        lz.sharpness_batches(out, 30, 16, 0)


def test_dev_errors_reproduce_the_recorded_dev_error(tiny_zoo):
    out, zoo = tiny_zoo
    errors = lz.dev_errors(out, ["model_000", "model_001"])
    assert errors.shape == (2, TINY["corpus"]["n_dev"]) and set(np.unique(errors)) <= {0.0, 1.0}
    np.testing.assert_allclose(errors.mean(1), [m["dev_error"] for m in zoo["models"]], atol=1e-12)


def test_ablations_are_the_appendix_g_variants():
    assert set(lz.ABLATIONS) == {f"geodesic_{m}_{v}" for m in ("invariant", "mixed")
                                 for v in ("no_christoffel", "christoffel_only")}
    for name, m in lz.ABLATIONS.items():
        assert m.name == name and m.geometry == "geodesic"
        assert (m.step == "straight") == name.endswith("no_christoffel")
        assert (m.ball == "adaptive") == name.endswith("christoffel_only")


def test_load_zoo_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="language_zoo train"):
        lz.load_zoo(tmp_path)


@pytest.mark.slow
def test_cli_reads_params_and_overrides(tmp_path):
    import yaml

    full = lz.ZooSpec.from_dict(TINY).to_dict()      # the stage states every setting
    params = {"profile": "cpu", "language_train": {"cpu": full}}
    pfile = tmp_path / "params.yaml"
    pfile.write_text(yaml.safe_dump(params))
    out = tmp_path / "zoo"
    # a setting left out is refused, not filled with a default written in code
    partial = tmp_path / "partial.yaml"
    partial.write_text(yaml.safe_dump({"profile": "cpu", "language_train": {"cpu": TINY}}))
    with pytest.raises(ValueError, match=r"language_train settings missing .*state them in params.yaml"):
        lz.main(["train", "--out", str(out), "--params", str(partial)])
    no_dropout = {**full, "finetune": {k: v for k, v in full["finetune"].items() if k != "dropout"}}
    partial.write_text(yaml.safe_dump({"profile": "cpu", "language_train": {"cpu": no_dropout}}))
    with pytest.raises(ValueError, match=r"finetune\.dropout"):
        lz.main(["train", "--out", str(out), "--params", str(partial)])
    rc = lz.main(["train", "--out", str(out), "--params", str(pfile), "--set", "finetune.n_models=1",
                  "--set", "pretrain.steps=2"])
    assert rc == 0
    zoo = lz.load_zoo(out)
    assert len(zoo["models"]) == 1 and zoo["spec"]["pretrain"]["steps"] == 2
    with pytest.raises(KeyError, match="no profile"):
        lz.main(["train", "--out", str(out), "--params", str(pfile), "--profile", "gpu"])


@pytest.mark.slow
def test_cli_restarts_with_pinned_kernels(tmp_path):
    """cpu_kernels: avx2 from the command line: the process restarts itself with KERNEL_ENV and
    records the pinned kernels in zoo.json."""
    import os
    import platform
    import subprocess
    import sys

    import yaml

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("AVX2 kernels exist on x86-64 only")
    pfile = tmp_path / "params.yaml"
    full = lz.ZooSpec.from_dict(TINY).to_dict()
    pfile.write_text(yaml.safe_dump({"profile": "cpu", "language_train": {"cpu": {**full, "cpu_kernels": "avx2"}}}))
    env = {k: v for k, v in os.environ.items() if k not in lz.KERNEL_ENV["avx2"]}
    res = subprocess.run([sys.executable, "-m", "companion.experiments.language_zoo", "train", "--out",
                          str(tmp_path / "z"), "--params", str(pfile), "--set", "finetune.n_models=1"],
                         env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-800:]
    assert "restarting" in res.stdout
    kernels = lz.load_zoo(tmp_path / "z")["cpu_kernels"]
    assert kernels["capability"] == "AVX2" and kernels["MKL_CBWR"] == "AVX2"


def test_source_of_a_generated_zoo_reads_what_the_stages_read(tiny_zoo):
    """The ZooSource of a generated zoo (the cpu path of every language stage): the seeded draw of
    training pairs, encoded and trimmed as by hand, the saved fine-tunes, the recorded members, the
    per-example dev errors; and the module's shorthands give the same."""
    from transformers import BertForSequenceClassification

    from companion.experiments.zoo import ZooSource

    out, zoo = tiny_zoo
    src = lz.source(out)
    assert isinstance(src, lz.GeneratedNLIZoo) and isinstance(src, ZooSource) and src.kind == "generated_nli"
    assert src.description() == f"generated_nli: {len(zoo['models'])} seed-only fine-tunes"
    train = nc.load_split(out / "corpus" / "train.jsonl")
    idx = np.sort(np.random.default_rng(3).choice(len(train), size=32, replace=False))
    inputs, labels = nc.encode(nc.make_tokenizer(out / "corpus" / "vocab.txt"), [train[i] for i in idx],
                               zoo["spec"]["max_length"])
    got, short = src.sharpness_batches(32, 16, 3), lz.sharpness_batches(out, 32, 16, 3)
    assert len(got) == len(short) == 2
    for k, ((x, y), (xs, ys)) in enumerate(zip(got, short)):
        n = int(inputs["attention_mask"][16 * k:16 * k + 16].sum(1).max())
        assert torch.equal(y, labels[16 * k:16 * k + 16]) and torch.equal(ys, y)
        assert all(torch.equal(x[key], v[16 * k:16 * k + 16, :n]) and torch.equal(xs[key], x[key])
                   for key, v in inputs.items())
    names = [m["name"] for m in zoo["models"]]
    loaded = src.loaders()
    assert [n for n, _ in loaded] == names and [n for n, _ in src.loaders(names[::-1])] == names[::-1]
    for name, load in loaded:
        ref = BertForSequenceClassification.from_pretrained(out / name, local_files_only=True).state_dict()
        model = load()
        assert not model.training and all(torch.equal(t, ref[k]) for k, t in model.state_dict().items())
    assert [n for n, _ in lz.model_loaders(out)] == names
    table = src.member_table()
    assert list(table.index) == names and table["dev_error"].tolist() == [m["dev_error"] for m in zoo["models"]]
    assert table.equals(lz.member_table(out))
    errors = src.eval_errors(names[::-1])
    np.testing.assert_allclose(errors.mean(1), [m["dev_error"] for m in zoo["models"]][::-1], atol=1e-12)
    assert np.array_equal(errors, lz.dev_errors(out, names[::-1]))
    with pytest.raises(ValueError, match="halves"):
        src.retest_batches(32, 16, 3)
