"""companion.params.settings: typed stage settings, missing and unknown keys refused."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest

import hideseek as hs
from companion.params import ParamsError, settings


@dataclass(frozen=True)
class Inner:
    n: int
    rate: float


@dataclass(frozen=True)
class Stage:
    seed: int
    rhos: list[float]
    inner: Inner
    measures: dict[str, hs.Measure]
    mode: Literal["fast", "slow"]
    threads: int | None
    pair: tuple[int, int]


PARAMS = {
    "profile": "cpu",
    "s": {
        "defaults": {"seed": 0, "rhos": [0.1, 1], "inner": {"n": 3, "rate": 2},
                     "measures": {"adaptive": "m_apgd_l2", "mixed": {"geometry": "geodesic", "metric": "mixed"}},
                     "mode": "fast", "threads": None, "pair": [1, 2]},
        "cpu": {"inner": {"n": 4}},
        "gpu": {"mode": "slow"},
    },
}


def test_settings_builds_typed_nested_objects():
    s = settings(Stage, "s", params=PARAMS)
    assert s.inner == Inner(n=4, rate=2.0) and isinstance(s.inner.rate, float)
    assert s.rhos == [0.1, 1.0] and s.pair == (1, 2) and s.threads is None
    assert s.measures["adaptive"] == hs.Measure(geometry="adaptive", p="l2")
    assert s.measures["mixed"] == hs.Measure(metric="mixed")
    assert settings(Stage, "s", "gpu", params=PARAMS).mode == "slow"
    assert settings(Stage, "s", overrides=["inner.rate=0.5"], params=PARAMS).inner.rate == 0.5


@pytest.mark.parametrize("override, message", [
    ("inner.extra=1", r"keys \['extra'\] that Inner does not know"),
    ("seed=1.5", r"s \(cpu\)\.seed must be an integer, got 1.5"),
    ("mode=medium", r"mode must be one of \['fast', 'slow'\]"),
    ("rhos=[0.1, x]", r"rhos\[1\] must be a number"),
    ("measures.mixed=nonsense", r"measures\.mixed: unknown measure 'nonsense'"),
    ("pair=[1, 2, 3]", r"pair must have 2 entries"),
    ("threads=two", r"threads = 'two' matches none of|threads must be an integer"),
])
def test_settings_refuses_bad_values_in_one_line(override, message):
    with pytest.raises(ParamsError, match=message) as err:
        settings(Stage, "s", overrides=[override], params=PARAMS)
    assert "\n" not in str(err.value)


def test_settings_refuses_missing_keys_no_defaults_in_code():
    params = {"profile": "cpu", "s": {"defaults": {k: v for k, v in PARAMS["s"]["defaults"].items() if k != "seed"},
                                      "cpu": {}}}
    with pytest.raises(ParamsError, match=r"is missing \['seed'\]; add them to params.yaml"):
        settings(Stage, "s", params=params)


def test_settings_needs_a_dataclass():
    with pytest.raises(TypeError, match="needs a dataclass"):
        settings(dict, "s", params=PARAMS)
