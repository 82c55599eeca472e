"""benchmarks/bench_floor.py: the table of its result files and the generated section of the
report (replaced in place, the rest of the file untouched)."""
import json
from pathlib import Path

from benchmarks import bench_floor


def _result(path, label, x):
    runs = [dict(model="minilm", batch=8, seq_len=64, n_params=1_000_000, n_iters=20, rho=0.1, repeats=3, threads=1,
                 measures={"floor": dict(passes=20, value=None, peak_mib=4.0, median_s=2.0, x_floor=1.0,
                                          seconds=[2.0, 1.5, 2.5]),
                           "adaptive": dict(passes=21, value=0.5, peak_mib=8.0, median_s=2.0 * x, x_floor=x)})]
    machine = dict(threads=1, load_avg_start=[0.5, 0, 0], load_avg_end=[1.5, 0, 0], date="today")
    path.write_text(json.dumps(dict(label=label, commit="abc", machine=machine, runs=runs)))
    return str(path)


def test_report_rows_and_section(tmp_path, monkeypatch):
    before, after = _result(tmp_path / "b.json", "before", 3.0), _result(tmp_path / "a.json", "after", 1.5)
    table = bench_floor.report([before, after])
    # n = 20 iterations: at best (20 + 1.5)/20 = 1.075 the floor; low_memory not recorded in these files
    assert ("| before (abc) | minilm (1.0 M) | 8×64 | adaptive | 20 | 21 | 6.00 | 3.00 | 1.07 | not recorded | 8 | "
            "2.10 | 0.5 |") in table
    assert ("| after (abc) | minilm (1.0 M) | 8×64 | adaptive | 20 | 21 | 3.00 | 1.50 | 1.07 | not recorded | 8 | "
            "2.10 | 0.5 |") in table
    assert "load average 0.50 at the start and 1.50 at the end (quiet)" in table
    report = tmp_path / "benchmarks.md"
    report.write_text("# head\n\ntext\n")
    monkeypatch.setattr(bench_floor, "ROOT", tmp_path)
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    _result(tmp_path / "benchmarks" / "results" / "floor_minilm_after.json", "after", 1.5)
    bench_floor.write_report(report)
    once = report.read_text()
    bench_floor.write_report(report)
    assert report.read_text() == once and once.startswith("# head\n\ntext\n")
    assert once.count(bench_floor.BEGIN) == 1 and "| after (abc) |" in once


def test_low_memory_column_and_readme_sentence(tmp_path, monkeypatch):
    """The column reads the recorded flag; the README's sentence is filled between its markers,
    indented as the list item it stands in, from the files (and nowhere else)."""
    path = tmp_path / "benchmarks" / "results"
    path.mkdir(parents=True)
    _result(path / "floor_minilm_before.json", "before", 3.0)
    after = json.loads(Path(_result(path / "floor_minilm_after.json", "after", 1.25)).read_text())
    after["runs"][0]["measures"]["adaptive"]["low_memory"] = True
    (path / "floor_minilm_after.json").write_text(json.dumps(after))
    table = bench_floor.report([str(path / "floor_minilm_after.json")])
    assert "| 1.25 | 1.07 | on | 8 |" in table
    assert bench_floor.bound(5) == 1.3
    monkeypatch.setattr(bench_floor, "ROOT", tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(f"* cost:\n  {bench_floor.README_BEGIN}\n  old\n  {bench_floor.README_END}\n  more.\n")
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "benchmarks.md").write_text("# r\n")
    bench_floor.write_report(tmp_path / "reports" / "benchmarks.md", readme=readme)
    text = readme.read_text()
    assert "old" not in text and text.endswith(f"  {bench_floor.README_END}\n  more.\n")
    assert ("  minilm (1.0 M parameters, 8 × 64 tokens, 20 iterations, at best 1.07×; "
            "`benchmarks/results/floor_minilm_after.json`): adaptive 1.25× the floor (before, at abc: "
            "adaptive 3.00×), peak extra resident memory in the timing process 2.10 copies of N.") in text
