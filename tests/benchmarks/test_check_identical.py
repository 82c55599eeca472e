"""benchmarks/check_identical.py: the comparison flags any differing bit, and refuses values
computed on another grid; the worker's training and curvature rows are deterministic."""
import copy
import json
import os
import subprocess
import sys

import pytest

from benchmarks import check_identical as ci
from tests import ROOT


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


@pytest.mark.slow
def test_worker_rows_repeat_bit_for_bit():
    """Two fresh processes give the same training and curvature values (what makes a recorded
    baseline comparable at all)."""
    out = []
    for _ in range(2):
        p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "check_identical.py"), "--worker",
                            "--sections", "curvature"], capture_output=True, text=True, check=True,
                           cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
        out.append(json.loads(p.stdout))
    assert out[0]["rows"] and out[0] == out[1]
