"""hideseek.measures.Measure: validation, names, labels, round-trips, and that sharpness()
measures what the Measure says."""
import itertools
import json
import warnings

import pytest
import hideseek as hs
from hideseek.measures import BALLS, GEOMETRIES, KINDS, METRICS, PS, STEPS, Measure


#: the names results have always carried (written out, not derived from the code)
KNOWN = {
    "m_apgd_l2": dict(geometry="adaptive"),
    "m_apgd_linf": dict(geometry="adaptive", p="linf"),
    "avg_l2": dict(geometry="adaptive", kind="average"),
    "avg_linf": dict(geometry="adaptive", p="linf", kind="average"),
    "geodesic_invariant": dict(metric="invariant"),
    "geodesic_mixed": dict(metric="mixed"),
    "geodesic_mixed_no_christoffel": dict(metric="mixed", step="straight"),
    "geodesic_invariant_christoffel_only": dict(metric="invariant", ball="adaptive"),
    "geodesic_mixed_adaptive_norm_straight": dict(metric="mixed", ball="adaptive", step="straight"),
    "geodesic_invariant_exact": dict(metric="invariant", step="exact"),
    "geodesic_mixed_exact": dict(metric="mixed", step="exact"),
    "avg_geodesic_mixed_christoffel_only": dict(metric="mixed", ball="adaptive", kind="average"),
}

#: every combination of the fields, with eps in {0, 0.1}
GRID = [dict(zip(("geometry", "metric", "p", "ball", "step", "eps", "kind"), c)) for c in itertools.product(
    GEOMETRIES, (None,) + tuple(METRICS), PS, (None,) + BALLS, (None,) + STEPS, (0.0, 0.1), KINDS)]


def _valid(d):
    """Validity written independently of the class: the rules of the docs."""
    if d["geometry"] != "geodesic":   # adaptive / euclidean: their own ball, straight step, no metric, no eps
        return d["metric"] is None and d["ball"] in (None, d["geometry"]) and d["step"] in (None, "straight") \
            and d["eps"] == 0.0
    if d["p"] != "l2":
        return False
    if d["step"] == "exact":
        return d["ball"] in (None, "riemannian") and d["eps"] == 0.0
    return True


@pytest.mark.parametrize("name,fields", KNOWN.items())
def test_known_names(name, fields):
    m = Measure(**fields)
    assert m.name == name
    assert Measure.parse(name) == m


def test_every_combination_is_valid_or_raises_and_round_trips():
    n_valid = 0
    for d in GRID:
        if not _valid(d):
            with pytest.raises(ValueError, match="Measure: "):
                Measure(**d)
            continue
        n_valid += 1
        m = Measure(**d)
        assert Measure.parse(m.name) == m.replace(eps=0.0)          # ε is not in the name
        assert Measure.from_dict(json.loads(json.dumps(m.to_dict()))) == m
        assert Measure(**m.to_dict()) == m
        assert Measure.from_keywords(**m.to_keywords()) == m
    assert n_valid > 20


def test_names_and_labels_are_distinct():
    ms = {Measure(**d) for d in GRID if _valid(d)}
    assert len({m.label for m in ms}) == len(ms)
    zero = [m for m in ms if m.eps == 0.0]
    assert len({m.name for m in zero}) == len(zero) == len(Measure.all())
    assert Measure(metric="mixed", step="straight").label == "geodesic_mixed[no-christoffel]"
    assert Measure(geometry="adaptive").label == "adaptive ℓ2"


@pytest.mark.parametrize("kw,msg", [
    (dict(geometry="adaptive", metric="invariant"), "no metric"),
    (dict(geometry="adaptive", step="second_order"), "straight step"),
    (dict(geometry="adaptive", eps=0.1), "eps"),
    (dict(p="linf"), "linf"),
    (dict(eps=-1.0), "eps"),
    (dict(eps=float("nan")), "eps"),
    (dict(eps=True), "eps"),
    (dict(metric="mixed", step="exact", eps=0.1), "exact"),
    (dict(ball="adaptive", step="exact"), "exact"),
    (dict(geometry="euclid"), "geometry"),
    (dict(kind="best"), "kind"),
    (dict(step="first_order"), "step"),
])
def test_invalid_measures_say_what_to_do(kw, msg):
    with pytest.raises(ValueError, match=msg) as err:
        Measure(**kw)
    assert "\n" not in str(err.value)


def test_parse_aliases_and_errors():
    assert Measure.parse("geodesic") == Measure() == Measure(metric="invariant")
    assert Measure.parse("adaptive") == Measure(geometry="adaptive", p="l2", kind="worst")
    m = Measure(metric="mixed")
    assert Measure.parse(m) is m
    with pytest.raises(ValueError, match="unknown measure 'geodesic_foo'"):
        Measure.parse("geodesic_foo")
    with pytest.raises(TypeError):
        Measure.parse(3)
    with pytest.raises(ValueError, match="unknown keys"):
        Measure.from_dict(dict(geometry="adaptive", radius=1))


def test_frozen_and_replace():
    m = Measure()
    with pytest.raises(AttributeError):
        m.eps = 1.0
    assert m.replace(metric="mixed").name == "geodesic_mixed"
    # changing the geometry resets the geometry-dependent fields
    assert m.replace(geometry="adaptive", p="linf").name == "m_apgd_linf"
    assert Measure(geometry="adaptive").replace(geometry="geodesic") == Measure()


def test_keyword_form():
    kf = Measure.from_keywords
    assert kf("geodesic", metric="mixed", christoffel=False) == Measure(metric="mixed", step="straight")
    assert kf("adaptive", p="linf", kind="average").name == "avg_linf"
    assert kf("geodesic_mixed", norm="adaptive").name == "geodesic_mixed_christoffel_only"
    assert kf("geodesic", christoffel="exact").step == "exact"
    assert kf("adaptive", norm="adaptive", christoffel=False) == Measure(geometry="adaptive")
    with pytest.raises(ValueError, match="no metric"):
        kf("adaptive", metric="invariant")
    with pytest.raises(ValueError, match="christoffel"):
        kf("geodesic", christoffel="yes")


@pytest.mark.parametrize("m", [Measure(), Measure(metric="mixed", step="straight", eps=0.01),
                               Measure(metric="mixed", ball="adaptive"), Measure(geometry="adaptive", p="linf"),
                               Measure(geometry="adaptive", kind="average")], ids=lambda m: m.label)
def test_sharpness_takes_a_measure_and_the_keyword_form_agrees(m, mha_model, mha_data):
    model, b = mha_model, mha_data
    kw = dict(measure=m.geometry, p=m.p, kind=m.kind, norm=m.ball, christoffel=m.christoffel, eps=m.eps)
    if m.metric:
        kw["metric"] = m.metric
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        a = hs.sharpness(model, b, m, rho=0.05, n_iters=4, n_samples=3, progress=False)
        by_name = hs.sharpness(model, b, m.name, eps=m.eps or None, rho=0.05, n_iters=4, n_samples=3,
                               progress=False)
        c = hs.sharpness(model, b, rho=0.05, n_iters=4, n_samples=3, progress=False, **kw)
    assert a.measure == by_name.measure == c.measure == m
    assert a.name == m.name and a.config["measure"] == m.geometry and a.config["eps"] == m.eps
    assert a.per_batch == by_name.per_batch == c.per_batch


def test_adaptive_with_a_metric_is_an_error_not_ignored(mha_model, mha_data):
    with pytest.raises(ValueError, match="no metric"):
        hs.sharpness(mha_model, mha_data, measure="adaptive", metric="mixed", rho=0.1, progress=False)
