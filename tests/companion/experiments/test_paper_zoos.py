"""The paper's own zoos (profile ``paper``) on stand-ins in the real formats, written here.

* CLIP: four random-weight state dicts in the model-soups layout (a small ViT), a
  tiny ImageNet tree (3 classes) with a 98 % / 2 % mask; the zoo's errors are compared
  with a forward pass written out in float64 (``test_assets_clip.reference_logits``)
  on images listed and preprocessed here, and one sharpness value of
  the vision stage's measurement with a direct ``hideseek.sharpness`` call on directly built batches.
* BERT: the TensorFlow-written tiny checkpoint (tests/data/mccoy_bert_tiny) copied into
  McCoy's layout as four runs, three of them with their classifier bias changed in
  the checkpoint files themselves (tensor bytes, the entry's CRC32C and the index
  block's checksum rewritten), plus tiny GLUE MNLI TSV files; errors are compared with
  the converted models run on untrimmed, 128-token batches.
* Missing assets: the train CLIs print the one message, exit status 2, no traceback.
"""
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

import hideseek as hs
from companion.assets.bert_mcoy import BASE_DIR, bert_tokenizer, convert_tf_bert
from companion.assets.clip_soups import load_clip_finetune
from companion.assets.imagenet import ImageNetAssets, clip_preprocess
from companion.assets.manifest import DEFAULT_MANIFEST
from companion.assets.mnli import encode, read_glue_tsv
from companion.assets.tf_checkpoint import TFCheckpointReader, crc32c, read_sstable
from companion.experiments import paper_zoos as pz
from tests import ROOT as REPO
from tests.companion.assets.test_clip_soups import openai_clip_soup_state_dict, reference_logits
from tests.companion.assets.test_mnli import DEV, DEV_HEADER, TRAIN, TRAIN_HEADER, write_tsv
from companion.params import load_yaml

BERT_FIX = REPO / "tests" / "data" / "mccoy_bert_tiny" / "mccoy_bert"

WNIDS = ["n01440764", "n01443537", "n01484850"]
N_TRAIN, N_VAL = 6, 3
HELD_OUT = [2, 9, 13]  # training images (ImageFolder order) held out by the mask
CLIP = dict(width=64, layers=1, patch=16, image_size=32, out_dim=8, classes=len(WNIDS))  # one head of width 64
N_CLIP = 6  # split_half_taus needs at least 6 models


# --------------------------------------------------------------------------- CLIP soups + ImageNet stand-ins


