"""companion.budget: per-stage minutes from reports/timings, the README block generated from them."""
import json

from companion import budget
from tests import ROOT


def test_sources_in_order_and_the_sum(tmp_path):
    t = tmp_path / "timings"
    t.mkdir()
    (t / "a.json").write_text(json.dumps({"stage_wall_s": 120.0, "total": 5}))        # own wall time wins
    (t / "b.json").write_text(json.dumps({"total": 60}))                              # fresh clone wins over total
    (t / "c.json").write_text(json.dumps({"total": 30}))
    (t / "fresh_clone_stages.txt").write_text("stage b (cpu) done in 90.0s\n")
    (t / "fresh_clone.log").write_text("07:00:37 START d\n07:37:08 END d rc=0 seconds=600\n")
    dvc = tmp_path / "dvc.yaml"
    dvc.write_text("stages:\n  a: {cmd: x}\n  b: {cmd: x}\n  c: {cmd: x}\n  d: {cmd: x}\n  e: {cmd: x}\n"
                   "  language_stability: {cmd: x}\n")
    secs = budget.stage_seconds(t, budget.stages(dvc))
    assert {s: v for s, (v, _) in secs.items()} == {"a": 120.0, "b": 90.0, "c": 30.0, "d": 600.0, "e": None,
                                                   "language_stability": 0.0}
    text = budget.block(t, dvc, new_stages=("a",))
    assert "**Per stage, cpu profile: 14 minutes in all**" in text            # (120 + 90 + 30 + 600) / 60 = 14
    assert "| a (new) | 2.0 |" in text and "Not timed: e." in text and "was not timed as one run" in text


def test_readme_budget_block_is_generated():
    text = (ROOT / "README.md").read_text()
    block = text[text.index(budget.README_BEGIN):text.index(budget.README_END) + len(budget.README_END)]
    assert block == budget.block(new_stages=budget.NEW_STAGES)


def test_a_complete_timed_rebuild_is_the_source_and_its_total_is_stated(tmp_path):
    t = tmp_path / "timings"
    t.mkdir()
    (t / "a.json").write_text(json.dumps({"stage_wall_s": 999.0}))                   # an older run of its own
    dvc = tmp_path / "dvc.yaml"
    dvc.write_text("stages:\n  a: {cmd: x}\n  b: {cmd: x}\n  language_stability: {cmd: x}\n")
    log = ("17:30:51 START setup\n17:31:21 at abc update: a line that is not a step\n"
           "17:34:57 END setup rc=0 seconds=240\n17:34:57 START force:a\n17:43:29 END force:a rc=0 seconds=600\n"
           "17:43:29 START b\n")
    (t / "fresh_clone.log").write_text(log)                       # b never ended: not a complete rebuild
    assert budget.full_rebuild(t, budget.stages(dvc)) is None
    assert budget.stage_seconds(t, budget.stages(dvc))["a"][0] == 999.0
    (t / "fresh_clone.log").write_text(log + "17:53:29 END b rc=0 seconds=1200\n")
    assert budget.full_rebuild(t, budget.stages(dvc)) == {"steps": {"setup": 240.0, "a": 600.0, "b": 1200.0},
                                                         "total": 2040.0, "stopped": {}, "in_repro": [],
                                                         "forced": ["a", "b"]}
    secs = budget.stage_seconds(t, budget.stages(dvc))
    assert {s: v for s, (v, _) in secs.items()} == {"a": 600.0, "b": 1200.0, "language_stability": 0.0}
    text = budget.block(t, dvc)
    assert "**Measured as one run, cpu profile: 34 minutes**" in text        # (240 + 600 + 1200) / 60 = 34
    assert "`make setup` (4.0 min)" in text and "stages 30 minutes" in text and "not timed as one run" not in text
    (t / "fresh_clone.log").write_text(log.replace("START b", "START c") + "17:53:29 END c rc=0 seconds=1200\n")
    assert budget.full_rebuild(t, budget.stages(dvc)) is None          # stage b has no step of its own
    (t / "fresh_clone.log").write_text(log + "17:53:29 END b rc=2 seconds=1200\n")
    assert budget.full_rebuild(t, budget.stages(dvc)) is None          # a failed step
    retried = log.replace("17:43:29 START b\n", "17:43:29 START b\n17:50:00 END b rc=143 seconds=391\n"
                          "17:50:01 at def update: b stopped\n17:50:01 START b\n18:10:01 END b rc=0 seconds=1200\n")
    (t / "fresh_clone.log").write_text(retried)
    assert budget.full_rebuild(t, budget.stages(dvc)) == {"steps": {"setup": 240.0, "a": 600.0, "b": 1200.0},
                                                         "total": 2040.0, "stopped": {"b": 391.0}, "in_repro": [],
                                                         "forced": ["a", "b"]}
    assert "not counted: a stopped attempt of `b` (7 min)" in budget.block(t, dvc)


