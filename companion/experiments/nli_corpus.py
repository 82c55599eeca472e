"""A generated premise/hypothesis corpus with three labels, in the spirit of MNLI and HANS.

The paper measures sharpness on BERT fine-tunes of MNLI (McCoy et al., 2020).
MNLI cannot be downloaded here, so the ``cpu`` profile trains its own BERTs on
this corpus instead.

Every pair is built from a small logical form (:class:`Clause`), then realised
as English. Sentences use the perfect aspect ("has seen", "has not seen", "has
been seen by"), so that the passive of a premise and a negated premise with
"not" removed are both built from the premise's own words: that is what makes
high-overlap pairs of every label possible.

Labels are assigned by the template that built the pair, and can be re-derived
independently by :func:`entailment_label`, which checks the two logical forms
against every possible world (a brute-force model checker). The tests check
that the two always agree.

Splits
------
``train`` / ``dev``
    The training distribution. As in MNLI, a hypothesis made only of premise
    words is mostly an entailment: non-entailed pairs with full word overlap
    (subject/object swaps, passive swaps, "near"-subsequences, dropped
    negations, crossed antonyms) are rare, a fraction ``hard_rate`` of the
    neutral and contradiction pairs.
``test``
    In the spirit of HANS (McCoy, Pavlick & Linzen, 2019): every hypothesis is
    made only of premise words, and the three labels are balanced. A model that
    relies on lexical overlap predicts "entailment" everywhere and scores 1/3.
"""
from __future__ import annotations

import itertools
import json
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Sequence

LABELS: tuple[str, ...] = ("entailment", "neutral", "contradiction")
LABEL_ID = {name: i for i, name in enumerate(LABELS)}

NOUNS: tuple[str, ...] = (
    "doctor", "lawyer", "artist", "student", "farmer", "senator",
    "baker", "pilot", "teacher", "actor", "banker", "judge",
)
ANTONYMS: tuple[tuple[str, str], ...] = (
    ("tall", "short"), ("young", "old"), ("happy", "sad"), ("rich", "poor"),
)
ADJECTIVES: tuple[str, ...] = tuple(a for pair in ANTONYMS for a in pair)
ANTONYM = {a: b for x, y in ANTONYMS for a, b in ((x, y), (y, x))}
# past participles (the perfect aspect: "has seen", "has been seen by")
TRANSITIVE: tuple[str, ...] = (
    "seen", "helped", "called", "paid", "visited", "thanked", "followed", "praised",
)
INTRANSITIVE: tuple[str, ...] = ("slept", "laughed", "waited", "arrived", "danced", "smiled")
LOCATIONS: dict[str, str] = {"park": "in", "station": "at", "library": "in", "market": "at"}
FUNCTION_WORDS: tuple[str, ...] = ("the", "has", "not", "been", "by", "near", "in", "at")
SPECIAL_TOKENS: tuple[str, ...] = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def vocabulary() -> list[str]:
    """The word-level vocabulary: special tokens first, then every word, sorted."""
    words = set(NOUNS) | set(ADJECTIVES) | set(TRANSITIVE) | set(INTRANSITIVE)
    words |= set(LOCATIONS) | set(FUNCTION_WORDS)
    return list(SPECIAL_TOKENS) + sorted(words)


# ----------------------------------------------------------------------------
# logical forms and their realisation


@dataclass(frozen=True)
class NP:
    """A definite noun phrase: "the [adj] noun [near the other]".

    A noun names one individual, whatever its modifiers; the adjective and the
    "near" relation are asserted of it.
    """

    noun: str
    adj: str | None = None
    near: str | None = None


