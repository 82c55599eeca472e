r"""The Riemannian Hessian of the loss on the quotient, as a linear operator (docs/maths.md §14).

>>> H = hs.RiemannianHessian(model, batches, hs.Measure(metric="mixed"))      # doctest: +SKIP
>>> H.trace()                    # exact: one product per dimension (small models)  # doctest: +SKIP
>>> H.trace("hutch++", n_probes=99, seed=0)      # estimate and standard error  # doctest: +SKIP
>>> H.eigenvalues(3)             # the top 3, Lanczos (scipy's eigsh)             # doctest: +SKIP
>>> hs.EuclideanHessian(model, batches).trace()  # the plain Hessian, same code   # doctest: +SKIP

The loss is ``f(θ) = (1/N) Σ_b L_b(θ)``, the mean over the ``N`` batches of each batch's
loss.  The operator lives on the perturbation space of a measure
(:class:`~hideseek.geometry.space.ProductGeometry`): the GL(h) pairs with a registered
metric (:mod:`hideseek.geometry.metrics`: invariant, mixed, …) and horizontal tangent vectors, every other parameter with the adaptive metric
``Σ ξ_i² / θ_i²`` (``geometry="geodesic"`` or ``"adaptive"``) or the plain one
(``geometry="euclidean"``: then the operator *is* the Euclidean Hessian).  At a tangent
vector ξ (§14)::

    lift(Hess f[ξ]) = P^h( g⁻¹ ∇²f ξ + (D_ξ g⁻¹) ∇f + Γ(ξ, g⁻¹ ∇f) )

one Euclidean Hessian-vector product (double backward through the loss, in the tangent
coordinates of the geometry), the derivative of the inverse metric along ξ (forward-mode
autograd of the metric object's definition, ``blocks``), the connection term (the metric
object's Christoffel contraction, polarised:
``Γ(ξ, V) = ½ (Γ(ξ+V, ξ+V) − Γ(ξ, ξ) − Γ(V, V))``) and the horizontal projection.  The input
is projected onto the horizontal space first, so vertical directions map to 0 and the
operator is self-adjoint in ``g`` on the whole tangent space.

Layouts.  A tangent vector is the geometry's list of tensors (``[ξ_G, ξ_H]`` per stack of
pairs of one shape, ``(B, n, h)`` and ``(B, m, h)``, then one tensor per free parameter, in
:attr:`RiemannianHessian.layout` order), or a flat vector: the same tensors flattened
row-major and concatenated in that order (:meth:`RiemannianHessian.flatten`,
:meth:`RiemannianHessian.unflatten`).  :meth:`RiemannianHessian.to_scipy` works in
metric-whitened coordinates ``w = g^{1/2} ξ`` (flat), where the operator is a symmetric
matrix ``A = g^{1/2} Hess g^{-1/2}`` whose non-zero eigenvalues are the Hessian's and whose
trace is its trace; the vertical directions give ``dim V`` extra zero eigenvalues.
The same form is an operator of :mod:`hideseek.estimators` (:meth:`RiemannianHessian.whitened`:
``shape``, ``matvec``, ``matmat``, ``to_scipy``), whose trace and eigenvalue estimators (exact,
Hutchinson, Hutch++, Lanczos) take any such operator; :meth:`RiemannianHessian.trace` and
:meth:`RiemannianHessian.eigenvalues` call them.

What the operator depends on: the measure's geometry, metric and ε only (not its step, ball
radius, ℓ2/ℓ∞ or kind).  Refused in one line: ``ball="adaptive"`` (the Christoffel-only
ablation has no metric on the pairs) and, at ε > 0, a metric whose ε only regularises
inverses (``eps_exact = False``, the mixed metric: its relaxed gradient is not the dual of
any metric, docs/maths.md §2.1).  At ε > 0 the invariant metric is a true
metric but not GL(h)-invariant: the operator is then the Hessian on its horizontal
distribution, not on a quotient.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

from .estimators import TRACE_ESTIMATORS, TraceEstimate, exact_trace, lanczos_eigenvalues, to_scipy
from .geometry.free import FreePart
from .geometry.gl import PairGeometry
from .geometry.metrics import get_metric
from .geometry.space import ProductGeometry
from .measures import Measure
from .symmetries.base import SymmetryBlock

Tangent = list[Tensor]
#: largest dimension for which :meth:`RiemannianHessian.trace` (exact) and
#: :meth:`RiemannianHessian.dense` run by default (one product per dimension)
EXACT_MAX_DIM = 20_000
TRACE_METHODS = tuple(TRACE_ESTIMATORS)
#: products that share one vectorised backward pass by default (``chunk=None``) on spaces of
#: at most :data:`CHUNK_MAX_DIM` dimensions, where the per-product overhead dominates; above
#: it one at a time (batching then costs memory and, on CPUs, time: ``reports/benchmarks.md``)
CHUNK, CHUNK_MAX_DIM = 16, 10_000


# ---------------------------------------------------------------------------- set-up
def _set_up(model, batches, measure: Measure, *, loss_fn, pairs, on_unsupported, exclude, checks):
    """The checked model, batches and geometry from the one engine of
    :func:`hideseek.sharpness` (:class:`hideseek.problem.SharpnessProblem`: its input
    checks, loss closure, set-up pass and symmetry discovery; nothing is duplicated here),
    in one process."""
    from .problem import SharpnessProblem

    problem = SharpnessProblem(model, batches, measure, loss_fn=loss_fn, pairs=pairs, on_unsupported=on_unsupported,
                               exclude=exclude, checks=checks, progress=False, distributed=False).set_up()
    problem.drop_start()              # the set-up pass's gradient is not needed here
    return problem


def _hessian_measure(measure) -> Measure:
    """The measure whose geometry the Hessian lives in, with the straight step (the point
    map ``ξ ↦ θ + ξ`` is then linear, so derivatives in ξ are derivatives in θ)."""
    m = Measure.parse(measure) if isinstance(measure, str) else measure
    if not isinstance(m, Measure):
        raise TypeError(f"measure must be a hs.Measure or its name, got {type(measure).__name__}")
    if m.has_pairs:
        if m.ball != "riemannian":
            raise ValueError("RiemannianHessian: ball='adaptive' (the Christoffel-only ablation) puts no metric "
                             "on the pairs; use ball='riemannian' (the default) or geometry='adaptive'")
        if m.eps != 0.0 and not get_metric(m.metric).eps_exact:
            raise ValueError(f"RiemannianHessian: the {m.metric} metric at eps > 0 is not the geometry of any metric "
                             "(its ε only regularises inverses, docs/maths.md §2.1), so it has no Hessian; use eps=0 "
                             "or a metric whose relaxation is exact (invariant)")
        return m.replace(step="straight", kind="worst")
    return m.replace(p="l2", kind="worst")


# ---------------------------------------------------------------------------- parts
class _PairOps:
    """Inverse metric, its derivative, the connection and ``g^{±1/2}`` of one stack of pairs,
    from its metric object (:class:`~hideseek.geometry.metrics.PairMetric`): any registered
    metric, no branch on its name."""

    def __init__(self, pg: PairGeometry) -> None:
        self.pg, self.metric = pg, pg.impl
        MG, MH = self.metric.mats()
        self.sqrt = (_spd_power(MG, 0.5), _spd_power(MH, 0.5))
        self.isqrt = (_spd_power(MG, -0.5), _spd_power(MH, -0.5))

    def inv_metric(self, gG: Tensor, gH: Tensor) -> tuple[Tensor, Tensor]:
        """``g⁻¹∇ = (∇_G M_G⁻¹, ∇_H M_H⁻¹)``: the metric's dual (not projected)."""
        return self.metric.dual(gG, gH)

    def d_inv_metric(self, xG: Tensor, xH: Tensor, vG: Tensor, vH: Tensor) -> tuple[Tensor, Tensor]:
        """``(D_ξ g⁻¹)∇ = −(V_G Ṁ_G M_G⁻¹, V_H Ṁ_H M_H⁻¹)`` with ``V = g⁻¹∇`` and
        ``Ṁ = D M[ξ]`` the derivative of the metric's definition
        (:meth:`~hideseek.geometry.metrics.PairMetric.blocks`) along ξ, by forward-mode
        autograd (invariant: ``(∇_G Ṡ_G, ∇_H Ṡ_H)``; mixed:
        ``(−∇_G S_H⁻¹Ṡ_H S_H⁻¹, −∇_H S_G⁻¹Ṡ_G S_G⁻¹)``, ``Ṡ = ξᵀX + Xᵀξ``)."""
        m, pg = self.metric, self.pg
        _, (dMG, dMH) = torch.func.jvp(lambda G, H: type(m).blocks(G, H, m.eps), (pg.G, pg.H), (xG, xH))
        rG, rH = m.dual(vG @ dMG, vH @ dMH)
        return -rG, -rH

    def connection(self, xG, xH, vG, vH, acc_v) -> tuple[Tensor, Tensor]:
        """``Γ(ξ, V)`` by polarisation of ``Γ(ξ, ξ) = −acceleration(ξ)``; ``acc_v`` is
        ``acceleration(V)``, computed once."""
        m = self.metric
        sG, sH = m.acceleration(xG + vG, xH + vH)
        aG, aH = m.acceleration(xG, xH)
        return -0.5 * (sG - aG - acc_v[0]), -0.5 * (sH - aH - acc_v[1])


