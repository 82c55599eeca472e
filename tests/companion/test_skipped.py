"""companion.skipped: the cpu profile drops the 144 k-parameter BERT zoo (stages language_train, language,
language_retest) for its time budget; their command then writes, in seconds, outputs that say so, and paired,
table1 and the budget work without that row. The gpu and paper profiles run every stage."""
import csv
import json
import os
import subprocess
import sys
import resource
from pathlib import Path

import nbformat
import pandas as pd
import pytest
import yaml

from companion import budget, skipped
from companion.experiments import paired, table1
from tests import ROOT
from tests.companion.notebooks.test_paired import language_tables, tiny_params, vision_tables
from companion.params import load_yaml

BERT144K = ("language_train", "language", "language_retest")
WANTED = "not run in the cpu profile (secondary, superseded by the MiniLM row; dropped for the budget)"


def test_only_the_cpu_profile_skips_the_bert_zoo_and_never_a_primary_row():
    _, cpu = skipped.skipped_stages("cpu")
    assert sorted(cpu) == sorted(BERT144K) and all(WANTED in r for r in cpu.values())
    assert skipped.skipped_stages("gpu")[1] == {} and skipped.skipped_stages("paper")[1] == {}
    stages = load_yaml((ROOT / "dvc.yaml").read_text())["stages"]
    for s in BERT144K:   # every skipped stage is wrapped, so its command can skip it
        assert stages[s]["cmd"].startswith(f"python -m companion.skipped {s} -- python -m ")
    # the primary rows' stages are not skipped (and not wrapped)
    for s in ("vision_train", "vision", "minilm_train", "minilm", "paired", "table1"):
        assert s not in cpu and "companion.skipped" not in stages[s]["cmd"]


