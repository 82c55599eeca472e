"""benchmarks/report.py: a section replaces only itself (text outside its markers byte for byte
unchanged, appended once), and a fresh process sees LIVE_ENV only when asked, this one never."""
import os

import pytest

from benchmarks import report

S, E = "<!-- x:start -->", "<!-- x:end -->"


def test_a_section_is_appended_once_then_replaced_in_place(tmp_path):
    path = tmp_path / "b.md"
    path.write_text("# B\n\nbefore\n")
    report.write_section(f"{S}\none\n{E}\n", S, E, path)
    assert path.read_text() == f"# B\n\nbefore\n\n{S}\none\n{E}\n"
    path.write_text(path.read_text() + "\nafter\n")
    report.write_section(f"{S}\ntwo\n{E}", S, E, path)
    report.write_section(f"{S}\ntwo\n{E}\n\n", S, E, path)      # trailing blank lines do not pile up
    assert path.read_text() == f"# B\n\nbefore\n\n{S}\ntwo\n{E}\n\nafter\n"
    path.write_text(f"{S}\nhalf")
    with pytest.raises(ValueError, match="without its"):
        report.write_section(f"{S}\n{E}", S, E, path)


def _env(key):
    return os.environ.get(key)


def test_a_fresh_process_gets_the_live_environment_only_when_asked():
    (key, value), = report.LIVE_ENV.items()
    before = os.environ.get(key)
    assert report.in_fresh_process(_env, key, live=True) == value
    assert report.in_fresh_process(_env, key) == before
    assert os.environ.get(key) == before
