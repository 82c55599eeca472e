"""The language zoo: one small BERT pre-trained once, fine-tuned many times (Figures 5, 7, 8, 9).

The paper uses 35 of the 100 ``bert-base-uncased`` MNLI fine-tunes of McCoy et
al. (2020), which differ only in the fine-tuning seed. The ``cpu`` analogue:

1. a generated NLI corpus (:mod:`companion.experiments.nli_corpus`) with a
   HANS-like test split on which lexical overlap does not help;
2. a small ``transformers`` BERT (``BertForMaskedLM``) pre-trained once, from
   a fixed seed, with masked language modelling on the training pairs;
3. ``n_models`` ``BertForSequenceClassification`` fine-tunes of it with the
   same hyperparameters and different seeds; the seed sets the classifier
   initialisation, the data order and the dropout masks, as in McCoy et al.

Generalisation gap (errors in [0, 1]): ``gap = "dev"``, the paper's, is the
in-distribution dev error minus the train error (McCoy et al.'s runs on MNLI
dev-matched); ``gap = "test"`` the HANS-like test error minus the train error. Every
member records both (``gap_in_distribution``, ``gap_hans``); ``gap`` is the chosen one.

Reproducibility. Training runs under ``torch.use_deterministic_algorithms`` with every
random source seeded (corpus, classifier initialisation, data order, dropout, MLM
masking), and with a fixed number of intra-op threads (``threads``): the same member
trained twice, in fresh processes (any ``PYTHONHASHSEED``), with the same thread count and
the same CPU kernels is bitwise identical. A different thread count, or a processor with
other vector units (PyTorch, MKL and oneDNN pick AVX-512 / AVX2 / ... kernels at run time),
rounds differently and a fine-tune amplifies that: member 0 of the 3-epoch recipe trained
with 2 threads, or with AVX2 instead of AVX-512 kernels, ends with other weights and its
dev error moves from 0.173 to 0.178 / 0.183; with the 12-epoch recipe AVX2 kernels move member 1's
dev error from 0.078 to 0.107, as much as another seed would: a kernel change acts like a
reseed (hence the zoo-seed stability of :mod:`companion.experiments.stability`). ``cpu_kernels: avx2`` pins the kernels to one
level on every x86-64 processor that has it (:data:`KERNEL_ENV`, set before Python
starts) and refuses to train otherwise; ``zoo.json`` records the kernels in force.
``workers`` trains members in parallel processes (one thread each) without changing any
member.

Command line (the DVC stage ``language_train``)::

    python -m companion.experiments.language_zoo train --out data/zoos/language --profile cpu

reads ``params.yaml`` (section ``language_train``, sub-dict of the profile) and
writes ``out/corpus/`` (vocab.txt, splits), ``out/pretrained/``, one folder per
fine-tune ``out/model_XXX/`` (``save_pretrained``) and ``out/zoo.json``.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from companion import paper
from companion.experiments import nli_corpus as nc
from companion.pool import run_tasks
from hideseek.measures import Measure
from hideseek.utils import resolve_device

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ZOO_FORMAT = 1
#: Environment that pins the CPU kernels to one instruction-set level on any x86-64 processor
#: that has it (PyTorch's own kernels, MKL's BLAS with conditional numerical reproducibility,
#: oneDNN); read when the libraries load, so it must be set before Python starts.
KERNEL_ENV = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}

#: ``gap`` setting -> the split whose error the recorded gap subtracts the train error from
GAP_SPLITS = {"dev": "gap_in_distribution", "test": "gap_hans"}


# ----------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class ModelSpec:
    hidden_size: int = 64
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    intermediate_size: int = 128
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1


@dataclass(frozen=True)
class PretrainSpec:
    seed: int = 0
    steps: int = 1000
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 0.01
    warmup_frac: float = 0.1
    mask_prob: float = 0.15


@dataclass(frozen=True)
class FinetuneSpec:
    n_models: int = 36
    base_seed: int = 1000
    epochs: float = 3.0
    batch_size: int = 32
    lr: float = 2e-3
    weight_decay: float = 0.01
    warmup_frac: float = 0.1
    # hidden and attention dropout while fine-tuning; None: the pre-trained model's (`model`)
    dropout: float | None = None


@dataclass(frozen=True)
class ZooSpec:
    corpus: nc.CorpusSpec = field(default_factory=nc.CorpusSpec)
    model: ModelSpec = field(default_factory=ModelSpec)
    pretrain: PretrainSpec = field(default_factory=PretrainSpec)
    finetune: FinetuneSpec = field(default_factory=FinetuneSpec)
    max_length: int = 40
    device: str = "cpu"  # "cpu", "cuda" or "auto" (cuda when available)
    # which error the recorded `gap` subtracts the train error from: "test" (HANS-like), "dev"
    # (in-distribution, the paper's)
    gap: str = "test"
    # intra-op threads while training (None: leave torch's setting); results depend on it
    threads: int | None = None
    # parallel fine-tuning processes (one thread each); does not change any member
    workers: int = 1
    # CPU kernel level the training must run with (e.g. "avx2"; None: whatever the processor has);
    # KERNEL_ENV must be set before Python starts: the command line restarts itself with it
    cpu_kernels: str | None = None
    # "scratch": BERT of `model`, MLM pre-trained once on the corpus; "minilm" or a saved BERT
    # folder: fine-tune that pre-trained model instead (companion.experiments.minilm)
    base: str = "scratch"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ZooSpec":
        """From the nested ``params.yaml`` dict; unknown keys are an error."""
        parts = {"corpus": nc.CorpusSpec, "model": ModelSpec,
                 "pretrain": PretrainSpec, "finetune": FinetuneSpec}
        scalars = {"max_length": int, "device": str, "base": str, "gap": str,
                   "threads": lambda v: None if v is None else int(v), "workers": int,
                   "cpu_kernels": lambda v: None if v is None else str(v).lower()}
        unknown = set(d) - set(parts) - set(scalars)
        if unknown:
            raise ValueError(f"unknown language zoo settings {sorted(unknown)}")
        kw: dict[str, Any] = {}
        for key, typ in parts.items():
            sub = dict(d[key]) if key in d and d[key] is not None else {}
            names = {f.name for f in fields(typ)}
            bad = set(sub) - names
            if bad:
                raise ValueError(f"unknown {key} settings {sorted(bad)}; known: {sorted(names)}")
            kw[key] = typ(**sub)
        for key, conv in scalars.items():
            if key in d:
                kw[key] = conv(d[key])
        spec = cls(**kw)
        if spec.gap not in GAP_SPLITS:
            raise ValueError(f"gap must be one of {sorted(GAP_SPLITS)}, got {spec.gap!r}")
        if spec.workers < 1 or (spec.threads is not None and spec.threads < 1):
            raise ValueError(f"workers and threads must be >= 1, got {spec.workers} and {spec.threads}")
        if spec.cpu_kernels is not None and spec.cpu_kernels not in KERNEL_ENV:
            raise ValueError(f"cpu_kernels must be null or one of {sorted(KERNEL_ENV)}, got {spec.cpu_kernels!r}")
        if spec.workers > 1 and spec.device != "cpu":
            raise ValueError("workers > 1 is for cpu training; use workers: 1 on a GPU")
        return spec

    @classmethod
    def from_params(cls, d: Mapping[str, Any]) -> "ZooSpec":
        """From a ``language_train`` profile (``python -m companion.params language_train``): like
        :meth:`from_dict`, but every setting must be stated — none falls back to a default written here."""
        parts = {"corpus": nc.CorpusSpec, "model": ModelSpec, "pretrain": PretrainSpec, "finetune": FinetuneSpec}
        missing = [f.name for f in fields(cls) if f.name not in d]
        missing += [f"{key}.{f.name}" for key, typ in parts.items() if isinstance(d.get(key), Mapping)
                    for f in fields(typ) if f.name not in d[key]]
        if missing:
            raise ValueError(f"language_train settings missing {sorted(missing)}: state them in params.yaml "
                             "(the stage uses no defaults written in code)")
        return cls.from_dict(d)

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------
# helpers


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """Deterministic torch kernels inside the block (restored afterwards).

    On CPU every kernel used here has a deterministic implementation; on CUDA
    a kernel without one only warns (bitwise reproducibility is a CPU promise).
    """
    was = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.cuda.is_available()
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def _to(batch: Mapping[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def trim(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop padding columns beyond the longest sequence of the batch.

    The attention mask hides padding, so this changes no output; it only saves time.
    """
    n = int(inputs["attention_mask"].sum(dim=1).max())
    return {k: v[:, :n] for k, v in inputs.items()}


