"""companion.params: the one reader of params.yaml (defaults + per-profile changes)."""
import json

import pytest
import yaml

from companion.params import PROFILES, ParamsError, load_params, stage_params
from tests import ROOT

#: Resolved params.yaml of every stage and profile, captured from the file *before* it was split
#: into defaults + per-profile changes (commit 2cacf74, by the old reader params[stage][profile]).
FIXTURE = ROOT / "tests" / "fixtures" / "params_resolved.json"


def test_split_params_yaml_resolves_exactly_as_before():
    before = json.loads(FIXTURE.read_text())
    now = load_params(ROOT / "params.yaml")
    assert now["profile"] == before["profile"]
    assert sorted(k for k in now if k != "profile") == sorted(before["stages"])
    for stage, by_profile in before["stages"].items():
        for profile in PROFILES:
            got = stage_params(stage, profile, params=now)[1]
            # json round trip: the fixture is JSON; yaml floats such as 1.0e-5 compare equal
            assert json.loads(json.dumps(got)) == by_profile[profile], (
                f"params.yaml {stage}.{profile} no longer resolves to the recorded parameters; if the change "
                f"is intended, record it: python -m companion.params > {FIXTURE.relative_to(ROOT)}")


def test_every_profile_section_is_named_and_states_only_differences():
    now = load_params(ROOT / "params.yaml")
    for stage, section in now.items():
        if stage == "profile":
            continue
        assert set(section) == {"defaults", *PROFILES}, stage
        defaults = section["defaults"] or {}
        for profile in PROFILES:
            for key, value in (section[profile] or {}).items():
                assert defaults.get(key, object()) != value, f"{stage}.{profile}.{key} repeats the default"


def test_merge_overrides_and_errors(tmp_path):
    params = {"profile": "gpu",
              "s": {"defaults": {"a": 1, "grid": {"x": [1, 2], "y": [3]}, "l": [1, 2]},
                    "cpu": {}, "gpu": {"grid": {"y": [4]}, "l": [9]}, "paper": {"b": 2}}}
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump(params))
    # default profile from the file; nested mappings merge, lists replace
    assert stage_params("s", path=f) == ("gpu", {"a": 1, "grid": {"x": [1, 2], "y": [4]}, "l": [9]})
    assert stage_params("s", "cpu", path=f)[1] == params["s"]["defaults"]
    assert stage_params("s", "paper", params=params)[1]["b"] == 2
    # overrides: key=value strings (YAML values) or a dotted mapping; the input is not mutated
    assert stage_params("s", "cpu", ["grid.x=[5]", "a=0.5"], params=params)[1] == \
        {"a": 0.5, "grid": {"x": [5], "y": [3]}, "l": [1, 2]}
    assert stage_params("s", "cpu", {"new.k": True}, params=params)[1]["new"] == {"k": True}
    assert params["s"]["defaults"]["grid"] == {"x": [1, 2], "y": [3]}
    # a section without defaults reads as before the split
    assert stage_params("t", "cpu", params={"t": {"cpu": {"a": 3}}})[1] == {"a": 3}
    assert stage_params("absent", "cpu", params=params)[1] == {}
    with pytest.raises(ParamsError, match="no profile 'paper'"):
        stage_params("t", "paper", params={"t": {"cpu": {"a": 3}}})
    with pytest.raises(ParamsError, match="unknown profile 'tpu'"):
        stage_params("s", "tpu", params=params)
    with pytest.raises(ParamsError, match=r"\['cpuu'\].*move them"):
        stage_params("s", "cpu", params={"s": {"defaults": {}, "cpu": {}, "cpuu": {}}})
    with pytest.raises(ParamsError, match="key=value"):
        stage_params("s", "cpu", ["novalue"], params=params)
    with pytest.raises(ParamsError, match="does not exist"):
        stage_params("s", path=tmp_path / "missing.yaml")
    assert isinstance(ParamsError("x"), KeyError) and str(ParamsError("no 'q'")) == "no 'q'"


def test_resolve_all_and_cli(tmp_path, capsys):
    from companion.params import main, resolve_all

    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"profile": "cpu", "s": {"defaults": {"a": 1}, "cpu": {}, "gpu": {"a": 2}}}))
    assert resolve_all(f) == {"profile": "cpu", "stages": {"s": {"cpu": {"a": 1}, "gpu": {"a": 2}}}}
    assert main(["s", "--profile", "gpu", "--set", "b=[1]", "--params", str(f)]) == 0
    assert json.loads(capsys.readouterr().out) == {"stage": "s", "profile": "gpu", "params": {"a": 2, "b": [1]}}
    assert main(["nosuch", "--params", str(f)]) == 1
    assert "no stage section 'nosuch'" in capsys.readouterr().err
