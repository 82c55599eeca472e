"""companion.experiments.zoo: measuring a zoo, and its tau tables.

measure_zoo is checked against direct hideseek.sharpness calls on tiny open_clip ViTs
(float64); the tau helpers against scipy.stats.kendalltau computed here independently.
"""
import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats

import hideseek as hs
from companion.experiments.vision_zoo import GlyphViT, ViTConfig
from companion.analysis import retest_table
from companion.experiments.zoo import (STANDARD_MEASURES, measure_zoo, per_batch_halves,
                                      split_half_taus, tau_vs_rho, value_table)

TINY = dict(width=8, layers=1, heads=2, patch_size=4, mlp_ratio=2.0, embed_dim=8, logit_scale=5.0)


def tiny_model(seed):
    torch.manual_seed(seed)
    return GlyphViT(ViTConfig(**TINY), 8, 10).double().eval()


def tiny_batches(n_batches=2, size=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 1, 8, 8, generator=g, dtype=torch.float64),
             torch.randint(0, 10, (size,), generator=g)) for _ in range(n_batches)]


MEASURES = {"adaptive": STANDARD_MEASURES["adaptive"], "geodesic_mixed": STANDARD_MEASURES["geodesic_mixed"]}
GRID = {"adaptive": [0.1, 0.3], "geodesic_mixed": [0.05]}


@pytest.fixture(scope="module")
def zoo_frame():
    models = [("a", tiny_model(0)), ("b", lambda: tiny_model(1))]  # a module and a loader
    return measure_zoo(models, tiny_batches(), MEASURES, GRID, seed=3, n_iters=2, progress=False)


def test_frame_shape_and_order(zoo_frame):
    assert list(zoo_frame.columns) == ["model", "measure", "rho", "value", "per_batch", "base_loss", "seconds"]
    expected = [(m, k, r) for m in ("a", "b") for k in MEASURES for r in GRID[k]]
    assert list(zip(zoo_frame["model"], zoo_frame["measure"], zoo_frame["rho"])) == expected
    assert all(len(pb) == 2 for pb in zoo_frame["per_batch"])
    assert np.allclose(zoo_frame["value"], [np.mean(pb) for pb in zoo_frame["per_batch"]])
    assert (zoo_frame["seconds"] > 0).all()


def test_values_equal_direct_sharpness_calls(zoo_frame):
    batches = tiny_batches()
    for name, seed in (("a", 0), ("b", 1)):
        model = tiny_model(seed)
        for measure, kw in MEASURES.items():
            for rho in GRID[measure]:
                direct = hs.sharpness(model, batches, rho=rho, n_iters=2, seed=3, progress=False, **kw)
                row = zoo_frame[(zoo_frame.model == name) & (zoo_frame.measure == measure) & (zoo_frame.rho == rho)]
                assert len(row) == 1
                assert row["value"].item() == direct.value
                assert row["per_batch"].item() == direct.per_batch
                assert row["base_loss"].item() == direct.base_losses


def test_sharper_radius_gives_larger_worst_case(zoo_frame):
    # a worst-case loss increase over a larger ball can only be larger (same start, more room)
    t = value_table(zoo_frame, "adaptive")
    assert (t[0.3] > t[0.1]).all(), t


def test_deterministic(zoo_frame):
    again = measure_zoo([("a", tiny_model(0)), ("b", tiny_model(1))], tiny_batches(), MEASURES, GRID,
                        seed=3, n_iters=2, progress=False)
    pd.testing.assert_frame_equal(zoo_frame.drop(columns="seconds"), again.drop(columns="seconds"))