def _linear_schedule(opt, total: int, warmup_frac: float):
    warm = max(1, int(round(warmup_frac * total)))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return max(0.0, (total - step) / max(1, total - warm))

    return torch.optim.lr_scheduler.LambdaLR(opt, f)


def bert_config(spec: ZooSpec, vocab_size: int, **extra):
    from transformers import BertConfig

    m = spec.model
    if m.hidden_size % m.num_attention_heads:
        raise ValueError(f"hidden_size {m.hidden_size} is not divisible by {m.num_attention_heads} heads")
    return BertConfig(
        vocab_size=vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads, intermediate_size=m.intermediate_size,
        hidden_dropout_prob=m.hidden_dropout_prob,
        attention_probs_dropout_prob=m.attention_probs_dropout_prob,
        max_position_embeddings=spec.max_length, type_vocab_size=2, pad_token_id=0, **extra,
    )


@torch.no_grad()
def error_rate(model, inputs: Mapping[str, torch.Tensor], labels: torch.Tensor,
               batch_size: int = 512) -> tuple[float, np.ndarray]:
    """Classification error of ``model`` (eval mode) and its predictions."""
    was = model.training
    model.eval()
    preds = []
    device = next(model.parameters()).device
    for i in range(0, labels.numel(), batch_size):
        batch = _to(trim({k: v[i:i + batch_size] for k, v in inputs.items()}), device)
        preds.append(model(**batch).logits.argmax(-1).cpu())
    model.train(was)
    pred = torch.cat(preds)
    return int((pred != labels).sum()) / labels.numel(), pred.numpy()


