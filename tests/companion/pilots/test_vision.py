"""companion.pilots.vision: the pre-registration rules on synthetic pilot data (no training)."""
import numpy as np
import pandas as pd
import pytest
from scipy import stats

from companion.pilots import vision as vp
from companion.params import settings


def test_choose_rho_takes_the_best_retest_and_ties_go_to_the_smaller_radius():
    assert vp.choose_rho({0.1: 0.5, 0.2: 0.9, 0.4: 0.7}) == 0.2
    assert vp.choose_rho({0.4: 0.8, 0.1: 0.8, 0.2: 0.3}) == 0.1


def _synthetic(p, n_models=12, seed=0):
    """Members with a known gap spread, per-example errors, and sharpness whose retest falls with rho."""
    rng = np.random.default_rng(seed)
    true_err = rng.uniform(0.2, 0.4, n_models)
    errors = (rng.random((n_models, p.n_test)) < true_err[:, None]).astype(np.uint8)
    train = true_err - rng.uniform(0.0, 0.1, n_models)
    meta = {"members": [dict(name=f"model_{i:03d}", train_error=float(train[i]),
                             test_error=float(errors[i].mean()), gap=float(errors[i].mean() - train[i]),
                             hparams={"lr": 1e-3}) for i in range(n_models)]}
    latent = rng.standard_normal(n_models)
    nb = p.n_images // p.batch_size
    rows = []
    for m in p.measures:
        for j, rho in enumerate(p.rho_grid[m.name]):
            noise = 0.2 + 0.6 * j  # larger radii: noisier
            for i in range(n_models):
                pb = list(latent[i] + noise * rng.standard_normal(2 * nb))
                rows.append(dict(model=f"model_{i:03d}", measure=m.name, rho=rho, value=float(np.mean(pb)),
                                 per_batch=pb, base_loss=[0.5] * (2 * nb), seconds=0.1))
    return meta, errors, pd.DataFrame(rows)


def test_summarise_applies_the_rules_checked_with_scipy():
    p = settings(vp.VisionPilot, "vision_pilot", "cpu", ["n_test=2000", "test_sizes=[200,500,2000]",
                                                         "n_images=512", "n_images_candidates=[512]",
                                                         "power.n_sim=200"])
    meta, errors, frame = _synthetic(p)
    r = vp.summarise(p, meta, errors, frame, dict(training=1.0, sharpness=2.0, per_call_mean=0.1, n_calls=len(frame)))
    nb = p.n_images // p.batch_size
    for m in p.measures:  # retest and the chosen radius, recomputed from the frame with scipy
        taus = {}
        for rho, g in frame[frame.measure == m.name].groupby("rho"):
            pb = np.array(list(g["per_batch"]))
            taus[rho] = stats.kendalltau(pb[:, :nb].mean(1), pb[:, nb:].mean(1)).statistic
        best = max(taus.values())
        assert r["chosen"][m.name]["rho"] == min(k for k, v in taus.items() if v >= best - 1e-9)
        assert r["chosen"][m.name]["retest"] == pytest.approx(best)
        assert 0 <= r["chosen"][m.name]["power"] <= 1
    sizes = [c["n_test"] for c in r["reliability"]]
    assert sizes == [200, 500, 2000]
    ok = [c["n_test"] for c in r["reliability"] if c["split_half"] >= p.target_reliability]
    assert r["chosen_n_test"] == (min(ok) if ok else 2000)
    # the larger test set gives the more reliable gap
    assert r["reliability"][-1]["split_half"] > r["reliability"][0]["split_half"]
    md = vp.render_markdown(r)
    for c in r["chosen"].values():
        assert f"{c['retest']:.3f}" in md and f"{c['power']:.3f}" in md
    assert f"**{r['chosen_n_test']}**" in md