def _spd_power(M: Tensor, p: float) -> Tensor:
    w, U = torch.linalg.eigh(M.double())
    return ((U * w.pow(p).unsqueeze(-2)) @ U.transpose(-1, -2)).to(M.dtype)


def _twice_differentiable():
    """Scaled-dot-product attention through its plain-math kernel: the fused kernels (flash,
    memory-efficient) have no double backward."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:   # pragma: no cover (older torch)
        import contextlib

        return contextlib.nullcontext()
    return sdpa_kernel(SDPBackend.MATH)


# ---------------------------------------------------------------------------- the tangent space
class TangentMetric:
    """The tangent space of a :class:`RiemannianHessian` at θ and its metric ``g``: the layout of a
    tangent vector (list ↔ flat), the inverse metric, the inner product, whitening ``g^{±1/2}``
    and the metric's terms of the covariant derivative (docs/maths.md §14) — the pairs' from
    their metric objects (:class:`_PairOps`), the free parameters' from their free part
    (:class:`~hideseek.geometry.free.FreePart`).  No autograd through the loss happens here."""

    def __init__(self, geometry: ProductGeometry) -> None:
        self.pair_ops = [_PairOps(pg) for pg in geometry.pairs]
        self.free: FreePart = geometry.adaptive
        self.dtype, self.device = geometry.dtype, geometry.device
        zeros = geometry.zeros()
        self.shapes = [t.shape for t in zeros]
        self.dim = sum(t.numel() for t in zeros)

    # ------------------------------------------------------------------ layout
    @property
    def layout(self) -> list[tuple[str, tuple[int, ...]]]:
        """:attr:`RiemannianHessian.layout`."""
        out = []
        for i in range(len(self.pair_ops)):
            out += [(f"pairs[{i}].G", tuple(self.shapes[2 * i])), (f"pairs[{i}].H", tuple(self.shapes[2 * i + 1]))]
        out += [(n, tuple(s)) for n, s in zip(self.free.names, self.shapes[2 * len(self.pair_ops):])]
        return out

    def flatten(self, x: Sequence[Tensor]) -> Tensor:
        """The flat vector (length :attr:`dim`) of a tangent list."""
        return torch.cat([t.reshape(-1) for t in x]) if len(x) else torch.zeros(0, dtype=self.dtype)

    def unflatten(self, v) -> Tangent:
        """The tangent list of a flat vector (a tensor or a NumPy array)."""
        v = torch.as_tensor(v, dtype=self.dtype, device=self.device).reshape(-1)
        if v.numel() != self.dim:
            raise ValueError(f"a flat tangent vector has {self.dim} entries (RiemannianHessian.layout), got {v.numel()}")
        out, start = [], 0
        for s in self.shapes:
            n = math.prod(s)
            out.append(v[start:start + n].reshape(s))
            start += n
        return out

    def as_list(self, x) -> tuple[Tangent, bool]:
        """``(tangent list, whether x was flat)`` of ``x`` in either layout (checked)."""
        if isinstance(x, (list, tuple)):
            if len(x) != len(self.shapes) or any(t.shape != s for t, s in zip(x, self.shapes)):
                raise ValueError("a tangent list must match RiemannianHessian.layout: shapes "
                                 f"{[tuple(s) for s in self.shapes]}, got {[tuple(t.shape) for t in x]}")
            return [t.to(self.dtype) for t in x], False
        return self.unflatten(x), True

    def split(self, x: Tangent) -> tuple[list[tuple[Tensor, Tensor]], Tangent]:
        """``([(ξ_G, ξ_H) per stack], free tensors)``."""
        k = len(self.pair_ops)
        return [(x[2 * i], x[2 * i + 1]) for i in range(k)], list(x[2 * k:])

    # ------------------------------------------------------------------ metric
    def inv_metric(self, g: Tangent) -> Tangent:
        """``g⁻¹∇``: the metric dual of a Euclidean gradient (not projected)."""
        pairs, free = self.split(g)
        out = []
        for ops, (gG, gH) in zip(self.pair_ops, pairs):
            out += list(ops.inv_metric(gG, gH))
        return out + self.free.inv_metric(free)

    def inner(self, x: Tangent, y: Tangent) -> Tensor:
        """``⟨x, y⟩_g`` at θ (a scalar)."""
        pairs_x, free_x = self.split(x)
        pairs_y, free_y = self.split(y)
        total = torch.zeros((), dtype=self.dtype, device=self.device)
        for ops, (xG, xH), (yG, yH) in zip(self.pair_ops, pairs_x, pairs_y):
            total = total + ops.pg.inner(xG, xH, yG, yH).sum()
        for term in self.free.inner_terms(free_x, free_y):
            total = total + term
        return total

    def to_whitened(self, x: Tangent) -> Tangent:
        """``w = g^{1/2} ξ`` (list layout); zero where a free parameter is exactly 0."""
        pairs, free = self.split(x)
        out = []
        for ops, (xG, xH) in zip(self.pair_ops, pairs):
            out += [xG @ ops.sqrt[0], xH @ ops.sqrt[1]]
        return out + self.free.whiten(free)

    def from_whitened(self, w: Tangent) -> Tangent:
        """``ξ = g^{-1/2} w`` (list layout)."""
        pairs, free = self.split(w)
        out = []
        for ops, (wG, wH) in zip(self.pair_ops, pairs):
            out += [wG @ ops.isqrt[0], wH @ ops.isqrt[1]]
        return out + self.free.unwhiten(free)

    def accelerations(self, V: Tangent) -> list[tuple[Tensor, Tensor]]:
        """The pairs' ``acceleration(V)`` (``−Γ(V, V)``), computed once per gradient field."""
        return [ops.metric.acceleration(V[2 * i], V[2 * i + 1]) for i, ops in enumerate(self.pair_ops)]

    def covariant(self, xi: Tangent, ehv: Tangent, egrad: Tangent, V: Tangent, accV) -> Tangent:
        """``g⁻¹∇²f ξ + (D_ξ g⁻¹)∇f + Γ(ξ, V)`` from the Euclidean Hessian-vector product
        ``ehv = ∇²f ξ``, the gradient ``egrad = ∇f``, ``V = g⁻¹∇f`` and ``accV`` =
        :meth:`accelerations` of ``V`` (no projection)."""
        hv = self.inv_metric(ehv)
        pairs_x, free_x = self.split(xi)
        _, free_g = self.split(egrad)
        pairs_v, _ = self.split(V)
        out: Tangent = []
        for i, ops in enumerate(self.pair_ops):
            (xG, xH), (vG, vH) = pairs_x[i], pairs_v[i]
            dG, dH = ops.d_inv_metric(xG, xH, vG, vH)
            cG, cH = ops.connection(xG, xH, vG, vH, accV[i])
            out += [hv[2 * i] + dG + cG, hv[2 * i + 1] + dH + cH]
        # the free part's own terms (its metric's derivative and connection: FreePart.hessian_terms)
        return out + self.free.hessian_terms(hv[2 * len(self.pair_ops):], free_x, free_g)