def mask_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, mask_prob: float,
                mask_id: int, vocab_size: int, n_special: int, gen: torch.Generator):
    """BERT's masking: of ``mask_prob`` of the real tokens (not [CLS]/[SEP]/[PAD]),
    80 % become [MASK], 10 % a random word, 10 % stay; labels -100 elsewhere."""
    ids = input_ids.clone()
    special = ids < n_special
    cand = attention_mask.bool() & ~special
    chosen = (torch.rand(ids.shape, generator=gen) < mask_prob) & cand
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    r = torch.rand(ids.shape, generator=gen)
    ids[chosen & (r < 0.8)] = mask_id
    rand_words = torch.randint(n_special, vocab_size, ids.shape, generator=gen)
    swap = chosen & (r >= 0.8) & (r < 0.9)
    ids[swap] = rand_words[swap]
    return ids, labels


# ----------------------------------------------------------------------------
# data


@dataclass
class Data:
    tokenizer: Any
    splits: dict[str, list[nc.Example]]
    encoded: dict[str, tuple[dict[str, torch.Tensor], torch.Tensor]]


def prepare_data(spec: ZooSpec, corpus_dir: str | Path, save: bool = True) -> Data:
    """Generate the corpus (deterministic given ``spec.corpus``), write it to ``corpus_dir``
    unless ``save=False`` (it must then hold ``vocab.txt`` already), and encode it."""
    splits = nc.make_corpus(spec.corpus)
    if save:
        nc.save_corpus(splits, corpus_dir)
    if spec.base == "scratch":
        tok = nc.make_tokenizer(Path(corpus_dir) / "vocab.txt")
    else:  # a pre-trained base model reads the corpus with its own tokenizer
        from .minilm import load_tokenizer, resolve_base
        tok = load_tokenizer(resolve_base(spec.base))
    enc = {k: nc.encode(tok, v, spec.max_length) for k, v in splits.items()}
    return Data(tok, splits, enc)


# ----------------------------------------------------------------------------
# training


