"""companion.experiments.ablations: each ablation value is the library's own (a direct call with the measure the
paper's Appendix G describes, at the radius the pre-registration gives it), the full and adaptive values are the
published ones (checked by re-running, a wrong table is refused), τ and Δτ are scipy's on the same members,
refusals are counted, and Table 1 shows one exploratory line per ablation (or "not computed" before the stage ran)."""
import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats

import hideseek as hs
from companion import paper
from companion.experiments import ablations as ab
from companion.experiments import table1
from tests.companion.experiments.tiny_zoo import TinySource as _TinySource
from tests.companion.experiments.tiny_zoo import batches as _batches
from tests.models import tiny_bert

RHO = {"adaptive": 0.1, "geodesic_invariant": 0.05, "geodesic_mixed": 0.01}
N_ITERS = 1


def _settings(**kw):
    p = {"rows": {"tiny": {"row": "language", "stage": "tinystage", "zoo": "unused", "batches": [0, 2],
                           "variants": ["no_christoffel", "christoffel_only"], "eps_grid": [0.001, 0.1], "reason": ""},
                  "vision": {"row": "vision", "stage": "vision", "zoo": None, "batches": [0, 1],
                             "variants": ["no_christoffel", "christoffel_only"], "eps_grid": [0.1],
                             "reason": "not computed: zoo not in the cache"}},
         "metrics": ["invariant", "mixed"], "eps_metric": "invariant",
         "language": {"stage": "tinystage", "zoo": "unused", "relative_flatness_layer": "classifier.weight",
                      "orbit": {"model": None, "batch": 0, "scales": [0.1, 10.0], "action_seed": 0, "dtype": "float64"},
                      "reason": ""},
         "n_boot": 200, "seed": 24, "confidence": 0.95, "retest_splits": {"n_splits": 20, "seed": 24},
         "check_rtol": 1e-5, "metrics_dir": "unused", "data_dir": "unused", "workers": 1, "threads": 1,
         "budget_minutes": 20, "cpu_kernels": None}
    p.update(kw)
    return p


def test_lines_are_the_papers_switches_at_the_declared_radii():
    s = ab.load_settings(_settings())
    lines = ab.lines_of(s.rows["tiny"], s)
    got = {ln.key: (ln.measure(0.0), ln.rho_of) for ln in lines}
    assert got["no_christoffel_mixed"] == (hs.Measure(metric="mixed", ball="riemannian", step="straight"),
                                           "geodesic_mixed")
    assert got["no_christoffel_mixed"][0].name == "geodesic_mixed_no_christoffel"
    # no metric norm: the adaptive ball (every parameter) at the adaptive radius, second-order step
    assert got["christoffel_only_invariant"] == (hs.Measure(metric="invariant", ball="adaptive", step="second_order"),
                                                 "adaptive")
    assert got["eps_0.1_invariant"] == (hs.Measure(metric="invariant", eps=0.1), "geodesic_invariant")
    assert [ln.key for ln in lines] == ["no_christoffel_invariant", "no_christoffel_mixed", "christoffel_only_invariant",
                                        "christoffel_only_mixed", "eps_0.001_invariant", "eps_0.1_invariant"]
    # with a straight step the no-metric-norm measure is adaptive sharpness itself (docs/maths.md §7.4)
    m, bs = tiny_bert(0), _batches()[:1]
    a = hs.sharpness(m, bs, hs.Measure(metric="invariant", ball="adaptive", step="straight"), rho=0.1, n_iters=2,
                     seed=0, progress=False).value
    assert a == pytest.approx(hs.sharpness(m, bs, hs.Measure(geometry="adaptive"), rho=0.1, n_iters=2, seed=0,
                                           progress=False).value, rel=1e-10)