@dataclass(frozen=True)
class Clause:
    """One event statement. ``patient is None`` for intransitive verbs.

    ``passive`` only changes the surface form (the patient becomes the subject);
    ``loc`` restricts where the event happened; ``neg`` negates the event (the
    noun-phrase modifiers stay asserted).
    """

    agent: NP
    verb: str
    patient: NP | None = None
    loc: str | None = None
    neg: bool = False
    passive: bool = False

    def __post_init__(self) -> None:
        if self.verb in TRANSITIVE and self.patient is None:
            raise ValueError(f"transitive verb {self.verb!r} needs a patient")
        if self.verb in INTRANSITIVE and self.patient is not None:
            raise ValueError(f"intransitive verb {self.verb!r} takes no patient")
        if self.verb not in TRANSITIVE and self.verb not in INTRANSITIVE:
            raise ValueError(f"unknown verb {self.verb!r}")
        if self.passive and self.patient is None:
            raise ValueError("only transitive clauses have a passive")
        if self.loc is not None and self.loc not in LOCATIONS:
            raise ValueError(f"unknown location {self.loc!r}")
        if self.object_np is not None and self.object_np.near is not None:
            raise ValueError("'near' may only modify the surface subject")

    @property
    def subject_np(self) -> NP:
        return self.patient if self.passive else self.agent  # type: ignore[return-value]

    @property
    def object_np(self) -> NP | None:
        if self.patient is None:
            return None
        return self.agent if self.passive else self.patient

    def nps(self) -> list[NP]:
        return [self.agent] + ([self.patient] if self.patient is not None else [])


def _np_words(np_: NP) -> list[str]:
    words = ["the"] + ([np_.adj] if np_.adj else []) + [np_.noun]
    if np_.near:
        words += ["near", "the", np_.near]
    return words


def realise(c: Clause) -> str:
    """The English sentence of a clause (lower case, space separated)."""
    aux = ["has"] + (["not"] if c.neg else [])
    if c.patient is None:
        words = _np_words(c.agent) + aux + [c.verb]
    elif not c.passive:
        words = _np_words(c.agent) + aux + [c.verb] + _np_words(c.patient)
    else:
        words = _np_words(c.patient) + aux + ["been", c.verb, "by"] + _np_words(c.agent)
    if c.loc:
        words += [LOCATIONS[c.loc], "the", c.loc]
    return " ".join(words)


# ----------------------------------------------------------------------------
# the independent label: model checking over all worlds

_OTHER_PLACE = "<elsewhere>"


def _atoms(clauses: Sequence[Clause]):
    """Atoms needed to evaluate the clauses, grouped so each group is enumerated jointly."""
    dims: set[tuple[str, tuple[str, str]]] = set()  # (entity, antonym pair)
    nears: set[tuple[str, str]] = set()
    events: set[tuple[str, str, str | None]] = set()
    places = {_OTHER_PLACE}
    for c in clauses:
        for np_ in c.nps():
            if np_.adj:
                dims.add((np_.noun, tuple(sorted((np_.adj, ANTONYM[np_.adj])))))
            if np_.near:
                nears.add((np_.noun, np_.near))
        events.add((c.verb, c.agent.noun, c.patient.noun if c.patient else None))
        if c.loc:
            places.add(c.loc)
    event_atoms = sorted((e + (p,) for e in events for p in places), key=str)
    return sorted(dims), sorted(nears), event_atoms


def _holds(c: Clause, props: dict, near: dict, facts: dict) -> bool:
    for np_ in c.nps():
        if np_.adj and not props[(np_.noun, np_.adj)]:
            return False
        if np_.near and not near[(np_.noun, np_.near)]:
            return False
    key = (c.verb, c.agent.noun, c.patient.noun if c.patient else None)
    if c.loc is None:
        happened = any(v for (vb, a, p, _), v in facts.items() if (vb, a, p) == key)
    else:
        happened = facts[key + (c.loc,)]
    return happened != c.neg


def worlds(clauses: Sequence[Clause]) -> Iterable[tuple[dict, dict, dict]]:
    """Every assignment of the relevant atoms, respecting antonymy.

    For each (individual, antonym pair) an individual is one of the two, or
    neither; "near" facts and events at each mentioned place (or elsewhere) are
    free booleans.
    """
    dims, nears, events = _atoms(clauses)
    dim_states = [(True, False), (False, True), (False, False)]
    for dstate in itertools.product(dim_states, repeat=len(dims)):
        props = {}
        for (ent, (a, b)), (va, vb) in zip(dims, dstate):
            props[(ent, a)], props[(ent, b)] = va, vb
        for nstate in itertools.product((False, True), repeat=len(nears)):
            near = dict(zip(nears, nstate))
            for estate in itertools.product((False, True), repeat=len(events)):
                yield props, near, dict(zip(events, estate))


