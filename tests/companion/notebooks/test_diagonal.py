"""Execute the toy and diagonal notebooks through the pipeline with tiny parameters,
and assemble Table 1 from their metrics."""
import csv
import json

import pytest

from companion.experiments import table1
from companion.pipeline import run_stage

TINY = {
    "toy": {"n_grid": 24, "lim": 2.0, "x": 1.0, "y": 1.0, "metric": "invariant",
            "points": [[0.5, 0.5], [1.0, 1.0], [1.6, 1.1], [-0.6, 1.2], [-1.2, -1.5], [1.4, -1.4]], "cpu_kernels": None},
    "diagonal": {"n": 15, "d": 30, "kappa": 3, "seed": 0, "stop_loss": 1e-4, "max_steps": 40000, "check_every": 100,
                 "rho": 0.1, "rhos": [0.03, 0.1], "n_iters": 10, "n_starts": 3, "n_boot": 50, "convergence_factor": 2,
                 "main": {"n_nets": 6, "alpha": 0.1,
                          "methods": {"gd": {"batch_size": 15, "lr": {"constant": 1.0, "decay": 2.0}},
                                      "sgd": {"batch_size": 1, "lr": {"constant": 0.25, "decay": 0.3}}},
                          "lr_factor_range": [0.1, 1.0], "schedules": ["constant", "decay"],
                          "decay_fracs": [0.1, 0.3, 0.5], "decay_factor": 10.0, "horizon": 1000},
                 "alpha_sweep": {"n_nets": 4, "alpha": [0.01, 1.0],
                                 "methods": {"gd": {"batch_size": 15, "lr": {"constant": 0.2}}},
                                 "lr_factor_range": [1.0, 1.0], "schedules": ["constant"],
                                 "decay_fracs": [0.1], "decay_factor": 10.0, "horizon": 1000},
                 "orthogonal": {"d": 6, "rho": 1e-3}, "cpu_kernels": None},
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("reports")
    for stage, params in TINY.items():
        run_stage(stage, params=params, reports_dir=out, progress_bar=False)
    return out


@pytest.mark.slow
def test_toy_notebook(reports):
    m = json.loads((reports / "metrics" / "toy.json").read_text())
    assert m["stage"] == "toy" and m["profile"] == "cpu"
    assert m["claims"]["a_level_sets_follow_loss"] is True
    assert set(m["levels"]) == {"loss", "egrad_norm", "rgrad_norm", "ehess_trace", "rhess_trace"}
    assert all(0.0 <= v <= 1.0 for lv in m["levels"].values() for v in lv)
    for name in ("fig1_toy_gradients", "fig6_toy_hessian"):
        for ext in ("png", "pdf"):
            assert (reports / "figures" / "toy" / f"{name}.{ext}").stat().st_size > 1000
    assert (reports / "notebooks" / "toy.ipynb").is_file()


@pytest.mark.slow
def test_diagonal_notebook_and_table1(reports, tmp_path):
    m = json.loads((reports / "metrics" / "diagonal.json").read_text())
    assert m["setting"]["n_nets"] == 6 and m["setting"]["n"] == 15
    assert m["setting"]["n_converged"] + len(m["setting"]["not_converged"]) == 6
    for src in ("tau_exact", "tau_second_order", "tau_straight"):
        assert set(m[src]) == {"adaptive", "geodesic_invariant", "geodesic_mixed"}
        for v in m[src].values():
            assert -1 <= v["tau"] <= 1
            assert -1 - 1e-12 <= v["ci_low"] <= v["ci_high"] <= 1 + 1e-12   # a percentile interval
    assert m["table1"][0]["source"] == "exact" and m["table1"][0]["primary"]   # the primary row first (DVC headline)
    assert m["n_starts"] == 3 and set(m["tau_exact_single_start"]) == set(m["tau_exact"])
    gains = {k: g["max"] for k, g in m["restart_gain"].items()}
    assert all(g >= 0 for g in gains.values()) and "geodesic_mixed:exact" in gains   # best of starts >= start 0
    assert m["orthogonal_check"]["max_abs_rel_diff"] < 0.05
    for name in ("fig3_diagonal", "diagonal_second_order", "diagonal_tau_by_step", "diagonal_tau_vs_rho",
                 "diagonal_alpha_sweep"):
        assert (reports / "figures" / "diagonal" / f"{name}.png").is_file()
    assert (reports / "data" / "diagonal" / "networks.csv").is_file()

    md, csv_path = table1.write(reports / "metrics", tmp_path)
    text = md.read_text()
    assert "-0.68" in text and "-0.83" in text and "+0.38" in text       # paper values
    assert text.count(table1.NOT_COMPUTED) == 6                           # vision + language rows
    rows = list(csv.DictReader(csv_path.open()))
    ours = [r for r in rows if r["row"] == "diagonal" and r["source"] == "ours"]
    assert len(ours) == 4 and all(r["profile"] == "cpu" for r in ours)
    assert float(ours[0]["adaptive"]) == pytest.approx(m["tau_exact"]["adaptive"]["tau"])
    assert [r["row"] for r in rows if r["source"] == "paper"] == ["diagonal", "vision", "language"]


def test_table1_prints_each_seeded_zoo(tmp_path):
    mdir = tmp_path / "m"
    mdir.mkdir()
    spread = {"adaptive": {"taus": [0.25, -0.5, 0.125], "std": 0.38}}
    (mdir / "language_stability.json").write_text(json.dumps({"profile": "cpu", "table1": {
        "row": "language", "variant": "3 zoos", "n_models": 12, "spread": spread,
        "tau": {"adaptive": -0.0417, "geodesic_invariant": 0.1, "geodesic_mixed": 0.2}}}))
    md, csv_path = table1.write(mdir, tmp_path)
    line = next(ln for ln in md.read_text().splitlines() if "3 zoos" in ln)
    assert "-0.04 · zoos: +0.25 / -0.50 / +0.12 (sd 0.38) | +0.10 | +0.20 |" in line
    row = next(r for r in csv.DictReader(csv_path.open()) if r["variant"] == "3 zoos")
    assert row["adaptive_zoo_taus"] == "0.25;-0.5;0.125" and row["geodesic_mixed_zoo_taus"] == ""


def test_table1_without_any_metrics(tmp_path):
    md, csv_path = table1.write(tmp_path / "nothing", tmp_path)
    assert md.read_text().count(table1.NOT_COMPUTED) == 9
    bad = tmp_path / "m"
    bad.mkdir()
    (bad / "x.json").write_text(json.dumps({"table1": {"row": "diagonal", "tau": {"adaptive": 0.1}}}))
    with pytest.raises(ValueError, match="lacks tau"):
        table1.build(bad)
