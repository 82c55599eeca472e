"""companion.findings: the README's findings block is generated from the committed results (regenerated identically),
names no issue, types no number (every number in it is one of the results' own), and is short."""
import csv
import json
import re

import pytest

from companion import findings
from companion.params import stage_params
from tests import ROOT

NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _committed_block():
    return findings.block(ROOT / "reports" / "table1.csv", ROOT / "reports" / "metrics")


def test_readme_block_is_regenerated_identically_from_the_committed_results():
    assert findings.read_block(ROOT / "README.md") == _committed_block(), (
        "README.md's findings block is not what the committed results give: python -m companion.findings --readme README.md")


def test_block_names_no_issue_and_is_short():
    text = _committed_block()
    assert not re.search(r"#\d|\bissues?\s+\d", text, re.I)
    assert len(text.splitlines()) <= 45
    assert findings.FIGURE in text and (ROOT / findings.FIGURE).is_file()
    for _, path in findings.LINKS:
        assert (ROOT / path).exists(), path


def _formats(x):
    x = abs(x)
    return {f"{x:.2f}", f"{x:.0%}".rstrip("%"), f"{x:g}", f"{x:.2g}", f"{x:.3g}"} | ({str(int(x))} if x == int(x) else set())


def _source_numbers():
    """Every number the results hold: as written in their files, and as the block's formats print them."""
    table = ROOT / "reports" / "table1.csv"
    out = set(NUMBER.findall(table.read_text()))
    for r in csv.DictReader((ROOT / "reports" / "table1.csv").open()):
        for v in r.values():
            try:
                out |= _formats(float(v))
            except ValueError:
                pass

    def walk(o):
        if isinstance(o, dict):
            [walk(v) for v in o.values()]
        elif isinstance(o, list):
            [walk(v) for v in o]
        elif isinstance(o, (int, float)) and not isinstance(o, bool) and o == o:
            out.update(_formats(float(o)))
    paired = json.loads((ROOT / "reports" / "metrics" / "paired.json").read_text())   # the block reads its partial τ
    walk(paired["exploratory"]["partial"])
    walk(paired["params"])
    out |= _formats(stage_params("paired")[1]["mde"]["target"])   # the MDE's power, where paired.json predates it
    return out


def test_the_number_check_can_fail():
    """The results do not hold every two-decimal number, so a typed one would be caught."""
    have = _source_numbers()
    assert sum(f"{k / 100:.2f}" in have for k in range(100)) < 90


def test_every_number_in_the_block_is_one_of_the_results():
    text = re.sub(r"(Table|Figure|camera-ready|fig)\s?_?\d+", "", _committed_block())   # names, not results
    text = re.sub(r"\(reports/[^)]*\)|`reports/[^`]*`", "", text)   # paths
    found = set(NUMBER.findall(text))
    assert found, "the block shows no number"
    missing = sorted(found - _source_numbers())
    assert not missing, f"numbers typed into the findings, not in the results: {missing}"


def test_markers_are_inserted_once_and_the_block_replaced(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\nintro\n\n### What we found (old)\n\nold text\n")
    text = f"{findings.BEGIN}\nnew\n{findings.END}"
    findings.update_readme(readme, text)
    body = readme.read_text()
    assert body.index(findings.BEGIN) < body.index("### What we found") and body.count(findings.BEGIN) == 1
    findings.update_readme(readme, text.replace("new", "newer"))
    assert readme.read_text().count(findings.BEGIN) == 1 and findings.read_block(readme) == text.replace("new", "newer")
    readme.write_text(f"# x\n{findings.BEGIN}\nonly one marker\n")
    with pytest.raises(ValueError, match="only one of the findings markers"):
        findings.update_readme(readme, text)


def test_a_row_that_cannot_detect_the_papers_delta_says_so(tmp_path):
    src = list(csv.DictReader((ROOT / "reports" / "table1.csv").open()))
    for r in src:                       # give the language row an MDE above the paper's Δ, the vision row none reached
        if r["source"] == "ours" and r["comparison"] == "primary" and r["row"] == "language":
            r["mde_delta_geodesic_invariant"], r["mde_delta_geodesic_mixed"] = "0.61", "0.12"
        if r["source"] == "ours" and r["comparison"] == "primary" and r["row"] == "vision":
            r["mde_delta_geodesic_invariant"] = "not reached (power 0.41 at the largest Δ)"
    path = tmp_path / "table1.csv"
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(src[0]))
        w.writeheader()
        w.writerows(src)
    text = findings.block(path, ROOT / "reports" / "metrics")
    lang = next(ln for ln in text.splitlines() if ln.startswith("* **MNLI"))
    assert "cannot detect the paper's effect" in lang and "invariant (MDE +0.61 against the paper's +0.22)" in lang
    assert "mixed (MDE" not in lang                     # +0.12 is below the paper's +0.32: detectable
    vis = next(ln for ln in text.splitlines() if ln.startswith("* **vision"))
    assert "MDE not reached (power 0.41" in vis


