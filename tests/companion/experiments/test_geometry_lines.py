"""companion.experiments.geometry_lines: each member's values are the library's own (direct calls), τ and Δτ are
scipy's, refusals are counted (never dropped silently), the diagonal networks' traces match a closed form and the
group action, and Table 1 / the README show the lines with their status."""
import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats

import hideseek as hs
from companion import paper
from companion.experiments import geometry_lines as gl
from companion.experiments import table1
from tests.companion.experiments.tiny_zoo import TinySource as _TinySource
from tests.companion.experiments.tiny_zoo import batches as _batches
from tests.models import tiny_bert

HS = gl.HessianSettings("hutchinson", True, 0)


def _settings(**kw):
    p = {"rows": {"tiny": {"row": "language", "stage": "tinystage", "zoo": "unused", "exact_batches": [0, 1],
                           "hessian_batches": [0, 2], "hessian_probes": 2, "families": ["exact", "hessian"], "reason": ""},
                  "language": {"row": "language", "stage": "language", "zoo": None, "exact_batches": None,
                               "hessian_batches": None, "hessian_probes": None, "families": [],
                               "reason": "not computed: zoo not in the cache"}},
         "diagonal": None, "metrics": ["invariant", "mixed"],
         "hessian": {"method": "hutchinson", "keep_graph": True, "probe_seed": 0}, "baseline": "adaptive",
         "n_boot": 200, "seed": 24, "confidence": 0.95, "power": {"n_sim": 20, "n_boot": 50, "seed": 24},
         "retest_splits": {"n_splits": 20, "seed": 24}, "max_correction_ratio": 0.5, "workers": 1, "threads": 1,
         "budget_minutes": 25, "cpu_kernels": None}
    p.update(kw)
    return p


@pytest.mark.slow
def test_member_values_equal_direct_library_calls():
    model, bs = tiny_bert(0), _batches()
    rho = {"invariant": 0.05, "mixed": 0.01}
    rec = gl.measure_member("m", model, exact_batches=bs[:2], hessian_batches=[(0, bs[0]), (2, bs[2])],
                            metrics=["invariant", "mixed"], rho=rho, n_iters=2, seed=0, eps=0.0, hessian=HS, probes=2)
    for metric in ("invariant", "mixed"):
        ref = hs.sharpness(model, bs[:2], hs.Measure(metric=metric, step="exact"), rho=rho[metric], n_iters=2, seed=0,
                           progress=False)
        got = rec[f"exact_{metric}"]
        assert not got["refused"] and got["value"] == ref.value and got["per_batch"] == list(ref.per_batch)
        assert len(got["ratio"]) == 2 and all(0 < r < math.inf for r in got["ratio"])
    for kind in gl.HESSIANS:
        per = []
        for b in (0, 2):
            op = (hs.EuclideanHessian(model, [bs[b]]) if kind == "euclidean" else
                  hs.RiemannianHessian(model, [bs[b]], hs.Measure(metric=kind)))
            per.append(op.trace("hutchinson", n_probes=2, seed=b))
        got = rec[f"hessian_{kind}"]
        assert got["per_batch"] == pytest.approx([t.value for t in per], rel=1e-10)
        assert got["value"] == pytest.approx(np.mean([t.value for t in per]), rel=1e-10)
        assert got["stderr"] == pytest.approx(math.hypot(*[t.stderr for t in per]) / 2, rel=1e-10)


def test_refusals_are_recorded_and_counted(monkeypatch):
    model, bs = tiny_bert(0), _batches()
    kw = dict(exact_batches=bs[:2], hessian_batches=[(0, bs[0])], metrics=["mixed"], rho={"mixed": 0.1}, n_iters=2,
              seed=0, eps=0.0, hessian=HS, probes=2)
    # this tiny BERT's mixed geodesic at rho 0.1 meets an exactly singular Gram matrix (torch's LinAlgError)
    rec = gl.measure_member("m", model, **kw)["exact_mixed"]
    assert rec["refused"] and rec["refusal"] == "singular_gram" and math.isnan(rec["value"])
    # the library's own one-line refusal
    from hideseek.problem import SharpnessProblem

    def refuse(self):
        raise ValueError("2 geodesic(s) of the mixed metric reach a rank-deficient pair (GᵀG or HᵀH loses rank)")
    monkeypatch.setattr(SharpnessProblem, "run", refuse)
    rec = gl.measure_member("m", model, **kw)["exact_mixed"]
    assert rec["refused"] and rec["refusal"] == "rank_loss" and "rank-deficient" in rec["message"]
    monkeypatch.setattr(SharpnessProblem, "run", lambda self: (_ for _ in ()).throw(ValueError("something else")))
    with pytest.raises(ValueError, match="something else"):
        gl.measure_member("m", model, **kw)
    # a refused member is left out of both τ of the Δ and counted
    s = gl.load_settings(_settings())
    rng = np.random.default_rng(0)
    gap, base, x = rng.normal(size=(3, 12))
    x[[2, 7]] = np.nan
    st = gl.line_stats(x, base, gap, row="vision", s=s)
    ok = np.isfinite(x)
    assert st["n"] == 10 and st["n_refused"] == 2
    assert st["tau"] == pytest.approx(stats.kendalltau(x[ok], gap[ok]).statistic)


