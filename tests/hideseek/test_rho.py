"""hideseek.rho: suggest_rho's two rules checked by independent sharpness calls around the
suggested radius; warnings at large ρ whose advice works; saturation."""
import warnings

import pytest
import torch

import hideseek as hs
from hideseek import SharpnessInputError

from tests.models import MHAClassifier


@pytest.fixture(scope="module")
def setup():
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(6, 5, 12, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g))]
    return MHAClassifier(), data


def quiet_sharpness(model, data, measure, rho, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hs.sharpness(model, data, measure, rho=rho, n_iters=5, progress=False, **kw)


@pytest.mark.parametrize("measure", ["geodesic", "geodesic_mixed", "m_apgd_l2"])
def test_loss_rule_brackets_the_target_loss_increase(setup, measure):
    model, data = setup
    s = hs.suggest_rho(model, data, measure, increase=0.1)
    base = quiet_sharpness(model, data, measure, s.rho).base_losses[0]
    assert s.rule == "loss" and s.target == pytest.approx(0.1 * base)
    below = quiet_sharpness(model, data, measure, s.rho / 1.5).value
    above = quiet_sharpness(model, data, measure, s.rho * 1.5).value
    assert below < s.target < above
    assert s.achieved == pytest.approx(quiet_sharpness(model, data, measure, s.rho).value)
    assert len(s.trace) >= 9


def test_correction_rule_is_the_largest_rho_below_the_bound(setup):
    model, data = setup
    s = hs.suggest_rho(model, data, "geodesic_mixed", rule="correction", bound=0.2)
    at = max(quiet_sharpness(model, data, "geodesic_mixed", s.rho).correction_ratio)
    over = max(quiet_sharpness(model, data, "geodesic_mixed", s.rho * 1.5).correction_ratio)
    assert at < 0.2 < over
    with warnings.catch_warnings():
        warnings.simplefilter("error")     # at the suggested rho with the default bound: no warning
        hs.sharpness(model, data, "geodesic_mixed", rho=hs.suggest_rho(model, data, "geodesic_mixed",
                     rule="correction").rho, n_iters=5, progress=False)


def test_bad_rules_refused(setup):
    model, data = setup
    with pytest.raises(ValueError, match="rule must be 'loss' or 'correction'"):
        hs.suggest_rho(model, data, rule="size")
    with pytest.raises(ValueError, match="rule='correction' needs a geodesic measure with second-order steps"):
        hs.suggest_rho(model, data, "m_apgd_l2", rule="correction")
    with pytest.raises(ValueError, match="increase must be a positive number"):
        hs.suggest_rho(model, data, increase=0)


def test_large_correction_advice_works(setup):
    """The warning's advice runs on this model: suggest_rho, and step='exact' (the
    integrated geodesic, any h since issue 26)."""
    model, data = setup
    with pytest.warns(RuntimeWarning, match=r"correction is large .*hs.suggest_rho.*--rho auto") as rec:
        hs.sharpness(model, data, "geodesic_mixed", rho=50.0, n_iters=3, progress=False)
    assert any("step='exact'" in str(w.message) for w in rec)
    assert hs.suggest_rho(model, data, "geodesic_mixed", rule="correction").rho < 50.0


def test_saturation_warns(setup):
    model, data = setup
    with pytest.warns(RuntimeWarning, match=r"rho=1000000.0 is so large that the measure saturates"):
        hs.sharpness(model, data, "m_apgd_l2", rho=1e6, n_iters=3, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hs.sharpness(model, data, "m_apgd_l2", rho=0.05, n_iters=3, progress=False)


def test_zero_loss_cannot_use_the_loss_rule():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2)).double().eval()
    x = torch.randn(4, 2, dtype=torch.float64)
    with pytest.raises(SharpnessInputError, match="needs a positive loss"):
        hs.suggest_rho(model, [(x, x)], "m_apgd_l2", loss_fn=lambda out, y: (out * 0).sum())
