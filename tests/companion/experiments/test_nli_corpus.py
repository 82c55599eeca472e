"""The generated NLI corpus: labels follow from meaning, HANS-like test split, tokenizer."""
from __future__ import annotations

import collections
import random
from dataclasses import replace

import pytest
import torch

from companion.experiments import nli_corpus as nc
from companion.experiments.nli_corpus import NP, Clause, entailment_label as label

SMALL = nc.CorpusSpec(seed=3, n_train=900, n_dev=150, n_test=300, hard_rate=0.05)


@pytest.fixture(scope="module")
def corpus():
    return nc.make_corpus(SMALL)


# --- the independent checker on hand-made cases (so it can be trusted below)

DOC, LAW = NP("doctor"), NP("lawyer")
SAW = Clause(DOC, "seen", LAW)


@pytest.mark.parametrize(
    "premise, hypothesis, expected",
    [
        # attribute drop is entailment, adding one is neutral
        (Clause(NP("doctor", "tall"), "slept"), Clause(DOC, "slept"), "entailment"),
        (Clause(DOC, "slept"), Clause(NP("doctor", "tall"), "slept"), "neutral"),
        # antonym and negation are contradictions
        (Clause(NP("doctor", "tall"), "slept"), Clause(NP("doctor", "short"), "slept"), "contradiction"),
        (SAW, replace(SAW, neg=True), "contradiction"),
        (replace(SAW, neg=True), SAW, "contradiction"),
        # the passive means the same; a swap does not
        (SAW, replace(SAW, passive=True), "entailment"),
        (SAW, Clause(LAW, "seen", DOC), "neutral"),
        # locations: dropping is entailment, adding or changing is neutral
        (replace(SAW, loc="park"), SAW, "entailment"),
        (SAW, replace(SAW, loc="park"), "neutral"),
        (replace(SAW, loc="park"), replace(SAW, loc="market"), "neutral"),
        # negation reverses monotonicity in the location
        (replace(SAW, neg=True), replace(SAW, neg=True, loc="park"), "entailment"),
        (replace(SAW, neg=True, loc="park"), SAW, "neutral"),
        (replace(SAW, neg=True, loc="park"), replace(SAW, neg=True), "neutral"),
        (replace(SAW, loc="park"), replace(SAW, neg=True, loc="park"), "contradiction"),
        # "near" is asserted of the subject only
        (Clause(NP("doctor", near="judge"), "slept"), Clause(DOC, "slept"), "entailment"),
        (Clause(NP("doctor", near="judge"), "slept"), Clause(NP("judge"), "slept"), "neutral"),
        # an adjective is asserted even under negation
        (Clause(NP("doctor", "tall"), "slept", neg=True), Clause(NP("doctor", "short"), "slept"),
         "contradiction"),
        # crossed antonyms: the lawyer being short says nothing of the doctor being short
        (Clause(NP("doctor", "tall"), "seen", NP("lawyer", "short")),
         Clause(NP("doctor", "short"), "seen", LAW), "contradiction"),
        (Clause(DOC, "seen", NP("lawyer", "short")), Clause(NP("doctor", "short"), "seen", LAW),
         "neutral"),
        # a different verb or individual is neutral
        (SAW, replace(SAW, verb="called"), "neutral"),
        (SAW, Clause(NP("judge"), "seen", LAW), "neutral"),
    ],
)
def test_checker_on_hand_made_pairs(premise, hypothesis, expected):
    assert label(premise, hypothesis) == expected


def test_realise_examples():
    assert nc.realise(SAW) == "the doctor has seen the lawyer"
    assert nc.realise(replace(SAW, passive=True, neg=True, loc="station")) == (
        "the lawyer has not been seen by the doctor at the station")
    assert nc.realise(Clause(NP("judge", "old", near="pilot"), "arrived")) == (
        "the old judge near the pilot has arrived")


def test_clause_rejects_bad_forms():
    with pytest.raises(ValueError, match="needs a patient"):
        Clause(DOC, "seen")
    with pytest.raises(ValueError, match="takes no patient"):
        Clause(DOC, "slept", LAW)
    with pytest.raises(ValueError, match="unknown verb"):
        Clause(DOC, "ate", LAW)
    with pytest.raises(ValueError, match="surface subject"):
        Clause(DOC, "seen", NP("lawyer", near="judge"))


# --- the generator: every template's label is the checker's label


@pytest.mark.parametrize("template", [t.name for t in nc.TEMPLATES])
def test_template_labels_follow_from_meaning(template):
    t = nc.TEMPLATE[template]
    rng = random.Random(f"test-{template}")
    for _ in range(40):
        p, h = t.build(rng)
        assert label(p, h) == t.label, (template, nc.realise(p), nc.realise(h))


