"""The exploratory language_retest stage: its whole-half retest is the pre-registered one of
primary.csv, the committed outputs agree with the committed inputs, bad inputs are refused."""
import json
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from companion import analysis
from companion.experiments import language_retest as lr
from companion.params import load_params
from tests import ROOT

LANG = ROOT / "reports" / "data" / "language"


def _drawn_zoo(n=20, batches=30, seed=0):
    """Tables laid out as the language stage publishes them, at the cpu protocol (15 batches of 128 per half),
    drawn here: the cpu profile does not run that stage (companion.skipped), so nothing of it is committed."""
    rng = np.random.default_rng(seed)
    rows, prim = [], []
    for k, m in enumerate(("adaptive", "geodesic_invariant", "geodesic_mixed")):
        v = rng.standard_normal(n)[:, None] * (1 + k) + rng.standard_normal((n, batches)) * 3
        rows += [dict(model=f"model_{i:03d}", measure=m, rho=0.1, value=float(v[i].mean()),
                      per_batch=json.dumps(v[i].tolist())) for i in range(n)]
        h = batches // 2
        r = stats.kendalltau(v[:, :h].mean(1), v[:, h:].mean(1)).statistic
        prim.append(dict(measure=m, label=m, rho=0.1, retest=r, retest_ci_low=r - 0.1, retest_ci_high=r + 0.1,
                         reliability=analysis.spearman_brown(r, 2)))
    return pd.DataFrame(rows), pd.DataFrame(prim)


def committed_run() -> bool:
    """Whether the committed profile ran the language stages (else their outputs are records of the skip)."""
    return (LANG / "sharpness.csv").is_file()


@pytest.fixture(scope="module")
def inputs():
    if not committed_run():
        return _drawn_zoo()
    return pd.read_csv(LANG / "sharpness.csv"), pd.read_csv(LANG / "primary.csv")


def _settings(**over):
    _, s = lr.load_settings("cpu")
    return lr.RetestSettings(**{**s.__dict__, **over})


def test_settings_read_the_zoo_sections_of_the_profile():
    profile, s = lr.load_settings("cpu")
    raw = load_params(ROOT / "params.yaml")
    assert profile == "cpu" and s.n_train == raw["language_train"]["cpu"]["corpus"]["n_train"]
    assert s.batch_size == raw["language"]["defaults"]["batch_size"] and s.n_points == raw["language"]["cpu"]["n_points"]
    assert lr.load_settings("paper")[1].n_train is None          # McCoy et al.'s zoo: no generated corpus


def test_whole_halves_are_the_preregistered_retest(inputs):
    frame, primary = inputs
    table = lr.curve(frame, primary, _settings(n_draws=20))
    prim = primary.set_index("measure")
    for m, g in table.groupby("measure"):
        whole = g[g.batches_per_half == g.batches_per_half.max()].iloc[0]
        assert whole.batches_per_half == 15 and whole.tau == prim.loc[m, "retest"]            # exactly
        assert analysis.spearman_brown(whole.tau, 2) == pytest.approx(prim.loc[m, "reliability"], abs=1e-12)
        # the same τ by hand: scipy on the means of the first and the last 15 batches
        v = np.array([json.loads(p) for p in frame[frame.measure == m].per_batch])
        assert whole.tau == pytest.approx(stats.kendalltau(v[:, :15].mean(1), v[:, 15:].mean(1)).statistic, abs=1e-12)


def test_other_halves_or_another_protocol_are_refused(inputs):
    frame, primary = inputs
    swapped = frame.assign(per_batch=[json.dumps(json.loads(p)[1:] + json.loads(p)[:1]) for p in frame.per_batch])
    with pytest.raises(ValueError, match="not the pre-registered halves"):
        lr.curve(swapped, primary, _settings(n_draws=5))
    with pytest.raises(ValueError, match="not this profile's zoo"):
        lr.curve(frame, primary, _settings(n_points=1024, n_draws=5))


def test_committed_outputs_follow_from_the_committed_inputs(inputs):
    frame, primary = inputs
    metrics = json.loads((ROOT / "reports" / "metrics" / "language_retest.json").read_text())
    if not committed_run():      # the committed profile skips the stage: its outputs say so, and nothing else
        from companion.skipped import skipped_stages

        profile, skips = skipped_stages(metrics["profile"])
        assert metrics["skipped"] == skips["language_retest"] and metrics["table1"] == []
        assert not (ROOT / "reports" / "data" / "language_retest" / "retest_by_batches.csv").exists()
        return
    table = pd.read_csv(ROOT / "reports" / "data" / "language_retest" / "retest_by_batches.csv")
    s = _settings()
    assert metrics["exploratory"] and metrics["training_pairs_available"] == s.n_train
    redo = lr.curve(frame, primary, s)
    pd.testing.assert_frame_equal(redo.reset_index(drop=True), table, check_dtype=False, atol=1e-12, rtol=0)
    for m, r in metrics["measures"].items():
        b = r["batches_per_half_for_target"]
        # the smallest whole number of batches per half whose Spearman–Brown retest reaches the target
        assert analysis.spearman_brown(r["retest"], b / 15) >= s.target > analysis.spearman_brown(r["retest"], (b - 1) / 15)
        assert r["pairs_per_member_for_target"] == 2 * b * s.batch_size
        lo, hi = r["batches_per_half_for_target_interval"]
        assert lo <= b <= hi
    assert any(str(r["batches_per_half_for_target"]) in line for line in metrics["findings"] for r in
               metrics["measures"].values())


def test_batches_for_rounds_up_and_handles_no_signal():
    tau = 2 / math.pi * math.asin(0.5)                        # r = 0.5: R = 0.8 at exactly 4x the data
    assert lr.batches_for(tau, 15, 2 / math.pi * math.asin(0.8)) == 60
    assert lr.batches_for(tau, 15, 0.8) == math.ceil(15 * analysis.spearman_brown_factor(tau, 0.8))
    assert lr.batches_for(-0.1, 15, 0.8) is None


def test_random_splits_follow_the_preregistered_rule_against_a_loop():
    """Issue 24 item 6: the retest of the halves as the mean over random splits of all the batches, from
    paired.retest_splits; recomputed here with scipy, split by split."""
    from scipy import stats

    s = _settings(n_points=6 * 128, batch_size=128, split_n_splits=20, split_seed=5)
    rng = np.random.default_rng(0)
    level = rng.standard_normal(7)
    rows = [dict(model=f"m{i}", measure="adaptive", rho=0.1, per_batch=json.dumps((level[i] + rng.standard_normal(6)).tolist()))
            for i in range(7)]
    frame = pd.DataFrame(rows)
    v = np.array([json.loads(p) for p in frame["per_batch"]])
    primary = pd.DataFrame([dict(measure="adaptive", retest=stats.kendalltau(v[:, :3].mean(1), v[:, 3:].mean(1)).statistic)])
    got = lr.random_splits(frame, primary, s).iloc[0]
    r = np.random.default_rng(5)
    taus = []
    for _ in range(20):
        p = r.permutation(6)
        taus.append(stats.kendalltau(v[:, p[:3]].mean(1), v[:, p[3:]].mean(1)).statistic)
    assert got.retest_random_splits == pytest.approx(np.mean(taus), abs=1e-12)
    assert got.retest_first_last == pytest.approx(primary.retest.iloc[0])
    p = lr.load_settings("cpu")[1]
    assert (p.split_n_splits, p.split_seed) == (1000, 24)      # the pre-registered rule, read from params.yaml