def test_every_number_moves_with_the_results(tmp_path):
    """Shift every number of the results the block reads: every number of the block must move with them, except those
    of names (the settings' text, "Table 1", the paper's model counts, which are names of its zoos) and the 0 of "> 0"."""
    shift = 0.01         # small: no rule of the caveats changes its choice, every printed number moves
    rows = list(csv.DictReader((ROOT / "reports" / "table1.csv").open()))
    moved = []
    for r in rows:
        out = {}
        for k, v in r.items():
            try:
                out[k] = repr(float(v) + shift) if k not in ("setting", "variant") else v
            except ValueError:   # a generated text cell ("MDE not reached (power 0.66 ...)"): its numbers move too
                out[k] = re.sub(r"(?<=power )\d+\.\d+", lambda m: f"{float(m.group(0)) + shift:.2f}", v)
        moved.append(out)
    (tmp_path / "m").mkdir()
    with (tmp_path / "t.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(moved)
    paired = json.loads((ROOT / "reports" / "metrics" / "paired.json").read_text())
    for p in paired["exploratory"]["partial"]:
        p["value"] += shift
    paired["params"]["mde"] = {"target": 0.7}
    (tmp_path / "m" / "paired.json").write_text(json.dumps(paired))
    (tmp_path / "m" / "vision.json").write_text((ROOT / "reports" / "metrics" / "vision.json").read_text())
    before = findings.block(ROOT / "reports" / "table1.csv", ROOT / "reports" / "metrics")
    after = findings.block(tmp_path / "t.csv", tmp_path / "m")
    a, b = (NUMBER.findall(re.sub(r"(Table|Figure|camera-ready|fig)\s?_?\d+", "", x)) for x in (before, after))
    assert len(a) == len(b)
    names = {n for r in rows for n in NUMBER.findall(r["setting"])} | {"0", "1"} | {
        str(n) for n in findings.paper.TABLE1_N_MODELS.values()}
    still = [x for x, y in zip(a, b) if x == y and x not in names]
    assert not still, f"numbers that do not come from the results: {still}"


def test_a_stage_measured_on_an_earlier_zoo_is_named_not_current(tmp_path):
    """The findings name a measuring stage whose locked zoo is not the zoo its training stage now records."""
    import yaml

    from companion import findings

    lock = {"schema": "2.0", "stages": {
        "train": {"cmd": "x", "outs": [{"path": "data/zoos/z", "md5": "new.dir"}]},
        "measure": {"cmd": "y", "deps": [{"path": "data/zoos/z", "md5": "old.dir"}]},
        "fresh": {"cmd": "w", "deps": [{"path": "data/zoos/z", "md5": "new.dir"}]}}}
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump(lock))
    got = findings.stale_measurements(tmp_path)
    assert len(got) == 1 and "`measure`" in got[0] and "`train`" in got[0] and "dvc repro measure" in got[0]
    lock["stages"]["measure"]["deps"][0]["md5"] = "new.dir"
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump(lock))
    assert findings.stale_measurements(tmp_path) == []


@pytest.mark.parametrize("splits", [True, False])
def test_the_vision_caveat_names_a_factor_that_splits_the_gap_into_clusters(tmp_path, splits):
    vision = json.loads((ROOT / "reports" / "metrics" / "vision.json").read_text())
    vision["gap_clusters"] = [dict(factor="batch_size", splits=False), dict(factor="shift", splits=splits)]
    (tmp_path / "vision.json").write_text(json.dumps(vision))
    (tmp_path / "paired.json").write_text((ROOT / "reports" / "metrics" / "paired.json").read_text())
    text = findings.block(ROOT / "reports" / "table1.csv", tmp_path)
    vis = next(ln for ln in text.splitlines() if ln.startswith("* **vision"))
    assert ("splits into separate clusters by shift" in vis) is splits
    assert "by batch_size" not in vis
