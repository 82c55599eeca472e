"""The paper's own zoos (profile ``paper``): model-soups CLIP fine-tunes and McCoy et al.'s BERTs.

The ``cpu``/``gpu`` profiles train their zoos (:mod:`.vision_zoo`,
:mod:`.language_zoo`); the ``paper`` profile *describes* the released
checkpoints instead, so that the same stages and notebooks measure them:

``build_clip_soups_zoo(out_dir, params)``
    the ``vision_train`` stage with ``source: clip_soups``: checks the assets
    (one :class:`~companion.assets.MissingAssetsError` listing everything
    missing), loads each selected ``model_{i}.pt`` and writes ``zoo.json``
    (``kind: "clip_soups"``) with each model's train error (a seeded subset of
    the 98 % of ImageNet's training set the models were fine-tuned on), test
    error (the validation set) and gap = test - train. No weights are copied:
    the zoo records where the checkpoints and images are.
``build_mccoy_zoo(out_dir, params)``
    the ``language_train`` stage with ``source: mccoy_bert``: the same for
    McCoy et al.'s runs ``bert_00`` ...: train error on a seeded subset of MNLI
    train, test error on MNLI dev matched, ``kind: "mccoy_bert"``.

Why the BERTs are converted on the fly and not saved once: a converted run is
0.44 GB, so 35 of them would put 15 GB into the DVC cache of
``data/zoos/language`` (the stage output) beside the 42 GB of checkpoints they
come from; converting one (reading its weights, skipping the optimizer slots)
costs seconds, against minutes for its sharpness on 1024 pairs. The cost is
paid once per call of :func:`companion.experiments.zoo.measure_zoo`, i.e. a few
times per model.

Readers, behind :class:`ClipSoupsZoo` and :class:`McCoyZoo` (the
:class:`companion.experiments.zoo.ZooSource` of these kinds, which ``vision_zoo.source`` and
``language_zoo.source`` open when ``zoo.json`` has one of them):

* :func:`clip_soups_loaders` -> ``(meta, [(name, loader), ...])``, :func:`clip_soups_sharpness_batches`
  (2048 training images of the 98 % split in batches of 256 in the paper);
* :func:`mccoy_loaders`, :func:`mccoy_sharpness_batches` (1024 MNLI training pairs
  in batches of 128, ``[CLS] premise [SEP] hypothesis [SEP]`` padded to 128 tokens).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from hideseek.utils import resolve_device

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ZOO_FORMAT = 1  # the language zoo's format number, which language_zoo.load_zoo checks
KINDS = ("clip_soups", "mccoy_bert")


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class ClipSoupsSettings:
    """``vision_train`` under profile ``paper`` (``source: clip_soups``); see :func:`build_clip_soups_zoo`."""

    source: Literal["clip_soups"]
    assets_root: str | None
    manifest: str | None
    models: int | list[int] | None
    expect: str | dict[str, Any] | None
    num_classes: int | None
    image_size: int
    train_error_images: int | None
    test_error_images: int | None
    error_seed: int
    batch_size: int
    num_workers: int
    group_size: int
    device: str
    threads: int | None


@dataclass(frozen=True)
class McCoySettings:
    """``language_train`` under profile ``paper`` (``source: mccoy_bert``); see :func:`build_mccoy_zoo`."""

    source: Literal["mccoy_bert"]
    assets_root: str | None
    manifest: str | None
    runs: int | list[int] | None
    train_error_pairs: int | None
    test_error_pairs: int | None
    error_seed: int
    batch_size: int
    max_seq_length: int
    prefer: Literal["tsv", "jsonl"]
    device: str
    threads: int | None


SETTINGS = {"clip_soups": ClipSoupsSettings, "mccoy_bert": McCoySettings}


def paper_settings(kind: str, params: Any, inherited: Iterable[str] = ()):
    """Typed settings of the ``kind`` builder from a resolved profile mapping (missing and unknown keys
    refused), or as given. ``inherited``: keys of the stage's generated recipe that the paper profile
    inherits from the section's defaults and does not use; they are dropped before the check."""
    from companion.params import from_mapping

    if kind not in SETTINGS:
        raise ValueError(f"unknown paper zoo source {kind!r}; known: {KINDS}")
    cls = SETTINGS[kind]
    if isinstance(params, cls):
        return params
    own = {f.name for f in dataclasses.fields(cls)}
    drop = set(inherited) - own
    return from_mapping(cls, {k: v for k, v in params.items() if k not in drop}, f"{kind} zoo settings")