def entailment_label(premise: Clause, hypothesis: Clause) -> str:
    """The label that follows from the meaning of the two clauses.

    Entailment if the hypothesis holds in every world where the premise holds,
    contradiction if it holds in none, neutral otherwise.
    """
    seen_true = seen_false = False
    for props, near, facts in worlds([premise, hypothesis]):
        if not _holds(premise, props, near, facts):
            continue
        if _holds(hypothesis, props, near, facts):
            seen_true = True
        else:
            seen_false = True
        if seen_true and seen_false:
            return "neutral"
    if not (seen_true or seen_false):
        raise ValueError(f"premise is unsatisfiable: {realise(premise)!r}")
    return "entailment" if seen_true else "contradiction"


# ----------------------------------------------------------------------------
# templates: each builds a (premise, hypothesis) pair whose label is known by
# construction. ``hard`` templates give full lexical overlap but no entailment.


@dataclass(frozen=True)
class Template:
    name: str
    label: str
    build: Callable[[random.Random], tuple[Clause, Clause]]
    hard: bool = False  # full overlap, not entailment (HANS-like)
    full_overlap: bool = False  # hypothesis words are always premise words


def _nouns(rng: random.Random, k: int) -> list[str]:
    return rng.sample(NOUNS, k)


def _maybe(rng: random.Random, p: float, value):
    return value if rng.random() < p else None


def _adj(rng: random.Random) -> str:
    return rng.choice(ADJECTIVES)


def _clause(rng: random.Random, *, transitive: bool | None = None, adj_p: float = 0.4,
            loc_p: float = 0.3, near_p: float = 0.0, neg: bool = False,
            passive: bool | None = None) -> Clause:
    """A random clause; nouns are distinct individuals."""
    if transitive is None:
        transitive = rng.random() < 0.65
    a, p, n = _nouns(rng, 3)
    if passive is None:
        passive = transitive and rng.random() < 0.3
    agent = NP(a, _maybe(rng, adj_p, _adj(rng)))
    patient = NP(p, _maybe(rng, adj_p, _adj(rng))) if transitive else None
    verb = rng.choice(TRANSITIVE if transitive else INTRANSITIVE)
    near = n if rng.random() < near_p else None
    if near is not None:
        if passive:
            patient = replace(patient, near=near)  # type: ignore[arg-type]
        else:
            agent = replace(agent, near=near)
    return Clause(agent, verb, patient, _maybe(rng, loc_p, rng.choice(sorted(LOCATIONS))),
                  neg, passive)


def _with_adj(c: Clause, rng: random.Random) -> Clause:
    """``c`` with an adjective on at least one noun phrase."""
    nps = c.nps()
    i = rng.randrange(len(nps))
    new = replace(nps[i], adj=nps[i].adj or _adj(rng))
    return replace(c, agent=new) if i == 0 else replace(c, patient=new)


def _drop_adjs(c: Clause, rng: random.Random) -> Clause:
    """Drop at least one adjective (``c`` must carry one)."""
    idx = [i for i, np_ in enumerate(c.nps()) if np_.adj]
    keep_any = rng.random() < 0.3 and len(idx) > 1
    drop = [rng.choice(idx)] if keep_any else idx
    agent, patient = c.agent, c.patient
    if 0 in drop:
        agent = replace(agent, adj=None)
    if 1 in drop:
        patient = replace(patient, adj=None)  # type: ignore[arg-type]
    return replace(c, agent=agent, patient=patient)


def _drop_near(c: Clause) -> Clause:
    return replace(c, agent=replace(c.agent, near=None),
                   patient=replace(c.patient, near=None) if c.patient else None)


