"""companion.pilots.vision_minima: members, corners, cost projection, the choice, no gap computed."""
import json

import pytest

from companion.pilots import vision_minima as vmp
from companion.experiments import vision_zoo as vz
from companion.params import settings
from tests import ROOT
from tests.companion.experiments.test_vision_zoo import TINY
from companion.params import load_yaml


@pytest.fixture(scope="module")
def pilot():
    return settings(vmp.MinimaPilot, vmp.STAGE, "cpu")


@pytest.fixture(scope="module")
def tiny():
    return vz.load_settings("cpu", TINY)


def test_params_declare_the_preregistered_criterion_and_candidates_in_order(pilot):
    # reports/preregistration/vision_minima.md, sections 1, 2 and 4
    assert pilot.max_train_error == 0.30 and pilot.budget_minutes == 15.0
    assert (pilot.n_slow, pilot.n_fast, pilot.n_drawn) == (3, 1, 6) and pilot.stream == "minima_pilot"
    assert [c.name for c in pilot.candidates] == ["K1", "K2", "K3"]
    k1, k2, k3 = (vz.load_settings("cpu", pilot.base_overrides + c.overrides) for c in pilot.candidates)
    base = vz.load_settings("cpu", pilot.base_overrides)
    # the recipe before the pilot: the defaults' ranges (the cpu profile changed none of them then), no warm-up
    before = load_yaml((ROOT / "params.yaml").read_text())["vision_train"]["defaults"]
    assert base.ranges == vz.load_settings("gpu").ranges and base.warmup == 0.0
    assert base.pretrain.epochs == before["pretrain"]["epochs"] == 10
    assert k1.ranges.lr == (3e-3, 1.5e-2) and k1.warmup == 0.1 and k1.pretrain.epochs == 30
    assert k1.ranges.batch_size == base.ranges.batch_size and k1.ranges.epochs == base.ranges.epochs
    assert k2.ranges.batch_size == (32, 64) and k2.ranges.epochs == (8, 16) and k2.ranges.lr == k1.ranges.lr
    assert k3.ranges.lr == (6e-3, 1.5e-2) and k3.ranges.epochs == (11, 15) and k3.ranges.label_smoothing == (0.0, 0.1)
    for k in (k1, k2, k3):   # what the pre-registration keeps
        assert (k.model, k.data, k.n_models, k.seed) == (base.model, base.data, base.n_models, base.seed)
        assert (k.ranges.shift, k.ranges.noise_std, k.ranges.mixup_alpha, k.ranges.weight_decay) == \
            (base.ranges.shift, base.ranges.noise_std, base.ranges.mixup_alpha, base.ranges.weight_decay)


def test_params_hold_the_recipe_the_pilot_chose_and_the_criterion():
    """Step 3 of reports/preregistration/vision_minima.md: the chosen candidate (reports/pilots/vision_minima.json)
    is the cpu recipe of vision_train, and the vision stage draws apart members above the criterion."""
    report = json.loads((ROOT / "reports" / "pilots" / "vision_minima.json").read_text())
    pilot = settings(vmp.MinimaPilot, vmp.STAGE, "cpu")
    chosen = next(c for c in pilot.candidates if c.name == report["chosen"])
    assert vz.load_settings("cpu", pilot.base_overrides + chosen.overrides) == vz.load_settings("cpu")
    assert all(m["train_error"] <= pilot.max_train_error
               for c in report["candidates"] if c["name"] == report["chosen"] for m in c["members"])
    from companion.params import stage_params

    assert stage_params("vision", "cpu")[1]["max_train_error"] == pilot.max_train_error


def test_candidates_are_what_the_pilot_ran():
    """The recorded recipe of every candidate in the report is the one params.yaml gives it now."""
    from dataclasses import asdict

    report = json.loads((ROOT / "reports" / "pilots" / "vision_minima.json").read_text())
    pilot = settings(vmp.MinimaPilot, vmp.STAGE, "cpu")
    by_name = {c.name: c for c in pilot.candidates}
    for c in report["candidates"]:
        s = vz.load_settings("cpu", pilot.base_overrides + by_name[c["name"]].overrides)
        assert c["recipe"] == dict(ranges=json.loads(json.dumps(asdict(s.ranges))), warmup=s.warmup,
                                   pretrain_epochs=s.pretrain.epochs), c["name"]


