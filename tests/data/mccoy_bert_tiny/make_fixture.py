"""Write the tiny McCoy-style BERT checkpoint used by tests/companion/assets/test_bert_mcoy.py.

Run once, with TensorFlow, in a throw-away environment (TensorFlow is not a
dependency of hideseek):

    python3.11 -m venv /tmp/tfvenv && /tmp/tfvenv/bin/pip install tensorflow-cpu
    /tmp/tfvenv/bin/python tests/data/mccoy_bert_tiny/make_fixture.py

It builds, with TensorFlow 1 style variables (tf.compat.v1), every variable
that google-research/bert's run_classifier.py creates for an MNLI model (the
BERT encoder, `output_weights` [num_labels, hidden], `output_bias`,
AdamWeightDecayOptimizer's `<var>/adam_m`, `<var>/adam_v` slots and
`global_step`), in a tiny configuration, and saves it with
tf.compat.v1.train.Saver, i.e. the tensor-bundle format of McCoy et al.'s
release. It then reads every tensor back *with TensorFlow*
(tf.train.load_checkpoint) into reference.npz, which the tests compare the
project's TensorFlow-free reader against.
"""
import json
import os
import shutil

import numpy as np
import tensorflow as tf

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "mccoy_bert")
RUN = os.path.join(ROOT, "bert_00")
BASE = os.path.join(ROOT, "uncased_L-12_H-768_A-12")  # same folder name as Google's release
STEP = 36816

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "a", "man", "woman", "dog", "cat",
         "is", "are", "not", "sleeping", "running", "in", "park", "##s", ".", ",", "and", "sat",
         "on", "mat", "runs", "sleeps", "who", "saw", "happy"]
CONFIG = {
    "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
    "hidden_size": 8, "initializer_range": 0.02, "intermediate_size": 16,
    "max_position_embeddings": 128, "num_attention_heads": 2, "num_hidden_layers": 2,
    "type_vocab_size": 2, "vocab_size": len(VOCAB),
}
NUM_LABELS = 3


def variables(rng):
    h, i, v = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    w = lambda *s: (0.5 * rng.standard_normal(s)).astype(np.float32)
    gamma = lambda: (1 + 0.2 * rng.standard_normal(h)).astype(np.float32)
    out = {
        "bert/embeddings/word_embeddings": w(v, h),
        "bert/embeddings/token_type_embeddings": w(CONFIG["type_vocab_size"], h),
        "bert/embeddings/position_embeddings": w(CONFIG["max_position_embeddings"], h),
        "bert/embeddings/LayerNorm/gamma": gamma(),
        "bert/embeddings/LayerNorm/beta": w(h),
    }
    for l in range(CONFIG["num_hidden_layers"]):
        p = f"bert/encoder/layer_{l}"
        for name in ("query", "key", "value"):
            out[f"{p}/attention/self/{name}/kernel"] = w(h, h)   # [in, out], as tf.layers.dense
            out[f"{p}/attention/self/{name}/bias"] = w(h)
        out[f"{p}/attention/output/dense/kernel"] = w(h, h)
        out[f"{p}/attention/output/dense/bias"] = w(h)
        out[f"{p}/attention/output/LayerNorm/gamma"] = gamma()
        out[f"{p}/attention/output/LayerNorm/beta"] = w(h)
        out[f"{p}/intermediate/dense/kernel"] = w(h, i)
        out[f"{p}/intermediate/dense/bias"] = w(i)
        out[f"{p}/output/dense/kernel"] = w(i, h)
        out[f"{p}/output/dense/bias"] = w(h)
        out[f"{p}/output/LayerNorm/gamma"] = gamma()
        out[f"{p}/output/LayerNorm/beta"] = w(h)
    out["bert/pooler/dense/kernel"] = w(h, h)
    out["bert/pooler/dense/bias"] = w(h)
    out["output_weights"] = w(NUM_LABELS, h)  # [num_labels, hidden]: logits = pooled @ W^T + b
    out["output_bias"] = w(NUM_LABELS)
    return out


def main():
    shutil.rmtree(ROOT, ignore_errors=True)
    os.makedirs(RUN)
    os.makedirs(BASE)
    with open(os.path.join(BASE, "bert_config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)
    with open(os.path.join(BASE, "vocab.txt"), "w") as f:
        f.write("\n".join(VOCAB) + "\n")

    rng = np.random.default_rng(20200)
    values = variables(rng)
    tf.compat.v1.disable_eager_execution()
    with tf.Graph().as_default():
        for name, val in values.items():
            tf.compat.v1.get_variable(name, initializer=val)
            # the optimizer's slots, as google-research/bert's AdamWeightDecayOptimizer names them
            tf.compat.v1.get_variable(name + "/adam_m", initializer=(0.01 * val).astype(np.float32), trainable=False)
            tf.compat.v1.get_variable(name + "/adam_v", initializer=(0.001 * val ** 2).astype(np.float32), trainable=False)
        gs = tf.compat.v1.train.get_or_create_global_step()
        set_step = tf.compat.v1.assign(gs, STEP)
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(set_step)
            prefix = saver.save(sess, os.path.join(RUN, "model.ckpt"), global_step=STEP, write_meta_graph=False)

    # A pre-trained (not fine-tuned) checkpoint, as Google's bert_model.ckpt: no classifier.
    pre = os.path.join(HERE, "pretrained")
    shutil.rmtree(pre, ignore_errors=True)
    os.makedirs(pre)
    with tf.Graph().as_default():
        for name, val in values.items():
            if not name.startswith("output_"):
                tf.compat.v1.get_variable(name, initializer=val)
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            saver.save(sess, os.path.join(pre, "bert_model.ckpt"), write_meta_graph=False)
    os.remove(os.path.join(pre, "checkpoint"))

    reader = tf.train.load_checkpoint(prefix)
    shapes = reader.get_variable_to_shape_map()
    dtypes = reader.get_variable_to_dtype_map()
    ref = {f"value:{n}": reader.get_tensor(n) for n in sorted(shapes)}
    ref["names"] = np.array(sorted(shapes))
    ref["dtypes"] = np.array([dtypes[n].name for n in sorted(shapes)])
    ref["tf_version"] = np.array(tf.__version__)
    np.savez_compressed(os.path.join(HERE, "reference.npz"), **ref)
    print(prefix, len(shapes), "tensors; TensorFlow", tf.__version__)


if __name__ == "__main__":
    main()