# ---------------------------------------------------------------------------- the operator
class RiemannianHessian:
    """The Riemannian Hessian of the mean loss on the quotient at the model's weights, as a
    linear operator on horizontal tangent vectors (module docstring, docs/maths.md §14).

    Parameters
    ----------
    model, batches, loss_fn, pairs, on_unsupported, exclude, checks:
        As for :func:`hideseek.sharpness` (the same checks, loss and symmetry discovery:
        :class:`hideseek.problem.SharpnessProblem`; one process).
        The loss is the mean over ``batches`` of each batch's loss.
    keep_graph:
        Keep each batch's gradient graph between products: a product is then one backward
        pass instead of a forward and two backward passes, at the memory of one graph per
        batch.  Values are the same either way.
    chunk:
        Products whose Hessian-vector products share one (vectorised) backward pass in
        :meth:`matmat`, :meth:`trace` and :meth:`dense`; ``None``: :data:`CHUNK` on spaces of
        at most :data:`CHUNK_MAX_DIM` dimensions, else 1.
    measure:
        A :class:`~hideseek.measures.Measure` or its name: its geometry (``"geodesic"``,
        ``"adaptive"``, ``"euclidean"``), metric and ε define the operator.

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False), torch.nn.Linear(2, 2, bias=False)).eval()
    >>> pair = hs.FactorPair("1.weight", "0.weight", transpose_h=True)    # W₁W₀ = G Hᵀ, G = W₁, H = W₀ᵀ
    >>> batch, mse = (torch.randn(16, 3), torch.randn(16, 2)), torch.nn.functional.mse_loss
    >>> trace = lambda: hs.RiemannianHessian(model, [batch], "geodesic_invariant", loss_fn=mse,
    ...                                      pairs=[pair]).trace().value     # exact: 10 products
    >>> euclid = lambda: hs.EuclideanHessian(model, [batch], loss_fn=mse).trace().value
    >>> before, before_e = trace(), euclid()
    >>> A = torch.tensor([[2.0, 1.0], [0.0, 0.5]])                  # a group element, applied by hand
    >>> with torch.no_grad():
    ...     _ = model[0].weight.copy_(A @ model[0].weight)
    ...     _ = model[1].weight.copy_(model[1].weight @ torch.linalg.inv(A))
    >>> abs(trace() - before) < 1e-4 * before                        # the Riemannian trace: invariant
    True
    >>> abs(euclid() - before_e) > 0.5 * before_e                     # the Euclidean one is not
    True
    """

    def __init__(self, model: nn.Module, batches: Iterable, measure: Measure | str = Measure(), *,
                 loss_fn: Callable | None = None, pairs: Sequence[SymmetryBlock] | None = None,
                 on_unsupported: str = "raise", exclude: Sequence[str] = (), checks: bool = True,
                 keep_graph: bool = False, chunk: int | None = None) -> None:
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"chunk must be a positive integer (products per backward pass) or None, got {chunk!r}")
        self._graphs: dict | None = {} if keep_graph else None
        self.measure = _hessian_measure(measure)
        problem = _set_up(model, batches, self.measure, loss_fn=loss_fn, pairs=pairs,
                          on_unsupported=on_unsupported, exclude=exclude, checks=checks)
        self.model, self.loss, self.blocks = problem.model, problem.loss, problem.blocks
        self.geometry: ProductGeometry = problem.geometry
        self.batches = [problem.batch(i) for i in range(len(problem.data))]
        #: the tangent space and its metric (layout, whitening, the metric's terms)
        self.space = TangentMetric(self.geometry)
        self.dtype, self.device = self.geometry.dtype, self.geometry.device
        self.shapes, self.dim = self.space.shapes, self.space.dim
        self.chunk = chunk if chunk is not None else (CHUNK if self.dim <= CHUNK_MAX_DIM else 1)
        # the Euclidean gradient in tangent coordinates and the gradient field V = g⁻¹∇f
        self.loss_value, self.egrad = self._value_and_grad()
        self._V = self.space.inv_metric(self.egrad)
        self._accV = self.space.accelerations(self._V)

    # ------------------------------------------------------------------ layout and metric
    @property
    def layout(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(label, shape)`` of each tensor of a tangent vector, in order: ``pairs[i].G`` /
        ``pairs[i].H`` for the i-th stack of pairs (``(B, n, h)`` / ``(B, m, h)``, the maths'
        ``(in, out)`` orientation, ``B`` over heads and layers), then the free parameters by
        name.  The flat layout concatenates them flattened row-major in this order."""
        return self.space.layout

    def flatten(self, x: Sequence[Tensor]) -> Tensor:
        """The flat vector (length :attr:`dim`) of a tangent list."""
        return self.space.flatten(x)

    def unflatten(self, v) -> Tangent:
        """The tangent list of a flat vector (a tensor or a NumPy array)."""
        return self.space.unflatten(v)

    def project(self, x: Tangent) -> Tangent:
        """The metric-orthogonal projection onto the horizontal space (and zero where a free
        parameter is exactly 0 under the adaptive metric)."""
        return self.geometry.project(list(x))

    def inner(self, x: Tangent, y: Tangent) -> Tensor:
        """The metric inner product ``⟨x, y⟩_g`` at θ (a scalar)."""
        return self.space.inner(x, y)

    def to_whitened(self, x: Tangent) -> Tangent:
        """``w = g^{1/2} ξ`` (list layout); zero where a free parameter is exactly 0."""
        return self.space.to_whitened(x)

    def from_whitened(self, w: Tangent) -> Tangent:
        """``ξ = g^{-1/2} w`` (list layout), the inverse of :meth:`to_whitened` off exact zeros."""
        return self.space.from_whitened(w)

    # ------------------------------------------------------------------ autograd
    def _batch_loss(self, z: Tangent, x, y) -> Tensor:
        return self.loss(self.geometry.point(z), x, y)

    def _value_and_grad(self) -> tuple[float, Tangent]:
        """``f(θ)`` and ``∇f`` in tangent coordinates (the mean over batches)."""
        total, grads = 0.0, None
        for i, (x, y) in enumerate(self.batches):
            z = [t.requires_grad_(True) for t in self.geometry.zeros()]
            with torch.enable_grad():
                loss = self.loss.checked(self.geometry.point(z), x, y, i)
                g = torch.autograd.grad(loss, z, allow_unused=True)
            g = [torch.zeros_like(t) if gi is None else gi for t, gi in zip(z, g)]
            total += float(loss.detach())
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        n = len(self.batches)
        return total / n, [g / n for g in grads]

    def _graph(self, b: int, x, y) -> tuple[Tangent, list[int], list[Tensor]]:
        """Batch ``b``'s gradient with its graph, ``(z, used, ∂L/∂z[used])`` (kept between
        products with ``keep_graph``)."""
        if self._graphs is not None and b in self._graphs:
            return self._graphs[b]
        z = [t.requires_grad_(True) for t in self.geometry.zeros()]
        with torch.enable_grad(), _twice_differentiable():
            loss = self._batch_loss(z, x, y)
            g = torch.autograd.grad(loss, z, create_graph=True, allow_unused=True)
        used = [i for i, gi in enumerate(g) if gi is not None and gi.requires_grad]
        out = (z, used, [g[i] for i in used])
        if self._graphs is not None:
            self._graphs[b] = out
        return out

    def euclidean_hvps(self, xis: Sequence[Tangent]) -> list[Tangent]:
        """``∇²f ξ`` in tangent coordinates (no metric, no projection) for each ξ of ``xis``:
        per batch one forward pass and a backward pass that keeps its graph (once, with
        ``keep_graph``), then one more backward pass for all of ``xis`` together
        (``is_grads_batched``; one at a time where an operation cannot be batched)."""
        k = len(xis)
        out = [[torch.zeros(s, dtype=self.dtype, device=self.device) for s in self.shapes] for _ in range(k)]
        keep = self._graphs is not None
        for b, (x, y) in enumerate(self.batches):
            z, used, g = self._graph(b, x, y)
            if not used:
                continue
            with torch.enable_grad(), _twice_differentiable():
                hvs = None
                if k > 1:
                    try:
                        hv = torch.autograd.grad(g, [z[i] for i in range(len(z))],
                                                 [torch.stack([xi[i] for xi in xis]) for i in used],
                                                 retain_graph=True, allow_unused=True, is_grads_batched=True)
                        hvs = [[None if h is None else h[j] for h in hv] for j in range(k)]
                    except RuntimeError:    # an operation without a batching rule
                        hvs = None
                if hvs is None:
                    hvs = [torch.autograd.grad(g, z, [xi[i] for i in used], retain_graph=keep or j < k - 1,
                                               allow_unused=True) for j, xi in enumerate(xis)]
            for acc, hv in zip(out, hvs):
                for t, h in zip(acc, hv):
                    if h is not None:
                        t.add_(h.detach())
        n = len(self.batches)
        return [[t / n for t in acc] for acc in out]

    def euclidean_hvp(self, xi: Tangent) -> Tangent:
        """``∇²f ξ`` in tangent coordinates (no metric, no projection)."""
        return self.euclidean_hvps([list(xi)])[0]

    # ------------------------------------------------------------------ the operator
    def covariant_derivative(self, xi: Tangent) -> Tangent:
        """``∇̄_ξ grad f̄ = g⁻¹∇²f ξ + (D_ξ g⁻¹)∇f + Γ(ξ, g⁻¹∇f)``: the total-space
        Riemannian Hessian applied to ξ, *without* any projection (list layout)."""
        return self._covariant(list(xi), self.euclidean_hvp(xi))

    def _covariant(self, xi: Tangent, ehv: Tangent) -> Tangent:
        return self.space.covariant(xi, ehv, self.egrad, self._V, self._accV)

    def matvec(self, x):
        """``lift(Hess f[P^h ξ])`` for ξ in the list or the flat layout (the result in the same
        layout)."""
        xs, flat = self.space.as_list(x)
        out = self.project(self.covariant_derivative(self.project(xs)))
        return self.flatten(out) if flat else out

    __call__ = matvec

    def _matvecs(self, xs: Sequence[Tangent]) -> list[Tangent]:
        """The operator on several tangent lists, their Hessian-vector products batched in
        chunks of :attr:`chunk`."""
        out = []
        for s in range(0, len(xs), self.chunk):
            ps = [self.project(x) for x in xs[s:s + self.chunk]]
            hvs = self.euclidean_hvps(ps)
            out += [self.project(self._covariant(p, hv)) for p, hv in zip(ps, hvs)]
        return out

    def matmat(self, X):
        """The operator applied to each column of a ``(dim, k)`` matrix (flat layout), or to
        each tangent list of a sequence; the Hessian-vector products of :attr:`chunk` columns
        share one backward pass."""
        if isinstance(X, (list, tuple)):
            return self._matvecs([self.space.as_list(x)[0] for x in X])
        X = torch.as_tensor(X, dtype=self.dtype, device=self.device)
        if X.dim() != 2 or X.shape[0] != self.dim:
            raise ValueError(f"matmat takes a ({self.dim}, k) matrix, got shape {tuple(X.shape)}")
        outs = self._matvecs([self.unflatten(X[:, j]) for j in range(X.shape[1])])
        return torch.stack([self.flatten(o) for o in outs], dim=1)

    def whitened_matvec(self, w: Tensor) -> Tensor:
        """``A w = g^{1/2} Hess(g^{-1/2} w)`` (flat): the symmetric form of the operator."""
        xs = self.from_whitened(self.unflatten(w))
        return self.flatten(self.to_whitened(self.matvec(xs)))

    def whitened_matmat(self, W: Tensor) -> Tensor:
        """``A W`` for a ``(dim, k)`` matrix of whitened coordinates (columns batched)."""
        outs = self._matvecs([self.from_whitened(self.unflatten(W[:, j])) for j in range(W.shape[1])])
        return torch.stack([self.flatten(self.to_whitened(o)) for o in outs], dim=1)

    def to_scipy(self):
        """A ``scipy.sparse.linalg.LinearOperator`` (float64, shape ``(dim, dim)``) of the
        symmetric form ``A = g^{1/2} Hess g^{-1/2}`` in whitened coordinates ``w = g^{1/2} ξ``
        (flat layout): same trace and non-zero eigenvalues as the Hessian, 0 on the vertical
        directions.  Needs SciPy (imported here; not a dependency of the library)."""
        return to_scipy(self.whitened())

    def whitened(self) -> "WhitenedHessian":
        """The symmetric form ``A`` of :meth:`to_scipy` as an operator of
        :mod:`hideseek.estimators` (torch in, torch out)."""
        return WhitenedHessian(self)

    @property
    def shape(self) -> tuple[int, int]:
        """``(dim, dim)``."""
        return (self.dim, self.dim)

    # ------------------------------------------------------------------ spectral
    def dense(self, max_dim: int = EXACT_MAX_DIM) -> Tensor:
        """The symmetric ``(dim, dim)`` matrix ``A`` of :meth:`to_scipy` (one product per column)."""
        self._check_dim(max_dim, "dense")
        A = self.whitened_matmat(torch.eye(self.dim, dtype=self.dtype, device=self.device))
        return 0.5 * (A + A.T)

    def _check_dim(self, max_dim: int, what: str) -> None:
        if self.dim > max_dim:
            raise ValueError(f"RiemannianHessian.{what} takes one product per dimension and the space has "
                             f"{self.dim} > max_dim={max_dim}; use trace('hutch++', n_probes=...) or "
                             "eigenvalues(k), or raise max_dim")

    def trace(self, method: str = "exact", n_probes: int = 99, seed: int = 0,
              max_dim: int = EXACT_MAX_DIM) -> TraceEstimate:
        """The trace of the Hessian on the horizontal space (docs/maths.md §14).

        ``"exact"``: ``Σ_i ⟨e_i, Hess e_i⟩_g`` over a g-orthonormal basis ``e_i = g^{-1/2} u_i``
        of the tangent space (``u_i`` the standard basis of the whitened coordinates; the
        vertical directions contribute 0), ``dim`` products.  ``"hutchinson"``: the mean of
        ``⟨z, Hess z⟩_g`` over ``n_probes`` probes ``z = P^h g^{-1/2} ε``, ε Rademacher, so
        that ``E[z ⊗ z]`` is the inverse metric on the horizontal space; ``"hutch++"``
        (Meyer et al. 2021): ``n_probes`` products in all, a third sketching the top of the
        spectrum exactly, a third for its range, a third for Hutchinson on the rest.  The
        standard error is the probes' sample standard deviation over √(number of probes)
        (0 for the exact trace).

        The estimators are :mod:`hideseek.estimators`' functions on :meth:`whitened` (any
        operator with ``matvec``/``matmat``/``shape`` takes them)."""
        if method not in TRACE_METHODS:
            raise ValueError(f"trace method must be one of {TRACE_METHODS}, got {method!r}")
        if method == "exact":
            self._check_dim(max_dim, "trace")
            return exact_trace(self.whitened(), block=self.chunk)
        return TRACE_ESTIMATORS[method](self.whitened(), n_probes=n_probes, seed=seed)

    def eigenvalues(self, k: int = 1, which: str = "LA", tol: float = 0.0, seed: int = 0):
        """The ``k`` eigenvalues of largest value (``which="LA"``; ``"SA"`` smallest, ``"LM"``
        largest magnitude — the vertical directions add zeros) by Lanczos
        (``scipy.sparse.linalg.eigsh`` on :meth:`to_scipy`), in descending order (NumPy):
        :func:`hideseek.estimators.lanczos_eigenvalues` on :meth:`whitened`."""
        return lanczos_eigenvalues(self.whitened(), k=k, which=which, tol=tol, seed=seed)


class WhitenedHessian:
    """The symmetric form ``A = g^{1/2} Hess g^{-1/2}`` of a :class:`RiemannianHessian` in
    flat whitened coordinates ``w = g^{1/2} ξ``, as an operator of :mod:`hideseek.estimators`
    (``shape``, ``dtype``, ``device``, ``matvec``, ``matmat``, ``to_scipy``): the same trace and
    non-zero eigenvalues as the Hessian, 0 on the vertical directions."""

    def __init__(self, hessian: "RiemannianHessian") -> None:
        self.hessian = hessian
        self.shape = (hessian.dim, hessian.dim)
        self.dtype, self.device = hessian.dtype, hessian.device

    def matvec(self, w: Tensor) -> Tensor:
        return self.hessian.whitened_matvec(w)

    def matmat(self, W: Tensor) -> Tensor:
        return self.hessian.whitened_matmat(W)

    def to_scipy(self):
        """:func:`hideseek.estimators.to_scipy` of this operator."""
        return to_scipy(self)


class EuclideanHessian(RiemannianHessian):
    """The plain Hessian ``∇²f`` of the same loss from the same code (the Euclidean geometry:
    identity metric, no connection, no projection), for comparison.

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False), torch.nn.Linear(2, 2, bias=False)).eval()
    >>> batch, mse = (torch.randn(16, 3), torch.randn(16, 2)), torch.nn.functional.mse_loss
    >>> H = hs.EuclideanHessian(model, [batch], loss_fn=mse)
    >>> def loss(flat):                                               # the same loss of the 10 weights
    ...     W0, W1 = flat[:6].reshape(2, 3), flat[6:].reshape(2, 2)
    ...     return mse(batch[0] @ W0.T @ W1.T, batch[1])
    >>> flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    >>> torch.allclose(H.dense(), torch.autograd.functional.hessian(loss, flat), atol=1e-5)   # dense, by autograd
    True
    """

    def __init__(self, model: nn.Module, batches: Iterable, *, loss_fn: Callable | None = None,
                 exclude: Sequence[str] = (), checks: bool = True, keep_graph: bool = False,
                 chunk: int | None = None) -> None:
        super().__init__(model, batches, Measure(geometry="euclidean"), loss_fn=loss_fn, exclude=exclude,
                         checks=checks, keep_graph=keep_graph, chunk=chunk)


__all__ = ["CHUNK", "CHUNK_MAX_DIM", "EXACT_MAX_DIM", "EuclideanHessian", "RiemannianHessian", "TangentMetric",
           "TraceEstimate", "WhitenedHessian"]