def test_corners_are_the_ends_of_the_ranges(tiny):
    r = tiny.ranges
    slow, fast = vmp.corner(r, "slow"), vmp.corner(r, "fast")
    assert (slow.lr, slow.weight_decay, slow.epochs, slow.batch_size) == (r.lr[0], r.weight_decay[1], r.epochs[0], 32)
    assert (slow.label_smoothing, slow.shift, slow.noise_std, slow.mixup_alpha) == \
        (r.label_smoothing[1], 1, r.noise_std[1], r.mixup_alpha[1])
    assert (fast.lr, fast.weight_decay, fast.epochs, fast.batch_size) == (r.lr[1], r.weight_decay[0], r.epochs[1], 16)
    assert (fast.label_smoothing, fast.shift, fast.noise_std, fast.mixup_alpha) == (r.label_smoothing[0], 0, 0.0, 0.0)
    with pytest.raises(ValueError, match="corner"):
        vmp.corner(r, "middle")


def test_pilot_members_are_outside_the_zoo_and_the_earlier_pilots(tiny, pilot):
    members = vmp.pilot_members(tiny, pilot)
    assert [m["role"] for m in members] == ["drawn"] * 6 + ["slow corner"] * 3 + ["fast corner"]
    seeds = [m["seed"] for m in members]
    assert len(set(seeds)) == 10
    others = {seed for stream in ("main", "pilot") for _, seed in vz.member_draws(tiny, stream, 200)}
    assert not set(seeds) & others
    draws = vz.member_draws(tiny, "minima_pilot", 10)
    assert [m["hparams"] for m in members[:6]] == [hp for hp, _ in draws[:6]]
    assert seeds == [s for _, s in draws]


def test_projection_and_rest_by_hand(tiny):
    # rest of the committed stage: total - pretrain - members / workers
    assert vmp.stage_rest({"total": 100.0, "pretrain": 10.0, "members": {"a": 40.0, "b": 60.0}}, 2) == 40.0
    cost = {16: 1.5, 32: 1.0}
    draws = vz.member_draws(tiny, "main", tiny.n_models)
    member = sum(hp.epochs * cost[hp.batch_size] for hp, _ in draws)      # by hand: epochs x cost of the batch
    p = vmp.projection(tiny, cost, pretrain_cpu=12.0, rest=30.0)
    assert p["member_cpu_seconds"] == pytest.approx(member)
    assert p["stage_minutes"] == pytest.approx((12.0 + member / tiny.workers + 30.0) / 60)
    assert p["cpu_minutes"] == pytest.approx((12.0 + member) / 60)
    with pytest.raises(ValueError, match="batch size"):
        vmp.projection(tiny, {16: 1.0}, pretrain_cpu=0.0, rest=0.0)
    rows = [{"hparams": {"batch_size": 16, "epochs": 2}, "cpu_seconds": 4.0},
            {"hparams": {"batch_size": 16, "epochs": 1}, "cpu_seconds": 3.0},
            {"hparams": {"batch_size": 16, "epochs": 4}, "cpu_seconds": 2.0},
            {"hparams": {"batch_size": 32, "epochs": 2}, "cpu_seconds": 1.0}]
    assert vmp.per_epoch_cpu(rows) == {16: 2.0, 32: 0.5}       # medians of (2, 3, 0.5) and (0.5)


def test_verdict_criterion_is_inclusive_and_the_budget_binds(pilot):
    assert vmp.verdict([0.1, 0.30], 14.9, pilot)["chosen"]
    v = vmp.verdict([0.1, 0.3001, 0.5], 10.0, pilot)
    assert not v["chosen"] and v["n_fail"] == 2 and v["max_train_error"] == 0.5
    v = vmp.verdict([0.1], 15.01, pilot)
    assert v["all_fit"] and not v["within_budget"] and not v["chosen"]


