"""The MiniLM pilot's rules and its power of the paired Δτ (companion.pilots.minilm)."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from companion import paper
from companion.pilots import minilm as mp

POWER = dict(n_sim=60, n_boot=200, confidence=0.95, seed=0)


def test_paired_power_size_and_power():
    # no difference between the measures: the interval rarely lies above 0 (one-sided 2.5 %, plus noise)
    null = mp.paired_power(30, tau_a=0.3, tau_g=0.3, sign=1.0, rel_a=1.0, rel_g=1.0, rel_y=1.0, corr_ag=0.5, **POWER)
    assert null <= 0.15
    # a large difference with perfect reliabilities is found almost always
    big = mp.paired_power(40, tau_a=0.0, tau_g=0.6, sign=1.0, rel_a=1.0, rel_g=1.0, rel_y=1.0, corr_ag=0.0, **POWER)
    assert big >= 0.9
    # noise in the measures costs power
    noisy = mp.paired_power(40, tau_a=0.0, tau_g=0.6, sign=1.0, rel_a=0.3, rel_g=0.3, rel_y=0.5, corr_ag=0.0, **POWER)
    assert noisy < big
    # the sign flips the direction: the same difference against the paper's sign is never "supported"
    assert mp.paired_power(40, tau_a=0.0, tau_g=0.6, sign=-1.0, rel_a=1.0, rel_g=1.0, rel_y=1.0, corr_ag=0.0,
                           **POWER) <= 0.05
    with pytest.raises(ValueError, match="rel_a"):
        mp.paired_power(10, tau_a=0, tau_g=0, sign=1, rel_a=1.5, rel_g=1, rel_y=1, corr_ag=0, **POWER)


def test_paired_power_converts_to_the_shared_power_function():
    from companion import analysis

    kw = dict(n_sim=30, n_boot=100, seed=3, confidence=0.95)
    # Pearson reliability 1 is retest tau 1; a latent correlation of 0.5 at perfect reliability is observed as
    # Kendall tau (2/pi) asin(0.5) = 1/3
    ours = mp.paired_power(20, tau_a=0.1, tau_g=0.5, sign=1.0, rel_a=1.0, rel_g=1.0, rel_y=0.9, corr_ag=0.5, **kw)
    ref = analysis.delta_power(20, 0.5, 0.1, retest_x=1.0, retest_base=1.0, rel_y=0.9, tau_between=1 / 3, sign=1, **kw)
    assert ours == ref
    assert mp.paired_power(20, tau_a=0.1, tau_g=0.5, sign=1.0, rel_a=0.0, rel_g=1.0, rel_y=0.9, corr_ag=0.5, **kw) == 0


def test_choose_rho_follows_the_ratio_rule_then_the_retest():
    table = pd.DataFrame([dict(measure="adaptive", rho=0.05, retest_vc=0.5), dict(measure="adaptive", rho=0.1, retest_vc=0.6),
                          dict(measure="geodesic_mixed", rho=0.01, retest_vc=0.4),
                          dict(measure="geodesic_mixed", rho=0.02, retest_vc=0.7),
                          dict(measure="geodesic_invariant", rho=0.06, retest_vc=0.5),
                          dict(measure="geodesic_invariant", rho=0.12, retest_vc=0.5)])
    diag = pd.DataFrame([dict(measure="adaptive", rho=r, correction_ratio=math.nan) for r in (0.05, 0.1)]
                        + [dict(measure="geodesic_mixed", rho=0.01, correction_ratio=0.2),
                           dict(measure="geodesic_mixed", rho=0.02, correction_ratio=0.9),
                           dict(measure="geodesic_invariant", rho=0.06, correction_ratio=0.1),
                           dict(measure="geodesic_invariant", rho=0.12, correction_ratio=0.1)])
    s = type("S", (), {"max_correction_ratio": 0.5})()
    # adaptive: best retest; mixed: 0.02 has the better retest but breaks the ratio rule; invariant: tie -> smaller
    assert mp.choose_rho(table, diag, s) == {"adaptive": 0.1, "geodesic_mixed": 0.01, "geodesic_invariant": 0.06}


def test_paper_delta():
    tau = paper.table1_tau("language")
    assert mp.paper_delta() == pytest.approx({g: tau[g] - tau["adaptive"] for g in mp.GEODESIC})


def test_plan_trades_batches_against_members():
    s = mp.MiniLMPilotSettings(zoo_dir="", base_seed=0, n_members=8, batch_size=32, n_half=2, data_seed=0, seed=0,
                               workers=2, threads=1, n_iters=5, rho_grid={}, max_correction_ratio=0.5, diag_members=1,
                               target=0.8, max_train_error=0.2, gap_splits=10, batches_per_half=[2, 8],
                               members_grid=[8, 12], max_members=40, budget_seconds=2000, target_power=0.8,
                               power_n_sim=30, power_n_boot=100, confidence=0.95)
    comps = {m: (1.0, 4.0) for m in ("adaptive", *mp.GEODESIC)}
    out = mp.plan(s, comps, {g: 0.5 for g in mp.GEODESIC}, 0.9, train_seconds=50.0,
                  sec_per_batch_iter={m: 1.0 for m in comps})
    caps = {o["k"]: o["cap"] for o in out["options"]}
    # cost per member: 50 + 3 measures x 2k batches x 5 iterations x 1 s; budget 2000 s x 2 workers
    assert caps == {2: int(4000 // 110) - int(4000 // 110) % 2, 8: int(4000 // 290) - int(4000 // 290) % 2}
    assert out["batches_per_half"] in (2, 8) and out["n_models"] <= caps[out["batches_per_half"]]
    assert out["n_points"] == 2 * out["batches_per_half"] * 32