@pytest.fixture(scope="module")
def clip_assets(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clip_paper")
    root = tmp / "paper"
    rng = np.random.default_rng(0)
    files = {"train": [], "val": []}  # (path, label) in ImageFolder order, listed here independently
    for c, wnid in enumerate(WNIDS):
        for split, n in (("train", N_TRAIN), ("val", N_VAL)):
            d = root / "imagenet" / split / wnid
            d.mkdir(parents=True)
            for j in range(n):
                arr = rng.integers(0, 256, size=(30 + 3 * j, 40 + 5 * c, 3), dtype=np.uint8)
                name = f"{wnid}_{j}.JPEG" if split == "train" else f"ILSVRC2012_val_{c * n + j:08d}.JPEG"
                Image.fromarray(arr).save(d / name)
            files[split] += [(d / f, c) for f in sorted(os.listdir(d))]
    mask = np.zeros(len(files["train"]), dtype=np.int64)
    mask[HELD_OUT] = 1
    np.save(root / "imagenet" / "imagenet_98_idxs.npy", mask)
    (root / "clip_soups").mkdir()
    sds = []
    for i in range(N_CLIP):
        sd = openai_clip_soup_state_dict(**CLIP, seed=10 + i)
        torch.save(sd, root / "clip_soups" / f"model_{i}.pt")
        sds.append(sd)
    raw = load_yaml(DEFAULT_MANIFEST.read_text())  # the real manifest, with the tiny class count
    for entry in raw["groups"]["imagenet"]["files"]:
        if entry.get("kind") == "image_folder":
            entry["classes"] = len(WNIDS)
    manifest = tmp / "manifest.yaml"
    manifest.write_text(yaml.safe_dump(raw))
    params = dict(source="clip_soups", assets_root=str(root), manifest=str(manifest), models=list(range(N_CLIP)),
                  expect=None, num_classes=len(WNIDS), image_size=CLIP["image_size"], train_error_images=None,
                  test_error_images=None, error_seed=0, batch_size=5, num_workers=0, group_size=3,
                  device="cpu", threads=1)
    zoo_dir = tmp / "zoo"
    meta = pz.build_clip_soups_zoo(zoo_dir, params, progress=False)
    return dict(root=root, manifest=manifest, files=files, mask=mask, sds=sds, params=params,
                zoo_dir=zoo_dir, meta=meta, tmp=tmp)


def _images(paths):
    pre = clip_preprocess(CLIP["image_size"])
    return torch.stack([pre(Image.open(p)) for p in paths])


def _direct_wrong(sd, items):
    x = _images([p for p, _ in items])
    y = torch.tensor([c for _, c in items])
    pred = reference_logits(sd, x, heads=1, patch=CLIP["patch"]).argmax(-1)
    return int((pred != y).sum())


def test_clip_zoo_errors_equal_a_written_out_forward_pass(clip_assets):
    a = clip_assets
    meta = json.loads((a["zoo_dir"] / "zoo.json").read_text())
    assert meta == json.loads(json.dumps(a["meta"]))
    assert meta["kind"] == "clip_soups" and [m["name"] for m in meta["members"]] == [f"model_{i}" for i in range(N_CLIP)]
    assert meta["n_parameters"] == sum(p.numel() for p in load_clip_finetune(
        a["root"] / "clip_soups" / "model_0.pt", expect=None, num_classes=3).parameters())
    fit = [it for j, it in enumerate(a["files"]["train"]) if a["mask"][j] == 0]  # the 98 %: not held out
    assert meta["errors"]["train"]["n_images"] == len(fit) == N_TRAIN * len(WNIDS) - len(HELD_OUT)
    wrong = []
    for m, sd in zip(meta["members"], a["sds"]):
        w_tr, w_te = _direct_wrong(sd, fit), _direct_wrong(sd, a["files"]["val"])
        wrong.append((w_tr, w_te))
        assert (m["train_wrong"], m["n_train"]) == (w_tr, len(fit))
        assert (m["test_wrong"], m["n_test"]) == (w_te, N_VAL * len(WNIDS))
        assert m["gap"] == pytest.approx(w_te / len(a["files"]["val"]) - w_tr / len(fit))
        assert not any(str(a["root"]) in str(v) for k, v in m.items() if k != "name")  # paths relative to the root
    assert len(set(wrong)) > 1  # the stand-ins differ, so a mix-up of models would show
    assert not any(p.suffix == ".pt" for p in a["zoo_dir"].iterdir())  # no weights copied


def test_clip_zoo_train_subset_is_drawn_from_the_fine_tuning_split(clip_assets, tmp_path):
    a = clip_assets
    params = {**a["params"], "models": [1, 3], "train_error_images": 7, "test_error_images": 4, "error_seed": 5}
    meta = pz.build_clip_soups_zoo(tmp_path, params, progress=False)
    assert [m["index"] for m in meta["members"]] == [1, 3]
    fit = np.flatnonzero(a["mask"] == 0)
    sub = np.sort(np.random.default_rng(5).choice(fit, size=7, replace=False))  # the documented rule
    val = np.sort(np.random.default_rng(5).choice(len(a["files"]["val"]), size=4, replace=False))
    assert not set(sub.tolist()) & set(HELD_OUT)
    for m in meta["members"]:
        sd = a["sds"][m["index"]]
        assert m["n_train"] == 7 and m["n_test"] == 4
        assert m["train_wrong"] == _direct_wrong(sd, [a["files"]["train"][j] for j in sub])
        assert m["test_wrong"] == _direct_wrong(sd, [a["files"]["val"][j] for j in val])


def test_clip_zoo_checks_the_architecture_it_is_told_to_expect(clip_assets, tmp_path):
    from hideseek.open_clip_finetune import CheckpointError

    with pytest.raises(CheckpointError, match="not the expected architecture"):
        pz.build_clip_soups_zoo(tmp_path, {**clip_assets["params"], "expect": "vit_b32"}, progress=False)
    with pytest.raises(CheckpointError, match="classes, expected 1000"):
        pz.build_clip_soups_zoo(tmp_path, {**clip_assets["params"], "num_classes": 1000}, progress=False)
    with pytest.raises(ValueError, match="distinct"):
        pz.build_clip_soups_zoo(tmp_path, {**clip_assets["params"], "models": [1, 1]}, progress=False)
    assert not (tmp_path / "zoo.json").exists()


def _vision_params(a, **kw):
    return dict(zoo_dir=str(a["zoo_dir"]), n_images=4, batch_size=2, data_seed=1, n_iters=1, seed=0,
                measures={"adaptive": "m_apgd_l2", "geodesic_invariant": "geodesic_invariant",
                          "geodesic_mixed": "geodesic_mixed"},
                rho={"adaptive": 0.1, "geodesic_invariant": 0.01, "geodesic_mixed": 0.01},
                exploratory_rho={"adaptive": [0.1], "geodesic_invariant": [0.01], "geodesic_mixed": [0.01]},
                retest=False, max_train_error=0.5, n_boot=20, n_splits=10, power={"alpha": 0.05, "n_sim": 50, "seed": 0},
                workers=1, threads=1, device="cpu", cpu_kernels=None,
                cluster_factors=["shift"], cluster_auc=0.9) | kw


def test_vision_stage_measures_the_clip_zoo_as_a_direct_call(clip_assets):
    from companion.experiments import vision_report as vr
    from companion.experiments import vision_zoo as vz

    a = clip_assets
    meta, loaders = vz.load_zoo(a["zoo_dir"], device="cpu")
    assert [n for n, _ in loaders] == [f"model_{i}" for i in range(N_CLIP)]
    s = vr.load_settings("paper", _vision_params(a))
    src, frame, explore, _ = vr.measure_members(s, progress=False)
    assert explore is None and len(frame) == N_CLIP * 3 and np.isfinite(frame["value"]).all()
    assert frame["per_batch"].map(len).eq(2).all()
    with pytest.raises(ValueError, match="retest"):
        vr.measure_members(vr.load_settings("paper", _vision_params(a, retest=True)), progress=False)

    # the same number from the checkpoint and the images, without the zoo
    idx = ImageNetAssets(a["root"], image_size=CLIP["image_size"], manifest=a["manifest"]).sharpness_indices(4, seed=1)
    assert not set(idx.tolist()) & set(HELD_OUT)
    x = _images([a["files"]["train"][j][0] for j in idx])
    y = torch.tensor([a["files"]["train"][j][1] for j in idx])
    batches = [(x[:2], y[:2]), (x[2:], y[2:])]
    model = load_clip_finetune(a["root"] / "clip_soups" / "model_2.pt", expect=None, num_classes=3)
    for measure, m, rho in (("adaptive", hs.Measure(geometry="adaptive", p="l2"), 0.1),
                            ("geodesic_mixed", hs.Measure(metric="mixed"), 0.01)):
        torch.manual_seed(0)
        direct = hs.sharpness(model, batches, m, rho=rho, n_iters=1, seed=0, progress=False).value
        ours = frame.set_index(["model", "measure"]).loc[("model_2", measure), "value"]
        assert ours == pytest.approx(direct, rel=1e-5, abs=1e-7)


@pytest.mark.slow
def test_vision_notebook_runs_on_the_clip_zoo_with_profile_paper(clip_assets, tmp_path):
    from companion.pipeline import run_stage

    a = clip_assets
    res = run_stage("vision", profile="paper", params=_vision_params(a, data_seed=0), reports_dir=tmp_path / "reports",
                    progress_bar=False)
    metrics = json.loads(res.metrics.read_text())
    assert metrics["profile"] == "paper" and metrics["setting"].startswith("model-soups CLIP zoo (6 ")
    assert metrics["zoo"]["n_models"] == N_CLIP and metrics["gap_reliability"] == []
    members = {m["name"]: m for m in a["meta"]["members"]}
    assert metrics["zoo"]["gap_max"] == pytest.approx(max(m["gap"] for m in members.values()))
    assert {"fig4_vision.png", "vision_tau_vs_rho.png"} <= {p.name for p in res.figures}


def _run(args, **kw):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120, **kw)