def test_corpus_labels_follow_from_meaning(corpus):
    for split, exs in corpus.items():
        for e in exs:
            assert nc.LABELS[e.label] == label(e.premise_form, e.hypothesis_form), (split, e)
            assert e.premise == nc.realise(e.premise_form)
            assert e.hypothesis == nc.realise(e.hypothesis_form)


def test_corpus_is_deterministic_and_seeded(corpus):
    again = nc.make_corpus(SMALL)
    assert {k: [(e.premise, e.hypothesis, e.label) for e in v] for k, v in corpus.items()} == \
        {k: [(e.premise, e.hypothesis, e.label) for e in v] for k, v in again.items()}
    other = nc.make_corpus(replace(SMALL, seed=4))
    assert [e.premise for e in other["train"][:50]] != [e.premise for e in corpus["train"][:50]]


def test_splits_sizes_disjoint_and_balanced(corpus):
    assert [len(corpus[s]) for s in ("train", "dev", "test")] == [900, 150, 300]
    keys = {s: {(e.premise, e.hypothesis) for e in v} for s, v in corpus.items()}
    assert all(len(keys[s]) == len(corpus[s]) for s in keys)  # no duplicates
    assert not keys["train"] & keys["dev"] and not keys["train"] & keys["test"]
    assert not keys["dev"] & keys["test"]
    for s, exs in corpus.items():
        counts = collections.Counter(e.label for e in exs)
        assert max(counts.values()) - min(counts.values()) <= 1, (s, counts)


def test_hard_rate_controls_hard_pairs():
    for rate in (0.0, 0.3):
        exs = nc.generate(1500, 0, nc.TRAIN_WEIGHTS, hard_rate=rate, desc="x")
        non_ent = [e for e in exs if e.label != 0]
        frac = sum(nc.TEMPLATE[e.template].hard for e in non_ent) / len(non_ent)
        assert abs(frac - rate) < 0.05, (rate, frac)


# --- the HANS-like property


def test_test_split_has_full_overlap_and_balanced_labels(corpus):
    for e in corpus["test"]:
        assert nc.overlap(e.premise, e.hypothesis) == 1.0, e
    assert {nc.TEMPLATE[e.template].full_overlap for e in corpus["test"]} == {True}


def test_overlap_heuristic_works_on_train_not_on_test(corpus):
    h = nc.overlap_heuristic(corpus["train"])
    # in training, full overlap mostly means entailment
    assert nc.accuracy(h, corpus["train"], binary=True) > 0.8
    assert nc.accuracy(h, corpus["dev"], binary=True) > 0.8
    assert nc.accuracy(h, corpus["train"]) > 0.5  # well above the 1/3 of chance
    # on the test split it predicts entailment everywhere: chance, 1/3
    assert nc.accuracy(h, corpus["test"]) == pytest.approx(1 / 3, abs=0.01)
    # and a reasoner that knows the labels is not fooled (sanity of accuracy())
    assert nc.accuracy(lambda e: e.label, corpus["test"]) == 1.0


def test_overlap():
    assert nc.overlap("the doctor has slept", "the doctor has slept") == 1.0
    assert nc.overlap("the doctor has slept", "the tall doctor has slept") == pytest.approx(4 / 5)


def test_generate_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown templates"):
        nc.generate(3, 0, {"nope": 1.0})
    with pytest.raises(ValueError, match="hard_rate"):
        nc.generate(3, 0, nc.TRAIN_WEIGHTS, hard_rate=1.5)
    with pytest.raises(ValueError, match="no template"):
        nc.generate(3, 0, {"swap": 1.0})


# --- vocabulary and tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, corpus):
    d = nc.save_corpus(corpus, tmp_path_factory.mktemp("corpus"))
    return nc.make_tokenizer(d / "vocab.txt")


def test_tokenizer_is_a_real_bert_tokenizer_from_vocab_txt(tokenizer, corpus):
    from transformers import BertTokenizerFast

    assert isinstance(tokenizer, BertTokenizerFast)
    assert tokenizer.convert_ids_to_tokens(list(range(len(nc.SPECIAL_TOKENS)))) == list(nc.SPECIAL_TOKENS)
    words = {w for exs in corpus.values() for e in exs for w in (e.premise + " " + e.hypothesis).split()}
    assert words <= set(nc.vocabulary())


