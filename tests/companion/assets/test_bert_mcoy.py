"""McCoy et al.'s TF1 BERT checkpoints: the TensorFlow-free reader and the conversion.

The fixture tests/data/mccoy_bert_tiny was written by TensorFlow 2.21
(tf.compat.v1.train.Saver, see make_fixture.py there) in the layout of the
release: mccoy_bert/bert_00/model.ckpt-36816.* and
mccoy_bert/uncased_L-12_H-768_A-12/{bert_config.json, vocab.txt}; its
reference.npz holds every tensor as TensorFlow read it back. The forward pass
below is google-research/bert's modeling.py + run_classifier.py written out
in numpy (float64), from those TensorFlow-read values.
"""
import json
import shutil

import numpy as np
import pytest
import torch

from companion.assets import AssetError, MissingAssetsError
from companion.assets.bert_mcoy import LABELS, load_mccoy_bert, mccoy_tokenizer, convert_tf_bert
from companion.assets.tf_checkpoint import (CheckpointFormatError, TFCheckpointReader, crc32c,
                                           resolve_checkpoint_prefix)
from tests import ROOT

FIX = ROOT / "tests" / "data" / "mccoy_bert_tiny"
RUN = FIX / "mccoy_bert" / "bert_00"
CONFIG = FIX / "mccoy_bert" / "uncased_L-12_H-768_A-12" / "bert_config.json"


@pytest.fixture(scope="module")
def ref():
    with np.load(FIX / "reference.npz") as z:
        names = [str(n) for n in z["names"]]
        return {
            "names": names,
            "dtypes": [str(d) for d in z["dtypes"]],
            "values": {n: z[f"value:{n}"] for n in names},
        }


def test_crc32c_known_answer():
    # RFC 3720 (iSCSI) B.4 test vectors
    assert crc32c(bytes(32)) == 0x8A9136AA
    assert crc32c(bytes([0xFF] * 32)) == 0x62A8AB43
    assert crc32c(bytes(range(32))) == 0x46DD794E


def test_reader_matches_what_tensorflow_wrote(ref):
    reader = TFCheckpointReader(RUN, verify=True)  # the folder: prefix from its `checkpoint` file
    assert reader.prefix == RUN / "model.ckpt-36816"  # the file records an absolute path elsewhere
    assert reader.names() == ref["names"]
    assert len(ref["names"]) == 124  # 40 weights x (value, adam_m, adam_v) + global_step
    for name, dtype in zip(ref["names"], ref["dtypes"]):
        got, want = reader.read(name), ref["values"][name]
        assert got.dtype == np.dtype(dtype) and got.shape == want.shape, name
        np.testing.assert_array_equal(got, want, err_msg=name)
    assert reader.read("global_step") == 36816
    assert reader.shape("output_weights") == (3, 8)  # [num_labels, hidden]


def test_reader_detects_corruption(tmp_path):
    run = tmp_path / "bert_00"
    shutil.copytree(RUN, run)
    reader = TFCheckpointReader(run, verify=True)
    entry = reader.entries["output_bias"]
    data = run / "model.ckpt-36816.data-00000-of-00001"
    raw = bytearray(data.read_bytes())
    raw[entry.offset + 1] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointFormatError, match="output_bias: checksum mismatch"):
        TFCheckpointReader(run, verify=True).read("output_bias")
    np.asarray(TFCheckpointReader(run, verify=False).read("output_bias"))  # unverified read still works
    index = run / "model.ckpt-36816.index"
    raw = bytearray(index.read_bytes())
    raw[20] ^= 0xFF
    index.write_bytes(bytes(raw))
    with pytest.raises(CheckpointFormatError, match="checksum mismatch|corrupt"):
        TFCheckpointReader(run)
    index.write_bytes(b"not an sstable" * 10)
    with pytest.raises(CheckpointFormatError, match="bad magic number"):
        TFCheckpointReader(run)


def test_checkpoint_prefix_resolution(tmp_path):
    run = tmp_path / "bert_07"
    run.mkdir()
    for f in RUN.glob("model.ckpt-36816.*"):
        shutil.copy(f, run / f.name)
        shutil.copy(f, run / f.name.replace("36816", "36000"))  # an older checkpoint beside it
    assert resolve_checkpoint_prefix(run) == run / "model.ckpt-36816"  # no `checkpoint` file: latest step
    (run / "checkpoint").write_text('model_checkpoint_path: "/home/someone/bert_07/model.ckpt-36000"\n')
    assert resolve_checkpoint_prefix(run) == run / "model.ckpt-36000"
    assert resolve_checkpoint_prefix(run / "model.ckpt-36816.index") == run / "model.ckpt-36816"
    with pytest.raises(FileNotFoundError, match="no TensorFlow checkpoint"):
        resolve_checkpoint_prefix(tmp_path)


def layer_norm(x, g, b, eps=1e-12):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