def test_member_values_equal_direct_library_calls_and_refusals_are_recorded(monkeypatch):
    model, bs = tiny_bert(0), _batches()
    lines = [("a", hs.Measure(metric="mixed", step="straight"), 0.01),
             ("b", hs.Measure(metric="invariant", ball="adaptive"), 0.1), ("c", hs.Measure(eps=0.1), 0.05)]
    rec = ab.measure_member("m", model, batches=bs[:2], lines=lines, n_iters=2, seed=0)
    for key, measure, rho in lines:
        ref = hs.sharpness(model, bs[:2], measure, rho=rho, n_iters=2, seed=0, progress=False)
        assert rec[key]["value"] == ref.value and rec[key]["per_batch"] == list(ref.per_batch)
        assert not rec[key]["refused"]
    import hideseek

    def refuse(*a, **k):
        raise ValueError("pair 'layer.0' has a singular Gram matrix at eps = 0; use eps > 0\nsecond line")
    monkeypatch.setattr(hideseek, "sharpness", refuse)
    rec = ab.measure_member("m", model, batches=bs[:2], lines=lines[:1], n_iters=2, seed=0)["a"]
    assert rec["refused"] and math.isnan(rec["value"]) and rec["message"].endswith("use eps > 0")
    monkeypatch.setattr(hideseek, "sharpness", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("bug")))
    with pytest.raises(RuntimeError, match="bug"):
        ab.measure_member("m", model, batches=bs[:2], lines=lines[:1], n_iters=2, seed=0)


def test_line_statistics_against_scipy_and_by_hand():
    s = ab.load_settings(_settings())
    rng = np.random.default_rng(1)
    n = 14
    gap = rng.normal(size=n)
    pb = gap[:, None] + rng.normal(0, 0.7, (n, 2))
    full, adaptive = gap + rng.normal(0, 0.4, n), -gap + rng.normal(0, 1.0, n)
    x = pb.mean(1)
    tau = lambda a, b: stats.kendalltau(a, b).statistic  # noqa: E731
    for sign in (1, -1):
        st = ab.line_stats(x, pb, full, adaptive, gap, sign=sign, s=s)
        assert st["tau"] == pytest.approx(tau(x, gap), abs=1e-12) and st["ci_low"] <= st["tau"] <= st["ci_high"]
        assert st["delta_full"] == pytest.approx(sign * (tau(x, gap) - tau(full, gap)), abs=1e-12)
        assert st["delta_adaptive"] == pytest.approx(sign * (tau(x, gap) - tau(adaptive, gap)), abs=1e-12)
        assert st["delta_full_ci_low"] <= st["delta_full"] <= st["delta_full_ci_high"]
        # the paired interval by hand: the same resamples for both τ (kendall's seed rule)
        idx = np.random.default_rng(24).integers(0, n, (200, n))
        boots = np.array([sign * (tau(x[i], gap[i]) - tau(full[i], gap[i])) for i in idx])
        assert [st["delta_full_ci_low"], st["delta_full_ci_high"]] == pytest.approx(
            list(np.quantile(boots[np.isfinite(boots)], [0.025, 0.975])))
        rt = tau(pb[:, 0], pb[:, 1])
        r = math.sin(math.pi * rt / 2)
        assert st["retest"] == pytest.approx(rt) and st["reliability"] == pytest.approx(
            2 / math.pi * math.asin(2 * r / (1 + r)))
    x[[3, 8]] = np.nan                 # refused members: out of both τ of each Δ, counted
    st = ab.line_stats(x, pb, full, adaptive, gap, sign=1, s=s)
    ok = np.isfinite(x)
    assert st["n"] == 12 and st["n_refused"] == 2
    assert st["delta_full"] == pytest.approx(tau(x[ok], gap[ok]) - tau(full[ok], gap[ok]))


