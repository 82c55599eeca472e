"""Stages a profile does not run: their command writes, in seconds, outputs that say so (issue 24 item 7).

The cpu profile's ``make repro`` must fit its time budget, and the issue says to drop secondary experiments
before weakening a primary protocol. ``params.yaml`` section ``skipped_stages`` (``defaults`` and one mapping per
profile, like every section) maps a stage to the reason its profile does not run it. A skipped stage's ``cmd``
in ``dvc.yaml`` is wrapped::

    python -m companion.skipped <stage> [--profile P] -- <the stage's own command ...>

which runs the stage's own command (``os.execvp``, nothing else changes) unless the profile skips ``<stage>``.
When it does, nothing is trained or measured: every output ``dvc.yaml`` declares for the stage (``outs`` and
``metrics``) is replaced by a record of the skip, so DVC finds all its outputs and no number of an earlier run
survives in them:

* a folder: emptied, holding only :data:`MARKER` (``{"stage", "profile", "skipped": <reason>}``);
* a ``.json`` file (the metrics file): the same record with ``"table1": []`` (no Table 1 line); a DVC ``metrics``
  file (the headline ``dvc metrics show`` prints): ``{"skipped": [<stage> (<profile>): <reason>], "table1": []}``,
  lists only, which ``dvc metrics show`` does not print (its table keeps its columns);
* a ``.ipynb`` (the published notebook): one markdown cell stating the reason (cell id ``<stage>-00``).

The records hold no time and no machine path (the same bytes on every run). Downstream:
:mod:`companion.experiments.paired` reads :data:`MARKER` in a row's data folder and reports the row as not run;
:mod:`companion.experiments.table1` lists every metrics file with ``"skipped"`` under the table;
:mod:`companion.budget` counts a skipped stage as 0 minutes with its reason (:func:`skipped_stages`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Sequence
from companion.params import load_yaml


REPO_ROOT = Path(__file__).resolve().parents[1]
SECTION = "skipped_stages"
#: the record a skipped stage leaves in each of its output folders (read by companion.experiments.paired)
MARKER = "skipped.json"


def skipped_stages(profile: str | None = None, path: str | os.PathLike | None = None) -> tuple[str, dict[str, str]]:
    """``(profile, {stage: reason})``: the stages ``profile`` (default: ``params.yaml``'s) does not run."""
    from companion.params import stage_params

    profile, skips = stage_params(SECTION, profile, path=path)
    bad = {k: v for k, v in skips.items() if not (isinstance(v, str) and v.strip())}
    if bad:
        raise ValueError(f"params.yaml {SECTION}.{profile}: every entry must be a stage name with its reason (text); "
                         f"got {bad}")
    return profile, dict(skips)


def record(stage: str, profile: str, reason: str) -> dict:
    """What every output of a skipped stage says."""
    return {"stage": stage, "profile": profile, "skipped": reason}


def declared_outputs(stage: str, dvc_yaml: str | os.PathLike = REPO_ROOT / "dvc.yaml",
                     kind: str | None = None) -> list[str]:
    """The paths ``dvc.yaml`` declares as the stage's ``outs`` and ``metrics`` (or only those of ``kind``),
    relative to the repository."""
    stages = load_yaml(Path(dvc_yaml).read_text())["stages"]
    if stage not in stages:
        raise ValueError(f"{dvc_yaml} has no stage {stage!r}")
    out = []
    for key in ("outs", "metrics") if kind is None else (kind,):
        for item in stages[stage].get(key, []):
            out.append(item if isinstance(item, str) else next(iter(item)))
    return out


def _notebook(stage: str, text: str):
    import nbformat

    cell = nbformat.v4.new_markdown_cell(f"# Stage `{stage}`: not run\n\n{text}")
    cell["id"] = f"{stage}-00"    # the id companion.pipeline.scrub_notebook gives (no random id)
    return nbformat.v4.new_notebook(cells=[cell])


def write_skipped(stage: str, profile: str, reason: str, root: str | os.PathLike = REPO_ROOT,
                  dvc_yaml: str | os.PathLike | None = None) -> list[Path]:
    """Replace every output ``dvc_yaml`` (default: this checkout's) declares for ``stage``, under ``root``, by the
    record of its skip; returns the files written."""
    root = Path(root)
    rec = record(stage, profile, reason)
    text = json.dumps(rec, indent=1, sort_keys=True) + "\n"
    written = []
    dvc_yaml = dvc_yaml if dvc_yaml is not None else REPO_ROOT / "dvc.yaml"
    for rel in declared_outputs(stage, dvc_yaml, "metrics"):   # headlines: lists only (dvc metrics show skips them)
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"skipped": [f"{stage} ({profile}): {reason}"], "table1": []}, indent=1) + "\n")
        written.append(p)
    for rel in declared_outputs(stage, dvc_yaml, "outs"):
        p = root / rel
        if p.suffix == ".json":
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps({**rec, "table1": []}, indent=1, sort_keys=True) + "\n")
        elif p.suffix == ".ipynb":   # written as companion.pipeline.scrub_notebook writes (its normalised bytes)
            import nbformat

            p.parent.mkdir(parents=True, exist_ok=True)
            nbformat.write(_notebook(stage, f"Profile `{profile}`: {reason}."), str(p))
        elif p.suffix:
            raise ValueError(f"stage {stage}: cannot write the record of a skip as {rel} (a folder, .json or .ipynb "
                             "output only); declare such an output differently or do not skip the stage")
        else:   # a folder: no file of an earlier run stays
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
            p.mkdir(parents=True)
            p = p / MARKER
            p.write_text(text)
        written.append(p)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    import sys

    args_in = sys.argv[1:] if argv is None else list(argv)
    if "--" not in args_in:
        print("error: usage: python -m companion.skipped <stage> [--profile P] -- <command ...>", file=sys.stderr)
        return 2
    cut = args_in.index("--")
    ap = argparse.ArgumentParser(prog="python -m companion.skipped", description=__doc__.splitlines()[0])
    ap.add_argument("stage")
    ap.add_argument("--profile", default=None, help="parameter profile (default: params.yaml's `profile`, which the "
                                                    "stage's own command reads too)")
    ap.add_argument("--params", default=None, help="params.yaml (default: the repository's)")
    ap.add_argument("--root", default=str(REPO_ROOT), help="where the outputs go (default: this checkout)")
    args = ap.parse_args(args_in[:cut])
    command = args_in[cut + 1:]
    if not command:
        ap.error("name the stage's own command after `--`")
    profile, skips = skipped_stages(args.profile, args.params)
    if args.stage not in skips:
        sys.stdout.flush()
        os.execvp(command[0], command)
    for p in write_skipped(args.stage, profile, skips[args.stage], args.root):
        print(f"  wrote {p}")
    print(f"stage {args.stage} ({profile}): {skips[args.stage]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
