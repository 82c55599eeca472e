"""The time budget of ``make repro`` (cpu profile), per stage, for the README (issue 24 item 7).

Every number comes from a file under ``reports/timings/`` (git only, never a DVC output):

0. a **complete timed fresh-clone rebuild** (``fresh_clone.log`` from ``benchmarks/timed_repro.sh``, every step
   ended with rc 0 and every stage the profile runs timed there, as a step of its own, ``force:<stage>`` or
   ``<stage>``, or inside a plain ``repro`` step, from its ``STAGE`` line to the next stage's or the step's end):
   each stage's time — the one run the budget is about, so it comes first;
1. ``<stage>.json``'s ``stage_wall_s`` — the stage's own wall time at its last run, written by
   :func:`companion.pipeline.run_stage` for a notebook stage and by the command of ``language_retest`` and
   ``table1``;
2. else the timed fresh-clone run (``fresh_clone_stages.txt``: a notebook stage's closing line
   ``stage <name> (<profile>) done in <s>s``; ``fresh_clone.log``: a step ``END <name> rc=0 seconds=<s>``
   that is one stage, ``language_train``);
3. else the stage's own ``total`` (``vision_train.json``);

and a stage with none of these is listed as "not timed". A complete rebuild (rule 0) makes the block state the
run's own total, ``make setup`` included. Stages the cpu profile skips count 0 minutes and say why
(:func:`cpu_skipped`, from ``params.yaml``: section ``skipped_stages`` (:mod:`companion.skipped`), and
``language_stability``'s ``n_zoos: 0``), whatever an earlier run's timing file says. The block states the sum, and
that the sum was **not** measured as one fresh-clone run unless such a run is recorded for it.

``python -m companion.budget [--timings reports/timings] [--readme README.md]`` prints the block (and
replaces the README's ``budget`` block).
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from companion.params import load_yaml


REPO_ROOT = Path(__file__).resolve().parents[1]
README_BEGIN, README_END = "<!-- budget:begin (python -m companion.budget --readme README.md) -->", "<!-- budget:end -->"
_STAGE_LINE = re.compile(r"stage (\S+) \((\w+)\) done in ([\d.]+)s")
_END_LINE = re.compile(r"^\d\d:\d\d:\d\d END (?:force:)?(\S+) rc=0 seconds=(\d+)$")
_STEP_START = re.compile(r"^\d\d:\d\d:\d\d START (\S+)$")
_STEP_END = re.compile(r"^\d\d:\d\d:\d\d END (\S+) rc=(-?\d+) seconds=(\d+)$")
_STAGE_START = re.compile(r"^(\d\d):(\d\d):(\d\d) STAGE (\S+)$")    # a stage starting inside a plain `repro` step
_CLOCK = re.compile(r"^(\d\d):(\d\d):(\d\d) ")
PARAMS = REPO_ROOT / "params.yaml"


def cpu_skipped(params: str | Path = PARAMS) -> dict[str, str]:
    """``stage -> reason`` for the stages the cpu profile does not run (their command writes a record saying so, in
    seconds): ``params.yaml``'s ``skipped_stages.cpu`` and ``language_stability`` when its ``n_zoos`` is 0."""
    from companion.params import stage_params
    from companion.skipped import skipped_stages

    out = dict(skipped_stages("cpu", params)[1])
    if stage_params("language_stability", "cpu", path=params)[1].get("n_zoos") == 0:
        out["language_stability"] = "not run in the cpu profile (n_zoos: 0)"
    return out


def stages(dvc_yaml: str | Path = REPO_ROOT / "dvc.yaml") -> list[str]:
    """The pipeline's stages in ``dvc.yaml``'s order."""
    return list(load_yaml(Path(dvc_yaml).read_text())["stages"])