# --------------------------------------------------------------------------- helpers


def _path_or_none(p) -> str | None:
    """An asset location as recorded in zoo.json: ``None`` = the repository's default."""
    return None if p in (None, "") else str(Path(p).resolve())


def _manifest(manifest: str | None):
    from companion.assets import load_manifest

    return load_manifest(manifest)


def _root(assets_root: str | None, manifest) -> Path:
    return Path(assets_root) if assets_root not in (None, "") else manifest.root


def _indices(value, default_n: int, what: str) -> list[int]:
    """``None`` -> ``0 .. default_n - 1``; an int n -> ``0 .. n - 1``; a list -> itself (checked)."""
    if value is None:
        out = list(range(default_n))
    elif isinstance(value, int):
        out = list(range(value))
    else:
        out = [int(i) for i in value]
    if not out:
        raise ValueError(f"{what}: no models selected")
    if len(set(out)) != len(out) or min(out) < 0:
        raise ValueError(f"{what}: indices must be distinct and non-negative, got {out}")
    return out


def _checked_selection(s: "ClipSoupsSettings | McCoySettings", group: str, asset: str,
                       key: str) -> tuple[Any, Path, list[int]]:
    """Common start of the paper-zoo builders: threads, manifest, assets root, the selected
    model indices (``s.<key>``), and the one missing-assets check for that selection."""
    from companion.assets import check_assets
    from hideseek.utils import set_threads

    if s.threads is not None:
        set_threads(s.threads)
    man = _manifest(s.manifest)
    root = _root(s.assets_root, man)
    try:   # how many models the release has: the assets manifest's, not a parameter
        n_default = int(man.settings[asset]["n_models"])
    except KeyError:
        raise ValueError(f"the assets manifest has no settings.{asset}.n_models (the release's model count)") from None
    indices = _indices(getattr(s, key), n_default, f"{group}_train.{key}")
    check_assets(group, root=root, manifest=man, select={asset: indices})
    return man, root, indices


def _write_json(path: Path, obj: Mapping) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


