"""notebooks/paired.ipynb executed by the pipeline on tiny tables laid out as the vision and language stages
publish theirs; every Δ recomputed with scipy, the verdicts by the pre-registered rule."""
import json

import nbformat
import numpy as np
import pandas as pd
import pytest
from scipy import stats

from companion import analysis, paper
from companion.experiments import paired
from companion.pipeline import REPO_ROOT, run_stage

MEASURES = ("adaptive", "geodesic_invariant", "geodesic_mixed")


def _tau(a, b):
    return stats.kendalltau(a, b).statistic


def vision_tables(d, n=14, seed=0):
    rng = np.random.default_rng(seed)
    gap = rng.uniform(0, 0.2, n)
    m = pd.DataFrame({"name": [f"model_{i:03d}" for i in range(n)], "gap": gap, "train_error": rng.uniform(0, 0.3, n),
                      "batch_size": rng.choice([64, 128], n), "shift": np.arange(n) % 2,
                      "noise_std": np.where(np.arange(n) % 3 == 0, 0.0, rng.uniform(0, 0.2, n)),
                      "mixup_alpha": np.where(np.arange(n) % 4 == 0, 0.0, rng.uniform(0.1, 0.4, n))})
    for k, name in enumerate(MEASURES):
        m[f"sharpness_{name}"] = -gap * (k + 1) + rng.normal(0, 0.05, n)
    d.mkdir(parents=True)
    m.to_csv(d / "members.csv", index=False)
    pd.DataFrame({"measure": MEASURES, "rho": [0.2, 0.1, 0.05],
                  "tau": [_tau(m[f"sharpness_{k}"], gap) for k in MEASURES],
                  "retest": [0.9, 0.85, 0.8], "gap_reliability": 0.9}).to_csv(d / "primary.csv", index=False)
    return m


def language_tables(d, n=12, batches=6, seed=1):
    rng = np.random.default_rng(seed)
    names = [f"model_{i:03d}" for i in range(n)]
    gap = rng.uniform(0, 0.1, n)
    rows, prim = [], []
    for k, name in enumerate(MEASURES):
        level = gap * (1 + k) + rng.normal(0, 0.03, n)
        pb = level[:, None] + rng.normal(0, 0.02, (n, batches))
        for i in range(n):
            rows.append(dict(model=names[i], measure=name, rho=0.1, value=float(pb[i].mean()),
                             per_batch=json.dumps(pb[i].tolist())))
        h = batches // 2
        prim.append(dict(measure=name, rho=0.1, tau=_tau(pb.mean(1), gap),
                         retest=_tau(pb[:, :h].mean(1), pb[:, h:].mean(1)), reliability=0.7, gap_reliability=0.95))
    d.mkdir(parents=True)
    pd.DataFrame({"name": names, "gap": gap}).to_csv(d / "members.csv", index=False)
    pd.DataFrame(rows).to_csv(d / "sharpness.csv", index=False)
    pd.DataFrame(prim).to_csv(d / "primary.csv", index=False)
    return pd.DataFrame(rows)


def tiny_params(tmp_path):
    return {"rows": {"vision": {"row": "vision", "layout": "vision", "data": str(tmp_path / "data" / "vision"), "comparison": "primary"},
                     "language": {"row": "language", "layout": "language", "data": str(tmp_path / "data" / "language"), "comparison": "primary"}},
            "baseline": "adaptive", "geodesic": ["geodesic_invariant", "geodesic_mixed"], "n_boot": 300, "seed": 24,
            "confidence": 0.95, "power": {"n_sim": 30, "n_boot": 100, "seed": 24},
            "mde": {"target": 0.8, "n_sim": 30, "n_boot": 60, "seed": 24, "tol": 0.05},
            "retest_splits": {"n_splits": 40, "seed": 24},
            "exploratory": {"row": "vision", "factors": ["batch_size", "shift", "noise_std > 0", "mixup_alpha > 0"],
                            "control": "train_error"}}


