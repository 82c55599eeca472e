"""Smoke test of benchmarks/bench_exact.py on the tiny model (no timing is asserted) and of its
report section, which replaces only itself."""
from benchmarks import bench_exact


def test_bench_exact_times_both_steps_and_rewrites_only_its_section(tmp_path):
    rows = bench_exact.bench_model("tiny-bert", rho=0.1, rho_mixed=0.01, repeats=1, n_iters=1)
    assert [r["metric"] for r in rows] == list(bench_exact.METRICS)
    for r in rows:
        assert r["refused"] is None and r["ratio"] > 0 and r["rk4_steps"] >= 1
        assert set(r["seconds"]) == {"second_order", "exact"}
    section = bench_exact.report_section(rows, {"cpu": "test", "load_avg_start": [0.0]})
    assert section.count("| tiny-bert |") == len(bench_exact.METRICS)
    path = tmp_path / "benchmarks.md"
    path.write_text("# Benchmarks\n\nsomeone else's section\n")
    bench_exact.write_report(section, path)
    bench_exact.write_report(section.replace("tiny-bert", "tiny-bert2"), path)
    text = path.read_text()
    assert text.startswith("# Benchmarks\n\nsomeone else's section\n") and text.count(bench_exact.MARK_START) == 1
    assert "tiny-bert2" in text and "| tiny-bert |" not in text