def test_line_statistics_against_scipy_and_by_hand():
    s = gl.load_settings(_settings())
    rng = np.random.default_rng(1)
    n = 15
    gap = rng.normal(size=n)
    pb = gap[:, None] + rng.normal(0, 0.7, (n, 2))
    base_pb = -gap[:, None] + rng.normal(0, 0.5, (n, 2))
    x, base = pb.mean(1), base_pb.mean(1)
    for row in ("vision", "language"):
        st = gl.line_stats(x, base, gap, row=row, s=s, per_batch=pb, base_per_batch=base_pb,
                           paper_tau=paper.table1_tau(row)["geodesic_invariant"], gap_reliability=0.9)
        sign = np.sign(paper.table1_tau(row)["geodesic_mixed"])
        tau = lambda a, b: stats.kendalltau(a, b).statistic  # noqa: E731
        assert st["tau"] == pytest.approx(tau(x, gap), abs=1e-12) and st["ci_low"] <= st["ci_high"]
        assert st["delta"] == pytest.approx(sign * (tau(x, gap) - tau(base, gap)), abs=1e-12)
        assert st["delta_ci_low"] <= st["delta"] <= st["delta_ci_high"]
        rt = tau(pb[:, 0], pb[:, 1])                       # two batches: the one split
        r = math.sin(math.pi * rt / 2)
        assert st["retest"] == pytest.approx(rt) and st["reliability"] == pytest.approx(
            2 / math.pi * math.asin(2 * r / (1 + r)))
        p = paper.table1_tau(row)
        assert st["paper_delta"] == pytest.approx(sign * (p["geodesic_invariant"] - p["adaptive"]))
        assert 0 <= st["power"] <= 1 and st["reliability_adaptive"] > 0
    flat = gl.line_stats(x, base, gap, row="vision", s=s, per_batch=pb, base_per_batch=rng.normal(size=(n, 2)) * 0
                         + np.arange(n)[::-1, None] * np.array([1, -1]), paper_tau=-0.7, gap_reliability=0.9)
    assert flat["reliability_adaptive"] == 0.0 and math.isnan(flat["power"]) and "no power" in flat["power_note"]


def test_diagonal_traces_closed_form_and_group_action():
    rng = np.random.default_rng(0)
    n, d = 9, 5
    X, y = rng.normal(size=(n, d)), rng.normal(size=n)
    u, v = rng.normal(size=d), rng.normal(size=d)
    tr = gl.diagonal_traces(u, v, X, y)
    # Euclidean: f = |X(u*v) - y|^2 / (2n), d2f/du_i^2 = (X^T X)_ii v_i^2 / n (likewise for v)
    assert tr["euclidean"][0] == pytest.approx(((X ** 2).sum(0) * (u ** 2 + v ** 2)).sum() / n, rel=1e-12)
    a = np.exp(rng.normal(size=d))
    moved = gl.diagonal_traces(u * a, v / a, X, y)
    for k in ("invariant", "mixed"):     # traces on the quotient: unchanged by (u a, v / a)
        assert moved[k][0] == pytest.approx(tr[k][0], rel=1e-8) and tr[k][1] == 0.0
    assert abs(moved["euclidean"][0] - tr["euclidean"][0]) > 1e-3 * abs(tr["euclidean"][0])