def pretrain(spec: ZooSpec, data: Data, out_dir: str | Path | None = None,
             progress: bool = True):
    """Masked-LM pre-training of a fresh ``BertForMaskedLM`` on the training pairs."""
    from transformers import BertForMaskedLM

    p = spec.pretrain
    tok = data.tokenizer
    inputs, _ = data.encoded["train"]
    n = inputs["input_ids"].shape[0]
    with deterministic():
        torch.manual_seed(p.seed)
        device = resolve_device(spec.device)
        model = BertForMaskedLM(bert_config(spec, len(tok))).to(device)
        model.train()
        gen = torch.Generator().manual_seed(p.seed)
        opt = torch.optim.AdamW(model.parameters(), lr=p.lr, weight_decay=p.weight_decay)
        sched = _linear_schedule(opt, p.steps, p.warmup_frac)
        losses = []
        perm, pos = torch.randperm(n, generator=gen), 0
        for _ in tqdm(range(p.steps), desc="pretrain (MLM)", disable=not progress):
            if pos + p.batch_size > n:
                perm, pos = torch.randperm(n, generator=gen), 0
            idx = perm[pos:pos + p.batch_size]
            pos += p.batch_size
            batch = trim({k: v[idx] for k, v in inputs.items()})
            ids, labels = mask_tokens(batch["input_ids"], batch["attention_mask"], p.mask_prob,
                                      tok.mask_token_id, len(tok), len(nc.SPECIAL_TOKENS), gen)
            loss = model(input_ids=ids.to(device), attention_mask=batch["attention_mask"].to(device),
                         token_type_ids=batch["token_type_ids"].to(device), labels=labels.to(device)).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
    model.eval()
    if out_dir is not None:
        model.to("cpu").save_pretrained(out_dir)
        model.to(device)
        tok.save_pretrained(out_dir)
    return model, losses


def finetune(spec: ZooSpec, data: Data, pretrained_dir: str | Path, seed: int,
             progress: bool = False):
    """One ``BertForSequenceClassification`` fine-tune from the pre-trained weights.

    ``seed`` sets the classifier initialisation, the data order and the dropout masks.
    Returns the model (eval mode) and its training losses.
    """
    from transformers import BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    f = spec.finetune
    inputs, labels = data.encoded["train"]
    n = labels.numel()
    steps_per_epoch = math.ceil(n / f.batch_size)
    total = max(1, int(round(f.epochs * steps_per_epoch)))
    verbosity = hf_logging.get_verbosity()
    with deterministic():
        torch.manual_seed(seed)
        hf_logging.set_verbosity_error()  # "newly initialised classifier" is expected
        try:
            drop = {} if f.dropout is None else {"hidden_dropout_prob": f.dropout,
                                                 "attention_probs_dropout_prob": f.dropout}
            model = BertForSequenceClassification.from_pretrained(
                pretrained_dir, num_labels=len(nc.LABELS), local_files_only=True,
                id2label=dict(enumerate(nc.LABELS)), label2id=nc.LABEL_ID, **drop)
        finally:
            hf_logging.set_verbosity(verbosity)
        device = resolve_device(spec.device)
        model.to(device).train()
        gen = torch.Generator().manual_seed(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=f.lr, weight_decay=f.weight_decay)
        sched = _linear_schedule(opt, total, f.warmup_frac)
        losses = []
        perm, pos = torch.randperm(n, generator=gen), 0
        for _ in tqdm(range(total), desc=f"fine-tune seed {seed}", disable=not progress, leave=False):
            if pos >= n:
                perm, pos = torch.randperm(n, generator=gen), 0
            idx = perm[pos:pos + f.batch_size]
            pos += f.batch_size
            batch = _to(trim({k: v[idx] for k, v in inputs.items()}), device)
            loss = model(**batch, labels=labels[idx].to(device)).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
    model.eval()
    return model, losses


def evaluate(model, data: Data, gap: str = "test") -> dict[str, Any]:
    """Train / dev / test errors, both gaps, ``gap`` (the one named by ``gap``, see
    :data:`GAP_SPLITS`), and the test error per template."""
    out: dict[str, Any] = {}
    for split in ("train", "dev", "test"):
        inputs, labels = data.encoded[split]
        err, pred = error_rate(model, inputs, labels)
        out[f"{split}_error"] = err
        if split == "test":
            per: dict[str, list[bool]] = {}
            for e, p_ in zip(data.splits[split], pred):
                per.setdefault(e.template, []).append(bool(p_ != e.label))
            out["test_error_by_template"] = {k: float(np.mean(v)) for k, v in sorted(per.items())}
    out["gap_in_distribution"] = out["dev_error"] - out["train_error"]
    out["gap_hans"] = out["test_error"] - out["train_error"]
    out["gap"] = out[GAP_SPLITS[gap]]
    return out