def _flip_voice(c: Clause) -> Clause:
    """Active <-> passive; a "near" stays on whichever NP it modifies only if it is the new subject."""
    c = _drop_near(c) if c.subject_np.near else c
    return replace(c, passive=not c.passive)


# --- entailment


def _t_adj_drop(rng):
    p = _with_adj(_clause(rng, near_p=0.2, neg=rng.random() < 0.25), rng)
    return p, _drop_adjs(p, rng)


def _t_loc_drop(rng):
    p = _clause(rng, near_p=0.1)
    p = replace(p, loc=p.loc or rng.choice(sorted(LOCATIONS)))
    h = replace(p, loc=None)
    return p, (_drop_adjs(h, rng) if any(n.adj for n in h.nps()) and rng.random() < 0.3 else h)


def _t_near_drop(rng):
    p = _clause(rng, near_p=1.0, neg=rng.random() < 0.25)
    return p, _drop_near(p)


def _t_passive_to_active(rng):
    p = _clause(rng, transitive=True, passive=True, near_p=0.0, neg=rng.random() < 0.25)
    return p, replace(p, passive=False)


def _t_active_to_passive(rng):
    p = _clause(rng, transitive=True, passive=False, near_p=0.0, neg=rng.random() < 0.25)
    return p, replace(p, passive=True)


def _t_neg_add_loc(rng):
    """Not at all => not there (the negation reverses monotonicity)."""
    p = replace(_clause(rng, neg=True), loc=None)
    return p, replace(p, loc=rng.choice(sorted(LOCATIONS)))


# --- neutral


def _t_add_adj(rng):
    p = _clause(rng, adj_p=0.0, near_p=0.1, neg=rng.random() < 0.2)
    return p, _with_adj(p, rng)


def _t_add_loc(rng):
    p = replace(_clause(rng, near_p=0.1), loc=None)
    return p, replace(p, loc=rng.choice(sorted(LOCATIONS)))


def _t_change_loc(rng):
    p = _clause(rng)
    loc = p.loc or rng.choice(sorted(LOCATIONS))
    other = rng.choice([x for x in sorted(LOCATIONS) if x != loc])
    return replace(p, loc=loc), replace(p, loc=other)


def _t_other_verb(rng):
    p = _clause(rng, near_p=0.1)
    verbs = TRANSITIVE if p.patient is not None else INTRANSITIVE
    h = replace(p, verb=rng.choice([v for v in verbs if v != p.verb]), neg=rng.random() < 0.3)
    return p, replace(h, loc=None) if h.neg else h


def _t_other_entity(rng):
    p = _clause(rng, near_p=0.1)
    used = {np_.noun for np_ in p.nps()} | {np_.near for np_ in p.nps() if np_.near}
    other = rng.choice([n for n in NOUNS if n not in used])
    h = replace(_drop_near(p), agent=NP(other, _maybe(rng, 0.3, _adj(rng))))
    return p, h


def _t_swap(rng):
    """Subject/object swap (HANS lexical overlap)."""
    p = _clause(rng, transitive=True, near_p=0.0, neg=rng.random() < 0.2)
    return p, replace(p, agent=p.patient, patient=p.agent)


def _t_subsequence(rng):
    """"the X near the Y has slept" -> "the Y has slept" (HANS subsequence)."""
    p = _clause(rng, near_p=1.0, neg=rng.random() < 0.2)
    subj = p.subject_np
    new_subj = NP(subj.near)  # type: ignore[arg-type]
    h = replace(p, patient=new_subj) if p.passive else replace(p, agent=new_subj)
    return p, h


def _t_neg_loc_drop(rng):
    """"has not slept in the park" -> "has slept": maybe somewhere else."""
    p = _clause(rng, neg=True, near_p=0.1)
    p = replace(p, loc=p.loc or rng.choice(sorted(LOCATIONS)))
    return p, replace(p, neg=False, loc=None)


# --- contradiction


def _t_negate(rng):
    p = _clause(rng, near_p=0.1)
    h = replace(p, neg=True, loc=p.loc if rng.random() < 0.5 else None)
    if h.patient is not None and rng.random() < 0.3:
        h = _flip_voice(h)
    return p, h


