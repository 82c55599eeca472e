"""The manifest of the paper's assets, and the check that they are on disk.

``data/manifest.yaml`` lists every file the ``paper`` profile reads, where it
goes below ``data/paper/``, what it holds and where it comes from publicly.
:func:`check_assets` compares that list with the disk and, when anything is
missing, raises one :class:`MissingAssetsError` whose message names every
missing path and its origin. ``python -m companion.assets check`` prints that
message (no stack trace) and exits with status 2.

Example
-------
>>> from companion.assets import check_assets, MissingAssetsError
>>> try:
...     check_assets("vision", root="/nonexistent")
... except MissingAssetsError as err:
...     print(err.missing[0].group)
clip_soups
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence


from hideseek.open_clip_finetune import CheckpointError
from companion.params import load_yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MANIFEST = REPO_ROOT / "data" / "manifest.yaml"

IMAGE_SUFFIXES = (".jpeg", ".jpg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class AssetError(CheckpointError):
    """An asset is on disk but is not what the manifest describes."""


@dataclass(frozen=True)
class MissingAsset:
    """One missing (or incomplete) item of the manifest."""

    group: str
    path: str            # where it must go (a pattern with {i} for indexed files)
    indices: tuple = ()  # which indices of an indexed pattern are missing
    reason: str = "missing"
    alternative: str | None = None  # for groups that accept one of several file sets

    def describe(self) -> str:
        where = self.path
        if self.indices:
            n = len(self.indices)
            where += f"  for i in {_ranges(self.indices)} ({n} file{'s' if n != 1 else ''})"
        return where if self.reason == "missing" else f"{where}  ({self.reason})"


class MissingAssetsError(FileNotFoundError):
    """Raised once, listing every missing asset with where to put it and its origin."""

    def __init__(self, missing: Sequence[MissingAsset], manifest: "Manifest", root: Path):
        self.missing = list(missing)
        self.root = Path(root)
        self.manifest_path = manifest.path
        super().__init__(self._message(manifest))

    def _message(self, manifest: "Manifest") -> str:
        lines = [
            f"The paper's assets are incomplete: {self.count} file(s) or folder(s) "
            f"missing below {self.root}.",
            f"Put each file at the path shown (manifest: {self.manifest_path};",
            "how to obtain them: data/README.md). Nothing has been computed.",
        ]
        for group in dict.fromkeys(m.group for m in self.missing):
            g = manifest.groups[group]
            lines += ["", f"[{group}] {g['title']}", f"  origin: {_oneline(g['origin'])}"]
            items = [m for m in self.missing if m.group == group]
            alts = list(dict.fromkeys(m.alternative for m in items))
            for k, alt in enumerate(alts):
                indent = "  "
                if alt is not None:
                    lines.append(f"  {'either' if k == 0 else 'or'} ({alt}):")
                    indent = "    "
                lines += [f"{indent}- {m.describe()}" for m in items if m.alternative == alt]
        return "\n".join(lines)

    @property
    def count(self) -> int:
        """Number of missing files or folders (an indexed pattern counts once per index)."""
        return sum(max(1, len(m.indices)) for m in self.missing)

    def __str__(self) -> str:  # FileNotFoundError would otherwise print its args tuple
        return self.args[0]


@dataclass
class Manifest:
    """``data/manifest.yaml`` read into dictionaries."""

    path: Path
    root: Path
    settings: dict
    groups: dict
    sets: dict = field(default_factory=dict)

    def resolve_groups(self, what: str | Iterable[str]) -> list[str]:
        """Group names for a set name (``"paper"``, ``"vision"``), a group name or a list."""
        names = [what] if isinstance(what, str) else list(what)
        out: list[str] = []
        for name in names:
            if name in self.sets:
                out += self.sets[name]
            elif name in self.groups:
                out.append(name)
            else:
                raise ValueError(
                    f"unknown asset set or group {name!r}; sets: {sorted(self.sets)}, "
                    f"groups: {sorted(self.groups)}"
                )
        return list(dict.fromkeys(out))


def load_manifest(path: str | os.PathLike | None = None) -> Manifest:
    """Read the manifest (default ``data/manifest.yaml`` of this repository)."""
    path = Path(path) if path is not None else DEFAULT_MANIFEST
    with open(path) as f:
        raw = load_yaml(f)
    if not isinstance(raw, dict) or raw.get("version") != 1 or "groups" not in raw:
        raise AssetError(f"{path}: not a version-1 asset manifest")
    return Manifest(
        path=path,
        root=(path.parent / raw.get("root", "paper")).resolve(),
        settings=raw.get("settings", {}),
        groups=raw["groups"],
        sets=raw.get("sets", {}),
    )


def paper_settings(manifest: Manifest | None = None) -> dict:
    """The paper's protocol numbers (2048 images in batches of 256, 1024 pairs in batches of 128, ...)."""
    return (manifest or load_manifest()).settings