@pytest.mark.slow
def test_vision_train_cli_with_profile_paper_and_no_assets_prints_the_one_message(tmp_path):
    empty = tmp_path / "paper"
    empty.mkdir()
    r = _run(["-m", "companion.experiments.vision_zoo", "train", "--profile", "paper", "--out", str(tmp_path / "zoo"),
              "--set", f"assets_root={empty}", "--no-progress"])
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert r.stderr.count("The paper's assets are incomplete") == 1
    for what in ("clip_soups/model_{i}.pt", "for i in 0-71 (72 files)", "imagenet/train", "imagenet/val",
                 "imagenet_98_idxs.npy", "model-soups"):
        assert what in r.stderr, what
    assert "mccoy_bert" not in r.stderr  # only what the vision stage reads
    assert not (tmp_path / "zoo").exists()


# --------------------------------------------------------------------------- McCoy BERT + MNLI stand-ins


def _mask_crc(c: int) -> int:
    return ((((c >> 15) | (c << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(buf, pos):
    out = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        out |= (b & 0x7F) << shift
        if not b & 0x80:
            return out, pos
        shift += 7


def perturbed_run(src: Path, dst: Path, delta: np.ndarray) -> None:
    """A copy of a TF run folder whose ``output_bias`` is changed by ``delta`` in the files themselves."""
    shutil.copytree(src, dst)
    index_path = next(dst.glob("*.index"))
    data_path = next(dst.glob("*.data-00000-of-00001"))
    reader = TFCheckpointReader(dst)
    old = reader.read("output_bias")
    entry = read_sstable(index_path)[b"output_bias"]
    # BundleEntryProto: offset (field 4) and crc32c (field 6, fixed32, masked)
    fields, pos = {}, 0
    while pos < len(entry):
        key, pos = _varint(entry, pos)
        num, wt = key >> 3, key & 7
        if wt == 0:
            fields[num], pos = _varint(entry, pos)
        elif wt == 5:
            fields[num] = struct.unpack_from("<I", entry, pos)[0]
            pos += 4
        else:
            n, pos = _varint(entry, pos)
            pos += n
    new = (old + delta).astype(old.dtype)
    data = bytearray(data_path.read_bytes())
    off = fields.get(4, 0)
    data[off:off + new.nbytes] = new.tobytes()
    data_path.write_bytes(bytes(data))
    index = bytearray(index_path.read_bytes())
    old_field = b"\x35" + struct.pack("<I", fields[6])
    assert index.count(old_field) == 1
    at = index.find(old_field)
    index[at + 1:at + 5] = struct.pack("<I", _mask_crc(crc32c(new.tobytes())))
    # re-checksum the table block that holds the entry (footer -> index block -> data block handles)
    footer = bytes(index[-48:])
    p = 0
    for _ in range(2):
        _, p = _varint(footer, p)
    idx_off, p = _varint(footer, p)
    idx_size, _ = _varint(footer, p)
    block = bytes(index[idx_off:idx_off + idx_size])
    n_restarts = struct.unpack_from("<I", block, len(block) - 4)[0]
    end, q, fixed = len(block) - 4 * (n_restarts + 1), 0, False
    while q < end:
        _, q = _varint(block, q)
        non_shared, q = _varint(block, q)
        vlen, q = _varint(block, q)
        q += non_shared
        b_off, r = _varint(block, q)
        b_size, _ = _varint(block, r)
        q += vlen
        if b_off <= at < b_off + b_size:
            trailer = bytes(index[b_off:b_off + b_size + 1])  # block + compression type
            index[b_off + b_size + 1:b_off + b_size + 5] = struct.pack("<I", _mask_crc(crc32c(trailer)))
            fixed = True
    assert fixed
    index_path.write_bytes(bytes(index))
    check = TFCheckpointReader(dst, verify=True)
    np.testing.assert_array_equal(check.read("output_bias"), new)
    np.testing.assert_array_equal(check.read("output_weights"), reader.read("output_weights"))


N_BERT = 6  # split_half_taus needs at least 6 models
MNLI_DEV = DEV[:2] + [(h, p, lab) for p, h, lab in TRAIN[:7]]  # more dev pairs (GLUE TSV: no "-" labels)


@pytest.fixture(scope="module")
def bert_assets(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bert_paper")
    root = tmp / "paper"
    (root / "mccoy_bert").mkdir(parents=True)
    shutil.copytree(BERT_FIX / BASE_DIR, root / "mccoy_bert" / BASE_DIR)
    shutil.copytree(BERT_FIX / "bert_00", root / "mccoy_bert" / "bert_00")
    rng = np.random.default_rng(0)
    for run in range(1, N_BERT):
        perturbed_run(BERT_FIX / "bert_00", root / "mccoy_bert" / f"bert_{run:02d}",
                      rng.normal(0, 1.5, size=3).astype(np.float32))
    (root / "mnli").mkdir()
    write_tsv(root / "mnli" / "train.tsv", TRAIN_HEADER, TRAIN)
    write_tsv(root / "mnli" / "dev_matched.tsv", DEV_HEADER, MNLI_DEV)
    params = dict(source="mccoy_bert", assets_root=str(root), manifest=None, runs=list(range(N_BERT)),
                  train_error_pairs=None, test_error_pairs=None, error_seed=0, batch_size=4,
                  max_seq_length=128, prefer="tsv", device="cpu", threads=1)
    zoo_dir = tmp / "zoo"
    zoo = pz.build_mccoy_zoo(zoo_dir, params, progress=False)
    return dict(root=root, params=params, zoo_dir=zoo_dir, zoo=zoo, tmp=tmp)


def _direct_bert_wrong(root, run, pairs):
    folder = root / "mccoy_bert"
    model = convert_tf_bert(folder / f"bert_{run:02d}", folder / BASE_DIR / "bert_config.json")
    tok = bert_tokenizer(folder / BASE_DIR / "vocab.txt")
    x, y = encode(pairs, tok, 128)  # padded to 128, as run_classifier.py
    with torch.no_grad():
        pred = model(**x).logits.argmax(-1)
    return int((pred != y).sum())


def test_mccoy_zoo_errors_equal_the_converted_models_on_padded_batches(bert_assets):
    b = bert_assets
    zoo = json.loads((b["zoo_dir"] / "zoo.json").read_text())
    assert zoo["kind"] == "mccoy_bert" and zoo["format"] == 1 and zoo["spec"]["max_length"] == 128
    assert [m["name"] for m in zoo["models"]] == [f"bert_{r:02d}" for r in range(N_BERT)]
    train = read_glue_tsv(b["root"] / "mnli" / "train.tsv")
    dev = read_glue_tsv(b["root"] / "mnli" / "dev_matched.tsv")
    wrong = []
    for m in zoo["models"]:
        w_tr, w_te = _direct_bert_wrong(b["root"], m["run"], train), _direct_bert_wrong(b["root"], m["run"], dev)
        wrong.append((w_tr, w_te))
        assert (m["train_wrong"], m["n_train"], m["test_wrong"], m["n_test"]) == (w_tr, len(train), w_te, len(dev))
        assert m["gap"] == pytest.approx(w_te / len(dev) - w_tr / len(train))
    assert len(set(wrong)) > 1  # the perturbed runs really differ
    assert zoo["n_parameters"] == sum(p.numel() for p in convert_tf_bert(
        b["root"] / "mccoy_bert" / "bert_00", b["root"] / "mccoy_bert" / BASE_DIR / "bert_config.json").parameters())
    assert not any(p.is_dir() for p in b["zoo_dir"].iterdir())  # converted on the fly, nothing saved


def test_mccoy_zoo_error_subsets_follow_the_seed(bert_assets, tmp_path):
    b = bert_assets
    zoo = pz.build_mccoy_zoo(tmp_path, {**b["params"], "runs": [2], "train_error_pairs": 5,
                                        "test_error_pairs": 4, "error_seed": 3}, progress=False)
    rng = np.random.default_rng(3)  # the documented rule: train subset first, then dev, one generator
    i_tr = np.sort(rng.choice(len(TRAIN), size=5, replace=False))
    i_te = np.sort(rng.choice(len(MNLI_DEV), size=4, replace=False))
    train = read_glue_tsv(b["root"] / "mnli" / "train.tsv")
    dev = read_glue_tsv(b["root"] / "mnli" / "dev_matched.tsv")
    (m,) = zoo["models"]
    assert (m["n_train"], m["n_test"]) == (5, 4)
    assert m["train_wrong"] == _direct_bert_wrong(b["root"], 2, [train[i] for i in i_tr])
    assert m["test_wrong"] == _direct_bert_wrong(b["root"], 2, [dev[i] for i in i_te])


def test_mccoy_sharpness_batches_are_the_papers_pairs_with_padding_trimmed(bert_assets):
    from companion.assets.mnli import mnli_sharpness_batches

    b = bert_assets
    ours = pz.mccoy_sharpness_batches(b["zoo"], n_pairs=6, batch_size=4, seed=2)
    tok = bert_tokenizer(b["root"] / "mccoy_bert" / BASE_DIR / "vocab.txt")
    ref = mnli_sharpness_batches(read_glue_tsv(b["root"] / "mnli" / "train.tsv"), tok, n_pairs=6, batch_size=4, seed=2)
    assert [len(y) for _, y in ours] == [4, 2]
    model = convert_tf_bert(b["root"] / "mccoy_bert" / "bert_01", b["root"] / "mccoy_bert" / BASE_DIR / "bert_config.json")
    for (x, y), (xr, yr) in zip(ours, ref):
        assert torch.equal(y, yr) and xr["input_ids"].shape[1] == 128 and x["input_ids"].shape[1] < 128
        n = x["input_ids"].shape[1]
        assert xr["attention_mask"][:, n:].sum() == 0  # only padding was dropped
        for k in x:
            assert torch.equal(x[k], xr[k][:, :n])
        with torch.no_grad():
            torch.testing.assert_close(model(**x).logits, model(**xr).logits, rtol=1e-5, atol=1e-6)


def _mccoy_language_params(zoo_dir) -> dict:
    grid = [0.05]
    return dict(zoo_dir=str(zoo_dir), device="cpu", threads=1, workers=1, n_points=4, batch_size=2, data_seed=0,
                n_iters=1, seed=0, rho={"adaptive": 0.1, "geodesic_invariant": 0.01, "geodesic_mixed": 0.01},
                eps=0.0, max_train_error=0.5, n_boot=20, gap_splits=10, power_alpha=0.05, power_n_sim=20,
                exploratory=dict(n_points=2, n_iters=1, rho_grid={}, eps_grid=[0.0, 0.01],
                                 ablation_rho_grid={"geodesic_invariant_no_christoffel": grid,
                                                    "geodesic_mixed_christoffel_only": grid},
                                 relative_flatness_layer=None, orbit=None))


def test_language_primary_measurement_runs_on_the_mccoy_zoo_and_matches_a_direct_call(bert_assets):
    from companion.assets.mnli import mnli_sharpness_batches
    from companion.experiments import language_report as lr
    from companion.experiments import language_zoo as lz

    b = bert_assets
    s = lr.settings_from(_mccoy_language_params(b["zoo_dir"]))
    names = list(lz.member_table(s.zoo_dir).index)
    frame = lr.measure_primary(s, names, progress=False)
    assert len(frame) == N_BERT * 3 and np.isfinite(frame["value"]).all()
    assert names == [f"bert_{r:02d}" for r in range(N_BERT)] and lz.dev_errors(s.zoo_dir, names) is None

    folder = b["root"] / "mccoy_bert"
    model = convert_tf_bert(folder / "bert_03", folder / BASE_DIR / "bert_config.json")
    tok = bert_tokenizer(folder / BASE_DIR / "vocab.txt")
    batches = mnli_sharpness_batches(read_glue_tsv(b["root"] / "mnli" / "train.tsv"), tok, n_pairs=4,
                                     batch_size=2, seed=0)  # untrimmed, 128 tokens
    torch.manual_seed(0)
    direct = hs.sharpness(model, batches, measure="adaptive", p="l2", rho=0.1, n_iters=1, seed=0,
                          progress=False).value
    ours = frame.set_index(["model", "measure"]).loc[("bert_03", "adaptive"), "value"]
    assert ours == pytest.approx(direct, rel=1e-4, abs=1e-7)


@pytest.mark.slow
def test_language_notebook_runs_on_the_mccoy_zoo_with_profile_paper(bert_assets, tmp_path):
    from companion.pipeline import run_stage

    b = bert_assets
    res = run_stage("language", profile="paper", params=_mccoy_language_params(b["zoo_dir"]),
                    reports_dir=tmp_path / "reports", progress_bar=False)
    metrics = json.loads(res.metrics.read_text())
    assert metrics["profile"] == "paper" and metrics["setting"].startswith("mccoy_bert: 6 ")
    assert metrics["zoo"]["n_models"] == N_BERT and "gap_reliability" not in metrics["table1"][0]
    assert metrics["zoo"]["gap_max"] == pytest.approx(max(m["gap"] for m in b["zoo"]["models"]))
    assert {"fig5_language.png", "language_zoo.png", "fig9_eps.png"} <= {p.name for p in res.figures}


@pytest.mark.slow
def test_language_train_cli_with_profile_paper_and_no_assets_prints_the_one_message(tmp_path):
    empty = tmp_path / "paper"
    empty.mkdir()
    r = _run(["-m", "companion.experiments.language_zoo", "train", "--profile", "paper", "--out", str(tmp_path / "zoo"),
              "--set", f"assets_root={empty}"])
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert r.stderr.count("The paper's assets are incomplete") == 1
    for what in ("mccoy_bert/bert_{i:02d}/model.ckpt-*.index", "for i in 0-34 (35 files)", "bert_config.json",
                 "vocab.txt", "train.tsv", "multinli_1.0_train.jsonl", "zenodo"):
        assert what.lower() in r.stderr.lower(), what
    assert "clip_soups" not in r.stderr
    assert not (tmp_path / "zoo").exists()
