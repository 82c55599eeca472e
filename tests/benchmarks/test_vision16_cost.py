"""benchmarks/vision16_cost.py: the timed code paths run on a tiny stand-in (no timing asserted) and the
projection scales each stage's committed time by the measured ratios (checked by hand against params.yaml)."""
import dataclasses

import pytest

from benchmarks import vision16_cost as vc
from tests import ROOT
from companion.params import load_yaml

MEASURES = ("adaptive", "geodesic_invariant", "geodesic_mixed")


def _medians(pre=1.0, ft=1.0, sharp=1.0, geo=1.0):
    m = {"pretrain_epoch": pre, "finetune_epoch_bs64": ft, "finetune_epoch_bs128": ft, "geometry_member": geo}
    for k in MEASURES:
        m[f"sharpness_{k}_per_batch"] = sharp
    return m


def test_projection_scales_the_recorded_times_by_the_measured_ratios():
    recorded = {"vision_train": 700.0, "vision": 800.0, "geometry_lines_vision": 200.0, "sam": 300.0}
    r = {"profile": "cpu", "median": {"base": _medians(), "big": _medians(pre=3.0, ft=3.0, sharp=2.0, geo=4.0)}}
    out = vc.project(r, recorded)
    assert out["base"]["vision_2048"] == pytest.approx(800.0, abs=0.1)          # calibrated on itself
    assert out["base"]["vision_train"] == pytest.approx(700.0, abs=0.1)
    big = out["big"]
    assert big["vision_2048"] == pytest.approx(1600.0, abs=0.1)
    assert big["vision_train"] == pytest.approx(2100.0, abs=0.1)
    assert big["geometry_lines_vision"] == pytest.approx(800.0, abs=0.1)
    assert big["sam"] == pytest.approx(900.0, abs=0.1)
    # the exploratory radii's share, counted from params.yaml by hand: per measure two sets of n at the primary
    # radius, one set of n at each other exploratory radius
    # (the cpu profile's resolved protocol, as the projection reads it: since the 16-token choices it has no
    # exploratory radius, so the share is 1 there; the defaults' protocol, with radii, is checked below)
    doc = load_yaml((ROOT / "params.yaml").read_text())["vision"]
    v = {**doc["defaults"], **doc["cpu"]}
    extra = {k: len([x for x in v["exploratory_rho"][k] if x != v["rho"][k]]) for k in MEASURES}
    share = sum(2 for _ in MEASURES) / sum(2 + extra[k] for k in MEASURES)
    assert big["vision_2048_no_exploratory_rho"] == pytest.approx(1600.0 * share, abs=0.1)
    assert big["vision_1024"] == pytest.approx(800.0, abs=0.1)
    text = vc.table(dict(r, repeats=1, n_parameters={"base": 10, "big": 20}, projection_seconds=out))
    share = (2100.0 + 800.0 + 900.0 + 1600.0) / 60      # vision_train + geometry + sam + vision at 2048
    assert f"**{share:.1f}**" in text and "(×2.00)" in text


def test_parse_config_refuses_what_is_not_patch_width_layers():
    assert vc.parse_config("4:32:2") == {"patch_size": 4, "width": 32, "layers": 2}
    with pytest.raises(SystemExit, match="patch:width:layers"):
        vc.parse_config("4x32")


def test_one_repeat_times_every_code_path_on_a_tiny_stand_in():
    from companion.experiments import geometry_lines as gl
    from companion.experiments import vision_report as vr
    from companion.experiments import vision_zoo as vz
    from companion.params import settings, stage_params

    s = vc._settings("cpu", {"patch_size": 4, "width": 8, "layers": 1})
    s = dataclasses.replace(s, model=dataclasses.replace(s.model, heads=2),
                            data=dataclasses.replace(s.data, n_train=192),
                            pretrain=dataclasses.replace(s.pretrain, batch_size=64))
    data = vz.load_data(s.data, 8)
    vision = dataclasses.replace(settings(vr.VisionSettings, "vision", "cpu"), batch_size=32, n_iters=2)
    geo = gl.load_settings(stage_params("geometry_lines", "cpu")[1])
    task = dict(metrics=list(geo.metrics), rho={m: vision.rho[gl.METRIC_COLUMN[m]] for m in geo.metrics}, n_iters=2,
                seed=0, eps=0.0, hessian=geo.hessian, probes=2)
    out = vc.one_repeat(s, data, vision, geo, task, 0)
    keys = {"pretrain_epoch", "finetune_epoch_bs64", "finetune_epoch_bs128", "geometry_member"} | \
        {f"sharpness_{k}_{n}" for k in MEASURES for n in (1, 3)}
    assert set(out) == keys | {f"{k}_wall" for k in keys} and all(v > 0 for v in out.values())
    assert vc.config_name(s.model) == "p4_w8_l1_t16"