def _t_antonym(rng):
    p = _with_adj(_clause(rng, near_p=0.1, neg=rng.random() < 0.2), rng)
    idx = [i for i, np_ in enumerate(p.nps()) if np_.adj]
    i = rng.choice(idx)
    np_ = p.nps()[i]
    new = replace(np_, adj=ANTONYM[np_.adj])  # type: ignore[index]
    h = replace(p, agent=new) if i == 0 else replace(p, patient=new)
    return p, h


def _t_neg_drop(rng):
    """"has not seen" -> "has seen" (full overlap)."""
    p = replace(_clause(rng, neg=True, near_p=0.15), loc=None)
    h = replace(p, neg=False)
    if any(n.adj for n in h.nps()) and rng.random() < 0.3:
        h = _drop_adjs(h, rng)
    return p, h


def _t_crossed_antonym(rng):
    """"the tall X has seen the short Y" -> "the short X has seen the Y"."""
    p = _clause(rng, transitive=True, near_p=0.0, neg=rng.random() < 0.2)
    a = _adj(rng)
    p = replace(p, agent=replace(p.agent, adj=a), patient=replace(p.patient, adj=ANTONYM[a]))
    if rng.random() < 0.5:  # give the patient the agent's antonym
        h = replace(p, agent=replace(p.agent, adj=None), patient=replace(p.patient, adj=a))
    else:
        h = replace(p, agent=replace(p.agent, adj=ANTONYM[a]), patient=replace(p.patient, adj=None))
    return p, h


TEMPLATES: tuple[Template, ...] = (
    Template("adj_drop", "entailment", _t_adj_drop, full_overlap=True),
    Template("loc_drop", "entailment", _t_loc_drop, full_overlap=True),
    Template("near_drop", "entailment", _t_near_drop, full_overlap=True),
    Template("passive_to_active", "entailment", _t_passive_to_active, full_overlap=True),
    Template("active_to_passive", "entailment", _t_active_to_passive),
    Template("neg_add_loc", "entailment", _t_neg_add_loc),
    Template("add_adj", "neutral", _t_add_adj),
    Template("add_loc", "neutral", _t_add_loc),
    Template("change_loc", "neutral", _t_change_loc),
    Template("other_verb", "neutral", _t_other_verb),
    Template("other_entity", "neutral", _t_other_entity),
    Template("swap", "neutral", _t_swap, hard=True, full_overlap=True),
    Template("subsequence", "neutral", _t_subsequence, hard=True, full_overlap=True),
    Template("neg_loc_drop", "neutral", _t_neg_loc_drop, hard=True, full_overlap=True),
    Template("negate", "contradiction", _t_negate),
    Template("antonym", "contradiction", _t_antonym),
    Template("neg_drop", "contradiction", _t_neg_drop, hard=True, full_overlap=True),
    Template("crossed_antonym", "contradiction", _t_crossed_antonym, hard=True, full_overlap=True),
)
TEMPLATE = {t.name: t for t in TEMPLATES}

# relative weights within a label for the training distribution
TRAIN_WEIGHTS: dict[str, float] = {
    "adj_drop": 3, "loc_drop": 3, "near_drop": 2, "passive_to_active": 2,
    "active_to_passive": 2, "neg_add_loc": 1,
    "add_adj": 3, "add_loc": 3, "change_loc": 2, "other_verb": 3, "other_entity": 3,
    "swap": 1, "subsequence": 1, "neg_loc_drop": 1,
    "negate": 3, "antonym": 3, "neg_drop": 1, "crossed_antonym": 1,
}
# HANS-like test: full-overlap templates only, labels balanced
TEST_WEIGHTS: dict[str, float] = {
    "adj_drop": 1, "loc_drop": 1, "near_drop": 1, "passive_to_active": 1,
    "swap": 1, "subsequence": 1, "neg_loc_drop": 1,
    "neg_drop": 1, "crossed_antonym": 1,
}


