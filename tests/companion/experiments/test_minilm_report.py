"""The MiniLM stage's settings for the shared paired-Δτ code (companion.experiments.minilm_report)."""
from __future__ import annotations

import pytest

from companion.experiments import minilm_report as mr


def test_paired_settings_name_this_row_only(tmp_path):
    p = mr.PairedSettings(n_boot=10, seed=24, confidence=0.95, power_n_sim=5, power_n_boot=10, retest_splits=7)
    s = mr.MiniLMSettings(zoo_dir="", device="cpu", threads=1, workers=1, n_points=8, batch_size=4, data_seed=0, n_iters=1,
                          seed=0, rho=None, eps=0.0, max_train_error=0.2, n_boot=10, gap_splits=5, power_alpha=0.05,
                          power_n_sim=5, paired=p)
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
    ours = [r for r in records if r["row"] == "language" and r["source"] == "ours"]
    assert [r["setting"] for r in ours] == ["fine-tunes of pre-trained all-MiniLM-L6-v2"]
    assert "fine-tunes of pre-trained all-MiniLM-L6-v2" in md
    # a line without its own setting keeps the row's
    assert [r["setting"] for r in records if r["row"] == "vision" and r["source"] == "ours"] == [table1._OURS["vision"]]
