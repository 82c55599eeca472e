"""Smoke test of benchmarks/bench_sam.py on the tiny model (no timing is asserted) and of its
report section, which replaces only itself."""
from benchmarks import bench_sam


def test_bench_sam_runs_every_method_and_rewrites_only_its_section(tmp_path):
    res = bench_sam.bench_model("tiny-vit", rounds=1, steps=1)
    assert set(bench_sam.METHODS) <= set(res["seconds"]) and res["n_attention"] == 1
    assert all(res["seconds"][m + ":ascent"] > 0 for m in bench_sam.METHODS if m != "adamw")
    section = bench_sam.report_section([res], {"cpu": "test"})
    assert section.count("| tiny-vit |") == len(bench_sam.METHODS)
    path = tmp_path / "benchmarks.md"
    path.write_text("# Benchmarks\n\nsomeone else's section\n")
    bench_sam.write_report(section, path)
    bench_sam.write_report(section.replace("tiny-vit", "tiny-vit2"), path)
    text = path.read_text()
    assert text.startswith("# Benchmarks\n\nsomeone else's section\n") and text.count(bench_sam.MARK_START) == 1
    assert "tiny-vit2" in text and "| tiny-vit |" not in text
