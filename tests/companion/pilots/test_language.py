"""The language pilot's statistics, each against an independent reference (simulation with known truth)."""
from __future__ import annotations

import math
from dataclasses import asdict

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from companion import analysis
from companion.pilots import language as lp


def _settings(**kw) -> lp.PilotSettings:
    base = dict(zoo_dir="unused", base_seed=0, batch_size=2, n_half=4, data_seed=0, seed=0, workers=1, threads=1,
                radius_iters=5, protocol_half=2, rho_grid={"adaptive": [0.1, 0.2]}, n_iters=[5, 20], pairs=[2, 8], target=0.8,
                max_train_error=0.2, gap_splits=20, power_alpha=0.05, power_n_sim=200, power_members=[10],
                max_batches_per_half=15, exploratory_runs=32)
    return lp.PilotSettings(**{**base, **kw})


def _frame(values: np.ndarray, measure="adaptive", rho=0.1, n_iters=5, seconds=1.0) -> pd.DataFrame:
    return pd.DataFrame({"model": [f"m{i}" for i in range(len(values))], "measure": measure, "rho": rho,
                         "per_batch": [list(v) for v in values], "base_loss": [list(v) for v in values],
                         "seconds": seconds, "n_iters": n_iters})


def test_retest_table_direct_tau_uses_disjoint_batches_and_rho_choice_ignores_the_gap():
    rng = np.random.default_rng(4)
    s = _settings()
    member = rng.normal(0.0, 1.0, (12, 1))
    sharp = np.exp(member + rng.normal(0.0, 0.3, (12, 8)))     # reliable
    noisy = np.exp(0.1 * member + rng.normal(0.0, 1.0, (12, 8)))   # batch noise dominates
    frame = pd.concat([_frame(sharp, rho=0.1), _frame(noisy, rho=0.2)], ignore_index=True)
    outlier = np.exp(member[:1] + 5.0 + np.zeros((1, 8)))   # a member apart from the others on every batch, left out as not fitted
    frame = pd.concat([frame, _frame(outlier, rho=0.1).assign(model="out"),
                       _frame(outlier, rho=0.2).assign(model="out")], ignore_index=True)
    table = lp.retest_table(frame, s, [f"m{i}" for i in range(12)])
    row = table[(table["rho"] == 0.1) & (table["pairs"] == 8)].iloc[0]
    a, b = sharp[:, :4].mean(1), sharp[:, 4:8].mean(1)
    assert row["retest"] == pytest.approx(stats.kendalltau(a, b).statistic)
    assert row["grad_evals"] == 2 * 4 * 5
    assert lp.choose_rho(table, s) == {"adaptive": 0.1}
    assert lp.smallest_protocol(table, {"adaptive": 0.2}, 0.99) is None


def test_extrapolated_protocol_needs_enough_batches_for_every_measure():
    rng = np.random.default_rng(5)
    s = _settings(target=0.8)
    member = rng.normal(0.0, 1.0, (40, 1))
    frame = pd.concat([_frame(np.exp(member + rng.normal(0.0, 0.5, (40, 8))), measure="adaptive", rho=0.1),
                       _frame(np.exp(member + rng.normal(0.0, 2.0, (40, 8))), measure="geodesic_mixed", rho=0.2)],
                      ignore_index=True)
    table = lp.retest_table(frame, s, [f"m{i}" for i in range(40)])
    (row,) = lp.extrapolated_protocols(table, {"adaptive": 0.1, "geodesic_mixed": 0.2}, s)
    worst = table[table["measure"] == "geodesic_mixed"].iloc[0]
    k = row["batches_per_half"]
    assert k == math.ceil(worst["batches_for_target"]) and row["grad_evals"] == 2 * k * 5
    assert analysis.component_retest(worst["s_member"], worst["s_resid"], k) >= 0.8