def test_bad_inputs():
    m = [("a", tiny_model(0))]
    b = tiny_batches(1)
    with pytest.raises(ValueError, match="no grid"):
        measure_zoo(m, b, MEASURES, {"adaptive": [0.1]}, seed=0, n_iters=1, progress=False)
    with pytest.raises(ValueError, match="set by measure_zoo"):
        measure_zoo(m, b, {"x": dict(measure="adaptive", rho=0.2)}, [0.1], seed=0, n_iters=1, progress=False)
    with pytest.raises(ValueError, match="unique"):
        measure_zoo(m + m, b, MEASURES, [0.1], seed=0, n_iters=1, progress=False)
    with pytest.raises(ValueError, match="positive"):
        measure_zoo(m, b, MEASURES, [0.0], seed=0, n_iters=1, progress=False)
    with pytest.raises(TypeError, match="not an nn.Module"):
        measure_zoo([("a", lambda: 3)], b, MEASURES, [0.1], seed=0, n_iters=1, progress=False)


@pytest.mark.slow
def test_workers_give_every_value_bit_for_bit(tmp_path):
    # two spawned processes, each measuring whole models at this process's thread count, against
    # the serial loop: every value, per-batch value and base loss identical (float32, the zoos' dtype);
    # models given as saved members read by the vision zoo's own (picklable) loader, and one module
    import functools

    from companion.experiments.vision_zoo import load_member

    models = []
    for i in range(3):
        torch.manual_seed(10 + i)
        m = GlyphViT(ViTConfig(**TINY), 8, 10)
        torch.save(m.state_dict(), tmp_path / f"m{i}.pt")
        models.append((f"m{i}", functools.partial(load_member, ViTConfig(**TINY), 8, 10, str(tmp_path / f"m{i}.pt"))))
    models.append(("module", tiny_model(7).float()))
    batches = [(x.float(), y) for x, y in tiny_batches()]
    serial = measure_zoo(models, batches, MEASURES, GRID, seed=3, n_iters=2, progress=False)
    parallel = measure_zoo(models, batches, MEASURES, GRID, seed=3, n_iters=2, progress=False, workers=2)
    pd.testing.assert_frame_equal(serial.drop(columns="seconds"), parallel.drop(columns="seconds"), check_exact=True)
    assert serial["value"].nunique() > 1


def test_workers_refuse_what_cannot_be_sent():
    m = [("a", lambda: tiny_model(0)), ("b", tiny_model(1))]
    with pytest.raises(TypeError, match="picklable.*model 'a'.*use workers=1"):
        measure_zoo(m, tiny_batches(1), MEASURES, GRID, seed=0, n_iters=1, progress=False, workers=2)
    with pytest.raises(ValueError, match="workers must be >= 1"):
        measure_zoo(m, tiny_batches(1), MEASURES, GRID, seed=0, n_iters=1, progress=False, workers=0)


# ------------------------------------------------------------------------ tau tables


def synthetic_frame(n=16, seed=0):
    """Values built so that tau differs by rho: rho 1 tracks the gap, rho 2 is noise."""
    rng = np.random.default_rng(seed)
    names = [f"m{i:02d}" for i in range(n)]
    gap = rng.normal(size=n)
    rows = []
    for i, name in enumerate(names):
        for measure, sign in (("up", 1.0), ("down", -1.0)):
            rows.append(dict(model=name, measure=measure, rho=1.0, value=sign * gap[i] + 0.3 * rng.normal()))
            rows.append(dict(model=name, measure=measure, rho=2.0, value=rng.normal()))
    return pd.DataFrame(rows), pd.Series(gap, index=names)


def test_tau_vs_rho_matches_scipy():
    frame, gap = synthetic_frame()
    curves = tau_vs_rho(frame, gap, n_boot=200, seed=1)
    assert len(curves) == 4
    for _, r in curves.iterrows():
        sub = frame[(frame.measure == r.measure) & (frame.rho == r.rho)]
        ref = stats.kendalltau(sub["value"].to_numpy(), gap.loc[sub["model"]].to_numpy()).statistic
        assert r.tau == pytest.approx(ref, abs=1e-12)
        assert r.ci_low <= r.tau <= r.ci_high
    up = curves[(curves.measure == "up") & (curves.rho == 1.0)].tau.item()
    assert up > 0.5  # the constructed signal is found


