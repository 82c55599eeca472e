"""Stability of the language zoo's tau over independently seeded zoos (tiny zoos)."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from companion.experiments import language_zoo as lz
from companion.experiments import stability as st

TINY = {   # large steps, no hidden dropout: tiny members that differ (so tau is defined)
    "corpus": {"seed": 1, "n_train": 96, "n_dev": 30, "n_test": 45, "hard_rate": 0.1},
    "model": {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32,
              "hidden_dropout_prob": 0.0},
    "pretrain": {"steps": 20, "batch_size": 16, "seed": 5},
    "finetune": {"n_models": 4, "epochs": 6.0, "lr": 1e-2, "batch_size": 16, "base_seed": 7},
}
PARAMS = {"zoo": TINY, "n_zoos": 2, "seed_stride": 100, "vary_pretrain": False, "n_points": 16, "batch_size": 16,
          "data_seed": 0, "n_iters": 1, "seed": 0, "rho": {"adaptive": 0.1, "geodesic_mixed": 0.01},
          "relative_flatness": True, "n_boot": 0, "threads": None, "workers": 1}


def test_zoo_seeds_differ_and_never_overlap():
    a, b = st.zoo_spec(TINY, 0, 100), st.zoo_spec(TINY, 2, 100)
    assert (a.pretrain.seed, a.finetune.base_seed) == (5, 7)
    assert (b.pretrain.seed, b.finetune.base_seed) == (7, 207)
    assert a.corpus == b.corpus and a.model == b.model        # only the seeds differ
    c = st.zoo_spec(TINY, 2, 100, vary_pretrain=False, shared_pretrained="z0/pretrained")
    assert (c.pretrain.seed, c.finetune.base_seed, c.base) == (5, 207, "z0/pretrained")
    assert st.zoo_spec(TINY, 0, 100, vary_pretrain=False).base == "scratch"
    with pytest.raises(ValueError, match="share seeds"):
        st.zoo_spec(TINY, 1, 3)


@pytest.mark.slow  # trains 2 tiny zoos of 4 and measures them: ~25 s on a quiet machine
def test_run_stability(tmp_path):
    taus, members, summary, seconds = st.run_stability(PARAMS, tmp_path, progress=False)
    # no wall clock inside the stage's DVC output (the folder): the zoos' timing files were moved into `seconds`
    assert not [p for p in tmp_path.rglob("*") if "timing" in p.name]
    assert set(seconds) == {"zoo_0", "zoo_1"} and set(seconds["zoo_1"]["training"]["members"]) == set(members[
        members["zoo"] == 1]["model"])
    assert set(taus["measure"]) == {"adaptive", "geodesic_mixed", "relative_flatness"}
    assert len(taus) == 2 * 3 * 2 and set(taus["zoo"]) == {0, 1}
    assert list(taus.columns) == st.TAU_COLUMNS and list(members.columns) == st.MEMBER_COLUMNS
    assert sorted(members.groupby("zoo")["seed"].min()) == [7, 107]
    # zoo 1 fine-tuned zoo 0's pre-trained model (shared, as McCoy et al.'s runs)
    assert lz.load_zoo(tmp_path / "zoo_1")["pretrain"]["base"] == str(tmp_path / "zoo_0" / "pretrained")
    # the gaps are the recorded errors' differences
    np.testing.assert_allclose(members["gap_in_distribution"], members["dev_error"] - members["train_error"])
    np.testing.assert_allclose(members["gap_hans"], members["test_error"] - members["train_error"])
    # tau of one (zoo, measure, gap) recomputed from the members' values with scipy
    frame = st.measure_one_zoo(tmp_path / "zoo_1", PARAMS)
    vals = frame[frame["measure"] == "relative_flatness"].set_index("model")["value"]
    gaps = members[members["zoo"] == 1].set_index("model").loc[vals.index, "gap_hans"]
    ref = stats.kendalltau(vals.to_numpy(), gaps.to_numpy()).statistic
    got = taus[(taus["zoo"] == 1) & (taus["measure"] == "relative_flatness") & (taus["gap"] == "gap_hans")]
    assert np.isfinite(ref) and got["tau"].item() == pytest.approx(ref)
    row = summary[(summary["measure"] == "adaptive") & (summary["gap"] == "gap_in_distribution")]
    t = taus[(taus["measure"] == "adaptive") & (taus["gap"] == "gap_in_distribution")]["tau"]
    assert row["mean"].item() == pytest.approx(t.mean()) and row["n_zoos"].item() == 2
    # the Table 1 line: mean over zoos of the in-distribution taus, each zoo's tau kept as its spread
    entry = st.table1_entry(taus)
    assert entry["row"] == "language" and set(entry["tau"]) == {"adaptive", "geodesic_mixed"}
    per_zoo = t.to_list()
    assert entry["spread"]["adaptive"]["taus"] == per_zoo and entry["tau"]["adaptive"] == pytest.approx(np.mean(per_zoo))
    assert entry["spread"]["adaptive"]["std"] == pytest.approx(np.std(per_zoo, ddof=1))
    assert entry["n_models"] == members.groupby("zoo").size().max() and entry["rho"]["adaptive"] == PARAMS["rho"]["adaptive"]
    # reuse without training: same recipe passes, another recipe is refused
    again, *_ = st.run_stability(PARAMS, tmp_path, progress=False, train=False)
    assert again["tau"].equals(taus["tau"])
    other = {**PARAMS, "zoo": {**TINY, "finetune": {**TINY["finetune"], "epochs": 2.0}}}
    assert not (members["gap_in_distribution"] == members["gap_in_distribution"].iloc[0]).all()
    with pytest.raises(ValueError, match="another recipe"):
        st.run_stability(other, tmp_path, progress=False, train=False)


def test_bad_params():
    from companion.params import ParamsError

    for n in (1, 0):   # one zoo shows no spread; 0 (skip) is the command line's, not a run
        with pytest.raises(ValueError, match="n_zoos"):
            st.run_stability({**PARAMS, "n_zoos": n}, "unused", progress=False)
    with pytest.raises(ParamsError, match="missing.*rho"):
        st.run_stability({k: v for k, v in PARAMS.items() if k != "rho"}, "unused", progress=False)
    with pytest.raises(ParamsError, match="n_zoo"):
        st.run_stability({**PARAMS, "n_zoo": 3}, "unused", progress=False)
