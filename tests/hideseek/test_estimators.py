"""The trace and eigenvalue estimators on plain dense symmetric matrices, against NumPy: the
exact trace to rounding, Hutchinson and Hutch++ unbiased with honest standard errors, Hutch++
exact on low rank, Lanczos' extreme eigenvalues against numpy.linalg.eigvalsh."""
import numpy as np
import pytest
import torch

from hideseek.estimators import (TRACE_ESTIMATORS, DenseOperator, Operator, exact_trace, hutchinson_trace,
                                 hutchpp_trace, lanczos_eigenvalues, to_scipy)


def _symmetric(n=40, seed=0, spectrum=None):
    rng = np.random.default_rng(seed)
    Q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    lam = rng.standard_normal(n) * 3 if spectrum is None else np.asarray(spectrum, dtype=float)
    return (Q * lam) @ Q.T


def test_dense_operator_is_an_operator_and_exact_trace_is_numpys():
    A = _symmetric()
    op = DenseOperator(torch.from_numpy(A))
    assert isinstance(op, Operator) and op.shape == (40, 40)
    for block in (1, 7, 16, 40):
        est = exact_trace(op, block=block)
        assert est.value == pytest.approx(np.trace(A), rel=1e-12, abs=1e-12)
        assert est.stderr == 0.0 and est.n_matvecs == 40 and est.method == "exact"
    assert set(TRACE_ESTIMATORS) == {"exact", "hutchinson", "hutch++"}
    S = to_scipy(op)
    v = np.random.default_rng(1).standard_normal(40)
    np.testing.assert_allclose(S.matvec(v), A @ v, rtol=1e-12)
    with pytest.raises(ValueError, match="square matrix"):
        DenseOperator(torch.zeros(3, 4))


@pytest.mark.parametrize("estimator,n_probes", [(hutchinson_trace, 30), (hutchpp_trace, 30)])
def test_stochastic_traces_are_unbiased_with_honest_standard_errors(estimator, n_probes):
    """Over 200 seeds: the mean estimate is within 4 standard errors of the mean of the true trace,
    and the stated standard error covers the error about as often as a normal one would
    (|error| <= stderr for roughly 68 % of seeds, <= 3 stderr for nearly all)."""
    A = _symmetric(n=30, seed=2)
    op = DenseOperator(torch.from_numpy(A))
    est = [estimator(op, n_probes=n_probes, seed=s) for s in range(200)]
    vals = np.array([e.value for e in est])
    ses = np.array([e.stderr for e in est])
    err = vals - np.trace(A)
    assert abs(err.mean()) < 4 * vals.std(ddof=1) / np.sqrt(len(vals))
    within = np.mean(np.abs(err) <= ses)
    assert 0.5 < within < 0.85
    assert np.mean(np.abs(err) <= 3 * ses) > 0.95
    assert all(e.n_matvecs == n_probes for e in est)


def test_hutchpp_is_exact_on_low_rank_and_beats_hutchinson_on_a_decaying_spectrum():
    low = _symmetric(n=50, seed=3, spectrum=[5.0, -3.0, 2.0] + [0.0] * 47)     # rank 3 <= k = 10
    e = hutchpp_trace(DenseOperator(torch.from_numpy(low)), n_probes=30, seed=0)
    assert e.value == pytest.approx(np.trace(low), abs=1e-10) and e.stderr < 1e-10
    decay = _symmetric(n=50, seed=4, spectrum=1.0 / np.arange(1, 51) ** 2)
    op = DenseOperator(torch.from_numpy(decay))
    err = {f: np.mean([abs(f(op, n_probes=30, seed=s).value - np.trace(decay)) for s in range(50)])
           for f in (hutchinson_trace, hutchpp_trace)}
    assert err[hutchpp_trace] < 0.5 * err[hutchinson_trace]


def test_lanczos_extreme_eigenvalues_are_numpys():
    A = _symmetric(n=60, seed=5)
    op = DenseOperator(torch.from_numpy(A))
    ref = np.linalg.eigvalsh(A)
    np.testing.assert_allclose(lanczos_eigenvalues(op, 3), ref[::-1][:3], rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(lanczos_eigenvalues(op, 2, which="SA"), ref[:2][::-1], rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="1 <= k < dim = 60"):
        lanczos_eigenvalues(op, 60)
    with pytest.raises(ValueError, match="n_probes must be an integer >= 3 for hutch"):
        hutchpp_trace(op, n_probes=2)
