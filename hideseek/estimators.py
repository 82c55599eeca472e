r"""Trace and eigenvalue estimators over any symmetric linear operator (as curvlinops does).

An *operator* is anything with ``shape`` ``(n, n)``, ``dtype``, ``device`` and

* ``matvec(v)``: ``A v`` for a tensor ``v`` of length ``n``;
* ``matmat(V)``: ``A V`` for an ``(n, k)`` tensor (its columns may share work);

(:class:`Operator`, a ``runtime_checkable`` protocol).  :class:`DenseOperator` is a matrix as one;
the symmetric form of the Riemannian Hessian, :meth:`hideseek.curvature.RiemannianHessian.whitened`,
is another.  The estimators below assume ``A`` symmetric and use nothing else of it:

* :func:`exact_trace`: ``Σ_i e_iᵀ A e_i``, ``n`` products (``block`` columns per :meth:`matmat`);
* :func:`hutchinson_trace`: the mean of ``zᵀ A z`` over Rademacher probes ``z`` (Hutchinson 1989);
* :func:`hutchpp_trace`: Hutch++ (Meyer et al. 2021): a third of the products sketch the top of the
  spectrum, a third take its trace exactly, a third run Hutchinson on the rest;
* :func:`lanczos_eigenvalues`: the extreme eigenvalues by Lanczos (SciPy's ``eigsh`` on
  :func:`to_scipy`).

Estimates come back as :class:`TraceEstimate` (value, standard error, products, method).
:data:`TRACE_ESTIMATORS` names the trace estimators (``"exact"``, ``"hutchinson"``,
``"hutch++"``).  SciPy is imported only by :func:`to_scipy` and :func:`lanczos_eigenvalues`.

>>> import torch
>>> A = DenseOperator(torch.diag(torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)))
>>> exact_trace(A).value
6.0
>>> hutchinson_trace(A, n_probes=4, seed=0).method
'hutchinson'
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch
from torch import Tensor

#: columns per :meth:`Operator.matmat` in :func:`exact_trace` by default
BLOCK = 16


@runtime_checkable
class Operator(Protocol):
    """A square linear operator on flat tensors (module docstring)."""

    shape: tuple[int, int]
    dtype: torch.dtype
    device: torch.device

    def matvec(self, v: Tensor) -> Tensor:
        """``A v`` (length ``n``)."""
        ...

    def matmat(self, V: Tensor) -> Tensor:
        """``A V`` for an ``(n, k)`` matrix."""
        ...


class DenseOperator:
    """A square matrix (a tensor or a NumPy array) as an :class:`Operator`."""

    def __init__(self, matrix) -> None:
        self.matrix = torch.as_tensor(matrix)
        if self.matrix.dim() != 2 or self.matrix.shape[0] != self.matrix.shape[1]:
            raise ValueError(f"DenseOperator takes a square matrix, got shape {tuple(self.matrix.shape)}")
        self.shape = (int(self.matrix.shape[0]), int(self.matrix.shape[1]))
        self.dtype, self.device = self.matrix.dtype, self.matrix.device

    def matvec(self, v: Tensor) -> Tensor:
        return self.matrix @ v

    def matmat(self, V: Tensor) -> Tensor:
        return self.matrix @ V


@dataclass(frozen=True)
class TraceEstimate:
    """A trace: ``value``, its standard error (0 for the exact trace), the number of
    Hessian-vector products it took and the method (``"exact"``, ``"hutchinson"``,
    ``"hutch++"``).

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False), torch.nn.Linear(2, 2, bias=False)).eval()
    >>> batch, mse = (torch.randn(16, 3), torch.randn(16, 2)), torch.nn.functional.mse_loss
    >>> H = hs.EuclideanHessian(model, [batch], loss_fn=mse)
    >>> t = H.trace()                                                 # exact: one product per dimension
    >>> t.method, t.n_matvecs, t.stderr
    ('exact', 10, 0.0)
    >>> abs(float(t) - torch.trace(H.dense()).item()) < 1e-5
    True
    >>> est = H.trace("hutchinson", n_probes=200, seed=0)             # an estimate with its standard error
    >>> abs(est.value - t.value) < 4 * est.stderr
    True
    """

    value: float
    stderr: float
    n_matvecs: int
    method: str

    def __float__(self) -> float:
        return self.value


def _dim(op: Operator) -> int:
    n, m = op.shape
    if n != m:
        raise ValueError(f"the estimators need a square operator, got shape {tuple(op.shape)}")
    return int(n)


def to_scipy(op: Operator):
    """A ``scipy.sparse.linalg.LinearOperator`` (float64, shape ``(n, n)``) of a symmetric
    operator (``rmatvec`` is ``matvec``).  Needs SciPy (imported here)."""
    try:
        from scipy.sparse.linalg import LinearOperator
    except ImportError as err:   # pragma: no cover
        raise ImportError("to_scipy needs SciPy: pip install scipy") from err
    import numpy as np

    n = _dim(op)

    def mv(v):
        w = torch.as_tensor(np.asarray(v, dtype=np.float64).reshape(-1), device=op.device).to(op.dtype)
        return op.matvec(w).detach().to("cpu", torch.float64).numpy()

    def mm(V):
        W = torch.as_tensor(np.asarray(V, dtype=np.float64), device=op.device).to(op.dtype)
        return op.matmat(W.reshape(n, -1)).detach().to("cpu", torch.float64).numpy()

    return LinearOperator((n, n), matvec=mv, rmatvec=mv, matmat=mm, rmatmat=mm, dtype=np.float64)


def exact_trace(op: Operator, block: int = BLOCK) -> TraceEstimate:
    """``Σ_i e_iᵀ A e_i`` over the standard basis, ``block`` columns per :meth:`~Operator.matmat`
    (``n`` products; standard error 0)."""
    n = _dim(op)
    total = 0.0
    for s in range(0, n, block):
        cols = torch.arange(s, min(s + block, n), device=op.device)
        U = torch.zeros(n, len(cols), dtype=op.dtype, device=op.device)
        U[cols, torch.arange(len(cols), device=op.device)] = 1.0
        total += float(op.matmat(U)[cols, torch.arange(len(cols), device=op.device)].sum())
    return TraceEstimate(total, 0.0, n, "exact")


def _check_probes(n_probes, method: str, least: int) -> None:
    if isinstance(n_probes, bool) or not isinstance(n_probes, int) or n_probes < least:
        raise ValueError(f"n_probes must be an integer >= {least} for {method}, got {n_probes!r}")


def _rademacher(op: Operator, gen: torch.Generator) -> Callable[[int], Tensor]:
    n = _dim(op)

    def draw(k: int) -> Tensor:
        r = torch.randint(0, 2, (n, k), generator=gen, dtype=torch.int64)
        return (2 * r - 1).to(op.dtype).to(op.device)

    return draw


def hutchinson_trace(op: Operator, n_probes: int = 99, seed: int = 0) -> TraceEstimate:
    """The mean of ``zᵀ A z`` over ``n_probes`` Rademacher probes (one :meth:`~Operator.matmat`
    of all of them), its standard error the probes' sample standard deviation over
    ``√n_probes``."""
    _check_probes(n_probes, "hutchinson", 2)
    E = _rademacher(op, torch.Generator().manual_seed(int(seed)))(n_probes)
    vals = (E * op.matmat(E)).sum(0)
    return TraceEstimate(float(vals.mean()), float(vals.std(unbiased=True)) / math.sqrt(n_probes),
                         n_probes, "hutchinson")


def hutchpp_trace(op: Operator, n_probes: int = 99, seed: int = 0) -> TraceEstimate:
    """Hutch++ (Meyer et al. 2021) with ``n_probes`` products in all: ``k = n_probes // 3``
    sketch ``Q = orth(A S)``, ``k`` give ``tr(Qᵀ A Q)`` exactly, the other ``n_probes − 2k``
    run Hutchinson on ``(I − QQᵀ) A (I − QQᵀ)``; the standard error is that of the Hutchinson
    part."""
    _check_probes(n_probes, "hutch++", 3)
    rademacher = _rademacher(op, torch.Generator().manual_seed(int(seed)))
    k = n_probes // 3
    r = n_probes - 2 * k               # Hutchinson probes on the rest (≥ k)
    S = rademacher(k)
    Q, _ = torch.linalg.qr(op.matmat(S))
    top = float(torch.trace(Q.T @ op.matmat(Q)))
    E = rademacher(r)
    E = E - Q @ (Q.T @ E)
    vals = (E * op.matmat(E)).sum(0)
    se = float(vals.std(unbiased=True)) / math.sqrt(r) if r > 1 else float("nan")
    return TraceEstimate(top + float(vals.mean()), se, 2 * k + r, "hutch++")


#: the trace estimators by name: ``estimator(op, n_probes=..., seed=...)`` (exact: ``block=``)
TRACE_ESTIMATORS: dict[str, Callable[..., TraceEstimate]] = {
    "exact": exact_trace, "hutchinson": hutchinson_trace, "hutch++": hutchpp_trace}


def lanczos_eigenvalues(op: Operator, k: int = 1, which: str = "LA", tol: float = 0.0, seed: int = 0):
    """The ``k`` eigenvalues of largest value (``which="LA"``; ``"SA"`` smallest, ``"LM"``
    largest magnitude) by Lanczos (``scipy.sparse.linalg.eigsh`` on :func:`to_scipy`, start
    vector standard normal from ``seed``), in descending order (NumPy)."""
    import numpy as np
    from scipy.sparse.linalg import eigsh

    n = _dim(op)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k < n:
        raise ValueError(f"k must be an integer with 1 <= k < dim = {n}, got {k!r}")
    v0 = np.random.default_rng(seed).standard_normal(n)
    vals = eigsh(to_scipy(op), k=k, which=which, tol=tol, v0=v0, return_eigenvectors=False)
    return np.sort(vals)[::-1]


__all__ = ["BLOCK", "DenseOperator", "Operator", "TRACE_ESTIMATORS", "TraceEstimate", "exact_trace",
           "hutchinson_trace", "hutchpp_trace", "lanczos_eigenvalues", "to_scipy"]