def test_gaps_aligned_by_name_not_position():
    frame, gap = synthetic_frame()
    shuffled = gap.sample(frac=1.0, random_state=0)
    a = tau_vs_rho(frame, gap, n_boot=0, seed=0)
    b = tau_vs_rho(frame, shuffled, n_boot=0, seed=0)
    c = tau_vs_rho(frame, gap.to_numpy(), n_boot=0, seed=0)
    assert np.array_equal(a.tau, b.tau) and np.array_equal(a.tau, c.tau)
    with pytest.raises(ValueError, match="no gap"):
        tau_vs_rho(frame, gap.drop("m03"), n_boot=0, seed=0)


def test_split_half_chooses_on_one_half_reports_on_other():
    frame, gap = synthetic_frame(n=20, seed=2)
    table, halves = split_half_taus(frame, gap, seed=5, n_boot=200, paper={"up": 0.5})
    sel, ev = halves["select"], halves["eval"]
    assert set(sel).isdisjoint(ev) and sorted(sel + ev) == sorted(gap.index)
    for _, r in table.iterrows():
        sub = frame[frame.measure == r.measure]
        # independent choice: largest |tau| on the selection half
        taus = {rho: stats.kendalltau(sub[sub.rho == rho].set_index("model").loc[sel, "value"],
                                      gap.loc[sel]).statistic for rho in (1.0, 2.0)}
        best = max(taus, key=lambda k: abs(taus[k]))
        assert r.rho == best and r.tau_select == pytest.approx(taus[best])
        held = stats.kendalltau(sub[sub.rho == best].set_index("model").loc[ev, "value"], gap.loc[ev]).statistic
        assert r.tau == pytest.approx(held) and r.n_eval == len(ev)
        full = stats.kendalltau(sub[sub.rho == best].set_index("model").loc[gap.index, "value"], gap).statistic
        assert r.tau_all == pytest.approx(full) and r.n_all == 20
    assert table.set_index("measure").loc["up", "rho"] == 1.0  # the informative radius wins
    assert table.set_index("measure").loc["up", "paper"] == 0.5
    assert np.isnan(table.set_index("measure").loc["down", "paper"])


# ------------------------------------------------------------------------ test-retest


def test_per_batch_halves_by_hand():
    frame = pd.DataFrame([dict(model="a", measure="m", rho=0.1, value=2.5, per_batch=[1.0, 2.0, 3.0, 4.0]),
                          dict(model="b", measure="m", rho=0.1, value=2.0, per_batch=[1.0, 2.0, 3.0])])
    first, second = per_batch_halves(frame)
    assert first["value"].tolist() == [1.5, 1.0] and second["value"].tolist() == [3.5, 2.5]
    with pytest.raises(ValueError, match="at least 2 batches"):
        per_batch_halves(frame.assign(per_batch=[[1.0], [2.0]]))


def test_retest_table_matches_scipy_and_align_models_by_name():
    rng = np.random.default_rng(3)
    names = [f"m{i}" for i in range(15)]
    a = rng.normal(size=15)
    b = a + rng.normal(scale=0.5, size=15)
    first = pd.DataFrame(dict(model=names, measure="x", rho=0.2, value=a))
    second = pd.DataFrame(dict(model=names, measure="x", rho=0.2, value=b)).iloc[::-1]   # other order
    t = retest_table(first, second, n_boot=100, seed=0)
    assert len(t) == 1 and t["tau"].item() == pytest.approx(stats.kendalltau(a, b).statistic)
    assert t["ci_low"].item() <= t["tau"].item() <= t["ci_high"].item() and t["n"].item() == 15
    with pytest.raises(ValueError, match="no \\(measure, rho\\)"):
        retest_table(first, second.assign(rho=0.3), n_boot=0, seed=0)