def model_name(i: int) -> str:
    return f"model_{i:03d}"


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """``torch.set_num_threads(n)`` inside the block (nothing when ``n`` is None)."""
    if n is None:
        yield
        return
    was = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(was)


def train_member(spec: ZooSpec, data: Data, base_dir: str | Path, out: str | Path, i: int) -> dict:
    """Fine-tune member ``i`` (seed ``base_seed + i``), save it under ``out``, return its record."""
    seed = spec.finetune.base_seed + i
    t1, c1 = time.perf_counter(), time.process_time()
    model, losses = finetune(spec, data, base_dir, seed)
    secs, cpu = time.perf_counter() - t1, time.process_time() - c1
    rec = {"name": model_name(i), "path": model_name(i), "seed": seed,
           **evaluate(model, data, spec.gap), "final_train_loss": float(np.mean(losses[-20:])),
           "seconds": secs, "cpu_seconds": cpu, "hyperparameters": {**asdict(spec.finetune), "seed": seed},
           "n_parameters": sum(p.numel() for p in model.parameters())}
    rec["hyperparameters"].pop("n_models")
    rec["hyperparameters"].pop("base_seed")
    model.to("cpu").save_pretrained(Path(out) / rec["path"])
    return rec


_WORKER: dict[str, Any] = {}


def _worker_init(spec_dict: dict, corpus_dir: str, threads: int) -> None:
    torch.set_num_threads(threads)
    spec = ZooSpec.from_dict(spec_dict)
    _WORKER.update(spec=spec, data=prepare_data(spec, corpus_dir, save=False))


def _worker_member(base_dir: str, out: str, i: int) -> dict:
    return train_member(_WORKER["spec"], _WORKER["data"], base_dir, out, i)


def _train_members(spec: ZooSpec, data: Data, base_dir: Path, out: Path, progress: bool) -> list[dict]:
    n = spec.finetune.n_models
    bar = tqdm(total=n, desc="fine-tune zoo", disable=not progress)
    records: list[dict | None] = [None] * n

    def done(rec):
        records[int(rec["name"].split("_")[1])] = rec
        bar.update(1)
        bar.set_postfix(train=f"{rec['train_error']:.3f}", dev=f"{rec['dev_error']:.3f}")

    if spec.workers == 1:
        for i in range(n):
            done(train_member(spec, data, base_dir, out, i))
    else:
        run_tasks(_worker_member, [(str(base_dir), str(out), i) for i in range(n)], workers=spec.workers,
                  initializer=_worker_init, initargs=(spec.to_dict(), str(out / "corpus"), spec.threads or 1),
                  on_result=lambda _, rec: done(rec))
    bar.close()
    return records  # type: ignore[return-value]


def cpu_kernels() -> dict[str, Any]:
    """The CPU kernel level in force (``torch.backends.cpu.get_cpu_capability()``) and the
    environment variables of :data:`KERNEL_ENV` as set: what a bitwise comparison must match."""
    names = sorted({k for env in KERNEL_ENV.values() for k in env})
    return {"capability": torch.backends.cpu.get_cpu_capability(), **{k: os.environ.get(k) for k in names}}


def check_cpu_kernels(level: str | None) -> None:
    """Raise unless the kernels are pinned to ``level`` (nothing to check for None)."""
    if level is None:
        return
    want = KERNEL_ENV[level]
    have = cpu_kernels()
    bad = {k: have[k] for k, v in want.items() if have[k] != v}
    if bad or have["capability"].lower() != level:
        env = " ".join(f"{k}={v}" for k, v in want.items())
        raise RuntimeError(f"cpu_kernels={level!r} but torch runs {have['capability']} kernels with {bad or 'its env'}; "
                           f"start Python with `{env}` (the language_train stage command does), or set "
                           "cpu_kernels: null to train with this processor's own kernels (another zoo)")


def train_zoo(spec: ZooSpec, out_dir: str | Path, *, progress: bool = True) -> dict:
    """Build the whole zoo in ``out_dir`` (replaced if it exists) and return ``zoo.json``'s content.

    Runs with ``spec.threads`` intra-op threads (restored afterwards); with ``spec.workers > 1``
    the fine-tunes run in that many spawned processes, each with ``spec.threads`` (or 1) threads.
    With ``spec.cpu_kernels`` set, refuses to run unless the kernels are pinned to that level.
    """
    if spec.device == "cpu":
        check_cpu_kernels(spec.cpu_kernels)
    with torch_threads(spec.threads):
        return _train_zoo(spec, out_dir, progress=progress)