def test_a_plain_repro_of_a_fresh_clone_times_each_stage_from_its_start_to_the_next(tmp_path):
    t = tmp_path / "timings"
    t.mkdir()
    dvc = tmp_path / "dvc.yaml"
    dvc.write_text("stages:\n  a: {cmd: x}\n  b: {cmd: x}\n  language_stability: {cmd: x}\n")
    log = ("23:50:00 START setup\n23:52:00 END setup rc=0 seconds=120\n23:52:00 START repro\n"
           "23:52:01 STAGE a\n23:58:41 STAGE language_stability\n23:58:42 STAGE b\n"
           "00:10:42 END repro rc=0 seconds=1122\n")                      # past midnight: the clock wraps
    (t / "fresh_clone.log").write_text(log)
    rebuild = budget.full_rebuild(t, budget.stages(dvc))
    assert rebuild["steps"] == {"setup": 120.0, "a": 400.0, "language_stability": 1.0, "b": 720.0}
    secs = budget.stage_seconds(t, budget.stages(dvc))
    assert {s: v for s, (v, _) in secs.items()} == {"a": 400.0, "b": 720.0, "language_stability": 0.0}
    text = budget.block(t, dvc)
    assert "**Measured as one run, cpu profile: 21 minutes**" in text       # (120 + 400 + 1 + 720) / 60 = 20.7
    assert "a plain `dvc repro`, as `make repro` runs it, which ran every stage" in text
    assert "`make setup` (2.0 min)" in text and "(stages 19 minutes)" in text               # (400 + 720) / 60
    mixed = log.replace("23:58:42 STAGE b\n", "") + "00:10:42 START force:b\n00:22:42 END force:b rc=0 seconds=720\n"
    (t / "fresh_clone.log").write_text(mixed)                           # b rebuilt in a step of its own after it
    assert budget.full_rebuild(t, budget.stages(dvc))["steps"] == {"setup": 120.0, "a": 400.0,
                                                                  "language_stability": 1122.0 - 401.0, "b": 720.0}
    assert "which ran `a`, `language_stability` (each timed" in budget.block(t, dvc)
    (t / "fresh_clone.log").write_text(log.replace("23:58:42 STAGE b\n", ""))
    assert budget.full_rebuild(t, budget.stages(dvc)) is None              # stage b never started
    (t / "fresh_clone.log").write_text(log.replace("END repro rc=0", "END repro rc=1"))
    assert budget.full_rebuild(t, budget.stages(dvc)) is None              # the repro failed
    (t / "fresh_clone.log").write_text(log.replace("00:10:42 END repro rc=0 seconds=1122\n", ""))
    assert budget.full_rebuild(t, budget.stages(dvc)) is None              # never ended


def test_timed_repro_logs_each_stage_start_of_a_plain_repro(tmp_path):
    """benchmarks/timed_repro.sh's `repro` step writes a STAGE line per stage that dvc starts, which the budget reads."""
    import subprocess

    clone = tmp_path / "clone"
    (clone / ".venv" / "bin").mkdir(parents=True)
    (clone / ".venv" / "bin" / "activate").write_text(           # a stand-in dvc: two stages, then success
        "dvc() { echo \"Running stage 'a':\"; echo 'a line of a stage'; echo \"Running stage 'b':\"; }\n")
    log = tmp_path / "t" / "fresh_clone.log"
    log.parent.mkdir()
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "timed_repro.sh"), str(clone), "repro"],
                       env={"PATH": "/usr/bin:/bin", "LOG": str(log)}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = log.read_text().splitlines()
    assert [ln.split(" ", 1)[1].split(" seconds=")[0] for ln in lines] == ["START repro", "STAGE a", "STAGE b",
                                                                           "END repro rc=0"]
    assert "a line of a stage" in (tmp_path / "t" / "fresh_clone.log.repro.out").read_text()
    dvc = tmp_path / "dvc.yaml"
    dvc.write_text("stages:\n  a: {cmd: x}\n  b: {cmd: x}\n")
    assert set(budget.full_rebuild(log.parent, budget.stages(dvc), skipped={})["steps"]) == {"a", "b"}
    (clone / ".venv" / "bin" / "activate").write_text("dvc() { echo \"Running stage 'a':\"; return 3; }\n")
    log.unlink()
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "timed_repro.sh"), str(clone), "repro"],
                       env={"PATH": "/usr/bin:/bin", "LOG": str(log)}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and " END repro rc=3 seconds=" in log.read_text().splitlines()[-1]