def test_tokenizer_round_trip_and_format(tokenizer, corpus):
    exs = corpus["train"][:200] + corpus["test"][:100]
    inputs, labels = nc.encode(tokenizer, exs, max_length=40)
    assert inputs["input_ids"].shape == (300, 40)
    assert torch.equal(labels, torch.tensor([e.label for e in exs]))
    for row, tt, e in zip(inputs["input_ids"], inputs["token_type_ids"], exs):
        toks = tokenizer.convert_ids_to_tokens(row.tolist())
        p, h = e.premise.split(), e.hypothesis.split()
        n = 3 + len(p) + len(h)
        # one token per word: [CLS] premise [SEP] hypothesis [SEP] then padding
        assert toks[:n] == ["[CLS]", *p, "[SEP]", *h, "[SEP]"]
        assert set(toks[n:]) <= {"[PAD]"}
        assert tt[:n].tolist() == [0] * (len(p) + 2) + [1] * (len(h) + 1)
        assert tokenizer.decode(row, skip_special_tokens=True) == e.premise + " " + e.hypothesis


def test_pairs_fit_in_40_tokens(tokenizer, corpus):
    for exs in corpus.values():
        inputs, _ = nc.encode(tokenizer, exs, max_length=40)
        assert int(inputs["attention_mask"].sum(1).max()) <= 40


def test_encode_rejects_unknown_words_and_long_pairs(tokenizer):
    with pytest.raises(ValueError, match="unknown words"):
        nc.encode(tokenizer, [{"premise": "the cat has slept", "hypothesis": "the cat has slept",
                               "label": 0}])
    with pytest.raises(ValueError, match="longer than"):
        nc.encode(tokenizer, [{"premise": "the doctor has slept", "hypothesis": "the doctor has slept",
                               "label": 0}], max_length=6)


def test_make_tokenizer_needs_vocab_txt(tmp_path):
    with pytest.raises(FileNotFoundError):
        nc.make_tokenizer(tmp_path / "vocab.txt")


# --- the in-distribution dev split (the gap the paper uses) and reproducibility


def _expected_template_probs(weights, hard_rate):
    """Template probabilities of the training distribution, from the weights by hand: labels
    1/3 each; entailment by weight; within neutral/contradiction, the hard templates share
    ``hard_rate`` and the others ``1 - hard_rate``, each in proportion to its weight."""
    probs = {}
    for label in nc.LABELS:
        ts = [t for t in nc.TEMPLATES if t.label == label and weights.get(t.name, 0) > 0]
        groups = [ts] if label == "entailment" else [[t for t in ts if not t.hard], [t for t in ts if t.hard]]
        shares = [1.0] if label == "entailment" else [1 - hard_rate, hard_rate]
        for group, share in zip(groups, shares):
            total = sum(weights[t.name] for t in group)
            for t in group:
                probs[t.name] = share * weights[t.name] / total / 3
    return probs


def test_dev_split_has_the_training_distribution():
    from scipy import stats

    spec = nc.CorpusSpec(seed=5, n_train=1500, n_dev=1500, n_test=0, hard_rate=0.1)
    c = nc.make_corpus(spec)
    probs = _expected_template_probs(nc.TRAIN_WEIGHTS, spec.hard_rate)
    assert sum(probs.values()) == pytest.approx(1.0)
    # hard templates pooled per label, so every expected count is >= 5
    def cat(name):
        t = nc.TEMPLATE[name]
        return f"hard-{t.label}" if t.hard else name
    exp = collections.Counter()
    for name, p in probs.items():
        exp[cat(name)] += p
    keys = sorted(exp)
    for split in ("train", "dev"):
        obs = collections.Counter(cat(e.template) for e in c[split])
        f_obs = [obs[k] for k in keys]
        f_exp = [exp[k] * len(c[split]) for k in keys]
        assert min(f_exp) >= 5
        assert stats.chisquare(f_obs, f_exp).pvalue > 1e-3, split
    # and dev is not the HANS-like distribution: few full-overlap non-entailments
    hard = sum(nc.TEMPLATE[e.template].hard for e in c["dev"]) / len(c["dev"])
    assert hard == pytest.approx(2 / 3 * spec.hard_rate, abs=0.03)


def test_corpus_does_not_depend_on_the_hash_seed():
    """Set and dict iteration order is the usual hidden source of irreproducibility:
    the corpus built in two processes with different PYTHONHASHSEED is byte-identical."""
    import os
    import subprocess
    import sys

    code = ("import hashlib, json; from companion.experiments import nli_corpus as nc; "
            "c = nc.make_corpus(nc.CorpusSpec(seed=2, n_train=300, n_dev=60, n_test=90)); "
            "print(hashlib.sha256(json.dumps({k: [e.to_json() for e in v] for k, v in c.items()}, "
            "default=str).encode()).hexdigest())")
    digests = set()
    for hs in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hs}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        digests.add(out.stdout.strip())
    assert len(digests) == 1 and len(digests.pop()) == 64
