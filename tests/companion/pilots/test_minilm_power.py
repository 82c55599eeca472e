"""companion.pilots.minilm_power: cost model, Spearman-Brown steps, the choice, and the published power reproduced."""
import json
import math

import pytest

from companion.pilots import minilm_power as mpw
from companion.params import settings
from tests import ROOT


def test_cost_by_hand():
    cur = dict(n_models=24, k=2, n_train=4000, n_dev=2000, n_test=900, train_seconds=751.0, measure_seconds=520.0)
    assert mpw.design_seconds(24, 2, 2000, cur, 2.0) == pytest.approx(751.0 + 520.0)     # the current design
    # twice the members and the dev set 8000: training scales by 2 x (3*4000 + 4000 + 8000 + 900) / (... + 2000)
    want = 751.0 * 2 * (12000 + 4000 + 8000 + 900) / (12000 + 4000 + 2000 + 900) + 520.0 * (48 * 3) / (24 * 2)
    assert mpw.design_seconds(48, 3, 8000, cur, 2.0) == pytest.approx(want)
    assert mpw.latent_corr(0.5, 0.5, 0.5) == pytest.approx(min(0.99, math.sin(math.pi / 4) / 0.5))
    assert mpw.latent_corr(0.1, 0.9, 0.9) == pytest.approx(math.sin(math.pi * 0.05) / 0.9)


def test_note_reproduces_the_published_power_at_the_current_design_and_chooses_the_best():
    r = json.loads((ROOT / "reports" / "pilots" / "minilm_power.json").read_text())
    zoo = json.loads((ROOT / "reports" / "metrics" / "minilm.json").read_text())
    cur = r["current"]
    now = r["sources"]["zoo"]["current_grid_design"]
    assert now["n_models"] == cur["n_models"] == zoo["protocol"]["n_models"]
    for row in zoo["primary_delta_tau"]:            # the minilm row's own power, recomputed by the note's route
        assert now["power"][row["measure"]] == pytest.approx(row["power"], abs=1e-12)
    for s in r["sources"].values():
        assert all(d["seconds"] <= r["budget_seconds"] * (1 + 1e-9) for d in s["designs"])
        if s["chosen"] is not None:
            assert s["chosen"]["min_power"] == max(d["min_power"] for d in s["designs"]) > 0
    assert r["sources"]["pilot"]["chosen"] is None   # the pilot found no member variance for adaptive sharpness
    assert mpw.render_markdown(r) == (ROOT / "reports" / "pilots" / "minilm_power.md").read_text()
    p = settings(mpw.PowerPlan, mpw.STAGE, "cpu")
    assert cur["n_dev"] in p.dev_sizes and cur["k"] in p.batches_per_half