def _trim(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop padding columns beyond the batch's longest pair (masked, so outputs are unchanged)."""
    n = int(inputs["attention_mask"].sum(dim=1).max())
    return {k: v[:, :n] for k, v in inputs.items()}


def cli_build(kind: str, out_dir: str | os.PathLike, params: Mapping[str, Any], *, progress: bool = True,
              inherited: Iterable[str] = ()) -> int:
    """Build a paper zoo from a CLI (``params``, ``inherited``: as :func:`paper_settings`); a missing asset
    prints the one message (no traceback), status 2."""
    from companion.assets import MissingAssetsError

    s = paper_settings(kind, params, inherited)
    build = {"clip_soups": build_clip_soups_zoo, "mccoy_bert": build_mccoy_zoo}[kind]
    try:
        meta = build(out_dir, s, progress=progress)
    except MissingAssetsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    members = meta["members"] if "members" in meta else meta["models"]
    gaps = [m["gap"] for m in members]
    print(f"described {len(members)} {kind} models in {out_dir} ({meta['seconds_total']:.0f} s); "
          f"gap range [{min(gaps):.4f}, {max(gaps):.4f}]")
    return 0


# --------------------------------------------------------------------------- CLIP soups


def _clip_expect(value):
    from companion.assets.clip_soups import VIT_B32

    if value in ("vit_b32", "ViT-B/32"):
        return dict(VIT_B32)
    if value is None or isinstance(value, Mapping):
        return value
    raise ValueError(f"expect must be 'vit_b32', null (any CLIP ViT) or a dict, got {value!r}")


def _clip_loader(path: Path, expect, num_classes, device: torch.device) -> Callable[[], torch.nn.Module]:
    def load():
        from companion.assets.clip_soups import load_clip_finetune

        return load_clip_finetune(path, expect=expect, num_classes=num_classes).to(device).eval()

    return load


@torch.no_grad()
def _count_errors(models: Sequence[torch.nn.Module], batches, device: torch.device,
                  desc: str, progress: bool, to_inputs: Callable) -> list[tuple[int, int]]:
    """``(wrong, total)`` of each model (eval mode, on ``device``) over ``batches``, in one pass over the data.

    A model's output may be logits or a ``transformers`` output with ``.logits``.
    """
    wrong, total = [0] * len(models), 0
    for inputs, labels in tqdm(batches, desc=desc, unit="batch", leave=False, disable=not progress):
        inputs, labels = to_inputs(inputs, device), labels.to(device)
        for k, model in enumerate(models):
            out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
            logits = getattr(out, "logits", out)
            wrong[k] += int((logits.argmax(-1) != labels).sum())
        total += int(labels.numel())
    return [(w, total) for w in wrong]


def build_clip_soups_zoo(out_dir: str | os.PathLike, params: "ClipSoupsSettings | Mapping[str, Any]", *,
                         progress: bool = True) -> dict:
    """Describe the model-soups CLIP fine-tunes as a zoo: errors, gaps and where everything is.

    ``params`` (``vision_train.paper``): ``models`` (indices, null = all 72),
    ``assets_root``/``manifest`` (null = ``data/paper`` and ``data/manifest.yaml``),
    ``expect`` (``vit_b32`` or null for any CLIP ViT), ``num_classes`` (1000 or null),
    ``image_size`` (224), ``train_error_images`` (a seeded subset of the 98 % split;
    null = all of it), ``test_error_images`` (of the validation set; null = all),
    ``error_seed``, ``batch_size``, ``num_workers``, ``group_size`` (models evaluated
    together on one pass over the images), ``device`` (``auto``), ``threads``.
    Every key is required (:class:`ClipSoupsSettings`). Writes ``out_dir/zoo.json`` and returns its content.
    """
    from companion.assets.imagenet import ImageNetAssets

    s = paper_settings("clip_soups", params)
    man, root, indices = _checked_selection(s, "vision", "clip_soups", "models")

    t0 = time.perf_counter()
    device = resolve_device(s.device)
    expect = _clip_expect(s.expect)
    num_classes = s.num_classes
    image_size = s.image_size
    imagenet = ImageNetAssets(root, image_size=image_size, manifest=man)
    seed = s.error_seed
    n_train, n_test = s.train_error_images, s.test_error_images
    idx = {"train": imagenet.error_indices("train", n_train, seed),
           "val": imagenet.error_indices("val", n_test, seed)}
    imagenet.val  # noqa: B018 (checks that val/ has the class folders of train/)
    bs, workers = s.batch_size, s.num_workers
    group = max(1, s.group_size)
    paths = {i: root / "clip_soups" / f"model_{i}.pt" for i in indices}

    # Architecture and size from the first model (every model is checked against `expect` when loaded).
    from companion.assets.clip_soups import infer_vision_config, load_clip_finetune

    first = load_clip_finetune(paths[indices[0]], expect=expect, num_classes=num_classes)
    n_parameters = sum(p.numel() for p in first.parameters())
    config = infer_vision_config({k[len("visual."):]: v for k, v in first.state_dict().items()
                                  if k.startswith("visual.")})
    n_out = first.classification_head.out_features
    del first
    if n_out != len(imagenet.train.classes):
        raise ValueError(f"the models have {n_out} outputs but {imagenet.train_dir} has "
                         f"{len(imagenet.train.classes)} classes")

    errors: dict[int, dict[str, Any]] = {i: {} for i in indices}
    groups = [indices[k:k + group] for k in range(0, len(indices), group)]
    bar = tqdm(total=len(indices) * 2, desc="clip soups errors", unit="model·split", disable=not progress)
    for g in groups:
        models = [_clip_loader(paths[i], expect, num_classes, device)() for i in g]
        for split in ("train", "val"):
            dl = imagenet.loader(split, idx[split], batch_size=bs, num_workers=workers,
                                 pin_memory=device.type == "cuda")
            counts = _count_errors(models, dl, device, f"{split} {g[0]}-{g[-1]}", progress,
                                   lambda x, d: x.to(d, non_blocking=True))
            for i, (w, n) in zip(g, counts):
                errors[i][split] = (w, n)
            bar.update(len(g))
        del models
    bar.close()

    members = []
    for i in indices:
        (w_tr, n_tr), (w_te, n_te) = errors[i]["train"], errors[i]["val"]
        members.append(dict(
            name=f"model_{i}", index=i, file=f"clip_soups/model_{i}.pt",
            train_error=w_tr / n_tr, test_error=w_te / n_te, gap=w_te / n_te - w_tr / n_tr,
            train_wrong=w_tr, n_train=n_tr, test_wrong=w_te, n_test=n_te,
        ))
    meta = dict(
        kind="clip_soups", format=ZOO_FORMAT,
        assets_root=_path_or_none(s.assets_root), manifest=_path_or_none(s.manifest),
        model=config, n_parameters=n_parameters, num_classes=n_out, expect=expect, image_size=image_size,
        n_fit=int(len(imagenet.fit_indices())),
        errors=dict(
            train=dict(split="ImageNet train, the 98 % the models were fine-tuned on",
                       n_images=int(len(idx["train"])), all=n_train is None, seed=seed),
            test=dict(split="ImageNet validation", n_images=int(len(idx["val"])), all=n_test is None, seed=seed),
        ),
        device=str(device), params=dataclasses.asdict(s),
        seconds_total=time.perf_counter() - t0, members=members,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "zoo.json", meta)
    return meta


def clip_soups_loaders(meta: Mapping[str, Any], device: str | None = "auto") -> list[tuple[str, Callable]]:
    """``[(name, loader)]`` of a ``clip_soups`` zoo; each loader returns the model in eval mode on ``device``."""
    if meta["kind"] != "clip_soups":
        raise ValueError(f"not a clip_soups zoo (kind {meta['kind']!r})")
    root = _root(meta["assets_root"], _manifest(meta["manifest"]))
    dev = resolve_device(device)
    return [(m["name"], _clip_loader(root / m["file"], meta["expect"], meta["num_classes"], dev))
            for m in meta["members"]]


def load_clip_soups_zoo(zoo_dir: str | os.PathLike, device: str | None = "auto") -> tuple[dict, list]:
    """``(meta, [(name, loader), ...])`` of a ``clip_soups`` zoo folder (as ``vision_zoo.load_zoo``)."""
    meta = json.loads((Path(zoo_dir) / "zoo.json").read_text())
    return meta, clip_soups_loaders(meta, device)


def clip_soups_sharpness_batches(meta: Mapping[str, Any], n_images: int = 2048, batch_size: int = 256,
                                 seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n_images`` training images of the 98 % split (seeded), CLIP-preprocessed, in batches."""
    from companion.assets.imagenet import ImageNetAssets

    man = _manifest(meta["manifest"])
    assets = ImageNetAssets(_root(meta["assets_root"], man), image_size=int(meta["image_size"]), manifest=man)
    return assets.sharpness_batches(n_images, batch_size, seed)


# --------------------------------------------------------------------------- McCoy et al.'s BERTs


def _bert_loader(run: int, root: Path, manifest, device: torch.device, dtype=torch.float32):
    def load():
        from companion.assets.bert_mcoy import load_mccoy_bert

        return load_mccoy_bert(run, root=root, manifest=manifest, dtype=dtype).to(device).eval()

    return load


def build_mccoy_zoo(out_dir: str | os.PathLike, params: "McCoySettings | Mapping[str, Any]", *,
                    progress: bool = True) -> dict:
    """Describe McCoy et al.'s MNLI fine-tunes as a zoo: errors, gaps and where everything is.

    ``params`` (``language_train.paper``): ``runs`` (indices, null = 0..34),
    ``assets_root``/``manifest``, ``train_error_pairs`` (a seeded subset of MNLI
    train; null = all 392,702), ``test_error_pairs`` (of dev matched; null = all
    9,815), ``error_seed``, ``batch_size``, ``max_seq_length`` (128), ``prefer``
    (``tsv`` or ``jsonl`` when both are present), ``device``, ``threads``.
    Writes ``out_dir/zoo.json`` (``kind: "mccoy_bert"``, in the language zoo's
    format: ``models``, ``spec.model``, ``spec.max_length``, ``n_parameters``). Every key is required
    (:class:`McCoySettings`).
    """
    from companion.assets.bert_mcoy import BASE_DIR, bert_config, mccoy_tokenizer
    from companion.assets.mnli import iter_batches, load_mnli

    s = paper_settings("mccoy_bert", params)
    man, root, runs = _checked_selection(s, "language", "mccoy_bert", "runs")

    t0 = time.perf_counter()
    device = resolve_device(s.device)
    max_len = s.max_seq_length
    bs = s.batch_size
    seed = s.error_seed
    data = load_mnli(root, manifest=man, prefer=s.prefer)
    tok = mccoy_tokenizer(root, manifest=man)
    rng = np.random.default_rng(seed)
    n_train, n_test = s.train_error_pairs, s.test_error_pairs

    def subset(n, total):
        if n is None or int(n) >= total:
            return np.arange(total)
        return np.sort(rng.choice(total, size=int(n), replace=False))

    idx = {"train": subset(n_train, len(data.train)), "test": subset(n_test, len(data.dev_matched))}
    pairs = {"train": data.train, "test": data.dev_matched}
    # Tokenised once (the slow part on a CPU), reused for every model.
    encoded = {split: [(_trim(x), y) for x, y in tqdm(
        iter_batches(pairs[split], tok, batch_size=bs, max_seq_length=max_len, indices=idx[split]),
        total=-(-len(idx[split]) // bs), desc=f"tokenising {split}", leave=False, disable=not progress)]
        for split in ("train", "test")}

    cfg = bert_config(root / "mccoy_bert" / BASE_DIR / "bert_config.json")
    records, n_parameters = [], None
    to_device = lambda x, d: {k: v.to(d) for k, v in x.items()}
    bar = tqdm(runs, desc="mccoy berts", unit="model", disable=not progress)
    for run in bar:
        model = _bert_loader(run, root, man, device)()
        if n_parameters is None:
            n_parameters = sum(p.numel() for p in model.parameters())
        res = {split: _count_errors([model], encoded[split], device, split, progress, to_device)[0]
               for split in ("train", "test")}
        del model
        (w_tr, n_tr), (w_te, n_te) = res["train"], res["test"]
        records.append(dict(
            name=f"bert_{run:02d}", run=run, seed=run, train_error=w_tr / n_tr, test_error=w_te / n_te,
            gap=w_te / n_te - w_tr / n_tr, train_wrong=w_tr, n_train=n_tr, test_wrong=w_te, n_test=n_te,
        ))
        bar.set_postfix(train=f"{w_tr / n_tr:.3f}", test=f"{w_te / n_te:.3f}")
    zoo = dict(
        kind="mccoy_bert", format=ZOO_FORMAT,
        assets_root=_path_or_none(s.assets_root), manifest=_path_or_none(s.manifest),
        spec=dict(model=dict(hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
                             num_attention_heads=cfg.num_attention_heads, intermediate_size=cfg.intermediate_size,
                             vocab_size=cfg.vocab_size, hidden_act=cfg.hidden_act),
                  max_length=max_len, labels=["contradiction", "entailment", "neutral"]),
        n_parameters=int(n_parameters), mnli_source=data.source,
        errors=dict(
            train=dict(split="MNLI train", n_pairs=int(len(idx["train"])), all=n_train is None,
                       total=len(data.train), seed=seed),
            test=dict(split="MNLI dev matched", n_pairs=int(len(idx["test"])), all=n_test is None,
                      total=len(data.dev_matched), seed=seed),
        ),
        device=str(device), params=dataclasses.asdict(s),
        seconds_total=time.perf_counter() - t0, models=records,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "zoo.json", zoo)
    return zoo


def mccoy_loaders(zoo: Mapping[str, Any], names: Sequence[str] | None = None,
                  device: str | None = "auto") -> list[tuple[str, Callable]]:
    """``[(name, loader)]`` of a ``mccoy_bert`` zoo; each loader converts its TF checkpoint on the fly."""
    if zoo["kind"] != "mccoy_bert":
        raise ValueError(f"not a mccoy_bert zoo (kind {zoo['kind']!r})")
    man = _manifest(zoo["manifest"])
    root = _root(zoo["assets_root"], man)
    dev = resolve_device(device)
    runs = {m["name"]: int(m["run"]) for m in zoo["models"]}
    names = list(runs) if names is None else list(names)
    unknown = [n for n in names if n not in runs]
    if unknown:
        raise KeyError(f"models {unknown} are not in the zoo ({sorted(runs)})")
    return [(n, _bert_loader(runs[n], root, man, dev)) for n in names]


def load_mccoy_zoo(zoo_dir: str | os.PathLike, device: str | None = "auto") -> tuple[dict, list]:
    """``(zoo, [(name, loader), ...])`` of a ``mccoy_bert`` zoo folder."""
    zoo = json.loads((Path(zoo_dir) / "zoo.json").read_text())
    return zoo, mccoy_loaders(zoo, device=device)


def mccoy_sharpness_batches(zoo: Mapping[str, Any], n_pairs: int = 1024, batch_size: int = 128,
                            seed: int = 0, max_seq_length: int | None = None) -> list[tuple[dict, torch.Tensor]]:
    """``n_pairs`` MNLI training pairs (seeded) in batches, tokenised with the release's vocabulary.

    Padded to ``max_seq_length`` (the zoo's, 128) as run_classifier.py did, then the
    padding beyond each batch's longest pair is dropped: the attention mask hides it,
    so the loss is the same and the sharpness search is cheaper.
    """
    from companion.assets.bert_mcoy import mccoy_tokenizer
    from companion.assets.mnli import load_mnli, mnli_sharpness_batches

    man = _manifest(zoo["manifest"])
    root = _root(zoo["assets_root"], man)
    data = load_mnli(root, manifest=man, prefer=zoo["mnli_source"])
    tok = mccoy_tokenizer(root, manifest=man)
    length = int(max_seq_length if max_seq_length is not None else zoo["spec"]["max_length"])
    batches = mnli_sharpness_batches(data.train, tok, n_pairs=int(n_pairs), batch_size=int(batch_size),
                                     seed=int(seed), max_seq_length=length)
    return [(_trim(x), y) for x, y in batches]


# --------------------------------------------------------------------------- as zoo sources


class _PaperZoo:
    """What the paper's two zoos share as :class:`companion.experiments.zoo.ZooSource`: no per-example
    errors are kept, and one set of sharpness examples is drawn."""

    kind = ""
    _members = ""          # the zoo.json key of the member list

    def __init__(self, zoo_dir: Path, meta: dict):
        self.zoo_dir, self.meta = Path(zoo_dir), meta

    def member_table(self):
        import pandas as pd

        return pd.DataFrame(self.meta[self._members]).set_index("name")

    def eval_errors(self, names: Sequence[str]) -> None:
        return None

    def retest_batches(self, n_points: int, batch_size: int, seed: int):
        raise ValueError(f"a test-retest on a second set needs two disjoint example sets; the {self.kind} zoo "
                         "draws one (set retest: false in the paper profile)")


class McCoyZoo(_PaperZoo):
    """McCoy et al.'s BERTs (:func:`build_mccoy_zoo`) as a :class:`companion.experiments.zoo.ZooSource`."""

    kind, _members = "mccoy_bert", "models"

    def description(self) -> str:
        return f"{self.kind}: {len(self.meta['models'])} seed-only fine-tunes"

    def loaders(self, names: Sequence[str] | None = None, device: str | None = "cpu"):
        return mccoy_loaders(self.meta, names, device)

    def sharpness_batches(self, n_points: int, batch_size: int, seed: int):
        return mccoy_sharpness_batches(self.meta, n_points, batch_size, seed)


class ClipSoupsZoo(_PaperZoo):
    """The model-soups CLIP fine-tunes (:func:`build_clip_soups_zoo`) as a
    :class:`companion.experiments.zoo.ZooSource`."""

    kind, _members = "clip_soups", "members"

    def description(self) -> str:
        return f"model-soups CLIP zoo ({len(self.meta['members'])} ViT-B/32 fine-tunes on ImageNet)"

    def loaders(self, names: Sequence[str] | None = None, device: str | None = "cpu"):
        every = dict(clip_soups_loaders(self.meta, device))
        names = list(every) if names is None else list(names)
        unknown = [n for n in names if n not in every]
        if unknown:
            raise KeyError(f"models {unknown} are not in the zoo ({sorted(every)})")
        return [(n, every[n]) for n in names]

    def sharpness_batches(self, n_points: int, batch_size: int, seed: int):
        return clip_soups_sharpness_batches(self.meta, n_points, batch_size, seed)
