"""MNLI from GLUE TSV and MultiNLI JSONL files (tiny ones written here), tokenised batches."""
import json
import shutil

import numpy as np
import pytest
import torch

from companion.assets import AssetError, MissingAssetsError
from companion.assets.bert_mcoy import load_mccoy_bert, mccoy_tokenizer
from companion.assets.mnli import (LABELS, iter_batches, load_mnli, mnli_sharpness_batches, read_pairs)
from tests import ROOT

FIX = ROOT / "tests" / "data" / "mccoy_bert_tiny"

# (premise, hypothesis, gold label); the quote characters must survive (GLUE's TSV is unquoted)
TRAIN = [
    ("The man is sleeping.", "The man is not sleeping.", "contradiction"),
    ('A woman said "run" in the park.', "A woman is in the park.", "entailment"),
    ("The dog sat on the mat.", "The dog is happy.", "neutral"),
    ("The cat runs.", "A cat sleeps.", "contradiction"),
    ("A man saw the dog.", "The man saw a dog.", "entailment"),
    ("The woman sleeps in the park.", "The woman is happy.", "neutral"),
    ("Cats are sleeping.", "Cats are running.", "contradiction"),
    ("The man and the woman sat.", "The man sat.", "entailment"),
    ("A dog runs in the park.", "The dog is happy.", "neutral"),
    ("The cats sat on the mat.", "The cats are not on the mat.", "contradiction"),
    ("the man who saw the cat runs .", "the cat runs .", "neutral"),
]
DEV = [
    ("The woman runs.", "The woman is running.", "entailment"),
    ("The dog sleeps.", "The dog runs.", "contradiction"),
    ("Nobody agrees here.", "No majority label.", "-"),  # JSONL only: no gold label, skipped
]
TRAIN_HEADER = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
                "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1", "gold_label"]
DEV_HEADER = TRAIN_HEADER[:-1] + ["label2", "label3", "label4", "label5", "gold_label"]


def write_tsv(path, header, rows):
    lines = ["\t".join(header)]
    for n, (p, h, lab) in enumerate(rows):
        parse = lambda s: "( " + s + " )"
        cols = [str(n), str(1000 + n), f"{1000 + n}{lab[0]}", "fiction", parse(p), parse(h), parse(p), parse(h), p, h]
        cols += [lab] * (len(header) - len(cols))
        lines.append("\t".join(cols))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for n, (p, h, lab) in enumerate(rows):
            f.write(json.dumps({"annotator_labels": [lab], "genre": "fiction", "gold_label": lab,
                                "pairID": f"{1000 + n}{lab[0]}", "promptID": str(1000 + n),
                                "sentence1": p, "sentence1_binary_parse": "", "sentence1_parse": "",
                                "sentence2": h, "sentence2_binary_parse": "", "sentence2_parse": ""}) + "\n")


@pytest.fixture()
def roots(tmp_path):
    tsv, jsonl = tmp_path / "tsv", tmp_path / "jsonl"
    (tsv / "mnli").mkdir(parents=True)
    (jsonl / "mnli").mkdir(parents=True)
    write_tsv(tsv / "mnli" / "train.tsv", TRAIN_HEADER, TRAIN)
    write_tsv(tsv / "mnli" / "dev_matched.tsv", DEV_HEADER, DEV[:2])  # GLUE dropped the "-" pairs
    write_jsonl(jsonl / "mnli" / "multinli_1.0_train.jsonl", TRAIN)
    write_jsonl(jsonl / "mnli" / "multinli_1.0_dev_matched.jsonl", DEV)
    return tsv, jsonl


def test_both_formats_give_the_same_pairs_in_mccoys_label_order(roots):
    tsv, jsonl = roots
    a, b = load_mnli(tsv), load_mnli(jsonl)
    assert (a.source, b.source) == ("tsv", "jsonl")
    for data in (a, b):
        assert [(p.premise, p.hypothesis, LABELS[p.label]) for p in data.train] == TRAIN
        assert [(p.premise, p.hypothesis, LABELS[p.label]) for p in data.dev_matched] == DEV[:2]
    assert a.train[0].label == 0 and a.train[1].label == 1 and a.train[2].label == 2
    assert a.train[1].premise == 'A woman said "run" in the park.'


