"""The MiniLM stage's settings for the shared paired-Δτ code (companion.experiments.minilm_report)."""
from __future__ import annotations

import pytest

from companion.experiments import minilm_report as mr


def test_paired_settings_name_this_row_only(tmp_path):
    p = mr.PairedSettings(n_boot=10, seed=24, confidence=0.95, power_n_sim=5, power_n_boot=10, retest_splits=7)
    s = mr.MiniLMSettings(zoo_dir="", device="cpu", threads=1, workers=1, n_points=8, batch_size=4, data_seed=0, n_iters=1,
                          seed=0, rho=None, eps=0.0, max_train_error=0.2, n_boot=10, gap_splits=5, power_alpha=0.05,
                          power_n_sim=5, paired=p, cpu_kernels=None)
    ps = mr.paired_settings(s, tmp_path)
    assert list(ps.rows) == ["minilm"] and ps.rows["minilm"].row == "language" and ps.rows["minilm"].layout == "language"
    assert (ps.n_boot, ps.seed, ps.power.n_sim, ps.retest_splits.n_splits) == (10, 24, 5, 7)
    with pytest.raises(ValueError, match="rho is null"):
        mr.measure_primary(s, None, [])


def test_table1_names_the_pretrained_model_of_the_line(tmp_path):
    import json

    from companion.experiments import table1

    tau = {"adaptive": 0.1, "geodesic_invariant": 0.2, "geodesic_mixed": 0.3}
    entry = {"row": "language", "setting": "fine-tunes of pre-trained all-MiniLM-L6-v2", "primary": True, "tau": tau,
             "n_models": 10}
    (tmp_path / "minilm.json").write_text(json.dumps({"profile": "cpu", "table1": [entry]}))
    md, records = table1.build(tmp_path)
    ours = [r for r in records if r["row"] == "language" and r["source"] == "ours" and r["stage"] != "ablations"]
    assert [r["setting"] for r in ours] == ["fine-tunes of pre-trained all-MiniLM-L6-v2"]
    assert "fine-tunes of pre-trained all-MiniLM-L6-v2" in md
    # a line without its own setting keeps the row's
    assert [r["setting"] for r in records if r["row"] == "vision" and r["source"] == "ours"] == [table1._OURS["vision"]]


def test_a_measure_without_reliability_gets_delta_but_no_power(tmp_path):
    import numpy as np
    import pandas as pd
    from scipy import stats

    from companion.experiments import paired as pr

    rng = np.random.default_rng(0)
    gap = rng.normal(size=12)
    vals = {"adaptive": rng.normal(size=12), "geodesic_invariant": gap + rng.normal(size=12),
            "geodesic_mixed": rng.normal(size=12)}
    members = pd.DataFrame({"gap": gap}, index=[f"m{i}" for i in range(12)])
    rd = pr.RowData("minilm", "language", "minilm", members, vals, {m: 0.1 for m in vals},
                    {"adaptive": 0.0, "geodesic_invariant": 0.6, "geodesic_mixed": 0.2}, 0.7, {})
    p = mr.PairedSettings(n_boot=300, seed=24, confidence=0.95, power_n_sim=5, power_n_boot=10, retest_splits=7)
    s = mr.MiniLMSettings(zoo_dir="", device="cpu", threads=1, workers=1, n_points=8, batch_size=4, data_seed=0, n_iters=1,
                          seed=0, rho=None, eps=0.0, max_train_error=0.2, n_boot=10, gap_splits=5, power_alpha=0.05,
                          power_n_sim=5, paired=p, cpu_kernels=None)
    ps = mr.paired_settings(s, tmp_path)
    with pytest.raises(ValueError, match="signal"):     # why the shared table cannot be used here
        pr.delta_table(rd, ps)
    out = mr.delta_table_without_power(rd, ps).set_index("measure")
    t = {m: stats.kendalltau(v, gap).statistic for m, v in vals.items()}
    assert out.loc["geodesic_invariant", "delta"] == pytest.approx(t["geodesic_invariant"] - t["adaptive"])
    assert out["power"].isna().all() and out.loc["geodesic_mixed", "verdict"] in (
        "inconclusive", "contradicts the paper's size", "contradicts the paper's direction", "supports the paper")


def test_the_delta_table_names_this_stage_not_its_staging_folder(tmp_path):
    """The stage writes its tables to a staging folder ``<out>/data`` before publishing them to reports/data/minilm:
    the Δτ table's ``stage`` column names the stage (it read "data")."""
    import json

    import numpy as np
    import pandas as pd
    from scipy import stats

    rng = np.random.default_rng(1)
    names = [f"model_{i:03d}" for i in range(10)]
    gap = rng.normal(size=10)
    per_batch = {m: gap[:, None] * w + rng.normal(size=(10, 4)) for m, w in
                 (("adaptive", 1.0), ("geodesic_invariant", 2.0), ("geodesic_mixed", 0.5))}
    data = tmp_path / "data"
    data.mkdir()
    pd.DataFrame({"name": names, "gap": gap}).to_csv(data / "members.csv", index=False)
    pd.DataFrame([{"model": n, "measure": m, "value": v.mean(), "per_batch": json.dumps(list(v))}
                  for m, pb in per_batch.items() for n, v in zip(names, pb)]).to_csv(data / "sharpness.csv", index=False)
    pd.DataFrame([{"measure": m, "rho": 0.1, "tau": stats.kendalltau(pb.mean(axis=1), gap).statistic, "retest": 0.5,
                   "reliability": 0.6, "gap_reliability": 0.7} for m, pb in per_batch.items()]).to_csv(
        data / "primary.csv", index=False)
    p = mr.PairedSettings(n_boot=50, seed=24, confidence=0.95, power_n_sim=3, power_n_boot=10, retest_splits=5)
    s = mr.MiniLMSettings(zoo_dir="", device="cpu", threads=1, workers=1, n_points=8, batch_size=4, data_seed=0, n_iters=1,
                          seed=0, rho=None, eps=0.0, max_train_error=0.2, n_boot=10, gap_splits=5, power_alpha=0.05,
                          power_n_sim=3, paired=p, cpu_kernels=None)
    out = mr.delta_table(s, data)
    assert list(out["stage"]) == ["minilm", "minilm"] and list(out["row"]) == ["minilm", "minilm"]
    # the shared loader still names a published folder's stage by its name (reports/data/<stage>)
    from companion.experiments import paired as pr

    ps = mr.paired_settings(s, data)
    assert pr.load_row("minilm", ps.rows["minilm"], ps).stage == "data"
