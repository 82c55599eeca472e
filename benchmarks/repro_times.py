"""Per-stage wall times of a timed fresh-clone ``make repro`` (issue 16, item 8), from the log that
``benchmarks/timed_repro.sh`` writes, into ``reports/repro_times.md`` (the site's budget page; with
``--readme FILE``, also FILE's generated block).

Log lines (one START and one END per step, UTC clock)::

    07:00:37 START language_train
    07:41:02 END language_train rc=0 seconds=2425

``python -m benchmarks.repro_times LOG [--commit SHA] [--note TEXT] [--out reports/repro_times.md]
[--readme README.md] [--stage-output OUT ...]`` (the steps' outputs: each notebook stage's own
time is read from its closing line). A step that failed (rc ≠ 0) or never ended makes the report say the run is
incomplete, and no total is claimed. Timings live here, outside every DVC-hashed output.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

README_BEGIN, README_END = "<!-- repro-times:begin (python -m benchmarks.repro_times) -->", "<!-- repro-times:end -->"
_START = re.compile(r"^(\d\d:\d\d:\d\d) START (\S+)$")
_END = re.compile(r"^(\d\d:\d\d:\d\d) END (\S+) rc=(-?\d+) seconds=(\d+)$")
_STAGE = re.compile(r"stage (\S+) \((\w+)\) done in ([\d.]+)s")   # companion.pipeline's closing line


@dataclass(frozen=True)
class Step:
    name: str
    start: str
    seconds: int | None     # None: never ended
    rc: int | None


def parse(text: str) -> list[Step]:
    """The steps of a log, one entry per attempt, in the order they started; lines that are neither START nor END
    are ignored. A step may start again only after an attempt that failed (rc ≠ 0: stopped or crashed): the run
    goes on from there, and only the last attempt counts (:func:`counted`)."""
    attempts: list[list] = []                   # [name, start, seconds, rc]
    last: dict[str, int] = {}
    for line in text.splitlines():
        if m := _START.match(line.strip()):
            if m[2] in last:
                prev = attempts[last[m[2]]]
                if prev[3] is None or prev[3] == 0:
                    raise ValueError(f"step {m[2]!r} started twice in the log; time one run per log")
            last[m[2]] = len(attempts)
            attempts.append([m[2], m[1], None, None])
        elif m := _END.match(line.strip()):
            if m[2] not in last:
                raise ValueError(f"step {m[2]!r} ends in the log but never started")
            attempts[last[m[2]]][2:] = [int(m[4]), int(m[3])]
    if not attempts:
        raise ValueError("the log has no 'HH:MM:SS START <step>' line: is it a benchmarks/timed_repro.sh log?")
    return [Step(*a) for a in attempts]


def counted(steps: list[Step]) -> list[Step]:
    """The last attempt of every step (what the run consists of), in the order the steps first started."""
    last = {s.name: s for s in steps}
    return list({s.name: last[s.name] for s in steps}.values())


def stage_times(text: str) -> list[tuple[str, float]]:
    """``(stage, seconds)`` of every notebook stage a step's output reports (``stage X (profile) done in Ns``)."""
    return [(m[1], float(m[3])) for m in _STAGE.finditer(text)]


def complete(steps: list[Step]) -> bool:
    return all(s.rc == 0 and s.seconds is not None for s in counted(steps))


def markdown(steps: list[Step], *, commit: str | None = None, note: str | None = None,
             stages: list[tuple[str, float]] = ()) -> str:
    """The report: one row per attempt, the total (of the counted attempts) only when every step's last attempt
    ended with rc 0; an attempt that failed and was re-run is listed and its time stated, not counted;
    ``stages``: the notebook stages' own times inside the steps (a second table)."""
    keep = {id(s) for s in counted(steps)}

    def row(s: Step) -> str:
        if s.seconds is None:
            return f"| {s.name} | {s.start} | did not end |"
        if id(s) not in keep:
            return f"| {s.name} | {s.start} | {s.seconds / 60:.1f} (stopped, rc {s.rc}; re-run below, not counted) |"
        return f"| {s.name} | {s.start} | {s.seconds / 60:.1f}" + ("" if s.rc == 0 else f" (failed, rc {s.rc})") + " |"

    final = counted(steps)
    done = sum(s.seconds or 0 for s in final)
    dropped = [s for s in steps if id(s) not in keep]
    head = (f"**Fresh clone, `make setup` + every stage: {done / 60:.0f} minutes** (sum of the steps below"
            + (", " + ", ".join(f"not counting the stopped attempt of {s.name} ({s.seconds / 60:.0f} min)"
                                for s in dropped) if dropped else "") + ")."
            if complete(steps) else
            f"**Incomplete run**: {sum(s.seconds is not None and s.rc == 0 for s in final)} of {len(final)} steps "
            f"finished ({done / 60:.0f} minutes so far); no total is claimed.")
    lines = [head, ""]
    if commit:
        lines += [f"Commit: `{commit}`.", ""]
    if note:
        lines += [note, ""]
    lines += ["| step | started (UTC) | minutes |", "|---|---|---|", *map(row, steps)]
    if stages:
        lines += ["", "Inside the steps, each notebook stage's own time:", "", "| stage | minutes |", "|---|---|",
                  *(f"| {n} | {t / 60:.1f} |" for n, t in stages)]
    return "\n".join(lines) + "\n"


def update_readme(readme: Path, block: str) -> None:
    text = readme.read_text()
    a, b = text.find(README_BEGIN), text.find(README_END)
    if a < 0 or b < a:
        raise ValueError(f"{readme} has no generated block {README_BEGIN!r} … {README_END!r}")
    readme.write_text(text[:a] + README_BEGIN + "\n" + block + text[b:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--commit")
    ap.add_argument("--note")
    ap.add_argument("--out", default="reports/repro_times.md")
    ap.add_argument("--readme")
    ap.add_argument("--stage-output", nargs="*", default=[], help="the steps' outputs, for the stages' own times")
    a = ap.parse_args(argv)
    steps = parse(Path(a.log).read_text())
    stages = [t for f in a.stage_output for t in stage_times(Path(f).read_text(errors="replace"))]
    md = markdown(steps, commit=a.commit, note=a.note, stages=stages)
    Path(a.out).write_text("# Timed fresh-clone `make repro`\n\n" + md)
    if a.readme:
        update_readme(Path(a.readme), md)
    print(md)
    return 0 if complete(steps) else 1


if __name__ == "__main__":
    raise SystemExit(main())
