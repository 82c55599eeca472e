"""The metric registry and the solver protocol (hideseek/geometry/metrics.py, protocol.py).

A metric registered with one line reaches every reader of the registry — ``Measure``, the
CLI's ``--metric``, :func:`hideseek.reference.pair_metric_tensor`, ``PairGeometry`` — and
a run of :func:`hideseek.sharpness` with it; bad registrations fail in one line.
"""
from __future__ import annotations

import pytest
import torch

import hideseek as hs
from hideseek.geometry import (METRICS, InvariantMetric, MixedMetric, PairGeometry, PairMetric, ProductGeometry,
                               SolverGeometry, get_metric, metric_names, register_metric)
from hideseek.geometry.metrics import gram
from hideseek.reference import pair_metric_tensor
from hideseek.symmetries import find_symmetries

from tests.models import MHAClassifier


class ScaledInvariant(PairMetric):
    """Twice the invariant metric, by its blocks only (a new metric as a user writes it)."""

    name = "scaled_invariant"

    @classmethod
    def blocks(cls, G, H, eps=0.0):
        _, _, SGt, SHt = gram(G, H, eps)
        return 2 * torch.linalg.inv(SGt), 2 * torch.linalg.inv(SHt)


@pytest.fixture
def registered(monkeypatch):
    """ScaledInvariant in the registry for one test (removed afterwards)."""
    monkeypatch.setitem(METRICS, ScaledInvariant.name, ScaledInvariant)
    return ScaledInvariant


def test_the_registry_holds_the_paper_metrics():
    assert METRICS["invariant"] is InvariantMetric and METRICS["mixed"] is MixedMetric
    assert metric_names()[:2] == ("invariant", "mixed")
    assert get_metric("mixed") is MixedMetric and get_metric(InvariantMetric) is InvariantMetric


def test_bad_registrations_and_names_fail_in_one_line():
    with pytest.raises(ValueError, match="already registered"):
        class Other(PairMetric):
            name = "invariant"
        register_metric(Other)
    with pytest.raises(TypeError, match="PairMetric subclass with a name"):
        register_metric(object)
    with pytest.raises(ValueError, match="metric must be one of"):
        get_metric("riemann")
    with pytest.raises(ValueError, match="metric must be one of"):
        PairGeometry(torch.randn(2, 3, 2), torch.randn(2, 3, 2), "riemann")
    with pytest.raises(NotImplementedError, match="must define blocks"):
        class NoBlocks(PairMetric):
            name = "none"
        NoBlocks(torch.randn(2, 3, 2), torch.randn(2, 3, 2))


@pytest.mark.usefixtures("float64_default")
def test_pair_geometry_takes_a_name_a_class_or_an_instance():
    g = torch.Generator().manual_seed(0)
    G, H, xG, xH = [torch.randn(2, r, 3, generator=g) for r in (5, 4, 5, 4)]
    by_name = PairGeometry(G, H, "mixed", 0.01)
    by_class = PairGeometry(G, H, MixedMetric, 0.01)
    by_object = PairGeometry(G, H, MixedMetric(G, H, 0.01))
    for pg in (by_class, by_object):
        assert pg.metric == "mixed" and pg.eps == 0.01
        for a, b in zip(pg.project(xG, xH), by_name.project(xG, xH)):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="same"):
        PairGeometry(G + 1, H, MixedMetric(G, H))


@pytest.mark.usefixtures("float64_default")
def test_a_registered_metric_reaches_every_reader(registered):
    import hideseek.cli as cli

    m = hs.Measure(metric="scaled_invariant")
    assert m.name == "geodesic_scaled_invariant" and hs.Measure.parse(m.name) == m
    assert hs.Measure(metric=ScaledInvariant).metric == "scaled_invariant"
    args = cli._parser().parse_args(["sharpness", "--data", "d.pt", "--rho", "0.1", "--metric", "scaled_invariant"])
    assert args.metric == "scaled_invariant"
    # the reference's dense metric tensor is twice the invariant one
    theta = torch.randn(3 * 2 + 4 * 2, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(pair_metric_tensor(theta, 3, 4, 2, "scaled_invariant"),
                               2 * pair_metric_tensor(theta, 3, 4, 2, "invariant"), rtol=1e-12, atol=0)
    # the generic projection equals the invariant one (scaling a metric keeps its orthogonality)
    g = torch.Generator().manual_seed(2)
    G, H, xG, xH = [torch.randn(2, r, 3, generator=g) for r in (5, 4, 5, 4)]
    for a, b in zip(PairGeometry(G, H, "scaled_invariant").project(xG, xH),
                    PairGeometry(G, H, "invariant").project(xG, xH)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # and a sharpness run over the pairs alone: the scaled metric's radius √2 ρ is the
    # invariant metric's ρ (same geodesics, same directions)
    model = MHAClassifier()
    owned = {n for b in find_symmetries(model) for n in b.param_names}
    for n, t in model.named_parameters():
        t.requires_grad_(n in owned)
    gen = torch.Generator().manual_seed(3)
    batch = (torch.randn(5, 4, 12, generator=gen), torch.randint(0, 3, (5,), generator=gen))
    a = hs.sharpness(model, [batch], hs.Measure(metric="scaled_invariant"), rho=0.05 * 2 ** 0.5, n_iters=3)
    b = hs.sharpness(model, [batch], hs.Measure(metric="invariant"), rho=0.05, n_iters=3)
    assert a.value > 0 and a.value == pytest.approx(b.value, rel=1e-8, abs=1e-12)


def test_product_geometry_is_a_solver_geometry():
    model = MHAClassifier()
    params = {n: t.detach() for n, t in model.named_parameters()}
    for p in ("l2", "linf"):
        assert isinstance(ProductGeometry(params, (), p=p), SolverGeometry)
    assert not isinstance(object(), SolverGeometry)


@pytest.mark.usefixtures("float64_default")
def test_the_adding_a_metric_recipe_of_the_architecture_doc_works(monkeypatch):
    """docs/architecture.md, "Adding a metric": its code block, run as written (the registry
    restored afterwards), registers a metric that Measure knows and whose generic projection
    is horizontal and whose generic Christoffel contraction matches the reference."""
    import re
    from pathlib import Path

    from hideseek.reference import christoffel_contraction

    text = (Path(__file__).resolve().parents[3] / "docs" / "architecture.md").read_text()
    section = text.split("### Adding a metric", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.setattr("hideseek.geometry.metrics.METRICS", dict(METRICS))
    import hideseek.geometry.metrics as metrics_module
    ns: dict = {}
    exec(compile(code, "architecture.md", "exec"), ns)
    cls = metrics_module.METRICS["blend"]
    assert hs.Measure(metric="blend").name == "geodesic_blend"
    g = torch.Generator().manual_seed(4)
    G, H, xG, xH = [torch.randn(2, r, 2, generator=g) for r in (4, 3, 4, 3)]
    pg = PairGeometry(G, H, cls)
    pG, pH = pg.project(xG, xH)
    assert float(pg.horizontal_residual(pG, pH).abs().max()) < 1e-10
    theta = torch.cat([G[0].reshape(-1), H[0].reshape(-1)])
    v = torch.cat([xG[0].reshape(-1), xH[0].reshape(-1)])
    ref = -christoffel_contraction(lambda th: pair_metric_tensor(th, 4, 3, 2, cls), theta, v)
    aG, aH = pg.acceleration(xG, xH)
    torch.testing.assert_close(torch.cat([aG[0].reshape(-1), aH[0].reshape(-1)]), ref, rtol=1e-9, atol=1e-12)