def _train_zoo(spec: ZooSpec, out_dir: str | Path, *, progress: bool = True) -> dict:
    out = Path(out_dir)
    if spec.finetune.n_models < 1:
        raise ValueError("finetune.n_models must be >= 1")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    data = prepare_data(spec, out / "corpus")
    heur = nc.overlap_heuristic(data.splits["train"])
    if spec.base == "scratch":
        _, mlm_losses = pretrain(spec, data, out / "pretrained", progress=progress)
        base_dir = out / "pretrained"
    else:
        from .minilm import resolve_base
        mlm_losses, base_dir = None, resolve_base(spec.base)
    t_pre = time.perf_counter() - t0
    records = _train_members(spec, data, Path(base_dir), out, progress)
    n_params = records[0].pop("n_parameters")
    for rec in records[1:]:
        rec.pop("n_parameters")
    timings = {"seconds_total": time.perf_counter() - t0, "seconds_pretrain": t_pre,
               "members": {r["name"]: {"seconds": r.pop("seconds"), "cpu_seconds": r.pop("cpu_seconds")}
                           for r in records}}
    zoo = {
        "format": ZOO_FORMAT,
        "spec": spec.to_dict(),
        "corpus": {k: len(v) for k, v in data.splits.items()},
        "overlap_heuristic": {
            split: {"accuracy": nc.accuracy(heur, exs),
                    "binary_accuracy": nc.accuracy(heur, exs, binary=True)}
            for split, exs in data.splits.items()},
        "n_parameters": n_params,
        "pretrain": {"final_mlm_loss": None if mlm_losses is None else float(np.mean(mlm_losses[-20:])),
                     "base": spec.base if spec.base == "scratch" else str(base_dir)},
        "torch_threads": torch.get_num_threads(),
        "cpu_kernels": cpu_kernels(),
        "models": records,
    }
    (out / "zoo.json").write_text(json.dumps(zoo, indent=1))
    # timings beside the zoo folder, not in it: the folder is a DVC output whose hash must not move with them
    timings_file(out).write_text(json.dumps(timings, indent=1))
    return zoo


def timings_file(zoo_dir: str | Path) -> Path:
    """Where :func:`train_zoo` writes the training times of ``zoo_dir`` (beside it, outside the DVC output)."""
    zoo_dir = Path(zoo_dir)
    return zoo_dir.parent / f"{zoo_dir.name}.timings.json"


# ----------------------------------------------------------------------------
# reading a zoo back


def load_zoo(zoo_dir: str | Path) -> dict:
    """``zoo.json`` of a trained zoo, checked."""
    path = Path(zoo_dir) / "zoo.json"
    if not path.is_file():
        raise FileNotFoundError(f"no zoo at {zoo_dir} (missing zoo.json); run "
                                "`python -m companion.experiments.language_zoo train` first")
    zoo = json.loads(path.read_text())
    if zoo.get("format") != ZOO_FORMAT:
        raise ValueError(f"{path}: zoo format {zoo.get('format')}, expected {ZOO_FORMAT}")
    return zoo


def load_model(zoo_dir: str | Path, name: str, device: str | None = "cpu"):
    """One fine-tune of a generated zoo, in eval mode, on ``device`` (``"auto"``: cuda when available).

    The members of any language zoo, McCoy et al.'s included: ``source(zoo_dir).loaders()``."""
    from transformers import BertForSequenceClassification

    zoo = load_zoo(zoo_dir)
    if "kind" in zoo:
        raise ValueError(f"{zoo_dir} holds a {zoo['kind']} zoo, not a generated one: load its members with "
                         "companion.experiments.language_zoo.source(zoo_dir).loaders()")
    path = Path(zoo_dir) / name
    if not path.is_dir():
        raise FileNotFoundError(f"no model {name!r} in {zoo_dir}")
    model = BertForSequenceClassification.from_pretrained(path, local_files_only=True)
    return model.to(resolve_device(device)).eval()


