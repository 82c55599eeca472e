"""No wall clock inside a DVC output (issue 16 item 8): a time in a hashed output changes its hash on
every run, so a fresh clone re-runs every stage downstream of it. Timings go to ``reports/timings/``
(git only; :func:`companion.metrics.write_stage_timings`).

Scans every output and metrics file ``dvc.yaml`` declares that is present in the checkout (the
committed reports; cached outputs such as the zoos only where a run left them): JSON keys and CSV
columns named like a time (:data:`companion.metrics.TIMING_KEY`), executed notebooks for papermill's
clock metadata, stderr streams (progress bars) and printed durations, markdown for printed durations."""
import csv
import json
import re
from pathlib import Path

import pytest

from companion.metrics import TIMING_KEY, TIMINGS_DIR, timing_keys
from tests import ROOT
from companion.params import load_yaml

#: a printed duration: "12 s", "1.5 min", "3.2 ms", "13.46s/run", "3.70run/s", "1619 seconds", "timings (s): …",
#: "wall-clock", "ms / step"
PRINTED = re.compile(r"\d(\.\d+)?\s?(s|ms|min|sec|seconds)\b(?![-'])|\ds/(it|run)\b|(it|run)/s\b|\bseconds\b"
                     r"|\btimings?\b|wall[- ]clock|\bms ?/ ?step\b", re.I)
CLOCK_METADATA = ("start_time", "end_time", "duration", "execution")


def _declared() -> list[Path]:
    dvc = load_yaml((ROOT / "dvc.yaml").read_text())
    paths = []
    for stage in dvc["stages"].values():
        for kind in ("outs", "metrics", "plots"):
            for entry in stage.get(kind, []):
                paths.append(ROOT / (next(iter(entry)) if isinstance(entry, dict) else entry))
    return paths


def _files(paths: list[Path]) -> list[Path]:
    return sorted({f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*")) if p.is_dir() else [])
                   if f.is_file()})


def _notebook_problems(nb: dict) -> list[str]:
    found = [f"metadata.papermill.{k}" for k in CLOCK_METADATA if k in nb.get("metadata", {}).get("papermill", {})]
    for i, cell in enumerate(nb.get("cells", [])):
        meta = cell.get("metadata", {})
        found += [f"cell {i} metadata {k}" for k in CLOCK_METADATA if k in meta or k in meta.get("papermill", {})]
        for out in cell.get("outputs", []):
            if out.get("name") == "stderr":
                found.append(f"cell {i}: a stderr stream")
            texts = [out.get("text", "")] + [v for k, v in out.get("data", {}).items() if k.startswith("text/")]
            for text in texts:
                text = "".join(text) if isinstance(text, list) else text
                found += [f"cell {i} prints {m.group(0)!r}" for m in PRINTED.finditer(text)]
    return found


def problems(path: Path) -> list[str]:
    """What in the file at ``path`` records the wall clock (empty: nothing)."""
    if path.suffix == ".json":
        return timing_keys(json.loads(path.read_text()))
    if path.suffix == ".csv":
        with path.open() as fh:
            header = next(csv.reader(fh), [])
        return [f"column {c}" for c in header if TIMING_KEY.search(c)]
    if path.suffix == ".ipynb":
        return _notebook_problems(json.loads(path.read_text()))
    if path.suffix == ".md":
        return [f"prints {m.group(0)!r}" for m in PRINTED.finditer(path.read_text())]
    return []


def test_no_dvc_output_holds_a_wall_clock_time():
    files = _files(_declared())
    assert any(f.suffix == ".ipynb" for f in files) and any(f.name == "diagonal.json" for f in files)
    bad = {str(f.relative_to(ROOT)): p[:4] for f in files if (p := problems(f))}
    assert not bad, ("wall-clock times inside DVC outputs (their hash changes on every run; write them to "
                     f"reports/timings/<stage>.json with companion.metrics.write_stage_timings): {bad}")


def test_the_timings_folder_is_committed_and_declared_nowhere():
    declared = _declared()
    assert not [p for p in declared if p == TIMINGS_DIR or TIMINGS_DIR in p.parents]
    ignored = (ROOT / ".gitignore").read_text().split()
    assert not [g for g in ignored if "timings" in g or g.strip("/") == "reports"]


@pytest.mark.parametrize("content, suffix", [
    ({"tau": 0.3, "timings": {"train_s": 2.1}}, ".json"),
    ({"methods": {"sam": {"test_error": 0.1}}, "seconds": {"per_step": {"sam": 0.01}}}, ".json"),
    ("method,test_error,seconds_per_step\nsam,0.1,0.01\n", ".csv"),
    ({"metadata": {}, "cells": [{"metadata": {}, "outputs": [{"output_type": "stream", "name": "stdout",
                                                             "text": ["language: 50 members measured in 1619 s\n"]}]}]},
     ".ipynb"),
    ({"metadata": {"papermill": {"duration": 4.4}}, "cells": []}, ".ipynb"),
    ({"metadata": {}, "cells": [{"metadata": {}, "outputs": [{"output_type": "stream", "name": "stdout",
                                                             "text": "timings (s): {'train_s': 2.14}\n"}]}]}, ".ipynb"),
    ({"metadata": {}, "cells": [{"metadata": {}, "outputs": [{"output_type": "display_data", "data": {
        "text/html": "<th>ms / step</th>"}}]}]}, ".ipynb"),
    ({"metadata": {}, "cells": [{"metadata": {}, "outputs": [{"output_type": "stream", "name": "stderr",
                                                             "text": "sharpness: 100%\n"}]}]}, ".ipynb"),
])
def test_the_scanner_finds_a_time(tmp_path, content, suffix):
    path = tmp_path / f"out{suffix}"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    assert problems(path)


def test_the_scanner_leaves_numbers_that_are_not_times_alone(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"tau_second_order": {"n_starts": 17}, "restart_gain": {"adaptive:second_order": 0.1},
                                "findings": "τ = -0.66 at ρ = 0.1; 4000 pairs"}))
    assert problems(path) == []
    nb = tmp_path / "n.ipynb"
    nb.write_text(json.dumps({"metadata": {"papermill": {"parameters": {}}}, "cells": [{"metadata": {}, "outputs": [
        {"output_type": "stream", "name": "stdout", "text": "50 members, 2 seeds, τ = -0.66 [-0.79, -0.5]\n"}]}]}))
    assert problems(nb) == []
