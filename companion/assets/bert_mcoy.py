"""McCoy et al.'s (2020) MNLI fine-tunes of bert-base-uncased, as ``transformers`` models.

The release (100 runs differing in the fine-tuning seed; the paper uses 35)
holds TensorFlow 1 checkpoints written by google-research/bert's
``run_classifier.py``, to be read with Google's ``bert_config.json`` and
``vocab.txt``. Layout below the assets root (``data/paper``)::

    mccoy_bert/bert_00/ ... bert_99/       model.ckpt-<step>.{index,data-00000-of-00001}
    mccoy_bert/uncased_L-12_H-768_A-12/    bert_config.json, vocab.txt

:func:`load_mccoy_bert` reads a checkpoint with the project's TensorFlow-free
reader (:mod:`.tf_checkpoint`) and copies every variable into a
``transformers.BertForSequenceClassification``:

* dense ``kernel`` (in, out) -> ``weight`` (out, in) (transposed);
  LayerNorm ``gamma``/``beta`` -> ``weight``/``bias``; embeddings as they are;
* the classifier, which ``BertForSequenceClassification`` would not find by
  name: ``output_weights`` (num_labels, hidden), used by run_classifier.py as
  ``pooled @ output_weights^T + output_bias``, is copied to
  ``classifier.weight`` as it is (no transpose), ``output_bias`` to
  ``classifier.bias``;
* Google's ``"gelu"`` is the tanh approximation, which is ``"gelu_new"`` in
  ``transformers`` (``"gelu"`` there is the exact erf form);
* labels keep McCoy's order: 0 contradiction, 1 entailment, 2 neutral;
* optimizer slots (``*/adam_m``, ``*/adam_v``) and ``global_step`` are skipped;
  any other unused or missing variable is an error.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import torch

from .manifest import AssetError, Manifest, check_assets, load_manifest
from .tf_checkpoint import TFCheckpointReader

#: MnliProcessor.get_labels() in google-research/bert's run_classifier.py
LABELS = ("contradiction", "entailment", "neutral")
BASE_DIR = "uncased_L-12_H-768_A-12"
SKIP = re.compile(r"(/adam_[mv]$|^global_step$|/Adam(_1)?$|^beta[12]_power$)")


def run_dir(run: int | str) -> str:
    """``7`` -> ``"bert_07"`` (the release's folder names)."""
    return run if isinstance(run, str) else f"bert_{int(run):02d}"


def bert_config(config_file: str | os.PathLike, num_labels: int = len(LABELS)):
    """A ``transformers.BertConfig`` equivalent to a Google ``bert_config.json``."""
    from transformers import BertConfig

    with open(config_file) as f:
        g = json.load(f)
    act = g.get("hidden_act", "gelu")
    act = {"gelu": "gelu_new"}.get(act, act)  # google-research/bert's gelu is the tanh approximation
    return BertConfig(
        vocab_size=g["vocab_size"],
        hidden_size=g["hidden_size"],
        num_hidden_layers=g["num_hidden_layers"],
        num_attention_heads=g["num_attention_heads"],
        intermediate_size=g["intermediate_size"],
        hidden_act=act,
        hidden_dropout_prob=g.get("hidden_dropout_prob", 0.1),
        attention_probs_dropout_prob=g.get("attention_probs_dropout_prob", 0.1),
        max_position_embeddings=g["max_position_embeddings"],
        type_vocab_size=g.get("type_vocab_size", 2),
        initializer_range=g.get("initializer_range", 0.02),
        layer_norm_eps=1e-12,  # tf.contrib.layers.layer_norm's epsilon in modeling.py
        num_labels=num_labels,
        id2label=dict(enumerate(LABELS)),
        label2id={l: i for i, l in enumerate(LABELS)},
    )


def tf_to_hf_names(num_layers: int) -> dict[str, tuple[str, bool]]:
    """TF variable -> (transformers parameter, transpose?) for BertForSequenceClassification."""
    m = {
        "bert/embeddings/word_embeddings": ("bert.embeddings.word_embeddings.weight", False),
        "bert/embeddings/position_embeddings": ("bert.embeddings.position_embeddings.weight", False),
        "bert/embeddings/token_type_embeddings": ("bert.embeddings.token_type_embeddings.weight", False),
        "bert/embeddings/LayerNorm/gamma": ("bert.embeddings.LayerNorm.weight", False),
        "bert/embeddings/LayerNorm/beta": ("bert.embeddings.LayerNorm.bias", False),
        "bert/pooler/dense/kernel": ("bert.pooler.dense.weight", True),
        "bert/pooler/dense/bias": ("bert.pooler.dense.bias", False),
        "output_weights": ("classifier.weight", False),  # already (num_labels, hidden)
        "output_bias": ("classifier.bias", False),
    }
    for l in range(num_layers):
        tf, hf = f"bert/encoder/layer_{l}", f"bert.encoder.layer.{l}"
        dense = {
            "attention/self/query": "attention.self.query",
            "attention/self/key": "attention.self.key",
            "attention/self/value": "attention.self.value",
            "attention/output/dense": "attention.output.dense",
            "intermediate/dense": "intermediate.dense",
            "output/dense": "output.dense",
        }
        for a, b in dense.items():
            m[f"{tf}/{a}/kernel"] = (f"{hf}.{b}.weight", True)
            m[f"{tf}/{a}/bias"] = (f"{hf}.{b}.bias", False)
        for a, b in {"attention/output/LayerNorm": "attention.output.LayerNorm",
                     "output/LayerNorm": "output.LayerNorm"}.items():
            m[f"{tf}/{a}/gamma"] = (f"{hf}.{b}.weight", False)
            m[f"{tf}/{a}/beta"] = (f"{hf}.{b}.bias", False)
    return m


def convert_tf_bert(
    checkpoint: str | os.PathLike,
    config_file: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    verify: bool | str = "auto",
):
    """A ``BertForSequenceClassification`` (eval mode) holding a TF1 run_classifier checkpoint."""
    from transformers import BertForSequenceClassification

    reader = TFCheckpointReader(checkpoint, verify=verify)
    config = bert_config(config_file)
    if "output_weights" not in reader or "output_bias" not in reader:
        raise AssetError(
            f"{reader.prefix}: no output_weights / output_bias: not a run_classifier.py fine-tune "
            "(a pre-trained BERT checkpoint has no classifier)"
        )
    config.num_labels = reader.shape("output_weights")[0]
    if config.num_labels != len(LABELS):
        raise AssetError(f"{reader.prefix}: classifier has {config.num_labels} labels, MNLI has 3")
    mapping = tf_to_hf_names(config.num_hidden_layers)
    model = BertForSequenceClassification(config)
    params = dict(model.named_parameters())
    wanted = set(params)
    unused = [n for n in reader.names() if n not in mapping and not SKIP.search(n)]
    absent = [n for n in mapping if n not in reader]
    if unused or absent:
        raise AssetError(
            f"{reader.prefix}: does not match bert_config.json ({config.num_hidden_layers} layers); "
            f"variables missing: {absent[:8]}; variables not used: {unused[:8]}"
        )
    filled = set()
    with torch.no_grad():
        for tf_name, (hf_name, transpose) in mapping.items():
            value = reader.read(tf_name)
            if transpose:
                value = value.T
            target = params[hf_name]
            if tuple(value.shape) != tuple(target.shape):
                raise AssetError(
                    f"{reader.prefix}: {tf_name} has shape {value.shape}, "
                    f"{hf_name} needs {tuple(target.shape)}"
                )
            target.copy_(torch.from_numpy(np.ascontiguousarray(value)))
            filled.add(hf_name)
    if wanted - filled:
        raise AssetError(f"parameters left unset by the conversion: {sorted(wanted - filled)}")
    return model.to(dtype).eval()


def load_mccoy_bert(
    run: int | str,
    *,
    root: str | os.PathLike | None = None,
    manifest: Manifest | str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    verify: bool | str = "auto",
):
    """McCoy et al.'s run ``run`` (0-99, or a folder name like ``"bert_07"``) as a transformers model.

    Checks the run's files and the shared config/vocabulary first (a
    :class:`~companion.assets.MissingAssetsError` names what is missing).
    """
    man = manifest if isinstance(manifest, Manifest) else load_manifest(manifest)
    select = None
    if not isinstance(run, str):
        select = {"mccoy_bert": [int(run)]}
    root = check_assets("mccoy_bert", root=root, manifest=man, select=select)
    folder = Path(root) / "mccoy_bert"
    return convert_tf_bert(folder / run_dir(run), folder / BASE_DIR / "bert_config.json",
                           dtype=dtype, verify=verify)


def mccoy_tokenizer(root: str | os.PathLike | None = None, manifest=None):
    """The bert-base-uncased WordPiece tokenizer from the release's ``vocab.txt``."""
    from transformers import BertTokenizer

    man = manifest if isinstance(manifest, Manifest) else load_manifest(manifest)
    root = Path(root) if root is not None else man.root
    vocab = root / "mccoy_bert" / BASE_DIR / "vocab.txt"
    if not vocab.is_file():
        raise FileNotFoundError(f"no vocabulary at {vocab}")
    return bert_tokenizer(vocab)


def bert_tokenizer(vocab_file: str | os.PathLike):
    """An uncased WordPiece ``BertTokenizer`` for a Google ``vocab.txt`` (one token per line).

    The vocabulary is read here (token -> line number, as google-research/bert's
    ``load_vocab``) and passed as a dict: transformers 5's ``BertTokenizer``
    takes ``vocab=`` and silently ignores the older ``vocab_file=`` keyword.
    """
    from transformers import BertTokenizer

    with open(vocab_file, encoding="utf-8") as f:
        tokens = [line.rstrip("\n").strip() for line in f]
    while tokens and not tokens[-1]:
        tokens.pop()
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise AssetError(f"{vocab_file}: duplicate tokens")
    for special in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"):
        if special not in vocab:
            raise AssetError(f"{vocab_file}: no {special} token: not a BERT vocabulary")
    tok = BertTokenizer(vocab=vocab, do_lower_case=True)
    if len(tok) != len(vocab):
        raise AssetError(f"{vocab_file}: tokenizer holds {len(tok)} tokens, the file {len(vocab)}")
    return tok
