"""Smoke test of benchmarks/bench_hessian.py on the tiny model (no timing is asserted) and of
its report section, which replaces only itself."""
from benchmarks import bench_hessian


def test_bench_hessian_runs_every_method_and_rewrites_only_its_section(tmp_path):
    res = bench_hessian.bench_model("tiny-vit", rounds=1, memory=False)
    assert set(res["seconds"]) == set(bench_hessian.METHODS) and all(v > 0 for v in res["seconds"].values())
    assert set(res["peak_bytes"]) == set(bench_hessian.METHODS) and res["dim"] > 0
    section = bench_hessian.report_section([res], {"cpu": "test"})
    assert section.count("| tiny-vit |") == 2
    path = tmp_path / "benchmarks.md"
    path.write_text("# Benchmarks\n\nsomeone else's section\n")
    bench_hessian.write_report(section, path)
    bench_hessian.write_report(section.replace("tiny-vit", "tiny-vit2"), path)
    text = path.read_text()
    assert text.startswith("# Benchmarks\n\nsomeone else's section\n") and text.count(bench_hessian.MARK_START) == 1
    assert "tiny-vit2" in text and "| tiny-vit |" not in text
