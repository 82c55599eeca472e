r"""Quotient geometry of query/key pairs under rotary position embeddings, batched.

Rotary embeddings (RoPE) rotate each frequency pair of coordinates ``(i, j)`` of a query
and a key by a position-dependent angle, so a score is ``q R_{s−t} kᵀ`` and only the
``A ∈ GL(h)`` that commute with every rotation leave the model unchanged
(``docs/maths.md`` §12).  With distinct frequencies these are

    A = diag( a_1 I + c_1 J, …, a_p I + c_p J, A_free ),     J = [[0, −1], [1, 0]],

one 2×2 block per rotated pair (a copy of ``GL(1, ℂ)``) and a full ``GL(h − r)`` on the
``h − r`` columns that are not rotated (partial rotary; ``r = 2p``).  Its Lie algebra 𝔨
has dimension ``r + (h − r)²`` instead of ``h²``.

The invariant and mixed metrics of :mod:`hideseek.geometry.gl` are invariant under the
whole of GL(h), so under this subgroup too: metric, second-order geodesic step and the
metric dual of the Euclidean gradient are unchanged.  What changes is the vertical space,
now ``{(GΛ, −HΛᵀ) : Λ ∈ 𝔨}``, and with it the horizontal space (larger: it is orthogonal
to fewer directions) and the projection onto it.  The Riemannian gradient is the metric
dual projected onto *this* horizontal space (inherited
:meth:`~hideseek.geometry.gl.PairGeometry.egrad_to_rgrad` calls the overridden
:meth:`RotaryPairGeometry.project`).

Projection.  ``Pξ = ξ − (GΛ, −HΛᵀ)`` with ``Λ ∈ 𝔨`` solving the normal equations

    ⟨E, 𝒜(Λ)⟩_F = ⟨E, C(ξ)⟩_F   for every E ∈ 𝔨,

where, as in gl.py (``S̃ = S + εI``; the operators come from the metric object,
:meth:`hideseek.geometry.metrics.PairMetric.normal_operators`),

* invariant: ``𝒜(Λ) = S_G Λ S̃_G⁻¹ + S̃_H⁻¹ Λ S_H``, ``C(ξ) = Gᵀξ_G S̃_G⁻¹ − S̃_H⁻¹ξ_HᵀH``
  (``g(ξ, (GΛ, −HΛᵀ)) = ⟨C(ξ), Λ⟩_F`` and ``𝒜(Λ) = C(GΛ, −HΛᵀ)``: the exact projection of
  the ε-relaxed metric);
* mixed: ``𝒜(Λ) = 2 S̃_G Λ S̃_H``, ``C(ξ) = Gᵀξ_G S̃_H − S̃_G ξ_HᵀH`` (exact at ε = 0;
  at ε > 0 horizontal up to O(ε), like gl.py's explicit formula).

For 𝔨 = gl(h) these are gl.py's Sylvester equations, and the two projections agree.  The
unknowns split into the ``r`` rotary coordinates ``λ`` (basis ``E_a = e_ie_iᵀ + e_je_jᵀ``,
``E_c = e_je_iᵀ − e_ie_jᵀ`` per pair) and the free block ``Λ_F`` (``(h − r)²`` entries).
The free block alone is a generalised Sylvester equation ``A₁XB₁ + A₂XB₂ = C_F``, solved
with two generalised symmetric eigen-decompositions; the rotary coordinates then solve
the ``r × r`` Schur complement.  Everything that depends only on θ (eigen-decompositions,
Schur complement and its Cholesky factor) is computed once, in float64, so a projection
costs a few ``h × h`` matrix products per head.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .gl import PairGeometry
from .metrics import _generalised_eigh, _t

_CHUNK_ELEMENTS = 1 << 24   # bound on the (B, chunk, f, f) buffers of the set-up


def check_rotary_columns(h: int, rotary, rotary_free=None) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """Validate column pairs ``rotary`` and free columns ``rotary_free`` (``None`` or empty:
    the columns in no pair) of a head of width ``h``: together they must use every column once."""
    rot = tuple((int(i), int(j)) for i, j in rotary)
    used = [c for pair in rot for c in pair]
    free = tuple(int(c) for c in rotary_free) if rotary_free else \
        tuple(c for c in range(h) if c not in set(used))
    cols = sorted(used + list(free))
    if cols != list(range(h)):
        raise ValueError(f"rotary column pairs {rot} and free columns {free} must use each of the "
                         f"{h} columns of a head exactly once")
    return rot, free


def rotary_generators(h: int, rotary, dtype=None, device=None) -> Tensor:
    """The basis ``(2p, h, h)`` of the rotary part of 𝔨: ``E_a`` for every pair, then ``E_c``."""
    p = len(rotary)
    E = torch.zeros(2 * p, h, h, dtype=dtype, device=device)
    for k, (i, j) in enumerate(rotary):
        E[k, i, i] = E[k, j, j] = 1.0
        E[p + k, j, i], E[p + k, i, j] = 1.0, -1.0
    return E


def lie_algebra_projection(M: Tensor, rotary, rotary_free=None) -> Tensor:
    """Frobenius-orthogonal projection of ``(…, h, h)`` matrices onto 𝔨."""
    rot, free = check_rotary_columns(M.shape[-1], rotary, rotary_free)
    out = torch.zeros_like(M)
    if rot:
        i = torch.tensor([a for a, _ in rot], device=M.device)
        j = torch.tensor([b for _, b in rot], device=M.device)
        a = 0.5 * (M[..., i, i] + M[..., j, j])
        c = 0.5 * (M[..., j, i] - M[..., i, j])
        out[..., i, i], out[..., j, j] = a, a
        out[..., j, i], out[..., i, j] = c, -c
    if free:
        f = torch.tensor(free, device=M.device)
        out[..., f[:, None], f[None, :]] = M[..., f[:, None], f[None, :]]
    return out


def random_rotary_element(h: int, rotary, rotary_free=None, batch: tuple[int, ...] = (), *,
                          generator: torch.Generator | None = None, dtype=torch.float64,
                          log_scale: float = 0.5) -> Tensor:
    """A random element ``(*batch, h, h)`` of the rotary subgroup: each pair block
    ``r (cos φ I + sin φ J)`` with ``log r ~ U(−log_scale, log_scale)`` and ``φ ~ U(0, 2π)``;
    the free block ``exp``-like ``I + 0.3·N(0, 1)/√f`` (well conditioned)."""
    rot, free = check_rotary_columns(h, rotary, rotary_free)
    A = torch.zeros(*batch, h, h, dtype=dtype)
    for i, j in rot:
        u = torch.rand(2, *batch, generator=generator, dtype=dtype)
        r = torch.exp(log_scale * (2 * u[0] - 1))
        phi = 2 * torch.pi * u[1]
        a, c = r * torch.cos(phi), r * torch.sin(phi)
        A[..., i, i], A[..., j, j], A[..., j, i], A[..., i, j] = a, a, c, -c
    if free:
        f = torch.tensor(free)
        block = torch.eye(len(free), dtype=dtype) + 0.3 * torch.randn(
            *batch, len(free), len(free), generator=generator, dtype=dtype) / len(free) ** 0.5
        A[..., f[:, None], f[None, :]] = block
    return A


@dataclass
class RotaryPairGeometry(PairGeometry):
    """:class:`~hideseek.geometry.gl.PairGeometry` whose symmetry group is the rotary
    subgroup of GL(h) (module docstring).  Same interface; only the vertical and horizontal
    spaces, and so :meth:`project`, :meth:`horizontal_residual` and the Riemannian
    gradient, differ.

    Parameters
    ----------
    G, H, metric, eps:
        As for :class:`~hideseek.geometry.gl.PairGeometry`.
    rotary:
        Column pairs ``(i, j)`` of a head rotated together (the same for every head of the
        stack).
    rotary_free:
        Columns with the full GL (not rotated); ``None`` or empty: every column in no pair.
    """

    rotary: tuple[tuple[int, int], ...] = ()
    rotary_free: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        h = self.G.shape[-1]
        self.rotary, self.rotary_free = check_rotary_columns(h, self.rotary, self.rotary_free)
        dt, dev = self.G.dtype, self.G.device
        # 𝒜(Λ) = A₁ΛB₁ + A₂ΛB₂ and C = Gᵀξ N_G − N_H ξᵀH, float64, from the metric object
        ops, rhs = self.impl.normal_operators()
        self._E = rotary_generators(h, self.rotary, torch.float64, dev)
        # the two entries (row, column, value) of each generator, for the set-up's gathers
        ii = [i for i, _ in self.rotary]
        jj = [j for _, j in self.rotary]
        self._entries = (torch.tensor([[i, j] for i, j in zip(ii, jj)] + [[j, i] for i, j in zip(ii, jj)],
                                      dtype=torch.long, device=dev).reshape(-1, 2),
                         torch.tensor([[i, j] for i, j in zip(ii, jj)] + [[i, j] for i, j in zip(ii, jj)],
                                      dtype=torch.long, device=dev).reshape(-1, 2),
                         torch.tensor([[1.0, 1.0]] * len(ii) + [[1.0, -1.0]] * len(ii),
                                      dtype=torch.float64, device=dev).reshape(-1, 2))
        self._f = torch.tensor(self.rotary_free, dtype=torch.long, device=dev)
        f = self._f
        if len(f):
            blk = [X[..., f[:, None], f[None, :]] for X in ops]
            # A₁XB₁ + A₂XB₂ = C:  X = V [(Vᵀ C Z) ⊘ (d_i + e_j)] Zᵀ with A₁V = A₂V diag(d),
            # VᵀA₂V = I, B₂Z = B₁Z diag(e), ZᵀB₁Z = I.
            d, V = _generalised_eigh(blk[0], blk[2])
            e, Z = _generalised_eigh(blk[3], blk[1])
            inv_denom = 1.0 / (d.unsqueeze(-1) + e.unsqueeze(-2))
            self._fV, self._fZ, self._fden = V, Z, inv_denom
        if len(self.rotary):
            L, info = torch.linalg.cholesky_ex(self._schur(ops, inv_denom if len(f) else None))
            if bool((info != 0).any()):
                raise ValueError("the rotary projection's normal equations are singular: the weights of "
                                 "an attention head are rank deficient. Use eps > 0 or the adaptive measure.")
            self._schur_L = L
        cast = lambda x: x.to(dt)  # noqa: E731
        self._ops = tuple(cast(x) for x in ops)
        self._rhs = tuple(cast(x) for x in rhs)
        self._Ec = cast(self._E)
        if len(f):
            self._fV, self._fZ, self._fden = cast(self._fV), cast(self._fZ), cast(self._fden)
        if len(self.rotary):
            self._schur_L = cast(self._schur_L)

    def _schur(self, ops, inv_denom) -> Tensor:
        """Schur complement ``K_rr − K_rf K_ff⁻¹ K_fr`` (B, r, r) of the normal equations.

        Each generator ``E_k`` has two entries ``(p_kα, q_kα, v_kα)``, so
        ``⟨E_k, A E_l B⟩ = Σ_αβ v_kα v_lβ A[p_kα, p_lβ] B[q_lβ, q_kα]`` (gathers, O(r²));
        ``K_fr`` has columns ``(𝒜E_l)_FF = Σ_β v_lβ (A[F, p_lβ] B[q_lβ, F] + …)`` (outer
        products), solved against the free block in chunks of generators."""
        P, Q, v = self._entries
        A1, B1, A2, B2 = ops
        f = self._f
        r = P.shape[0]
        K = 0
        for a in range(2):
            for b in range(2):
                rows, cols = P[:, a][:, None], P[:, b][None, :]
                brow, bcol = Q[:, b][None, :], Q[:, a][:, None]
                K = K + (v[:, a][:, None] * v[:, b][None, :]) * (
                    A1[:, rows, cols] * B1[:, brow, bcol] + A2[:, rows, cols] * B2[:, brow, bcol])
        if len(f) == 0:
            return 0.5 * (K + _t(K))
        Bn, nf = A1.shape[0], len(f)
        chunk = max(1, _CHUNK_ELEMENTS // max(1, Bn * nf * nf))
        corr = []
        for s in range(0, r, chunk):
            sl = slice(s, s + chunk)
            Y = 0
            for b in range(2):
                pl, ql, vl = P[sl, b], Q[sl, b], v[sl, b]
                for A, Bm in ((A1, B1), (A2, B2)):
                    left = A[:, f][:, :, pl].transpose(1, 2)          # (B, c, f): A[F, p_l]
                    right = Bm[:, ql][:, :, f]                         # (B, c, f): B[q_l, F]
                    Y = Y + vl[:, None, None] * left.unsqueeze(-1) * right.unsqueeze(-2)
            W = self._solve_free(Y, self._fV, self._fZ, inv_denom)      # (B, c, f, f)
            c = 0
            for a in range(2):
                pk, qk, vk = P[:, a], Q[:, a], v[:, a]
                for A, Bm in ((A1, B1), (A2, B2)):
                    left = A[:, pk][:, :, f]                           # (B, r, f): A[p_k, F]
                    right = Bm[:, f][:, :, qk]                         # (B, f, r): B[F, q_k]
                    U = torch.einsum("bkf,blfg->bklg", left, W)
                    c = c + vk[:, None] * torch.einsum("bklg,bgk->bkl", U, right)
            corr.append(c)
        S = K - torch.cat(corr, dim=2)
        return 0.5 * (S + _t(S))

    # ----------------------------------------------------------------- pieces
    @staticmethod
    def _apply_op(Lam: Tensor, ops) -> Tensor:
        A1, B1, A2, B2 = (x.unsqueeze(-3) if Lam.dim() == 4 else x for x in ops)
        return A1 @ Lam @ B1 + A2 @ Lam @ B2

    def _free_block(self, M: Tensor) -> Tensor:
        f = self._f
        return M[..., f[:, None], f[None, :]]

    def _pad(self, W: Tensor) -> Tensor:
        h = self.G.shape[-1]
        out = W.new_zeros(*W.shape[:-2], h, h)
        f = self._f
        out[..., f[:, None], f[None, :]] = W
        return out

    @staticmethod
    def _solve_free(C: Tensor, V: Tensor, Z: Tensor, inv_denom: Tensor) -> Tensor:
        if C.dim() == 4:
            V, Z, inv_denom = V.unsqueeze(1), Z.unsqueeze(1), inv_denom.unsqueeze(1)
        return V @ ((_t(V) @ C @ Z) * inv_denom) @ _t(Z)

    def _coords(self, M: Tensor, E: Tensor | None = None) -> Tensor:
        """``⟨E_k, M⟩_F`` for every rotary generator: ``(…, r)``."""
        E = self._E if E is None else E
        return torch.einsum("kij,...ij->...k", E, M)

    # ------------------------------------------------------ vertical / horizontal
    def lie_algebra(self, M: Tensor) -> Tensor:
        """Frobenius-orthogonal projection of ``(B, h, h)`` matrices onto 𝔨."""
        return lie_algebra_projection(M, self.rotary, self.rotary_free)

    def _rhs_matrix(self, xG: Tensor, xH: Tensor) -> Tensor:
        NG, NH = self._rhs
        return _t(self.G) @ xG @ NG - NH @ _t(xH) @ self.H

    def horizontal_residual(self, xG: Tensor, xH: Tensor) -> Tensor:
        """The part in 𝔨 of the full-GL residual: ``R`` with ``g(ξ, vertical(Λ)) = ⟨R, Λ⟩_F``
        for every ``Λ ∈ 𝔨``.  ξ is horizontal (for this group) iff ``R = 0``."""
        return self.lie_algebra(super().horizontal_residual(xG, xH))

    def vertical_generator(self, xG: Tensor, xH: Tensor) -> Tensor:
        """``Λ ∈ 𝔨`` (B, h, h) of the vertical part ``(GΛ, −HΛᵀ)`` that :meth:`project` removes."""
        C = self._rhs_matrix(xG, xH)
        Lam = torch.zeros_like(C)
        Z = None
        if len(self._f):
            Z = self._solve_free(self._free_block(C), self._fV, self._fZ, self._fden)
        if len(self.rotary):
            b = self._coords(C, self._Ec)
            if Z is not None:
                b = b - self._coords(self._apply_op(self._pad(Z), self._ops), self._Ec)
            lam = torch.cholesky_solve(b.unsqueeze(-1), self._schur_L).squeeze(-1)
            Lam = torch.einsum("...k,kij->...ij", lam, self._Ec)
            if Z is not None:
                Z = Z - self._solve_free(self._free_block(self._apply_op(Lam, self._ops)),
                                         self._fV, self._fZ, self._fden)
        if Z is not None:
            Lam = Lam + self._pad(Z)
        return Lam

    def project(self, xG: Tensor, xH: Tensor) -> tuple[Tensor, Tensor]:
        """Orthogonal (in the metric) projection onto the horizontal space of the rotary
        subgroup: ``ξ − (GΛ, −HΛᵀ)`` with Λ from :meth:`vertical_generator`."""
        vG, vH = self.vertical(self.vertical_generator(xG, xH))
        return xG - vG, xH - vH