def full_rebuild(timings: str | Path, names: list[str], skipped: dict[str, str] | None = None) -> dict | None:
    """The complete timed fresh-clone rebuild of rule 0 (module docstring) as ``{"steps": {step: seconds},
    "total": seconds, "stopped": {step: seconds}}`` (``stopped``: attempts that failed and were run again in the
    same log, not counted), or None when ``fresh_clone.log`` is absent, has a step that failed or never ended, or
    leaves a stage the profile runs (``names`` less ``skipped``) without a step of its own."""
    log = Path(timings) / "fresh_clone.log"
    if not log.is_file():
        return None
    started, ended, stopped = [], {}, {}
    marks: list[tuple[str, int]] = []           # (stage, clock seconds): the STAGE lines of the `repro` step
    in_repro, repro_end = False, 0
    for line in log.read_text().splitlines():
        ln = line.strip()
        if m := _STEP_START.match(ln):
            if m[1] in ended and ended[m[1]][0] != 0:        # a failed attempt, run again: not counted
                stopped[m[1].removeprefix("force:")] = ended.pop(m[1])[1]
            started.append(m[1])
            in_repro = m[1] == "repro"
            if in_repro:
                marks = []
        elif m := _STEP_END.match(ln):
            ended[m[1]] = (int(m[2]), float(m[3]))
            if m[1] == "repro":
                in_repro, repro_end = False, _seconds(_CLOCK.match(ln))
        elif in_repro and (m := _STAGE_START.match(ln)):
            marks.append((m[4], _seconds(m)))
    if not started or any(ended.get(n, (1,))[0] != 0 for n in started):
        return None
    in_repro_secs: dict[str, float] = {}
    for (name, t0), t1 in zip(marks, [t for _, t in marks[1:]] + [repro_end]):
        in_repro_secs[name] = in_repro_secs.get(name, 0.0) + float((t1 - t0) % 86400)   # the UTC clock wraps
    secs: dict[str, float] = {}
    for n in dict.fromkeys(started):
        if n == "repro":
            secs.update(in_repro_secs)
        else:
            secs[n.removeprefix("force:")] = ended[n][1]
    skipped = cpu_skipped() if skipped is None else skipped
    if any(n not in secs for n in names if n not in skipped):
        return None
    forced = list(dict.fromkeys(n.removeprefix("force:") for n in started if n not in ("setup", "repro")))
    return {"steps": secs, "total": sum(secs.values()), "stopped": stopped,
            "in_repro": [n for n in in_repro_secs if n not in forced], "forced": forced}


def _seconds(m: re.Match) -> int:
    return int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3])


def stage_seconds(timings: str | Path, names: list[str],
                  skipped: dict[str, str] | None = None) -> dict[str, tuple[float | None, str]]:
    """``stage -> (seconds or None, source)`` by the rules of the module docstring; ``skipped``: the stages the
    profile does not run, with why (default: :func:`cpu_skipped`)."""
    skipped = cpu_skipped() if skipped is None else skipped
    t = Path(timings)
    fresh = {}
    if (t / "fresh_clone_stages.txt").is_file():
        fresh |= {m[1]: float(m[3]) for m in _STAGE_LINE.finditer((t / "fresh_clone_stages.txt").read_text())}
    if (t / "fresh_clone.log").is_file():
        for line in (t / "fresh_clone.log").read_text().splitlines():
            if (m := _END_LINE.match(line.strip())) and m[1] in names:
                fresh.setdefault(m[1], float(m[2]))
    rebuild = full_rebuild(t, names, skipped)
    out = {}
    for s in names:
        own = json.loads((t / f"{s}.json").read_text()) if (t / f"{s}.json").is_file() else {}
        if s in skipped:
            out[s] = (0.0, skipped[s])
        elif rebuild is not None:
            out[s] = (rebuild["steps"][s], "the timed fresh-clone rebuild (reports/timings/fresh_clone.log)")
        elif "stage_wall_s" in own:
            out[s] = (float(own["stage_wall_s"]), f"its last run (reports/timings/{s}.json)")
        elif s in fresh:
            out[s] = (fresh[s], "the timed fresh-clone run (reports/timings/fresh_clone*)")
        elif isinstance(own.get("total"), (int, float)):
            out[s] = (float(own["total"]), f"its own total (reports/timings/{s}.json)")
        else:
            out[s] = (None, "not timed")
    return out


