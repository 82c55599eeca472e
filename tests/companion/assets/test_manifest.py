"""The manifest of the paper's assets and the one message for missing files."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from companion.assets import MissingAssetsError, check_assets, find_missing, fingerprint, load_manifest
from companion.assets.__main__ import main
from companion.assets.manifest import DEFAULT_MANIFEST, _ranges
from tests import ROOT as REPO


def touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")


def make_vision(root: Path, n_classes: int = 1000, skip_models=()) -> None:
    for i in range(72):
        if i not in skip_models:
            touch(root / "clip_soups" / f"model_{i}.pt")
    for split in ("train", "val"):
        for c in range(n_classes):
            (root / "imagenet" / split / f"n{c:08d}").mkdir(parents=True, exist_ok=True)
    touch(root / "imagenet" / "imagenet_98_idxs.npy")


def test_manifest_is_the_shipped_file_and_holds_the_paper_protocol():
    man = load_manifest()
    assert man.path == DEFAULT_MANIFEST and man.root == REPO / "data" / "paper"
    assert set(man.groups) == {"clip_soups", "imagenet", "mccoy_bert", "mnli"}
    assert man.resolve_groups("paper") == ["clip_soups", "imagenet", "mccoy_bert", "mnli"]
    # Section 6.2 of the paper: 2048 ImageNet images in batches of 256, 1024 MNLI pairs in batches of 128
    s = man.settings
    assert (s["imagenet"]["n_images"], s["imagenet"]["batch_size"]) == (2048, 256)
    assert (s["mnli"]["n_pairs"], s["mnli"]["batch_size"], s["mnli"]["max_seq_length"]) == (1024, 128, 128)
    assert s["clip_soups"]["n_models"] == 72 and s["mccoy_bert"]["n_models"] == 35
    for name, g in man.groups.items():
        assert g["origin"].strip() and g["title"].strip(), name


def test_nothing_present_gives_one_error_listing_every_file_and_origin(tmp_path):
    with pytest.raises(MissingAssetsError) as info:
        check_assets("paper", root=tmp_path)
    err = info.value
    msg = str(err)
    # 72 + 3 + 35 + 35 + 2 + (2 + 2): both MNLI formats are listed as alternatives
    assert err.count == 72 + 3 + 35 + 35 + 2 + 4
    assert f"{tmp_path}/clip_soups/model_{{i}}.pt  for i in 0-71 (72 files)" in msg
    assert f"{tmp_path}/mccoy_bert/bert_{{i:02d}}/model.ckpt-*.index  for i in 0-34 (35 files)" in msg
    for rel in ("imagenet/train", "imagenet/val", "imagenet/imagenet_98_idxs.npy",
                "mccoy_bert/uncased_L-12_H-768_A-12/vocab.txt", "mnli/train.tsv",
                "mnli/multinli_1.0_dev_matched.jsonl"):
        assert str(tmp_path / rel) in msg, rel
    assert "either (GLUE TSV)" in msg and "or (MultiNLI JSONL)" in msg
    for origin in ("mlfoundations/model-soups", "Zenodo record 4110593", "ILSVRC 2012", "MultiNLI"):
        assert origin in msg
    assert "data/README.md" in msg


def test_only_the_missing_indices_are_listed(tmp_path):
    make_vision(tmp_path, skip_models=(5, 40, 41, 42, 71))
    missing = find_missing("vision", root=tmp_path)
    assert len(missing) == 1 and missing[0].indices == (5, 40, 41, 42, 71)
    with pytest.raises(MissingAssetsError, match=r"for i in 5, 40-42, 71 \(5 files\)"):
        check_assets(["clip_soups", "imagenet"], root=tmp_path)


def test_complete_vision_assets_pass_and_are_fingerprinted(tmp_path):
    make_vision(tmp_path)
    (tmp_path / "imagenet" / "train" / "n00000003" / "a.JPEG").write_bytes(b"jpeg")
    assert check_assets("vision", root=tmp_path) == tmp_path
    fp = fingerprint("vision", root=tmp_path)
    assert len(fp["clip_soups"]) == 72 and fp["clip_soups"]["clip_soups/model_0.pt"]["size"] == 1
    assert fp["imagenet"]["imagenet/train"] == {
        "classes": 1000, "files": 1, "listing_sha256": fp["imagenet"]["imagenet/train"]["listing_sha256"]}
    # adding an image changes the fingerprint, so DVC re-runs the stages that read ImageNet
    (tmp_path / "imagenet" / "train" / "n00000003" / "b.JPEG").write_bytes(b"jpeg")
    assert fingerprint("vision", root=tmp_path)["imagenet"] != fp["imagenet"]


def test_wrong_number_of_class_folders_is_reported(tmp_path):
    make_vision(tmp_path, n_classes=998)
    with pytest.raises(MissingAssetsError, match="998 class folders, expected 1000"):
        check_assets("imagenet", root=tmp_path)


def test_either_mnli_format_suffices(tmp_path):
    touch(tmp_path / "mnli" / "multinli_1.0_train.jsonl")
    assert find_missing("mnli", root=tmp_path)  # dev set still missing
    touch(tmp_path / "mnli" / "multinli_1.0_dev_matched.jsonl")
    assert find_missing("mnli", root=tmp_path) == []
    touch(tmp_path / "mnli" / "train.tsv")  # a partial second format does not matter
    assert find_missing("mnli", root=tmp_path) == []


def test_select_narrows_an_indexed_group_and_globs_find_the_step(tmp_path):
    run = tmp_path / "mccoy_bert" / "bert_03"
    touch(run / "model.ckpt-36816.index")
    touch(run / "model.ckpt-36816.data-00000-of-00001")
    touch(tmp_path / "mccoy_bert" / "uncased_L-12_H-768_A-12" / "bert_config.json")
    touch(tmp_path / "mccoy_bert" / "uncased_L-12_H-768_A-12" / "vocab.txt")
    assert find_missing("mccoy_bert", root=tmp_path, select={"mccoy_bert": [3]}) == []
    missing = find_missing("mccoy_bert", root=tmp_path, select={"mccoy_bert": [3, 4]})
    assert [m.indices for m in missing] == [(4,), (4,)]


def test_unknown_names_are_rejected():
    with pytest.raises(ValueError, match="unknown asset set or group 'imagenet21k'"):
        check_assets("imagenet21k")


def test_ranges():
    assert _ranges([3, 1, 2, 7, 9, 10]) == "1-3, 7, 9-10"
    assert _ranges([4]) == "4"


def run_cli(*args, cwd=REPO):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "companion.assets", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_cli_prints_the_message_without_a_traceback_and_exits_2(tmp_path):
    out = run_cli("check", "--profile", "paper", "--root", str(tmp_path), "--write", str(tmp_path / "fp.json"))
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout
    assert out.stderr.startswith("error: The paper's assets are incomplete: 151 file(s) or folder(s)")
    assert not (tmp_path / "fp.json").exists()


def test_cli_other_profiles_need_nothing_and_record_that(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"profile": "cpu"}))
    assert main(["check", "--params", str(params), "--root", str(tmp_path / "paper"),
                 "--write", str(tmp_path / "fp.json")]) == 0
    assert (tmp_path / "paper").is_dir()  # created, so that DVC finds the folder data.dvc records
    assert json.loads((tmp_path / "fp.json").read_text()) == {"profile": "cpu", "paper_assets": "not used"}


def test_cli_complete_assets(tmp_path):
    make_vision(tmp_path)
    assert main(["check", "--profile", "paper", "--what", "vision", "--root", str(tmp_path),
                 "--write", str(tmp_path / "fp.json")]) == 0
    rec = json.loads((tmp_path / "fp.json").read_text())
    assert rec["profile"] == "paper" and set(rec["assets"]) == {"clip_soups", "imagenet"}
