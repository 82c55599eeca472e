"""companion.paper is the one place the paper's numbers live: no other companion module or notebook
code cell types them, and Table 1 lists them from there."""
import ast
import json

import pytest

from companion import paper
from companion.experiments import table1
from tests import ROOT

PAPER_VALUES = {abs(v) for row in paper.TABLE1_TAU.values() for v in row.values()} | {
    abs(v) for v in paper.LANGUAGE_ABLATION_TAU.values()}


def _sources():
    for f in sorted((ROOT / "companion").rglob("*.py")):
        if f.name != "paper.py":
            yield f.relative_to(ROOT).as_posix(), f.read_text()
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        yield nb.relative_to(ROOT).as_posix(), "\n".join(
            ln for ln in code.splitlines() if not ln.lstrip().startswith(("%", "!")))


@pytest.mark.parametrize("name,src", list(_sources()), ids=lambda v: v if isinstance(v, str) and "/" in v else "")
def test_no_paper_number_typed_outside_companion_paper(name, src):
    typed = sorted({(n.lineno, n.value) for n in ast.walk(ast.parse(src))
                    if isinstance(n, ast.Constant) and isinstance(n.value, float) and abs(n.value) in PAPER_VALUES})
    assert not typed, f"{name} types the paper's numbers {typed}; import them from companion.paper"


def test_table1_rows_come_from_companion_paper():
    assert [r["row"] for r in table1.PAPER_ROWS] == list(paper.TABLE1_TAU)
    for r in table1.PAPER_ROWS:
        assert r["paper"] == dict(paper.TABLE1_TAU[r["row"]]) and r["setting"] == paper.TABLE1_SETTING[r["row"]]
    assert tuple(table1.MEASURES) == paper.TABLE1_MEASURES
    with pytest.raises(KeyError, match="no row"):
        paper.table1_tau("imagenet")