def gelu_tanh(x):  # google-research/bert modeling.gelu
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def numpy_bert_classifier(v, cfg, input_ids, token_type_ids, attention_mask):
    """modeling.BertModel + run_classifier.create_model's logits, from TF variables (float64)."""
    v = {k: a.astype(np.float64) for k, a in v.items() if a.dtype.kind == "f"}
    b, t = input_ids.shape
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    d = h // nh
    x = (v["bert/embeddings/word_embeddings"][input_ids]
         + v["bert/embeddings/token_type_embeddings"][token_type_ids]
         + v["bert/embeddings/position_embeddings"][:t][None])
    x = layer_norm(x, v["bert/embeddings/LayerNorm/gamma"], v["bert/embeddings/LayerNorm/beta"])
    adder = (1.0 - attention_mask[:, None, None, :].astype(np.float64)) * -10000.0
    dense = lambda z, name: z @ v[name + "/kernel"] + v[name + "/bias"]  # tf.layers.dense: x @ kernel
    for l in range(cfg["num_hidden_layers"]):
        p = f"bert/encoder/layer_{l}"
        heads = lambda z: z.reshape(b, t, nh, d).transpose(0, 2, 1, 3)
        q, k, val = (heads(dense(x, f"{p}/attention/self/{n}")) for n in ("query", "key", "value"))
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d) + adder
        s = np.exp(s - s.max(-1, keepdims=True))
        ctx = (s / s.sum(-1, keepdims=True)) @ val
        ctx = ctx.transpose(0, 2, 1, 3).reshape(b, t, h)
        x = layer_norm(dense(ctx, f"{p}/attention/output/dense") + x,
                       v[f"{p}/attention/output/LayerNorm/gamma"], v[f"{p}/attention/output/LayerNorm/beta"])
        inter = gelu_tanh(dense(x, f"{p}/intermediate/dense"))
        x = layer_norm(dense(inter, f"{p}/output/dense") + x,
                       v[f"{p}/output/LayerNorm/gamma"], v[f"{p}/output/LayerNorm/beta"])
    pooled = np.tanh(dense(x[:, 0], "bert/pooler/dense"))
    return pooled @ v["output_weights"].T + v["output_bias"]  # matmul(..., transpose_b=True)


def test_conversion_reproduces_the_tensorflow_model(ref):
    model = load_mccoy_bert(0, root=FIX, dtype=torch.float64, verify=True)
    assert not model.training
    assert [model.config.id2label[i] for i in range(3)] == ["contradiction", "entailment", "neutral"]
    assert list(LABELS) == ["contradiction", "entailment", "neutral"]
    # the classifier is copied explicitly and not transposed: output_weights is [num_labels, hidden]
    np.testing.assert_array_equal(model.classifier.weight.detach().numpy(), ref["values"]["output_weights"])
    np.testing.assert_array_equal(model.classifier.bias.detach().numpy(), ref["values"]["output_bias"])
    np.testing.assert_array_equal(model.bert.encoder.layer[1].intermediate.dense.weight.detach().numpy(),
                                  ref["values"]["bert/encoder/layer_1/intermediate/dense/kernel"].T)
    tok = mccoy_tokenizer(FIX)
    enc = tok(["The man is sleeping.", "A dog runs in the park, and the cat sat on the mat."],
              ["The woman is not sleeping.", "Cats are happy."],
              max_length=24, padding="max_length", truncation=True, return_tensors="pt")
    assert enc["attention_mask"][0].sum() < 24  # padding present, so the mask matters
    with torch.no_grad():
        ours = model(**enc).logits.numpy()
    cfg = json.loads(CONFIG.read_text())
    want = numpy_bert_classifier(ref["values"], cfg, *(enc[k].numpy() for k in
                                                      ("input_ids", "token_type_ids", "attention_mask")))
    np.testing.assert_allclose(ours, want, rtol=1e-9, atol=1e-9)
    assert np.abs(want).max() > 0.1 and not np.allclose(want[0], want[1])  # a non-degenerate check


def test_exact_gelu_would_be_detected(ref):
    """Google's 'gelu' is the tanh form; with the erf form the logits would differ visibly."""
    model = load_mccoy_bert(0, root=FIX, dtype=torch.float64)
    assert model.config.hidden_act == "gelu_new"
    enc = mccoy_tokenizer(FIX)(["the man saw the dog ."], ["a woman runs ."], return_tensors="pt")
    with torch.no_grad():
        a = model(**enc).logits
        model.config.hidden_act = "gelu"
        for layer in model.bert.encoder.layer:
            layer.intermediate.intermediate_act_fn = torch.nn.GELU()
        b = model(**enc).logits
    assert (a - b).abs().max() > 1e-6


def test_tokenizer_reads_the_vocabulary_file():
    tok = mccoy_tokenizer(FIX)
    enc = tok("The cats sat.", "A man")
    tokens = tok.convert_ids_to_tokens(enc["input_ids"])
    assert tokens == ["[CLS]", "the", "cat", "##s", "sat", ".", "[SEP]", "a", "man", "[SEP]"]
    vocab = (FIX / "mccoy_bert" / "uncased_L-12_H-768_A-12" / "vocab.txt").read_text().split("\n")
    assert enc["input_ids"][:3] == [vocab.index("[CLS]"), vocab.index("the"), vocab.index("cat")]
    assert enc["token_type_ids"] == [0] * 7 + [1] * 3


def test_wrong_checkpoints_are_rejected(tmp_path):
    with pytest.raises(AssetError, match="no output_weights / output_bias"):
        convert_tf_bert(FIX / "pretrained" / "bert_model.ckpt", CONFIG)
    cfg = json.loads(CONFIG.read_text())
    cfg["num_hidden_layers"] = 3
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(AssetError, match=r"variables missing: \['bert/encoder/layer_2/"):
        convert_tf_bert(RUN, tmp_path / "cfg.json")
    cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"] = 2, 16, 2
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(AssetError, match="has shape"):
        convert_tf_bert(RUN, tmp_path / "cfg.json")


def test_missing_run_lists_its_files():
    with pytest.raises(MissingAssetsError) as info:
        load_mccoy_bert(5, root=FIX)
    msg = str(info.value)
    assert "bert_{i:02d}/model.ckpt-*.index  for i in 5 (1 file)" in msg
    assert "Zenodo record 4110593" in msg and "bert_config.json" not in msg


def test_the_converted_model_exposes_its_attention_symmetries():
    import hideseek as hs

    model = load_mccoy_bert(0, root=FIX, dtype=torch.float64)
    assert len(hs.find_symmetries(model)) == 2  # one per encoder layer