# ----------------------------------------------------------------------------
# examples and splits


@dataclass(frozen=True)
class Example:
    premise: str
    hypothesis: str
    label: int
    template: str
    premise_form: Clause
    hypothesis_form: Clause

    @property
    def label_name(self) -> str:
        return LABELS[self.label]

    def to_json(self) -> dict:
        d = asdict(self)
        d["label_name"] = self.label_name
        return d


def overlap(premise: str, hypothesis: str) -> float:
    """Fraction of hypothesis words (tokens) that occur in the premise."""
    pw, hw = set(premise.split()), hypothesis.split()
    return sum(w in pw for w in hw) / len(hw)


def _sample(rng: random.Random, template: Template, max_tries: int = 50) -> Example:
    for _ in range(max_tries):
        p, h = template.build(rng)
        ps, hs = realise(p), realise(h)
        if ps == hs:
            continue
        if template.full_overlap and overlap(ps, hs) < 1.0:
            continue
        return Example(ps, hs, LABEL_ID[template.label], template.name, p, h)
    raise RuntimeError(f"template {template.name!r} failed to produce a valid pair")


def generate(n: int, seed: int, weights: dict[str, float], *,
             hard_rate: float | None = None, exclude: set[tuple[str, str]] | None = None,
             desc: str = "") -> list[Example]:
    """``n`` pairs, labels balanced (round robin), templates drawn by ``weights``.

    If ``hard_rate`` is given, within neutral and contradiction a fraction
    ``hard_rate`` of the pairs come from the hard (full-overlap, not entailed)
    templates and the rest from the others; otherwise ``weights`` alone decide.
    Pairs in ``exclude`` (premise, hypothesis) and duplicates are skipped.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if hard_rate is not None and not 0.0 <= hard_rate <= 1.0:
        raise ValueError(f"hard_rate must be in [0, 1], got {hard_rate}")
    unknown = set(weights) - set(TEMPLATE)
    if unknown:
        raise ValueError(f"unknown templates {sorted(unknown)}")
    rng = random.Random(f"hideseek-nli-{seed}-{desc}")
    by_label: dict[str, list[tuple[list[Template], list[float]]]] = {}
    for label in LABELS:
        ts = [TEMPLATE[k] for k in weights if TEMPLATE[k].label == label and weights[k] > 0]
        if not ts:
            raise ValueError(f"no template with positive weight for label {label!r}")
        groups = [(ts, [weights[t.name] for t in ts])]
        if hard_rate is not None and label != "entailment":
            hard = [t for t in ts if t.hard]
            easy = [t for t in ts if not t.hard]
            groups = []
            if easy:
                groups.append((easy, [weights[t.name] * (1 - hard_rate) / sum(weights[e.name] for e in easy) for t in easy]))
            if hard:
                groups.append((hard, [weights[t.name] * hard_rate / sum(weights[e.name] for e in hard) for t in hard]))
        by_label[label] = groups
    seen = set(exclude or ())
    out: list[Example] = []
    i = 0
    while len(out) < n:
        label = LABELS[i % 3]
        ts = [t for g in by_label[label] for t in g[0]]
        ws = [w for g in by_label[label] for w in g[1]]
        ex = _sample(rng, rng.choices(ts, weights=ws)[0])
        key = (ex.premise, ex.hypothesis)
        if key in seen:
            continue
        seen.add(key)
        out.append(ex)
        i += 1
    return out


@dataclass(frozen=True)
class CorpusSpec:
    seed: int = 0
    n_train: int = 4000
    n_dev: int = 900
    n_test: int = 900
    hard_rate: float = 0.05


def make_corpus(spec: CorpusSpec) -> dict[str, list[Example]]:
    """The three splits; deterministic given ``spec``; no pair occurs twice."""
    train = generate(spec.n_train, spec.seed, TRAIN_WEIGHTS, hard_rate=spec.hard_rate, desc="train")
    used = {(e.premise, e.hypothesis) for e in train}
    dev = generate(spec.n_dev, spec.seed, TRAIN_WEIGHTS, hard_rate=spec.hard_rate, exclude=used, desc="dev")
    used |= {(e.premise, e.hypothesis) for e in dev}
    test = generate(spec.n_test, spec.seed, TEST_WEIGHTS, exclude=used, desc="test")
    return {"train": train, "dev": dev, "test": test}


def overlap_heuristic(train: Sequence[Example]) -> Callable[[Example], int]:
    """The lexical-overlap heuristic of McCoy et al. (2019), three-way.

    Predict entailment when every hypothesis word is in the premise; otherwise
    predict the most frequent label among the training pairs without full overlap.
    """
    rest = [e.label for e in train if overlap(e.premise, e.hypothesis) < 1.0]
    if not rest:
        raise ValueError("every training pair has full overlap")
    fallback = max(set(rest), key=rest.count)
    return lambda e: LABEL_ID["entailment"] if overlap(e.premise, e.hypothesis) == 1.0 else fallback


def accuracy(predict: Callable[[Example], int], examples: Sequence[Example], *,
             binary: bool = False) -> float:
    """Accuracy of ``predict``; ``binary`` scores entailment vs non-entailment only."""
    if not examples:
        raise ValueError("no examples")
    ok = 0
    for e in examples:
        y, p = e.label, predict(e)
        ok += ((y == 0) == (p == 0)) if binary else (y == p)
    return ok / len(examples)


# ----------------------------------------------------------------------------
# files and the tokenizer


def save_corpus(splits: dict[str, list[Example]], out_dir: str | Path) -> Path:
    """Write ``vocab.txt`` and one ``<split>.jsonl`` per split."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab.txt").write_text("\n".join(vocabulary()) + "\n")
    for name, exs in splits.items():
        with open(out / f"{name}.jsonl", "w") as f:
            for e in exs:
                f.write(json.dumps({"premise": e.premise, "hypothesis": e.hypothesis,
                                    "label": e.label, "template": e.template}) + "\n")
    return out


