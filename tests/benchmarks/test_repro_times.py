"""benchmarks.repro_times: the timed fresh-clone report claims a total only for a complete run."""
from __future__ import annotations

import pytest

from benchmarks import repro_times as rt

LOG = """06:58:46 START setup
07:00:37 END setup rc=0 seconds=111
some dvc output
07:00:37 START language_train
07:40:37 END language_train rc=0 seconds=2400
07:40:40 START repro
08:40:40 END repro rc=0 seconds=3600
"""


def test_complete_run_sums_the_steps(tmp_path):
    steps = rt.parse(LOG)
    assert [s.name for s in steps] == ["setup", "language_train", "repro"] and rt.complete(steps)
    md = rt.markdown(steps, commit="abc")
    assert "6111" not in md and f"{(111 + 2400 + 3600) / 60:.0f} minutes" in md and "`abc`" in md
    assert "| language_train | 07:00:37 | 40.0 |" in md
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{rt.README_BEGIN}\nold\n{rt.README_END}\nrest\n")
    rt.update_readme(readme, md)
    text = readme.read_text()
    assert "old" not in text and text.startswith("intro\n") and text.endswith(f"{rt.README_END}\nrest\n")


def test_failed_or_unfinished_step_claims_no_total():
    failed = rt.parse(LOG.replace("END repro rc=0", "END repro rc=1"))
    assert not rt.complete(failed)
    md = rt.markdown(failed)
    assert md.startswith("**Incomplete run**: 2 of 3 steps") and "(failed, rc 1)" in md
    cut = rt.parse(LOG.rsplit("\n", 2)[0])                  # the last END missing
    assert not rt.complete(cut) and "did not end" in rt.markdown(cut)


def test_bad_logs_are_refused():
    with pytest.raises(ValueError, match="no 'HH:MM:SS START"):
        rt.parse("nothing here\n")
    with pytest.raises(ValueError, match="never started"):
        rt.parse("07:00:00 END x rc=0 seconds=1\n")
    with pytest.raises(ValueError, match="started twice"):
        rt.parse("07:00:00 START x\n07:00:01 START x\n")


def test_stage_times_from_the_pipeline_output():
    out = "Running stage 'toy':\nstage toy (cpu) done in 4.4s\nnoise\nstage vision (cpu) done in 1026.1s\n"
    stages = rt.stage_times(out)
    assert stages == [("toy", 4.4), ("vision", 1026.1)]
    md = rt.markdown(rt.parse(LOG), stages=stages)
    assert "| vision | 17.1 |" in md and "| toy | 0.1 |" in md


def test_a_failed_step_run_again_counts_once_and_its_stopped_attempt_is_shown():
    log = LOG.replace("END repro rc=0 seconds=3600", "END repro rc=143 seconds=1200\n"
                      "08:00:41 at def update: a line that is not a step\n08:00:41 START repro\n"
                      "09:00:41 END repro rc=0 seconds=3600")
    steps = rt.parse(log)
    assert [(s.name, s.rc) for s in steps] == [("setup", 0), ("language_train", 0), ("repro", 143), ("repro", 0)]
    assert [s.seconds for s in rt.counted(steps)] == [111, 2400, 3600] and rt.complete(steps)
    md = rt.markdown(steps)
    assert f"{(111 + 2400 + 3600) / 60:.0f} minutes" in md and "stopped attempt of repro (20 min)" in md
    assert "| repro | 07:40:40 | 20.0 (stopped, rc 143; re-run below, not counted) |" in md
    assert "| repro | 08:00:41 | 60.0 |" in md
    with pytest.raises(ValueError, match="started twice"):                   # a step that succeeded
        rt.parse(LOG + "09:00:00 START repro\n")
    assert not rt.complete(rt.parse(log.rsplit("\n", 2)[0]))                 # the re-run did not end
