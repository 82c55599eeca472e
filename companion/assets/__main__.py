"""Command line: ``python -m companion.assets {check,manifest,init}``.

``check`` verifies the paper's assets for the selected profile. For the
``paper`` profile a missing file ends the command with the one message of
:class:`~companion.assets.MissingAssetsError` on stderr (no stack trace) and
exit status 2. For other profiles it reports that no paper assets are read.
``--write FILE`` writes a JSON fingerprint of the assets (or, for other
profiles, a constant record), which the DVC stage ``paper_assets`` outputs so
that the stages reading the assets re-run when a file changes.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .manifest import REPO_ROOT, MissingAssetsError, describe_manifest, fingerprint, load_manifest

EXIT_MISSING = 2


def _profile_from_params(path: Path) -> str | None:
    if not path.is_file():
        return None
    from companion.params import load_yaml

    with open(path) as f:
        params = load_yaml(f) or {}
    return params.get("profile")


def _select_from_params(path: Path) -> dict:
    """Optional ``paper_assets: {paper: {select: {group: [indices]}}}`` in params.yaml."""
    if not path.is_file():
        return {}
    from companion.params import stage_params

    section = stage_params("paper_assets", "paper", path=path)[1]
    return {k: list(v) for k, v in (section.get("select") or {}).items()}


def _write(path: str, record: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    tmp.replace(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m companion.assets", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    chk = sub.add_parser("check", help="check that the paper's assets are on disk")
    chk.add_argument("--profile", help="cpu | gpu | paper (default: `profile` in params.yaml)")
    chk.add_argument("--what", nargs="+", default=["paper"], help="asset sets or groups (default: paper = all)")
    chk.add_argument("--root", help="folder holding the assets (default: data/paper)")
    chk.add_argument("--params", default=str(REPO_ROOT / "params.yaml"))
    chk.add_argument("--write", metavar="FILE", help="write a JSON fingerprint of the checked assets")
    sub.add_parser("manifest", help="print every expected file, its format and origin")
    init = sub.add_parser("init", help="create the empty folder layout below data/paper")
    init.add_argument("--root", help="default: data/paper")
    args = ap.parse_args(argv)

    man = load_manifest()
    if args.cmd == "manifest":
        print(describe_manifest(man))
        return 0
    if args.cmd == "init":
        root = Path(args.root) if args.root else man.root
        for g in man.groups.values():
            files = list(g.get("files", [])) + [f for a in g.get("alternatives", []) for f in a["files"]]
            for e in files:
                top = e["path"].split("/")[0]
                (root / top).mkdir(parents=True, exist_ok=True)
        print(f"created the folders of {', '.join(man.groups)} below {root}")
        return 0

    params = Path(args.params)
    profile = args.profile or _profile_from_params(params) or "cpu"
    # data.dvc records data/paper as an (empty) folder: make sure the folder exists, so that
    # `dvc status` / `dvc checkout` find it, whatever the profile.
    (Path(args.root) if args.root else man.root).mkdir(parents=True, exist_ok=True)
    if profile != "paper":
        print(f"profile {profile!r} reads none of the paper's assets; nothing to check.")
        if args.write:
            _write(args.write, {"profile": profile, "paper_assets": "not used"})
        return 0
    select = _select_from_params(params)
    try:
        record = fingerprint(args.what, root=args.root, manifest=man, select=select or None)
    except MissingAssetsError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_MISSING
    n = sum(len(v) for v in record.values())
    print(f"all paper assets present ({n} items in {', '.join(record)}) below {args.root or man.root}")
    if args.write:
        _write(args.write, {"profile": profile, "select": select, "assets": record})
    return 0


if __name__ == "__main__":
    sys.exit(main())