def _published(tmp_path, n, *, corrupt=False):
    """The tables a zoo stage publishes, with the library's own per-batch values of the three measures."""
    names = [f"model_{i:03d}" for i in range(n)]
    d = tmp_path / "data" / "tinystage"
    d.mkdir(parents=True)
    (tmp_path / "metrics").mkdir()
    rng = np.random.default_rng(3)
    pd.DataFrame({"name": names, "gap": rng.uniform(0, 0.1, n)}).to_csv(d / "members.csv", index=False)
    measures = {"adaptive": hs.Measure(geometry="adaptive"), "geodesic_invariant": hs.Measure(metric="invariant"),
                "geodesic_mixed": hs.Measure(metric="mixed")}
    rows = []
    for i, k in enumerate(names):
        for m, meas in measures.items():
            torch.manual_seed(0)
            pb = list(hs.sharpness(tiny_bert(i), _batches(), meas, rho=RHO[m], n_iters=N_ITERS, seed=0,
                                   progress=False).per_batch)
            if corrupt and i == 0 and m == "geodesic_invariant":
                pb[2] *= 1.01
            rows.append(dict(model=k, measure=m, rho=RHO[m], value=float(np.mean(pb)), per_batch=json.dumps(pb)))
    pd.DataFrame(rows).to_csv(d / "sharpness.csv", index=False)
    pd.DataFrame({"measure": paper.TABLE1_MEASURES, "rho": [RHO[m] for m in paper.TABLE1_MEASURES],
                  "gap_reliability": 0.9}).to_csv(d / "primary.csv", index=False)
    (tmp_path / "metrics" / "tinystage.json").write_text(json.dumps(
        {"protocol": {"rho": RHO, "n_iters": N_ITERS, "seed": 0, "eps": 0.0, "batch_size": 4, "n_points": 16,
                      "data_seed": 0}, "table1": [{"primary": True, "setting": "tiny BERTs"}]}))


@pytest.mark.slow
def test_stage_report_table1_lines_and_language_figures(tmp_path):
    n = 5
    _published(tmp_path, n)
    out = tmp_path / "out"
    params = _settings(metrics_dir=str(tmp_path / "metrics"), data_dir=str(tmp_path / "data"))
    rep = ab.run_report("cpu", params, out, progress=False, sources={"tiny": _TinySource(n), "language": _TinySource(n)})
    res = rep.results["tiny"]
    assert res.check_diff <= 1e-12
    members = pd.read_csv(out / "data" / "tiny" / "members.csv", index_col=0, float_precision="round_trip")
    gap, bs = members["gap"].to_numpy(), [_batches()[0], _batches()[2]]
    # every value a direct library call on batches 0 and 2 at the declared radius; full/adaptive the published ones
    ref = hs.sharpness(tiny_bert(3), bs, hs.Measure(metric="mixed", ball="adaptive"), rho=RHO["adaptive"],
                       n_iters=N_ITERS, seed=0, progress=False).value
    assert members.loc["model_003", "christoffel_only_mixed"] == ref
    ref = hs.sharpness(tiny_bert(1), bs, hs.Measure(metric="invariant", eps=0.1), rho=RHO["geodesic_invariant"],
                       n_iters=N_ITERS, seed=0, progress=False).value
    assert members.loc["model_001", "eps_0.1_invariant"] == ref
    full = hs.sharpness(tiny_bert(2), bs, hs.Measure(metric="mixed"), rho=RHO["geodesic_mixed"], n_iters=N_ITERS,
                        seed=0, progress=False).value
    assert members.loc["model_002", "geodesic_mixed"] == pytest.approx(full, rel=1e-12)
    lines = rep.lines.set_index("line")
    tau = lambda a: stats.kendalltau(members[a], gap).statistic  # noqa: E731
    assert lines.loc["no_christoffel_mixed", "delta_full"] == pytest.approx(tau("no_christoffel_mixed")
                                                                            - tau("geodesic_mixed"))
    assert lines.loc["no_christoffel_mixed", "paper_tau"] == paper.LANGUAGE_ABLATION_TAU["geodesic_mixed_no_christoffel"]
    assert pd.isna(lines.loc["christoffel_only_invariant", "paper_tau"])     # the paper gives no number for it
    # Table 1: one line per ablation under the row, Δ against full; the vision row "not computed" with its reason
    md, records = table1.build(out / "metrics")
    ours = [r for r in records if r["stage"] == "ablations"]
    tiny = [r for r in ours if r["status"] == "computed"]
    assert len(tiny) == 4 and {r["status"] for r in ours} == {"computed", "not computed: zoo not in the cache"}
    noc = next(r for r in tiny if "no Christoffel" in r["variant"])
    assert noc["geodesic_mixed"] == pytest.approx(tau("no_christoffel_mixed")) and noc["adaptive"] is None
    assert noc["delta_tau_geodesic_mixed"] == pytest.approx(lines.loc["no_christoffel_mixed", "delta_full"])
    eps = next(r for r in tiny if "ε = 0.001" in r["variant"])
    assert eps["geodesic_mixed"] is None and eps["geodesic_invariant"] == pytest.approx(tau("eps_0.001_invariant"))
    assert "## Ablations" in md and "against the full measure" in md
    # the language figures: relative flatness by the library, the orbit's geodesic ratios 1, the classifier's too
    lang = rep.language
    rf = hs.relative_flatness(tiny_bert(4), _batches(), layer="classifier.weight").value
    assert lang.relative.loc["model_004", "relative_flatness"] == pytest.approx(rf, rel=1e-12)
    summ = lang.orbit_summary.set_index("measure")
    assert summ.loc["geodesic_invariant", "max_abs_log_ratio"] < 1e-6
    assert summ.loc["relative_flatness", "max_abs_log_ratio"] < 1e-9
    assert summ.loc["adaptive", "max_abs_log_ratio"] > 1e-3
    metrics = json.loads((out / "metrics" / "ablations.json").read_text())
    assert metrics["findings"] and any(f.startswith("vision: not computed") for f in metrics["findings"])


