"""Table 1's reliability columns, primary vs exploratory lines and the ceiling sentences."""
import csv
import json
import math

import pytest

from companion import metrics as cm
from companion import paper
from companion.experiments import table1
from tests import ROOT

TAU = {"adaptive": -0.1, "geodesic_invariant": -0.2, "geodesic_mixed": -0.3}


def _write(mdir, name, entries, profile="cpu"):
    mdir.mkdir(exist_ok=True)
    (mdir / f"{name}.json").write_text(json.dumps({"profile": profile, "table1": entries}))


def test_reliability_fields_ceiling_by_hand_and_power_bounds():
    f = cm.reliability_fields(gap_reliability=0.5, retest={"adaptive": 0.9, "geodesic_mixed": 0.2}, n_models=30,
                              paper_tau=paper.table1_tau("vision"), alpha=0.05, n_sim=400, seed=0)
    hand = 2 / math.pi * math.asin(math.sqrt(math.sin(math.pi * 0.9 / 2) * 0.5))
    assert f["tau_ceiling"]["adaptive"] == pytest.approx(hand, abs=1e-12)
    assert f["tau_ceiling"]["geodesic_mixed"] < f["tau_ceiling"]["adaptive"]
    assert 0 <= f["power"]["geodesic_mixed"] < f["power"]["adaptive"] <= 1
    with pytest.raises(ValueError, match="no paper tau"):
        cm.reliability_fields(gap_reliability=0.5, retest={"x": 0.9}, n_models=30, paper_tau={}, alpha=0.05,
                              n_sim=10, seed=0)


def test_table1_columns_order_and_ceiling_sentence(tmp_path):
    mdir = tmp_path / "m"
    rel = cm.reliability_fields(gap_reliability=0.1, retest={m: 0.9 for m in TAU}, n_models=72,
                                paper_tau=paper.table1_tau("vision"), alpha=0.05, n_sim=200, seed=0)
    _write(mdir, "vision", [{"row": "vision", "variant": "half split", "exploratory": True, "tau": TAU, "n_models": 36},
                            {"row": "vision", "variant": "all members", "primary": True, "tau": TAU, "n_models": 72,
                             **rel}])
    _write(mdir, "diagonal", {"row": "diagonal", "variant": "old", "tau": TAU, "n_models": 50})
    md, csv_path = table1.write(mdir, tmp_path)
    rows = [r for r in csv.DictReader(csv_path.open()) if r["source"] == "ours" and r["stage"] != "ablations"]
    vision = [r for r in rows if r["row"] == "vision"]   # (the ablations stage's "not computed" lines aside)
    assert [r["comparison"] for r in vision] == ["primary", "exploratory"]        # primary first
    prim = vision[0]
    assert float(prim["gap_reliability"]) == 0.1
    for m in TAU:
        assert float(prim[f"retest_{m}"]) == 0.9
        assert float(prim[f"tau_ceiling_{m}"]) == pytest.approx(rel["tau_ceiling"][m])
        assert vision[1][f"tau_ceiling_{m}"] == "" and vision[1]["gap_reliability"] == ""
    diag = next(r for r in rows if r["row"] == "diagonal")
    assert diag["comparison"] == "not declared" and diag["retest_adaptive"] == ""
    text = md.read_text()
    ceiling = rel["tau_ceiling"]["geodesic_invariant"]
    assert ceiling < 0.71
    assert f"cap the observable |τ| at {ceiling:.2f}, below the paper's |τ| = 0.71" in text
    assert text.count("this zoo cannot show the paper's value") == 3
    h = cm.headline(json.loads((mdir / "vision.json").read_text()))
    assert h["n"] == 72 and h["table1"][1]["tau_ceiling"] == rel["tau_ceiling"]   # headline: the primary entry


def test_readme_table1_block_is_generated_from_the_committed_table():
    """The Table 1 summary (docs/profiles.md; the README carries the findings block) is what
    readme_summary makes of reports/table1.csv (no number typed by hand, none stale)."""
    from pathlib import Path

    from companion.experiments.table1 import (README_BEGIN, README_END, delta_sentences, not_run_notes, readme_notes,
                                              readme_summary, retest_note)

    root = ROOT
    text = (root / "docs" / "profiles.md").read_text()
    block = text[text.index(README_BEGIN):text.index(README_END) + len(README_END)]
    note = retest_note(root / "reports" / "metrics")          # the language row's data need (exploratory)
    assert note is None or note in block                      # None: its stage not run in this profile
    assert all(n in block for n in not_run_notes(root / "reports" / "metrics"))
    deltas = delta_sentences(root / "reports" / "metrics", primary_only=True)   # the paired Δτ findings
    assert deltas and all(d in block for d in deltas)
    assert block == readme_summary(root / "reports" / "table1.csv", readme_notes(root / "reports" / "metrics"))
    assert "| ours |" in block and "| paper |" in block


