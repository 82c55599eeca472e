"""language_stability when a profile does not run it (n_zoos: 0, the cpu profile): nothing trained or
measured, a metrics file that says so, header-only tables, and no stability line in Table 1."""
import csv
import json
from pathlib import Path

import pytest

from companion.experiments import stability as st
from companion.experiments import table1
from companion.params import stage_params

ROOT = Path(__file__).resolve().parents[3]


def _run_cpu(tmp_path):
    out, report, metrics = tmp_path / "zoos", tmp_path / "data" / "stability.csv", tmp_path / "m" / "language_stability.json"
    rc = st.main(["--out", str(out), "--report", str(report), "--metrics", str(metrics), "--profile", "cpu",
                  "--params", str(ROOT / "params.yaml")])
    return rc, out, report, metrics


def test_cpu_profile_skips_and_says_why(tmp_path, monkeypatch):
    def fail(*a, **k):
        raise AssertionError("a skipped profile must not train or measure")

    monkeypatch.setattr(st, "run_stability", fail)
    monkeypatch.setattr(st.lz, "train_zoo", fail)
    rc, out, report, metrics = _run_cpu(tmp_path)
    assert rc == 0
    m = json.loads(metrics.read_text())
    assert m["profile"] == "cpu" and m["table1"] == [] and "not run in this profile" in m["skipped"]
    assert m["params"]["n_zoos"] == 0 and "summary" not in m and "seconds" not in m
    assert [p.name for p in out.iterdir()] == ["SKIPPED.txt"]          # no zoo folder
    assert report.read_text().splitlines() == [",".join(st.TAU_COLUMNS)]
    members = report.with_name("stability_members.csv")
    assert members.read_text().splitlines() == [",".join(st.MEMBER_COLUMNS)]


def test_gpu_and_paper_profiles_still_run_three_zoos():
    for profile in ("gpu", "paper"):
        s = st.stability_settings(stage_params("language_stability", profile, path=ROOT / "params.yaml")[1])
        assert s.n_zoos == 3 and s.zoo["finetune"]["n_models"] == 12
    cpu = st.stability_settings(stage_params("language_stability", "cpu", path=ROOT / "params.yaml")[1])
    gpu = st.stability_settings(stage_params("language_stability", "gpu", path=ROOT / "params.yaml")[1])
    assert {k: v for k, v in vars(cpu).items() if k != "n_zoos"} == {k: v for k, v in vars(gpu).items() if k != "n_zoos"}


def test_one_zoo_is_refused_on_the_command_line(tmp_path):
    params = tmp_path / "params.yaml"
    raw = (ROOT / "params.yaml").read_text().replace("    n_zoos: 0 ", "    n_zoos: 1 ")
    params.write_text(raw)
    assert stage_params("language_stability", "cpu", path=params)[1]["n_zoos"] == 1
    with pytest.raises(ValueError, match="n_zoos must be >= 2"):
        st.main(["--out", str(tmp_path / "z"), "--profile", "cpu", "--params", str(params),
                 "--report", str(tmp_path / "r.csv"), "--metrics", str(tmp_path / "m.json")])
    assert not (tmp_path / "m.json").exists()


def test_table1_omits_a_skipped_stability_line(tmp_path):
    _, _, _, metrics = _run_cpu(tmp_path)
    (metrics.parent / "diagonal.json").write_text(json.dumps({"profile": "cpu", "table1": {
        "row": "diagonal", "variant": "exact", "n_models": 8,
        "tau": {"adaptive": 0.5, "geodesic_invariant": -0.25, "geodesic_mixed": 0.125}}}))
    md, csv_path = table1.write(metrics.parent, tmp_path / "out")
    rows = list(csv.DictReader(csv_path.open()))
    ours = [(r["row"], r["stage"]) for r in rows if r["source"] == "ours"]
    assert ours == [("diagonal", "diagonal"), ("vision", ""), ("language", "")]   # language: "not computed" only
    table, _, below = md.read_text().partition(table1.NOT_RUN_HEAD)
    assert "language_stability" not in table                          # no line in the table; listed as not run
    assert f"* stage `language_stability`: {st.SKIPPED}" in below
    assert md.read_text().count(table1.NOT_COMPUTED) == 6                # vision and language: no line of ours


def test_language_pilot_budget_ignores_a_skipped_stability_file():
    from companion.pilots.language import stability_seconds

    assert stability_seconds({"profile": "cpu", "skipped": st.SKIPPED, "table1": []}) is None
    ran = {"seconds": {"zoo_0": {"train": 1.0, "measure": 2.0}, "zoo_1": {"train": 3.0, "measure": 4.0}}}
    assert stability_seconds(ran) == 10.0