class GeneratedNLIZoo:
    """A zoo trained by :func:`train_zoo` on the generated corpus, as a
    :class:`companion.experiments.zoo.ZooSource` (its zoo.json records no ``kind``)."""

    kind = "generated_nli"

    def __init__(self, zoo_dir: Path, meta: dict):
        self.zoo_dir, self.meta = Path(zoo_dir), meta

    def description(self) -> str:
        return f"{self.kind}: {len(self.meta['models'])} seed-only fine-tunes"

    def loaders(self, names: Sequence[str] | None = None, device: str | None = "cpu"):
        names = [m["name"] for m in self.meta["models"]] if names is None else list(names)
        return [(n, functools.partial(load_model, self.zoo_dir, n, device)) for n in names]  # picklable

    def sharpness_batches(self, n_points: int, batch_size: int,
                          seed: int) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        """``n_points`` pairs drawn without replacement (seeded) from the zoo's training split, in batches
        of ``batch_size``; padding beyond each batch's longest pair is trimmed."""
        if n_points < 1 or batch_size < 1:
            raise ValueError("n_points and batch_size must be >= 1")
        corpus = self.zoo_dir / "corpus"
        train = nc.load_split(corpus / "train.jsonl")
        if n_points > len(train):
            raise ValueError(f"n_points={n_points} exceeds the {len(train)} training pairs")
        if n_points % batch_size:
            raise ValueError(f"n_points={n_points} is not a multiple of batch_size={batch_size}")
        rng = np.random.default_rng(seed)
        idx = np.sort(rng.choice(len(train), size=n_points, replace=False))
        tok = nc.make_tokenizer(corpus / "vocab.txt")
        inputs, labels = nc.encode(tok, [train[i] for i in idx], self.meta["spec"]["max_length"])
        return [(trim({k: v[i:i + batch_size] for k, v in inputs.items()}), labels[i:i + batch_size])
                for i in range(0, n_points, batch_size)]

    def retest_batches(self, n_points: int, batch_size: int, seed: int):
        raise ValueError("the language zoos' test-retest compares the two halves of the sharpness batches; "
                         "they draw no second set")

    def member_table(self) -> "pd.DataFrame":
        import pandas as pd

        return pd.DataFrame(self.meta["models"]).set_index("name")

    def eval_errors(self, names: Sequence[str]) -> np.ndarray:
        """Per-example errors on the in-distribution dev split (the gap's evaluation set)."""
        spec = ZooSpec.from_dict(self.meta["spec"])
        data = prepare_data(spec, self.zoo_dir / "corpus", save=False)
        inputs, labels = data.encoded["dev"]
        rows = []
        for name in names:
            _, pred = error_rate(load_model(self.zoo_dir, name, "cpu"), inputs, labels)
            rows.append(pred != labels.numpy())
        return np.array(rows, dtype=float)


def source(zoo_dir: str | Path):
    """The :class:`companion.experiments.zoo.ZooSource` of the language zoo in ``zoo_dir``: generated
    (:class:`GeneratedNLIZoo`) or McCoy et al.'s (:class:`companion.experiments.paper_zoos.McCoyZoo`),
    chosen from zoo.json's kind by :func:`companion.experiments.zoo.open_source`."""
    from companion.experiments.paper_zoos import McCoyZoo
    from companion.experiments.zoo import open_source

    return open_source(zoo_dir, load_zoo(zoo_dir), {GeneratedNLIZoo.kind: GeneratedNLIZoo, McCoyZoo.kind: McCoyZoo},
                       default_kind=GeneratedNLIZoo.kind)


def model_loaders(zoo_dir: str | Path, names: Sequence[str] | None = None, device: str | None = "cpu"):
    """``[(name, loader)]`` for :func:`companion.experiments.zoo.measure_zoo`: ``source(zoo_dir).loaders``."""
    return source(zoo_dir).loaders(names, device)


def sharpness_batches(zoo_dir: str | Path, n_points: int, batch_size: int,
                      seed: int) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """The fixed training pairs on which every model's sharpness is measured: ``source(zoo_dir).sharpness_batches``.

    ``n_points`` pairs drawn without replacement (seeded) from the zoo's training
    split, in batches of ``batch_size`` (McCoy et al.'s zoo: MNLI training pairs). A test–retest compares
    the measure on the first and the second half of these batches (disjoint pairs).
    """
    return source(zoo_dir).sharpness_batches(n_points, batch_size, seed)