@pytest.mark.slow
def test_a_published_table_that_is_not_the_measured_one_is_refused(tmp_path):
    _published(tmp_path, 4, corrupt=True)
    params = _settings(metrics_dir=str(tmp_path / "metrics"), data_dir=str(tmp_path / "data"), language=None)
    with pytest.raises(ValueError, match="not the batches the row's primary τ used"):
        ab.run_report("cpu", params, tmp_path / "out", progress=False, sources={"tiny": _TinySource(4)})


def test_table1_before_the_stage_ran_says_not_computed(tmp_path):
    (tmp_path / "m").mkdir()
    _, records = table1.build(tmp_path / "m")       # no row's stage has published: nothing to wait for
    assert not [r for r in records if r["stage"] == "ablations"]
    for stage in ("minilm", "vision"):
        (tmp_path / "m" / f"{stage}.json").write_text(json.dumps({"profile": "cpu", "table1": []}))
    md, records = table1.build(tmp_path / "m")
    ours = [r for r in records if r["stage"] == "ablations"]
    assert {r["row"] for r in ours} == {"language", "vision"} and len(ours) == 6
    assert {r["status"] for r in ours} == {ab.PENDING} and ab.PENDING == table1.ABLATIONS_PENDING
    assert ab.PENDING in md and "## Ablations" in md


def test_settings_are_checked():
    with pytest.raises(ValueError, match="choose from"):
        ab.load_settings(_settings(rows={"x": {"row": "vision", "stage": "vision", "zoo": "z", "batches": [0, 1],
                                               "variants": ["no_norm"], "eps_grid": [], "reason": ""}}))
    with pytest.raises(ValueError, match="every ε must be > 0"):
        ab.load_settings(_settings(rows={"x": {"row": "vision", "stage": "vision", "zoo": "z", "batches": [0, 1],
                                               "variants": [], "eps_grid": [0.0], "reason": ""}}))
    with pytest.raises(ValueError, match="an even number"):
        ab.load_settings(_settings(rows={"x": {"row": "vision", "stage": "vision", "zoo": "z", "batches": [0],
                                               "variants": [], "eps_grid": [], "reason": ""}}))
    with pytest.raises(ValueError, match="`reason` must say why"):
        ab.load_settings(_settings(rows={"x": {"row": "vision", "stage": "vision", "zoo": None, "batches": [0, 1],
                                               "variants": [], "eps_grid": [], "reason": ""}}))