def _published(tmp_path, n):
    rng = np.random.default_rng(3)
    names = [f"model_{i:03d}" for i in range(n)]
    (tmp_path / "data" / "tinystage").mkdir(parents=True)
    (tmp_path / "metrics").mkdir()
    pd.DataFrame({"name": names, "gap": rng.uniform(0, 0.1, n)}).to_csv(
        tmp_path / "data" / "tinystage" / "members.csv", index=False)
    rows = []
    for m in paper.TABLE1_MEASURES:
        pb = rng.uniform(0.01, 0.1, (n, 4))
        rows += [dict(model=k, measure=m, rho=0.05, value=float(pb[i].mean()), per_batch=json.dumps(pb[i].tolist()))
                 for i, k in enumerate(names)]
    pd.DataFrame(rows).to_csv(tmp_path / "data" / "tinystage" / "sharpness.csv", index=False)
    pd.DataFrame({"measure": paper.TABLE1_MEASURES, "rho": 0.05, "gap_reliability": 0.9}).to_csv(
        tmp_path / "data" / "tinystage" / "primary.csv", index=False)
    (tmp_path / "metrics" / "tinystage.json").write_text(json.dumps(
        {"protocol": {"rho": {"adaptive": 0.05, "geodesic_invariant": 0.05, "geodesic_mixed": 0.01}, "n_iters": 2,
                      "seed": 0, "eps": 0.0, "batch_size": 4, "n_points": 16, "data_seed": 0},
         "table1": [{"primary": True, "setting": "tiny BERTs"}], "zoo": {"n_planned": n + 1}}))


@pytest.mark.slow
def test_stage_report_and_table1_lines(tmp_path):
    n = 5
    _published(tmp_path, n)
    out = tmp_path / "out"
    rep = gl.run_report("cpu", _settings(), out, progress=False, metrics_dir=tmp_path / "metrics",
                        data_dir=tmp_path / "data", sources={"tiny": _TinySource(n)})
    members = pd.read_csv(out / "data" / "tiny" / "members.csv", index_col=0, float_precision="round_trip")
    gap = members["gap"].to_numpy()
    for m in ("invariant", "mixed"):   # the exact values are direct library calls on the first 2 batches
        ref = hs.sharpness(tiny_bert(3), _batches()[:2], hs.Measure(metric=m, step="exact"),
                           rho=0.05 if m == "invariant" else 0.01, n_iters=2, seed=0, progress=False).value
        assert members.loc["model_003", f"exact_{m}"] == ref
        line = rep.lines.set_index("line").loc[f"exact_{m}"]
        assert line.tau == pytest.approx(stats.kendalltau(members[f"exact_{m}"], gap).statistic)
        base = members["adaptive_same_batches"]
        assert line.delta == pytest.approx(
            stats.kendalltau(members[f"exact_{m}"], gap).statistic - stats.kendalltau(base, gap).statistic)
    ratios = pd.read_csv(out / "data" / "tiny" / "correction_ratio.csv")
    assert len(ratios) == 2 * n and (ratios.ratio_max >= ratios.ratio_median).all()
    metrics = json.loads((out / "metrics" / "geometry_lines.json").read_text())
    md, records = table1.build(out / "metrics")
    ours = [r for r in records if r["stage"] == "geometry_lines"]
    assert {r["status"] for r in ours} == {"computed", "not computed: zoo not in the cache"}
    exact = next(r for r in ours if r["variant"].startswith("exact geodesic") and r["status"] == "computed")
    assert exact["adaptive"] is None and exact["setting"] == "tiny BERTs" and f"{n} of the {n + 1}" in exact["variant"]
    assert exact["delta_tau_geodesic_invariant"] == pytest.approx(
        rep.lines.set_index("line").loc["exact_invariant", "delta"])
    hess = next(r for r in ours if r["variant"].startswith("Hessian trace") and r["status"] == "computed")
    assert hess["adaptive"] == pytest.approx(stats.kendalltau(members["hessian_euclidean"], gap).statistic)
    assert "## Geometry lines" in md and "not computed: zoo not in the cache" in md
    assert metrics["findings"] and any("language: not computed" in f for f in metrics["findings"])
    table1.write(out / "metrics", tmp_path / "t1")
    block = table1.readme_summary(tmp_path / "t1" / "table1.csv")
    assert "Exploratory geometry lines" in block and "not computed: zoo not in the cache" in block


def test_settings_are_checked():
    with pytest.raises(ValueError, match="hessian_probes must be an integer >= 2"):
        gl.load_settings(_settings(rows={"x": {"row": "vision", "stage": "vision", "zoo": "z", "exact_batches": None,
                                               "hessian_batches": None, "hessian_probes": 1, "families": ["exact"], "reason": "x"}}))
    with pytest.raises(ValueError, match="`reason` must say why"):
        gl.load_settings(_settings(rows={"x": {"row": "vision", "stage": "vision", "zoo": "z", "exact_batches": None,
                                               "hessian_batches": None, "hessian_probes": 2, "families": ["exact"],
                                               "reason": ""}}))