# ----------------------------------------------------------------------------
# measuring the zoo (the ``language`` notebook stage: companion.experiments.language_report)

#: Table 1, row "MNLI" (35 BERT fine-tunes of McCoy et al. 2020).
PAPER_TAU: dict[str, float] = paper.table1_tau("language")
#: Figure 8 (mixed metric): full and without the second-order (Christoffel) step.
#: Figure 7 (invariant metric) is described only qualitatively in the text.
PAPER_ABLATION_TAU: dict[str, float] = dict(paper.LANGUAGE_ABLATION_TAU)
PAPER_PROTOCOL: dict[str, Any] = dict(paper.LANGUAGE_PROTOCOL)

#: Appendix G ablations, per metric: no-Christoffel (Riemannian norm, straight step)
#: and Christoffel-only (adaptive norm, second-order geodesic step), by Measure name
#: (geodesic_{metric}_no_christoffel, geodesic_{metric}_christoffel_only).
ABLATIONS: dict[str, Measure] = {
    m.name: m for m in (Measure(metric=metric, step="straight") for metric in ("invariant", "mixed"))
} | {m.name: m for m in (Measure(metric=metric, ball="adaptive") for metric in ("invariant", "mixed"))}


def member_table(zoo_dir: str | Path) -> "pd.DataFrame":
    """One row per member of a zoo (index: its name): errors, gaps, seed, as ``zoo.json`` records."""
    return source(zoo_dir).member_table()


def dev_errors(zoo_dir: str | Path, names: Sequence[str]) -> np.ndarray | None:
    """Per-example dev errors ``[members, pairs]`` (0/1) of the members ``names`` on the zoo's
    in-distribution dev split (the gap's evaluation set); None for McCoy et al.'s zoo, whose
    per-example MNLI predictions are not kept. ``source(zoo_dir).eval_errors``."""
    return source(zoo_dir).eval_errors(names)


# ----------------------------------------------------------------------------
# command line


def main(argv: Sequence[str] | None = None) -> int:
    from hideseek.utils import set_threads

    ap = argparse.ArgumentParser(prog="python -m companion.experiments.language_zoo",
                                 description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="pre-train once and fine-tune the zoo")
    tr.add_argument("--out", default="data/zoos/language")
    tr.add_argument("--profile", default=None, help="profile in params.yaml (default: its `profile`)")
    tr.add_argument("--params", default="params.yaml")
    tr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a setting, e.g. finetune.n_models=3")
    args = ap.parse_args(argv)
    if args.cmd == "train":
        for kv in args.set:
            if "=" not in kv:
                ap.error(f"--set expects KEY=VALUE, got {kv!r}")
        from companion.params import stage_params

        profile, d = stage_params("language_train", args.profile, args.set, path=args.params)
        if "source" in d:  # profile paper: describe McCoy et al.'s runs, train nothing
            from companion.experiments.paper_zoos import cli_build

            return cli_build("mccoy_bert", args.out, d, inherited=("workers", "cpu_kernels", "base"))
        spec = ZooSpec.from_params(d)
        threads = set_threads(spec.threads)
        if spec.cpu_kernels is not None and spec.device == "cpu":
            env = KERNEL_ENV[spec.cpu_kernels]
            if any(os.environ.get(k) != v for k, v in env.items()):
                if os.environ.get("HIDESEEK_KERNEL_REEXEC"):
                    check_cpu_kernels(spec.cpu_kernels)  # raises with what is wrong
                # the kernels are chosen when the libraries load: start again with the environment
                print(f"cpu_kernels={spec.cpu_kernels}: restarting with {env}", flush=True)
                argv_ = list(sys.argv[1:]) if argv is None else list(argv)
                os.execve(sys.executable, [sys.executable, "-m", "companion.experiments.language_zoo", *argv_],
                          {**os.environ, **env, "HIDESEEK_KERNEL_REEXEC": "1"})
        print(f"language zoo, profile {profile!r}, {threads} threads, {spec.workers} worker(s) -> {args.out}")
        zoo = train_zoo(spec, args.out)
        gaps = [m["gap"] for m in zoo["models"]]
        secs = json.loads(timings_file(args.out).read_text())["seconds_total"]
        print(f"{len(gaps)} models in {secs:.0f} s; gap from {min(gaps):.3f} "
              f"to {max(gaps):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