def test_reliability_column_is_the_retest_unless_the_value_averages_both(tmp_path):
    """Vision (value = one of the two measurements): reliability_<m> is the retest. Language
    (value = mean of both halves): the recorded Spearman–Brown reliability, shown beside the retest."""
    mdir = tmp_path / "m"
    ret = {m: 0.5 for m in TAU}
    rel = {m: 0.7 for m in TAU}
    _write(mdir, "vision", {"row": "vision", "variant": "v", "primary": True, "tau": TAU, "n_models": 72,
                            "retest": ret, "gap_reliability": 0.9, "tau_ceiling": ret, "power": ret})
    _write(mdir, "language", {"row": "language", "variant": "l", "primary": True, "tau": TAU, "n_models": 50,
                              "retest": ret, "reliability": rel, "gap_reliability": 0.9, "tau_ceiling": rel,
                              "power": rel})
    md, csv_path = table1.write(mdir, tmp_path)
    rows = {r["row"]: r for r in csv.DictReader(csv_path.open()) if r["source"] == "ours"}
    for m in TAU:
        assert float(rows["vision"][f"reliability_{m}"]) == 0.5
        assert float(rows["language"][f"reliability_{m}"]) == 0.7 and float(rows["language"][f"retest_{m}"]) == 0.5
    assert "retest 0.50 (mean of both halves 0.70)" in md.read_text()


def test_the_language_retest_sentence_is_generated_from_its_metrics(tmp_path):
    mdir = tmp_path / "m"
    _write(mdir, "language", [{"row": "language", "tau": TAU, "n_models": 50, "primary": True}])
    assert table1.retest_note(mdir) is None and "How much data" not in table1.build(mdir)[0]
    per = {m: {"label": m, "batches_per_half": 15, "retest": t, "batches_per_half_for_target": b,
               "pairs_per_member_for_target": 2 * b * 128}
           for m, t, b in [("adaptive", 0.56, 89), ("geodesic_invariant", 0.68, 41), ("geodesic_mixed", 0.74, 28)]}
    (mdir / "language_retest.json").write_text(json.dumps(
        {"profile": "cpu", "target": 0.8, "batch_size": 128, "training_pairs_available": 4000, "measures": per}))
    note = table1.retest_note(mdir)
    assert "about 89 batches of 128 pairs per half (22784 training pairs per member; adaptive is the slowest" in note
    assert note.endswith("the corpus's training split has 4000.") and note in table1.build(mdir)[0]
    per["adaptive"]["batches_per_half_for_target"] = None                     # a measure without signal
    (mdir / "language_retest.json").write_text(json.dumps(
        {"profile": "cpu", "target": 0.8, "batch_size": 128, "training_pairs_available": 4000, "measures": per}))
    assert "cannot be reached" in table1.retest_note(mdir)


def test_paired_delta_columns_attach_to_the_primary_line_and_the_paper_delta_is_computed(tmp_path):
    mdir = tmp_path / "m"
    _write(mdir, "vision", [{"row": "vision", "variant": "all", "primary": True, "tau": TAU, "n_models": 72},
                            {"row": "vision", "variant": "half", "exploratory": True, "tau": TAU, "n_models": 36}])
    delta = {"name": "vision", "row": "vision", "stage": "vision", "n_models": 72,
             "delta": {"geodesic_invariant": -0.1, "geodesic_mixed": 0.05},
             "ci": {"geodesic_invariant": [-0.2, -0.01], "geodesic_mixed": [-0.03, 0.12]},
             "power": {"geodesic_invariant": 0.9, "geodesic_mixed": 0.8},
             "paper_delta": {"geodesic_invariant": 0.3, "geodesic_mixed": 0.29}, "expected_at_paper": {},
             "verdict": {"geodesic_invariant": "contradicts the paper's direction", "geodesic_mixed": "inconclusive"}}
    (mdir / "paired.json").write_text(json.dumps({"profile": "cpu", "delta_tau": [delta],
                                                  "findings": ["head", "line a", "line b", "exploratory c"],
                                                  "findings_primary": ["head", "line a", "line b"]}))
    md, csvp = table1.write(mdir, tmp_path)
    rows = list(csv.DictReader(open(csvp)))
    prim = [r for r in rows if r["row"] == "vision" and r["comparison"] == "primary"][0]
    expl = [r for r in rows if r["row"] == "vision" and r["comparison"] == "exploratory"][0]
    pap = [r for r in rows if r["row"] == "vision" and r["source"] == "paper"][0]
    assert float(prim["delta_tau_geodesic_invariant"]) == -0.1
    assert float(prim["delta_tau_geodesic_mixed_ci_high"]) == 0.12 and float(prim["power_delta_geodesic_mixed"]) == 0.8
    assert expl["delta_tau_geodesic_invariant"] == ""                  # exploratory lines carry no Δ
    assert float(pap["delta_tau_geodesic_invariant"]) == 0.3           # the paper's Δ as the stage paired wrote it
    lang = [r for r in rows if r["row"] == "language" and r["source"] == "paper"][0]
    assert lang["delta_tau_geodesic_invariant"] == ""                 # no paired entry for that row
    text = md.read_text()
    assert "Paired Δτ" in text and "contradicts the paper's direction" in text and "exploratory c" in text
    block = table1.readme_summary(csvp, table1.delta_sentences(mdir, primary_only=True))
    assert "-0.10 [-0.20, -0.01] · power 0.90" in block and "exploratory c" not in block and "line b" in block