def test_run_stops_at_the_first_passing_candidate_and_computes_no_gap(tmp_path, monkeypatch):
    tiny_pilot = ["n_slow=1", "n_fast=1", "n_drawn=1", "workers=1", f"stage_timings={tmp_path / 't.json'}"]
    (tmp_path / "t.json").write_text(json.dumps({"total": 10.0, "pretrain": 1.0, "members": {"m": 2.0}}))
    # the tiny model does not learn its 60 images: a rate too high for it moves every member off its start's pool
    # error (0.75), a vanishing rate keeps them there; a ceiling between the two tells the candidates apart
    cands = [{"name": "A", "label": "nothing fits", "overrides": TINY + ["ranges.lr=[3.0e-2, 5.0e-2]",
                                                                            "ranges.epochs=[20, 20]"]},
             {"name": "B", "label": "fits", "overrides": TINY + ["ranges.lr=[1.0e-9, 2.0e-9]"]},
             {"name": "C", "label": "never tried", "overrides": TINY}]
    p = settings(vmp.MinimaPilot, vmp.STAGE, "cpu", tiny_pilot + [f"candidates={json.dumps(cands)}",
                                                                  "max_train_error=0.76", "budget_minutes=100"])
    calls = []
    real = vz.error_rate
    monkeypatch.setattr(vz, "error_rate", lambda m, x, y: calls.append(len(y)) or real(m, x, y))
    r = vmp.run(p, progress=False)
    assert [c["name"] for c in r["candidates"]] == ["A", "B"] and r["chosen"] == "B"
    assert not r["candidates"][0]["all_fit"] and r["candidates"][1]["all_fit"]
    # only the pool (60 images) is ever evaluated: no test error, no gap
    assert set(calls) == {60}
    def keys(x):
        if isinstance(x, dict):
            return set(x) | {k for v in x.values() for k in keys(v)}
        return {k for v in x for k in keys(v)} if isinstance(x, list) else set()

    assert not {k for k in keys(r) if any(w in k for w in ("test", "gap", "sharp"))}
    md = vmp.render_markdown(r)
    assert "Chosen: B" in md and "| A: nothing fits |" in md


def test_calibration_by_hand(tiny):
    draws = vz.member_draws(tiny, "main", tiny.n_models)
    cost = {16: 2.0, 32: 1.0}
    base_cpu = sum(hp.epochs * cost[hp.batch_size] for hp, _ in draws)
    timings = {"total": 100.0, "pretrain": 6.0, "members": {"a": 3 * base_cpu / 2, "b": 3 * base_cpu / 2}}
    report = {"candidates": [
        {"name": "A", "epoch_cpu_seconds": {"16": 5.0}, "recipe": {"pretrain_epochs": 3}, "projection": {"member_cpu_seconds": 1.0}},
        {"name": "B", "epoch_cpu_seconds": {"16": 2.0, "32": 1.0}, "recipe": {"pretrain_epochs": 2},
         "projection": {"member_cpu_seconds": 10.0}}]}
    cal = vmp.calibration(report, tiny, timings)
    assert cal["costs_from"] == "B" and cal["ratio"] == pytest.approx(3.0)       # A lacks batch size 32
    rest = 100.0 - 6.0 - 3 * base_cpu / tiny.workers
    b = cal["candidates"]["B"]
    assert b["pretrain_seconds"] == pytest.approx(6.0 * 2 / tiny.pretrain.epochs) and b["member_seconds"] == 30.0
    assert b["stage_minutes"] == pytest.approx((b["pretrain_seconds"] + 30.0 / tiny.workers + rest) / 60)
    with pytest.raises(ValueError, match="batch size"):
        vmp.calibration({"candidates": report["candidates"][:1]}, tiny, timings)


def test_the_earlier_pilots_and_sam_keep_the_recipe_they_were_run_with(pilot):
    """The cpu profile moved to the chosen recipe; the 4- and 16-token pilots and sam keep the recipe they ran with."""
    import dataclasses

    from companion.pilots import vision as vp
    from companion.params import stage_params

    before = vz.load_settings("cpu", pilot.base_overrides + ["cpu_kernels=null"])
    for section in ("vision_pilot", "vision16_pilot"):
        s = vz.load_settings("cpu", settings(vp.VisionPilot, section, "cpu").vision_overrides)
        assert dataclasses.replace(s, model=before.model) == before, section
    st = stage_params("sam", "cpu")[1]
    assert vz.load_settings("cpu", st["vision_overrides"]).pretrain == before.pretrain   # sam's start: as measured