def test_notebook_follows_the_contract():
    nb = nbformat.read(REPO_ROOT / "notebooks" / "paired.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    lines = [ln for c in code for ln in c.source.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert "parameters" in code[0].metadata.get("tags", [])
    assert sum("paired.run_report(" in ln for ln in lines) == 1    # one call computes and writes; the rest plots
    assert not any(w in ln for ln in lines for w in ("kendalltau", "0.30", "0.29", "0.22", "0.32"))


@pytest.mark.slow
def test_paired_notebook_runs_and_publishes(tmp_path):
    members = vision_tables(tmp_path / "data" / "vision")
    language_tables(tmp_path / "data" / "language")
    params = tiny_params(tmp_path)
    reports = tmp_path / "reports"
    res = run_stage("paired", params=params, reports_dir=reports, progress_bar=False)
    assert {"paired_delta_tau.png", "paired_delta_tau.pdf", "paired_vision_factors.png"} <= {p.name for p in res.figures}
    metrics = json.loads(res.metrics.read_text())
    deltas = pd.read_csv(reports / "data" / "paired" / "delta_tau.csv")
    assert len(deltas) == 4 and set(deltas.row) == {"vision", "language"}
    # the vision Δ by hand: sign of the paper's (negative) vision τ times the difference of scipy's τ
    for g in ("geodesic_invariant", "geodesic_mixed"):
        line = deltas[(deltas.row == "vision") & (deltas.measure == g)].iloc[0]
        s = np.sign(paper.table1_tau("vision")[g])
        hand = s * (_tau(members[f"sharpness_{g}"], members.gap) - _tau(members.sharpness_adaptive, members.gap))
        assert line.delta == pytest.approx(hand, abs=1e-12) and line.ci_low <= line.ci_high
        p = paper.table1_tau("vision")
        assert line.paper_delta == pytest.approx(s * (p[g] - p["adaptive"]))
        assert line.verdict == paired.verdict(line.ci_low, line.ci_high, line.paper_delta)
        assert 0 <= line.power <= 1
    # the minimum detectable Δ: the bisection's bracket on the same Monte Carlo (0.8 reached there, not 0.05 below),
    # beside the verdict in Table 1 and in the findings
    for line in deltas.itertuples():
        if not np.isfinite(line.mde):
            assert line.mde_power_max < 0.8
            continue
        kw = dict(retest_x=line.reliability_geodesic, retest_base=line.reliability_baseline,
                  rel_y=line.gap_reliability, tau_between=line.tau_between, sign=int(line.sign), n_sim=30, n_boot=60,
                  seed=24)
        tb = paper.table1_tau(line.table1_row)["adaptive"]
        assert line.mde_power >= 0.8 and line.mde_power == pytest.approx(
            analysis.delta_power(line.n, tb + line.sign * line.mde, tb, **kw))
        assert analysis.delta_power(line.n, tb + line.sign * (line.mde - 0.05), tb, **kw) < 0.8
    from companion.experiments import table1
    entry = {e["stage"]: e for e in metrics["delta_tau"]}
    for r in deltas.itertuples():      # Table 1's MDE column of the row's primary line
        cell = table1._mde_csv(entry[r.row], r.measure)
        assert cell == pytest.approx(r.mde) if np.isfinite(r.mde) else cell.startswith("not reached")
    assert set(entry) == {"vision", "language"}
    assert entry["vision"]["delta"]["geodesic_invariant"] == pytest.approx(
        deltas[(deltas.row == "vision") & (deltas.measure == "geodesic_invariant")].delta.iloc[0])
    # exploratory lines: every declared factor, both levels, τ within the level by scipy
    fac = pd.read_csv(reports / "data" / "paired" / "factors.csv")
    assert set(fac.factor) == set(params["exploratory"]["factors"])
    sub = fac[(fac.level == "shift = 0") & (fac.quantity == "tau") & (fac.measure == "adaptive")].iloc[0]
    keep = members["shift"] == 0
    assert sub.value == pytest.approx(_tau(members.sharpness_adaptive[keep], members.gap[keep]))
    part = pd.read_csv(reports / "data" / "paired" / "partial.csv")
    t = lambda a, b: _tau(members[a], members[b])  # noqa: E731
    ref = (t("sharpness_adaptive", "gap") - t("sharpness_adaptive", "train_error") * t("gap", "train_error")) / np.sqrt(
        (1 - t("sharpness_adaptive", "train_error") ** 2) * (1 - t("gap", "train_error") ** 2))
    got = part[(part.quantity == "partial_tau") & (part.measure == "adaptive")].value.iloc[0]
    assert got == pytest.approx(ref)
    # the language retest of the halves over random splits, and the findings generated from the numbers
    rel = pd.read_csv(reports / "data" / "paired" / "reliability.csv")
    assert len(rel) == 3 and (rel.n_splits == 40).all()
    text = " ".join(metrics["findings"])
    for r in deltas.itertuples():
        assert f"{r.delta:+.2f}" in text and r.verdict in text
        assert (f"{r.mde:+.2f}" if np.isfinite(r.mde) else "reaches 80% power") in text
    nb = (reports / "notebooks" / "paired.ipynb").read_text()
    assert str(tmp_path / "reports") not in nb


def test_tables_whose_tau_is_not_the_published_one_are_refused(tmp_path):
    vision_tables(tmp_path / "data" / "vision")
    language_tables(tmp_path / "data" / "language")
    prim = pd.read_csv(tmp_path / "data" / "vision" / "primary.csv")
    prim.loc[0, "tau"] += 0.1
    prim.to_csv(tmp_path / "data" / "vision" / "primary.csv", index=False)
    s = paired.load_settings(tiny_params(tmp_path))
    with pytest.raises(ValueError, match="not the ones its primary τ used"):
        paired.load_row("vision", s.rows["vision"], s)
    with pytest.raises(ValueError, match="levels; declare binary factors only"):
        paired.factor_levels(pd.DataFrame({"a": [1, 2, 3]}), "a")
    with pytest.raises(ValueError, match="not a Table 1 row"):
        paired.load_settings({**tiny_params(tmp_path), "rows": {"x": {"row": "nope", "layout": "vision", "data": ".", "comparison": "primary"}}})