@pytest.mark.slow
def test_the_cpu_command_skips_in_seconds_and_writes_every_declared_output(tmp_path):
    """The real command line, in a fresh process: the wrapped command (which would fail) is never run."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for stage in BERT144K:
        cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        res = subprocess.run([sys.executable, "-m", "companion.skipped", stage, "--profile", "cpu", "--root",
                              str(tmp_path), "--", sys.executable, "-c", "raise SystemExit(7)"],
                             cwd=ROOT, env=env, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        # CPU seconds, not wall time (the shared machine's load): mostly importing torch, not the stage's minutes
        assert (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime) < 60
        assert WANTED in res.stdout
        for rel in skipped.declared_outputs(stage):
            assert (tmp_path / rel).exists(), rel
    lang = tmp_path / "reports"
    m = json.loads((lang / "metrics" / "language.json").read_text())
    assert m == {"stage": "language", "profile": "cpu", "skipped": skipped.skipped_stages("cpu")[1]["language"],
                 "table1": []}
    assert json.loads((lang / "headline" / "language.json").read_text()) == {   # lists: dvc metrics show skips them
        "skipped": [f"language (cpu): {m['skipped']}"], "table1": []}
    for folder in ("data", "figures"):
        assert [p.name for p in (lang / folder / "language").iterdir()] == [skipped.MARKER]
    assert [p.name for p in (tmp_path / "data" / "zoos" / "language").iterdir()] == [skipped.MARKER]
    nb = nbformat.read(lang / "notebooks" / "language.ipynb", as_version=4)
    assert len(nb.cells) == 1 and WANTED in nb.cells[0].source and nb.cells[0].id == "language-00"
    assert json.loads((lang / "metrics" / "language_retest.json").read_text())["skipped"]


def test_a_profile_that_runs_the_stage_runs_its_command(tmp_path, monkeypatch):
    ran = []

    def execvp(file, args):
        ran.append(args)
        raise SystemExit(0)      # os.execvp never returns

    monkeypatch.setattr(skipped.os, "execvp", execvp)
    for profile in ("gpu", "paper"):
        with pytest.raises(SystemExit):
            skipped.main(["language", "--profile", profile, "--root", str(tmp_path), "--", "python", "-m", "x"])
    assert ran == [["python", "-m", "x"]] * 2 and not any(tmp_path.iterdir())


def test_skipping_replaces_an_earlier_run_and_gives_the_same_bytes_anywhere(tmp_path, monkeypatch):
    monkeypatch.setattr(skipped.os, "execvp", lambda *a: pytest.fail("a skipped stage must not run its command"))
    stale = tmp_path / "a" / "reports" / "data" / "language" / "members.csv"
    stale.parent.mkdir(parents=True)
    stale.write_text("name,gap\nmodel_000,0.1\n")
    for root in ("a", "b"):
        assert skipped.main(["language", "--profile", "cpu", "--root", str(tmp_path / root), "--", "false"]) == 0
    assert not stale.exists()                            # no number of an earlier run survives
    files = lambda r: {p.relative_to(r): p.read_bytes() for p in sorted(r.rglob("*")) if p.is_file()}  # noqa: E731
    assert files(tmp_path / "a") == files(tmp_path / "b")
    with pytest.raises(ValueError, match="no stage 'nope'"):
        skipped.write_skipped("nope", "cpu", "why", tmp_path)
    assert skipped.main(["language", "--profile", "cpu"]) == 2          # no `--`: usage, nothing written


def _skip_language(tmp_path):
    """The tiny vision and MiniLM-like tables, and the language folder as the skipped stage leaves it."""
    vision_tables(tmp_path / "data" / "vision")
    language_tables(tmp_path / "data" / "minilm")
    folder = tmp_path / "data" / "language"
    folder.mkdir(parents=True)
    (folder / skipped.MARKER).write_text(json.dumps(skipped.record("language", "cpu", WANTED)))
    p = tiny_params(tmp_path)
    p["rows"]["language"]["comparison"] = "secondary (superseded by the pre-trained MiniLM row)"
    p["rows"]["minilm"] = {"row": "language", "layout": "language", "data": str(tmp_path / "data" / "minilm"),
                           "comparison": "primary"}
    return p


def test_paired_and_table1_without_the_skipped_row(tmp_path):
    assert paired.SKIPPED_FILE == skipped.MARKER
    p = _skip_language(tmp_path)
    rep = paired.run_report("cpu", p, tmp_path / "out")
    assert set(rep.deltas.row) == {"vision", "minilm"} and len(rep.deltas) == 4 and "language" not in rep.rows
    assert rep.not_run == [{"name": "language", "row": "language", "stage": "language", "profile": "cpu",
                            "comparison": "secondary (superseded by the pre-trained MiniLM row)", "reason": WANTED}]
    m = json.loads((tmp_path / "out" / "metrics" / "paired.json").read_text())
    assert [e["stage"] for e in m["delta_tau"]] == ["vision", "minilm"] and m["not_run"] == rep.not_run
    said = [ln for ln in m["findings"] if ln.startswith("language (secondary")]
    assert len(said) == 1 and WANTED in said[0] and "not compared" in said[0]
    assert said[0] not in m["findings_primary"]           # the README says it once, from table1's notes
    # Table 1 from these metrics and the skipped stages' metrics files: no line of the skipped stage, a note why
    mdir = tmp_path / "out" / "metrics"
    for stage in ("language", "language_retest"):
        (mdir / f"{stage}.json").write_text(json.dumps({**skipped.record(stage, "cpu", WANTED), "table1": []}))
    (mdir / "minilm.json").write_text(json.dumps({"profile": "cpu", "table1": {
        "row": "language", "setting": "fine-tunes of pre-trained all-MiniLM-L6-v2", "primary": True, "n_models": 12,
        "tau": {"adaptive": 0.1, "geodesic_invariant": 0.2, "geodesic_mixed": 0.3}}}))
    md, csv_path = table1.write(mdir, tmp_path / "t1")
    ours = [(r["row"], r["stage"], r["comparison"]) for r in csv.DictReader(open(csv_path)) if r["source"] == "ours"]
    assert ("language", "minilm", "primary") in ours and not any(s == "language" for _, s, _ in ours)
    text = md.read_text()
    assert table1.NOT_RUN_HEAD in text and f"* stage `language`: {WANTED}" in text
    assert f"* stage `language_retest`: {WANTED}" in text
    assert table1.retest_note(mdir) is None                # no data-need sentence from a stage that did not run
    notes = table1.readme_notes(mdir)
    assert table1.NOT_RUN_HEAD in notes and f"* stage `language`: {WANTED}" in notes
    # the exploratory row (or every row) skipped: refused in one line
    (tmp_path / "data" / "vision" / skipped.MARKER).write_text(json.dumps(skipped.record("vision", "cpu", "x")))
    with pytest.raises(ValueError, match="no data for the exploratory row"):
        paired.run_report("cpu", p, tmp_path / "out2")


@pytest.mark.slow
def test_paired_notebook_lists_the_skipped_row(tmp_path):
    from companion.pipeline import run_stage

    p = _skip_language(tmp_path)
    res = run_stage("paired", params=p, reports_dir=tmp_path / "reports", progress_bar=False)
    nb = res.notebook.read_text()
    assert "Not compared in this profile" in nb and WANTED in nb
    assert set(pd.read_csv(tmp_path / "reports" / "data" / "paired" / "delta_tau.csv").row) == {"vision", "minilm"}


def test_budget_counts_the_skipped_stages_as_zero_with_their_reason(tmp_path):
    t = tmp_path / "timings"
    t.mkdir()
    (t / "language.json").write_text(json.dumps({"stage_wall_s": 1626.0}))    # an earlier run's time: not counted
    (t / "minilm.json").write_text(json.dumps({"stage_wall_s": 600.0}))
    secs = budget.stage_seconds(t, ["language_train", "language", "language_retest", "language_stability", "minilm"])
    for s in BERT144K:
        assert secs[s][0] == 0.0 and WANTED in secs[s][1]
    assert secs["language_stability"] == (0.0, "not run in the cpu profile (n_zoos: 0)")
    assert secs["minilm"][0] == 600.0
    other = tmp_path / "params.yaml"
    raw = load_yaml((ROOT / "params.yaml").read_text())
    raw["skipped_stages"]["cpu"] = {}
    other.write_text(yaml.safe_dump(raw))
    assert budget.stage_seconds(t, ["language"], budget.cpu_skipped(other))["language"][0] == 1626.0