def test_missing_and_malformed_files(roots, tmp_path):
    tsv, _ = roots
    with pytest.raises(MissingAssetsError, match="either \\(GLUE TSV\\)"):
        load_mnli(tmp_path / "nothing")
    bad = tmp_path / "bad.tsv"
    write_tsv(bad, TRAIN_HEADER, [("a", "b", "maybe")])
    with pytest.raises(AssetError, match="unknown label 'maybe'"):
        read_pairs(bad)
    ragged = tmp_path / "ragged.tsv"
    ragged.write_text("\t".join(TRAIN_HEADER) + "\n0\tonly three\tcolumns\n")
    with pytest.raises(AssetError, match="3 columns, the header has 12"):
        read_pairs(ragged)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"sentence1": "a"}\n')
    with pytest.raises(AssetError, match="not a MultiNLI record"):
        read_pairs(broken)


def test_sharpness_batches_are_deterministic_and_tokenised_like_run_classifier(roots):
    tsv, _ = roots
    data = load_mnli(tsv)
    tok = mccoy_tokenizer(FIX)
    batches = mnli_sharpness_batches(data.train, tok, n_pairs=10, batch_size=4, seed=0)
    assert [len(y) for _, y in batches] == [4, 4, 2]
    again = mnli_sharpness_batches(data.train, tok, n_pairs=10, batch_size=4, seed=0)
    for (x1, y1), (x2, y2) in zip(batches, again):
        assert torch.equal(y1, y2) and all(torch.equal(x1[k], x2[k]) for k in x1)
    other = mnli_sharpness_batches(data.train, tok, n_pairs=10, batch_size=4, seed=1)
    assert not all(torch.equal(a[0]["input_ids"], b[0]["input_ids"]) for a, b in zip(batches, other))
    idx = np.random.default_rng(0).choice(len(data.train), size=10, replace=False)
    assert torch.cat([y for _, y in batches]).tolist() == [data.train[i].label for i in idx]
    x, _ = batches[0]
    assert set(x) == {"input_ids", "token_type_ids", "attention_mask"}
    assert x["input_ids"].shape == (4, 128)  # padded to max_seq_length, as run_classifier.py
    first = data.train[idx[0]]
    n = int(x["attention_mask"][0].sum())
    tokens = tok.convert_ids_to_tokens(x["input_ids"][0, :n].tolist())
    sep = tokens.index("[SEP]")
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]"
    assert tokens[1:sep] == tok.tokenize(first.premise) and tokens[sep + 1:-1] == tok.tokenize(first.hypothesis)
    assert x["token_type_ids"][0, :n].tolist() == [0] * (sep + 1) + [1] * (n - sep - 1)
    assert x["token_type_ids"][0, n:].eq(0).all() and x["input_ids"][0, n:].eq(0).all()
    with pytest.raises(ValueError, match="between 1 and 11"):
        mnli_sharpness_batches(data.train, tok, n_pairs=12)


def test_long_pairs_are_truncated_longer_first():
    tok = mccoy_tokenizer(FIX)
    from companion.assets.mnli import NLIPair, encode

    long = NLIPair("the man " * 100, "a dog runs .", 1)
    x, _ = encode([long], tok, max_seq_length=16)
    tokens = tok.convert_ids_to_tokens(x["input_ids"][0].tolist())
    assert len(tokens) == 16 and x["attention_mask"].sum() == 16
    # 13 places for words: the hypothesis (4 tokens) is kept whole, the premise cut to 9
    assert tokens == ["[CLS]"] + ["the", "man"] * 4 + ["the", "[SEP]", "a", "dog", "runs", ".", "[SEP]"]


def test_batches_run_through_a_converted_mccoy_bert(roots):
    tsv, _ = roots
    data = load_mnli(tsv)
    tok = mccoy_tokenizer(FIX)
    model = load_mccoy_bert(0, root=FIX)
    batches = list(iter_batches(data.dev_matched, tok, batch_size=8))
    assert len(batches) == 1
    x, y = batches[0]
    with torch.no_grad():
        out = model(**x).logits
    assert out.shape == (2, 3) and torch.isfinite(out).all() and y.tolist() == [1, 0]
