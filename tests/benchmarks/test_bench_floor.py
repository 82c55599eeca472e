"""benchmarks/bench_floor.py: the table of its result files and the generated section of the
report (replaced in place, the rest of the file untouched)."""
import json

from benchmarks import bench_floor


def _result(path, label, x):
    runs = [dict(model="minilm", batch=8, seq_len=64, n_params=1_000_000, n_iters=20, rho=0.1, repeats=3, threads=1,
                 measures={"floor": dict(passes=20, value=None, peak_mib=4.0, median_s=2.0, x_floor=1.0),
                           "adaptive": dict(passes=21, value=0.5, peak_mib=8.0, median_s=2.0 * x, x_floor=x)})]
    machine = dict(threads=1, load_avg_start=[0.5, 0, 0], load_avg_end=[1.5, 0, 0], date="today")
    path.write_text(json.dumps(dict(label=label, commit="abc", machine=machine, runs=runs)))
    return str(path)


def test_report_rows_and_section(tmp_path, monkeypatch):
    before, after = _result(tmp_path / "b.json", "before", 3.0), _result(tmp_path / "a.json", "after", 1.5)
    table = bench_floor.report([before, after])
    assert "| before (abc) | minilm (1.0 M) | 8×64 | adaptive | 21 | 6.00 | 3.00 | 8 | 2.10 | 0.5 |" in table
    assert "| after (abc) | minilm (1.0 M) | 8×64 | adaptive | 21 | 3.00 | 1.50 | 8 | 2.10 | 0.5 |" in table
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
