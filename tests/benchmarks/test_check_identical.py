"""benchmarks/check_identical.py: the comparison flags any differing bit, and refuses values
computed on another grid (the values themselves: ``python benchmarks/check_identical.py --base``)."""
import copy

from benchmarks import check_identical as ci


def _run(rows, grid="g", sections=("training",)):
    return dict(grid=grid, sections=list(sections), rows=rows)


def test_compare_counts_every_differing_value():
    rows = [dict(where="a", name="x", values=[(1.0).hex(), (2.0).hex()]),
            dict(where="b", name="y", values=[float("nan").hex()])]
    base = _run(rows)
    same = copy.deepcopy(base)
    assert ci.compare(base, same) == (3, 0.0, [])          # NaN == NaN here: same bits in, same out
    other = copy.deepcopy(base)
    other["rows"][0]["values"][1] = (2.0 + 2 ** -51).hex()
    n, worst, bad = ci.compare(base, other)
    assert n == 3 and worst == 2 ** -51 and len(bad) == 1 and bad[0].startswith("a:")


def test_compare_refuses_another_grid():
    rows = [dict(where="a", name="x", values=[(1.0).hex()])]
    n, worst, bad = ci.compare(_run(rows, grid="g1"), _run(rows, grid="g2"))
    assert n == 0 and worst == float("inf") and "different grids" in bad[0]
