"""The zoo-source registry: zoo.json's kind picks the ZooSource once (the paper's zoos included), a zoo of
another modality or kind is refused with one line, and the paper zoos keep no per-example errors."""
import json

import pytest

from companion.experiments import language_zoo as lz
from companion.experiments import paper_zoos as pz
from companion.experiments import vision_zoo as vz
from companion.experiments.zoo import ZooSource, open_source


def _zoo(path, meta):
    path.mkdir(parents=True, exist_ok=True)
    (path / "zoo.json").write_text(json.dumps(meta))
    return path


MCCOY = {"kind": "mccoy_bert", "format": 1, "assets_root": None, "manifest": None, "mnli_source": "tsv",
         "spec": {"max_length": 128}, "models": [{"name": "bert_00", "run": 0, "train_error": 0.1, "test_error": 0.2,
                                                  "gap": 0.1}, {"name": "bert_03", "run": 3, "train_error": 0.0,
                                                                "test_error": 0.3, "gap": 0.3}]}
CLIP = {"kind": "clip_soups", "format": 1, "assets_root": None, "manifest": None, "expect": None, "num_classes": 3,
        "image_size": 32, "members": [{"name": "model_0", "file": "clip_soups/model_0.pt", "train_error": 0.1,
                                       "test_error": 0.4, "gap": 0.3}]}


def test_the_kind_picks_the_paper_sources(tmp_path):
    m = lz.source(_zoo(tmp_path / "l", MCCOY))
    assert isinstance(m, pz.McCoyZoo) and isinstance(m, ZooSource) and m.meta == MCCOY
    assert m.description() == "mccoy_bert: 2 seed-only fine-tunes" and m.eval_errors(["bert_00"]) is None
    assert list(m.member_table().index) == ["bert_00", "bert_03"] and m.member_table().loc["bert_03", "gap"] == 0.3
    assert lz.member_table(tmp_path / "l").equals(m.member_table()) and lz.dev_errors(tmp_path / "l", ["bert_00"]) is None
    c = vz.source(_zoo(tmp_path / "v", CLIP))
    assert isinstance(c, pz.ClipSoupsZoo) and isinstance(c, ZooSource)
    assert c.description() == "model-soups CLIP zoo (1 ViT-B/32 fine-tunes on ImageNet)" and c.eval_errors(["model_0"]) is None
    assert [n for n, _ in c.loaders(device="cpu")] == ["model_0"]          # loaders are lazy: no checkpoint read
    with pytest.raises(KeyError, match="model_9"):
        c.loaders(["model_9"], device="cpu")
    for src in (m, c):
        with pytest.raises(ValueError, match="retest: false"):
            src.retest_batches(8, 4, 0)


def test_a_zoo_of_another_kind_is_refused(tmp_path):
    with pytest.raises(ValueError, match="kind 'mccoy_bert'.*'clip_soups', 'vision'"):
        vz.source(_zoo(tmp_path / "l", MCCOY))
    with pytest.raises(ValueError, match="kind 'vision'"):
        lz.source(_zoo(tmp_path / "v", {"kind": "vision", "format": 1, "members": []}))
    with pytest.raises(ValueError, match="kind None"):
        open_source(tmp_path, {}, {"a": object})
    with pytest.raises(ValueError, match="loaders"):          # the generated-zoo loader refuses the paper's zoo
        lz.load_model(tmp_path / "l", "bert_00")
    with pytest.raises(FileNotFoundError, match="train the zoo"):
        vz.source(tmp_path / "missing")