# --------------------------------------------------------------------------- checking


def _expand(entry: Mapping, select: Sequence[int] | None) -> list[tuple[int | None, str]]:
    pattern = entry["path"]
    if "indices" not in entry:
        return [(None, pattern)]
    idx = entry["indices"]
    indices = list(select) if select is not None else list(range(idx["start"], idx["stop"]))
    return [(i, pattern.format(i=i)) for i in indices]


def _present(root: Path, rel: str, entry: Mapping) -> str | None:
    """None when the item is there, else the reason it is not."""
    kind = entry.get("kind", "file")
    if kind == "file":
        if any(ch in rel for ch in "*?["):
            hits = [p for p in glob.glob(str(root / rel)) if os.path.isfile(p)]
            return None if hits else "missing"
        return None if (root / rel).is_file() else "missing"
    if kind == "image_folder":
        folder = root / rel
        if not folder.is_dir():
            return "missing"
        classes = [d for d in os.scandir(folder) if d.is_dir()]
        want = entry.get("classes")
        if not classes:
            return "no class sub-folders"
        if want is not None and len(classes) != want:
            return f"{len(classes)} class folders, expected {want}"
        return None
    raise AssetError(f"manifest entry {rel!r}: unknown kind {kind!r}")


def find_missing(
    what: str | Iterable[str] = "paper",
    *,
    root: str | os.PathLike | None = None,
    manifest: Manifest | str | os.PathLike | None = None,
    select: Mapping[str, Sequence[int]] | None = None,
) -> list[MissingAsset]:
    """Every missing item of the groups in ``what`` (empty when all is there)."""
    man = manifest if isinstance(manifest, Manifest) else load_manifest(manifest)
    root = Path(root) if root is not None else man.root
    select = dict(select or {})
    missing: list[MissingAsset] = []
    for group in man.resolve_groups(what):
        g = man.groups[group]
        if "alternatives" in g:
            per_alt = [
                _missing_in(group, alt["files"], root, select.get(group), alt["name"])
                for alt in g["alternatives"]
            ]
            if all(per_alt):  # no alternative is complete: list what each one lacks
                missing += [m for alt in per_alt for m in alt]
        else:
            missing += _missing_in(group, g["files"], root, select.get(group))
    return missing


def _missing_in(group: str, files: Sequence[Mapping], root: Path, select, alternative=None) -> list[MissingAsset]:
    out = []
    for entry in files:
        if entry.get("required", True) is False:
            continue
        absent: dict[str, list] = {}
        for i, rel in _expand(entry, select):
            reason = _present(root, rel, entry)
            if reason is not None:
                absent.setdefault(reason, []).append(i)
        for reason, idx in absent.items():
            shown = str(root / entry["path"])
            indices = tuple(i for i in idx if i is not None)
            out.append(MissingAsset(group, shown, indices, reason, alternative))
    return out