def test_a_superseded_row_is_shown_secondary_with_its_numbers_and_delta(tmp_path):
    """Issue 24: the MiniLM line is the primary language row; the 144 k-parameter BERT line (stage language), which
    still declares itself primary in its own metrics, is shown with the role the stage paired gives it."""
    mdir = tmp_path / "m"
    role = "secondary (superseded by the pre-trained MiniLM row)"
    lang_tau = {"adaptive": 0.4, "geodesic_invariant": 0.2, "geodesic_mixed": 0.3}
    _write(mdir, "language", [{"row": "language", "variant": "bert", "primary": True, "tau": lang_tau, "n_models": 50},
                              {"row": "language", "variant": "fitted", "exploratory": True, "tau": TAU, "n_models": 49}])
    _write(mdir, "minilm", [{"row": "language", "variant": "minilm", "primary": True, "tau": TAU, "n_models": 24,
                             "setting": "fine-tunes of pre-trained all-MiniLM-L6-v2"}])

    def delta(stage, comparison, d):
        return {"name": stage, "row": "language", "stage": stage, "comparison": comparison, "n_models": 7,
                "delta": {g: d for g in table1.GEODESIC}, "ci": {g: [d - 0.1, d + 0.1] for g in table1.GEODESIC},
                "power": {g: 0.5 for g in table1.GEODESIC}, "paper_delta": {"geodesic_invariant": 0.22,
                                                                             "geodesic_mixed": 0.32},
                "expected_at_paper": {}, "verdict": {g: "inconclusive" for g in table1.GEODESIC}}

    (mdir / "paired.json").write_text(json.dumps({"profile": "cpu", "delta_tau": [delta("language", role, -0.19),
                                                                                 delta("minilm", "primary", 0.07)],
                                                  "findings": ["head"], "findings_primary": ["head"]}))
    md, csvp = table1.write(mdir, tmp_path)
    ours = [r for r in csv.DictReader(open(csvp)) if r["row"] == "language" and r["source"] == "ours"
            and r["stage"] != "ablations"]
    assert [(r["stage"], r["comparison"]) for r in ours] == [("minilm", "primary"), ("language", role),
                                                            ("language", "exploratory")]
    assert [r["comparison"] for r in ours].count("primary") == 1          # one primary line per row
    bert = ours[1]
    assert float(bert["adaptive"]) == 0.4 and float(bert["delta_tau_geodesic_invariant"]) == -0.19   # numbers kept
    assert float(ours[0]["delta_tau_geodesic_mixed"]) == 0.07 and ours[2]["delta_tau_geodesic_invariant"] == ""
    text = md.read_text()
    assert f"| ours | {role} | cpu | 50 |" in text                     # Table 1's line
    assert f"| ours | {role} | 50 |" not in text and f"| ours | {role} | 7 |" in text   # the Δτ table's line
    block = table1.readme_summary(csvp)
    assert block.count(f"| ours | {role} | 50 |") == 2 and block.count("| ours | primary | 24 |") == 2   # τ and Δτ
    assert "| ours | exploratory |" not in block
    # without the stage paired's roles every stage keeps its own label
    (mdir / "paired.json").unlink()
    _, records = table1.build(mdir)
    assert [r["comparison"] for r in records if r["row"] == "language" and r["source"] == "ours"
            and r["stage"] != "ablations"] == ["primary", "primary", "exploratory"]
