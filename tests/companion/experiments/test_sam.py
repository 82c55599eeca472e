"""companion.experiments.sam: the selection rule, the bootstrap, the splits and the fine-tunes."""
import numpy as np
import pandas as pd
import pytest
import torch

from companion.experiments import sam as se
from companion.experiments import vision_zoo as vz
from companion.params import ParamsError
from tests.companion.notebooks.test_sam import TINY, VISION


def test_choose_rho_lowest_mean_validation_error_ties_to_smaller():
    runs = pd.DataFrame(dict(
        method=["sam"] * 6 + ["asam"] * 4,
        rho=[0.1, 0.1, 0.03, 0.03, 0.01, 0.01, 1.0, 1.0, 0.3, 0.3],
        val_error=[0.2, 0.2, 0.1, 0.3, 0.25, 0.15, 0.1, 0.2, 0.2, 0.1]))
    # sam: means 0.2 (0.1), 0.2 (0.03), 0.2 (0.01) -> all tied -> 0.01; asam: 0.15 vs 0.15 -> 0.3
    assert se.choose_rho(runs) == {"sam": 0.01, "asam": 0.3}
    runs.loc[0, "val_error"] = 0.0           # sam at 0.1 now has mean 0.1
    assert se.choose_rho(runs)["sam"] == 0.1


def test_bootstrap_error_resamples_seeds_and_images():
    rng = np.random.default_rng(0)
    corr = rng.random((3, 50)) < 0.8
    seeds, images = rng.integers(0, 3, (20, 3)), rng.integers(0, 50, (20, 50))
    draws = se.bootstrap_error(corr, 20, rng, seeds, images)
    for d, s, i in zip(draws, seeds, images):
        by_hand = np.mean([[1.0 - corr[a, b] for b in i] for a in s])
        assert d == pytest.approx(by_hand)


def test_splits_are_disjoint_and_fine_tunes_deterministic():
    s = se.Settings.from_params(TINY)
    start = se.pretrained_start(s, "cpu")
    vision = vz.load_settings("cpu", VISION)
    data = vz.load_data(vision.data)
    assert len(start.y_train) + len(start.y_val) == len(data.y_pool) == 192 and len(start.y_val) == 64
    assert torch.equal(torch.cat([start.x_train, start.x_val]), data.x_pool)
    assert torch.equal(start.y_val, data.y_pool[-64:])
    assert torch.equal(start.x_test, data.x_test) and len(start.y_test) == 200
    assert start.record["n_images"] == 128                  # pre-trained on the training part only
    assert isinstance(start.model(), vz.GlyphViT) and start.model().visual.conv1.kernel_size == (4, 4)
    a, ra = se.finetune(start, "geodesic_mixed", 0.1, 3, TINY)
    b, rb = se.finetune(start, "geodesic_mixed", 0.1, 3, TINY)
    c, _ = se.finetune(start, "adamw", 0.0, 3, TINY)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert ra["val_error"] == rb["val_error"]
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))
    with pytest.raises(ValueError, match="unknown method"):
        se.finetune(start, "sgd", 0.1, 0, TINY)


def test_settings_are_checked():
    with pytest.raises(ParamsError, match="missing"):
        se.Settings.from_params({k: v for k, v in TINY.items() if k != "n_val"})
    with pytest.raises(ParamsError, match="rho_grid must name exactly"):
        se.Settings.from_params(dict(TINY, rho_grid=dict(sam=[0.1])))
    with pytest.raises(ParamsError, match="selection"):
        se.Settings.from_params(dict(TINY, selection="min_test_error"))
    with pytest.raises(ParamsError, match="n_val must be in"):
        se.pretrained_start(se.Settings.from_params(dict(TINY, n_val=192)), "cpu")