def check_assets(
    what: str | Iterable[str] = "paper",
    *,
    root: str | os.PathLike | None = None,
    manifest: Manifest | str | os.PathLike | None = None,
    select: Mapping[str, Sequence[int]] | None = None,
) -> Path:
    """Check that the assets of ``what`` are on disk; return the root.

    ``what``: a set name from the manifest (``"paper"``, ``"vision"``,
    ``"language"``), a group name (``"clip_soups"``, ``"imagenet"``,
    ``"mccoy_bert"``, ``"mnli"``) or a list of them. ``select`` narrows an
    indexed group to some indices, e.g. ``{"mccoy_bert": range(35)}``.

    Raises :class:`MissingAssetsError` (one error, listing everything missing).
    """
    man = manifest if isinstance(manifest, Manifest) else load_manifest(manifest)
    root = Path(root) if root is not None else man.root
    missing = find_missing(what, root=root, manifest=man, select=select)
    if missing:
        raise MissingAssetsError(missing, man, root)
    return root


def fingerprint(
    what: str | Iterable[str] = "paper",
    *,
    root: str | os.PathLike | None = None,
    manifest: Manifest | str | os.PathLike | None = None,
    select: Mapping[str, Sequence[int]] | None = None,
) -> dict:
    """A cheap description of the assets on disk (names, sizes, modification times).

    Written by the DVC stage ``paper_assets`` so that the stages reading the
    assets re-run when a file is replaced, without hashing hundreds of GB.
    Image folders are summarised by their per-class file counts.
    """
    man = manifest if isinstance(manifest, Manifest) else load_manifest(manifest)
    root = Path(root) if root is not None else man.root
    check_assets(what, root=root, manifest=man, select=select)
    out: dict = {}
    for group in man.resolve_groups(what):
        g = man.groups[group]
        entries = list(g.get("files", []))
        for alt in g.get("alternatives", []):
            if not _missing_in(group, alt["files"], root, (select or {}).get(group)):
                entries = list(alt["files"])
                break
        items = {}
        for entry in entries:
            for _, rel in _expand(entry, (select or {}).get(group)):
                if entry.get("kind", "file") == "image_folder":
                    folder = root / rel
                    counts = {d.name: sum(1 for _ in os.scandir(d.path)) for d in os.scandir(folder) if d.is_dir()}
                    digest = hashlib.sha256(json.dumps(sorted(counts.items())).encode()).hexdigest()
                    items[rel] = {"classes": len(counts), "files": sum(counts.values()), "listing_sha256": digest}
                else:
                    for p in sorted(glob.glob(str(root / rel))):
                        st = os.stat(p)
                        items[os.path.relpath(p, root)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        out[group] = items
    return out


# --------------------------------------------------------------------------- formatting


def _ranges(indices: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    idx = sorted(set(indices))
    parts, start, prev = [], None, None
    for i in idx:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = i
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ", ".join(parts)


def _oneline(text: str) -> str:
    return re.sub(r"\s+", " ", str(text)).strip()


def describe_manifest(manifest: Manifest | None = None) -> str:
    """A readable listing of every expected path, its format and origin."""
    man = manifest or load_manifest()
    lines = [f"root: {man.root}"]
    for name, g in man.groups.items():
        lines += ["", f"[{name}] {g['title']}", f"  origin: {_oneline(g['origin'])}"]
        alts = g.get("alternatives") or [{"name": None, "files": g["files"]}]
        for alt in alts:
            if alt["name"]:
                lines.append(f"  either ({alt['name']}):")
            for e in alt["files"]:
                rng = ""
                if "indices" in e:
                    rng = f"  for i in {e['indices']['start']}-{e['indices']['stop'] - 1}"
                lines.append(f"  - {e['path']}{rng}")
                lines.append(f"      {_oneline(e.get('format', e.get('kind', 'file')))}")
    return "\n".join(lines)