def test_report_markdown_is_generated_from_the_report():
    rng = np.random.default_rng(6)
    s = _settings()
    member = rng.normal(0.0, 1.0, (12, 1))
    scan = pd.concat([_frame(np.exp(member + rng.normal(0.0, 0.5, (12, 8))), rho=r) for r in (0.1, 0.2)],
                     ignore_index=True)
    names = [f"m{i}" for i in range(12)]
    rho = lp.choose_rho(lp.retest_table(scan, s, names), s)
    deep = _frame(np.exp(member + rng.normal(0.0, 0.3, (12, 4))), rho=rho["adaptive"], n_iters=20)
    table = lp.retest_table(pd.concat([scan, deep], ignore_index=True), s, names)
    report = {"settings": asdict(s), "n_members": 12, "seeds": list(range(12)), "n_fitted": 12, "n_dev": 100,
              "rho": rho, "protocol": lp.smallest_protocol(table, rho, s.target),
              "extrapolated": lp.extrapolated_protocols(table, rho, s), "retest": table.to_dict("records"),
              "gap_reliability": {"all": 0.9, "fitted": 0.85}, "base_loss": lp.base_loss_retest(scan, s, names),
              "power": [dict(measure="adaptive", paper_tau=0.06, retest=0.8, gap_reliability=0.9, n=10, power=0.1)]}
    text = lp.markdown(report)
    assert "(chosen)" in text and "| adaptive | 20 |" in text and "0.90" in text
    row = table[(table["n_iters"] == 20) & (table["pairs"] == 2)].iloc[0]   # 8 pairs exceed its 2 batches per half
    assert f"{row['retest']:.2f} / {row['retest_splits']:.2f} / {row['retest_vc']:.2f}" in text


def test_budget_scales_the_reference_run_by_pass_count():
    reference = {"protocol": {"n_models": 40, "rho_grid": {"a": [1, 2], "b": [1, 2, 3]}, "n_batches": 1, "n_iters": 5},
                 "seconds": {"sharpness": {"main": 100.0}, "zoo_training": 800.0}}
    b = lp.budget({"batches_per_half": 4, "n_iters": 20}, 60, 10, reference,
                  {"seconds": {"z0": {"train": 10.0, "measure": 2.0}, "z1": {"train": 11.0, "measure": 3.0}}})
    per_pass = 100.0 / (40 * 5 * 1 * 5)          # 0.1 s per (member, run, batch, iteration)
    assert b["seconds_per_batch_iteration"] == pytest.approx(per_pass)
    assert b["train"] == pytest.approx(1200.0) and b["primary"] == pytest.approx(per_pass * 60 * 3 * 8 * 20)
    assert b["exploratory"] == pytest.approx(per_pass * 60 * 10 * 5) and b["language_stability"] == 26.0


def test_preregistration_applies_the_rules():
    report = {"rho": {"adaptive": 0.5}, "extrapolated": [
        {"n_iters": 5, "batches_per_half": 12, "pairs_per_half": 1536, "grad_evals": 120},
        {"n_iters": 20, "batches_per_half": 2, "pairs_per_half": 256, "grad_evals": 80},
        {"n_iters": 40, "batches_per_half": 16, "pairs_per_half": 2048, "grad_evals": 1280}],
        "power": [dict(measure=m, n=n, power=p) for n, p in ((30, 0.5), (50, 0.79), (70, 0.9))
                  for m in ("geodesic_invariant", "geodesic_mixed")]}
    reference = {"protocol": {"n_models": 10, "rho_grid": {"a": [1]}, "n_batches": 1, "n_iters": 1},
                 "seconds": {"sharpness": {"main": 10.0}, "zoo_training": 100.0}}
    pre = lp.preregistration(report, reference, None, _settings(max_batches_per_half=15, exploratory_runs=0))
    assert pre["protocol"]["n_iters"] == 20 and pre["n_models"] == 70
    assert pre["budget_seconds"]["primary"] == pytest.approx(1.0 * 70 * 3 * 2 * 2 * 20)
    assert "70" in "\n".join(lp._preregistration_lines(pre))


def test_largest_protocol_when_none_reaches_the_target():
    rows = [dict(measure="adaptive", rho=0.1, n_iters=n, s_member=1.0, s_resid=r) for n, r in ((5, 10.0), (20, 30.0))]
    report = {"rho": {"adaptive": 0.1}, "settings": {"batch_size": 128}, "retest": rows}
    p = lp.largest_protocol(report, 15)
    assert p["n_iters"] == 5 and p["pairs_per_half"] == 1920 and not p["reaches_target"]
    assert p["predicted_retest"]["adaptive"] == pytest.approx(analysis.component_retest(1.0, 10.0, 15))