def block(timings: str | Path = REPO_ROOT / "reports" / "timings", dvc_yaml: str | Path = REPO_ROOT / "dvc.yaml",
          *, new_stages: tuple[str, ...] = ()) -> str:
    """The README block: a table of minutes per stage with its source, the sum, and what was not measured."""
    names = stages(dvc_yaml)
    secs = stage_seconds(timings, names)
    rows = [f"| {s}{' (new)' if s in new_stages else ''} | "
            + ("–" if v is None else f"{v / 60:.1f}") + f" | {src} |" for s, (v, src) in secs.items()]
    total = sum(v for v, _ in secs.values() if v is not None)
    untimed = [s for s, (v, _) in secs.items() if v is None]
    rebuild = full_rebuild(timings, names)
    if rebuild is not None:
        setup = rebuild["steps"].get("setup")
        timed = "each timed from its start to the next stage's"
        if rebuild["in_repro"] and rebuild["forced"]:
            how = ("a plain `dvc repro`, as `make repro` runs it, which ran " + ", ".join(f"`{n}`" for n in
                                                                                   rebuild["in_repro"])
                   + f" ({timed}), then every other stage rebuilt with `dvc repro -f -s <stage>`, one after another")
        elif rebuild["in_repro"]:
            how = f"a plain `dvc repro`, as `make repro` runs it, which ran every stage ({timed})"
        else:
            how = "every stage, each rebuilt with `dvc repro -f -s <stage>`, one after another"
        return "\n".join([
            README_BEGIN,
            f"**Measured as one run, cpu profile: {rebuild['total'] / 60:.0f} minutes** — a fresh clone's "
            + (f"`make setup` ({setup / 60:.1f} min) and then " if setup is not None else "")
            + f"{how} (stages {total / 60:.0f} minutes), on the 2-core machine (`benchmarks/timed_repro.sh`; log "
            "`reports/timings/fresh_clone.log`)"
            + "".join(f"; not counted: a stopped attempt of `{n}` ({v / 60:.0f} min), re-run in the same run after the "
                      "change the log states" for n, v in rebuild["stopped"].items()) + ".",
            "", "| stage | minutes | measured on |", "|---|---|---|", *rows, README_END])
    lines = [README_BEGIN,
             f"**Per stage, cpu profile: {total / 60:.0f} minutes in all** (the sum of the stages' own times below, "
             "taken from different runs; `make setup` not included).",
             "", "| stage | minutes | measured on |", "|---|---|---|", *rows, "",
             "A fresh clone's `make repro` of this total was not timed as one run in the session that added "
             + (", ".join(f"`{s}`" for s in new_stages) if new_stages else "the newest stages")
             + "; the one timed fresh-clone run is the block above."
             + (f" Not timed: {', '.join(untimed)}." if untimed else ""),
             README_END]
    return "\n".join(lines)


def update_readme(readme: str | Path, text: str) -> None:
    body = Path(readme).read_text()
    a, b = body.find(README_BEGIN), body.find(README_END)
    if a < 0 or b < a:
        raise ValueError(f"{readme} has no budget block ({README_BEGIN!r} … {README_END!r})")
    Path(readme).write_text(body[:a] + text + body[b + len(README_END):])


#: the stages added since the last timed fresh-clone rebuild (labelled "new" in the block)
NEW_STAGES: tuple[str, ...] = ()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m companion.budget", description=__doc__.split("\n")[0])
    ap.add_argument("--timings", default=str(REPO_ROOT / "reports" / "timings"))
    ap.add_argument("--dvc-yaml", default=str(REPO_ROOT / "dvc.yaml"))
    ap.add_argument("--readme", default=None)
    args = ap.parse_args(argv)
    text = block(args.timings, args.dvc_yaml, new_stages=NEW_STAGES)
    if args.readme:
        update_readme(args.readme, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