def load_split(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def make_tokenizer(vocab_file: str | Path):
    """A real ``BertTokenizerFast`` built from the word-level ``vocab.txt`` (no hub)."""
    from transformers import BertTokenizerFast

    vocab_file = Path(vocab_file)
    if vocab_file.name != "vocab.txt" or not vocab_file.is_file():
        raise FileNotFoundError(f"expected an existing .../vocab.txt, got {vocab_file}")
    # from a local folder holding vocab.txt: the same call in transformers 4 and 5
    tok = BertTokenizerFast.from_pretrained(str(vocab_file.parent), local_files_only=True,
                                            do_lower_case=True)
    n_lines = len(vocab_file.read_text().split())
    if len(tok) != n_lines:
        raise ValueError(f"tokenizer has {len(tok)} tokens, {vocab_file} has {n_lines}")
    return tok


def encode(tokenizer, pairs: Sequence, max_length: int = 40):
    """``[CLS] premise [SEP] hypothesis [SEP]``, padded to ``max_length``.

    ``pairs``: :class:`Example` objects or dicts with premise/hypothesis/label.
    Returns ``(inputs, labels)`` with ``inputs`` a dict of long tensors.
    Raises if a pair is longer than ``max_length`` or has unknown words.
    """
    import torch

    get = (lambda e, k: e[k]) if pairs and isinstance(pairs[0], dict) else getattr
    prem = [get(e, "premise") for e in pairs]
    hyp = [get(e, "hypothesis") for e in pairs]
    enc = tokenizer(prem, hyp, padding="max_length", max_length=max_length,
                    truncation=False, return_tensors="pt")
    if enc["input_ids"].shape[1] > max_length:
        raise ValueError(f"a pair is longer than max_length={max_length} tokens")
    if (enc["input_ids"] == tokenizer.unk_token_id).any():
        raise ValueError("unknown words in the corpus; is vocab.txt current?")
    labels = torch.tensor([int(get(e, "label")) for e in pairs], dtype=torch.long)
    inputs = {k: enc[k] for k in ("input_ids", "token_type_ids", "attention_mask")}
    return inputs, labels