def test_vision16_pilot_parameters_load_and_its_model_has_16_patch_tokens():
    import torch

    from companion.experiments import vision_zoo as vz

    p = settings(vp.VisionPilot, "vision16_pilot", "cpu")
    vp.check_candidates(p)
    assert p.report == "vision16" and p.zoo_dir != settings(vp.VisionPilot, "vision_pilot", "cpu").zoo_dir
    assert sorted(p.n_images_candidates) == [1024, 2048] and p.min_retest == 0.8 and p.paired_power is not None
    s = vz.load_settings("cpu", p.vision_overrides)
    assert s.model.patch_size == 4 and s.data.spec.image_size == 16
    model = vz.build_model(s, 0)
    # the patch grid counted from the patch embedding's output on an image (not from the settings' arithmetic)
    grid = model.visual.conv1(torch.zeros(1, 1, 16, 16))
    assert grid.shape[-2] * grid.shape[-1] == 16
    assert model.visual.positional_embedding.shape[0] == 16 + 1      # + the class token
    assert model(torch.zeros(2, 1, 16, 16)).shape == (2, s.data.spec.n_classes)
    # the 4-token pilot's members stay what they were
    assert vz.load_settings("cpu", settings(vp.VisionPilot, "vision_pilot", "cpu").vision_overrides).model.patch_size == 8


def test_choose_count_takes_the_smallest_count_passing_for_every_measure():
    best = {1024: {"a": 0.85, "b": 0.79}, 2048: {"a": 0.9, "b": 0.81}, 4096: {"a": 0.95, "b": 0.95}}
    assert vp.choose_count(best, 0.8) == 2048
    assert vp.choose_count(best, 0.78) == 1024
    assert vp.choose_count(best, 0.99) == 4096        # none passes: the largest


def test_check_candidates_refuses_counts_it_cannot_measure():
    p = settings(vp.VisionPilot, "vision16_pilot", "cpu")
    for bad in (["n_images_candidates=[1000,2048]"], ["n_images_candidates=[1024,4096]"], ["n_images_candidates=[]"]):
        with pytest.raises(ValueError, match="n_images_candidates"):
            vp.check_candidates(settings(vp.VisionPilot, "vision16_pilot", "cpu", bad))
    vp.check_candidates(p)


def test_summarise_with_image_count_candidates_recomputed_with_scipy():
    p = settings(vp.VisionPilot, "vision16_pilot", "cpu", ["n_test=2000", "test_sizes=[200,2000]", "n_images=512",
                                                           "n_images_candidates=[256,512]", "power.n_sim=100",
                                                           "paired_power.n_sim=20", "paired_power.n_boot=200"])
    meta, errors, frame = _synthetic(p)
    meta["settings"] = {"model": {"patch_size": 4, "width": 32, "layers": 2, "heads": 4},
                        "data": {"spec": {"image_size": 16}}}
    r = vp.summarise(p, meta, errors, frame, dict(training=1.0, sharpness=2.0, per_call_mean=0.1, n_calls=len(frame)))
    best = {}
    for c in (256, 512):   # set 1 = batches 0 .. nb-1, set 2 = nb .. 2nb-1 of the measured layout
        nb = c // p.batch_size
        best[c] = {}
        for m in p.measures:
            taus = [stats.kendalltau(pb[:, :nb].mean(1), pb[:, nb:2 * nb].mean(1)).statistic
                    for _, g in frame[frame.measure == m.name].groupby("rho")
                    for pb in [np.array(list(g["per_batch"]))]]
            best[c][m.name] = max(taus)
            assert r["best_retest_by_count"][str(c)][m.name] == pytest.approx(best[c][m.name])
    passing = [c for c in (256, 512) if all(v >= p.min_retest for v in best[c].values())]
    assert r["chosen_n_images"] == (min(passing) if passing else 512)
    for m in p.measures:
        assert r["chosen"][m.name]["retest"] == pytest.approx(best[r["chosen_n_images"]][m.name])
    assert [x["measure"] for x in r["paired_power"]] == ["geodesic_invariant", "geodesic_mixed"]
    assert all(0 <= x["power"] <= 1 and x["paper_delta"] > 0 for x in r["paired_power"])
    md = vp.render_markdown(r)
    assert "16 patch tokens" in md and f"**{r['chosen_n_images']}** images per set" in md
    assert all(f"{x['power']:.3f}" in md for x in r["paired_power"])
