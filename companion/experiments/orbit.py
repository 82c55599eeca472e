"""Sharpness along a symmetry orbit (camera-ready Fig. 7, "orbit invariance").

One language model, one batch.  Every attention pair ``(G, H)`` of the model (per head,
Q/K and V/O) is moved to ``(G A, H A⁻ᵀ)`` with ``A = a·N``: ``N`` a standard Gaussian
``h × h`` matrix drawn once per head and pair (fixed seed; almost surely invertible), ``a``
a scale from 10⁻² to 10² (docs/maths.md §1.1).  The model computes
the same function at every point of this orbit; the figure shows sharpness after / before:
adaptive sharpness moves, geodesic sharpness stays at 1 up to the solver's arithmetic.

Every sharpness call starts Auto-PGD from ξ = 0 with the same seed, so the search on the
transformed model is the image of the search on the original one under the group action
(the metrics, the horizontal projection and the geodesic step are equivariant): the
geodesic ratio differs from 1 only by rounding, amplified by the conditioning of ``A``.
Adaptive sharpness's elementwise ball ``‖δ ⊘ |θ|‖`` is invariant under the scalar part
``a`` (Q scaled by ``a``, K by ``1/a``, each entry alike), so what moves it is ``N``: its
ratio differs from 1 by the same amount at every ``a`` for one draw of ``N``.
"""
from __future__ import annotations

import copy
import time
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor, nn

import hideseek as hs
from companion.experiments.zoo import STANDARD
from hideseek.symmetries import find_symmetries

#: The measures of the figure: adaptive beside the two geodesic ones (the paper's three).
ORBIT_MEASURES: dict[str, hs.Measure] = STANDARD


def draw_head_matrices(model: nn.Module, seed: int = 0) -> list[list[Tensor]]:
    """One standard Gaussian ``h × h`` matrix per head and pair, in the order of
    :func:`hideseek.find_symmetries` (block, then pair group): ``[[N of shape (count, h, h)]]``."""
    gen = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    out = []
    for blk in find_symmetries(model):
        out.append([torch.randn(G.shape[0], G.shape[-1], G.shape[-1], generator=gen, dtype=torch.float64)
                    for G, _ in blk.split({n: params[n] for n in blk.param_names})])
    return out


@torch.no_grad()
def act_on_heads(model: nn.Module, scale: float, matrices: Sequence[Sequence[Tensor]]) -> nn.Module:
    """In place: every pair ``(G, H) → (G A, H A⁻ᵀ)`` with ``A = scale · N`` (``N`` from
    :func:`draw_head_matrices` on the same architecture).  Computed in float64."""
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    params = dict(model.named_parameters())
    blocks = find_symmetries(model)
    if len(blocks) != len(matrices):
        raise ValueError(f"{len(matrices)} sets of matrices for {len(blocks)} attention blocks; draw "
                         "them with draw_head_matrices on this architecture")
    for blk, Ns in zip(blocks, matrices):
        pairs = blk.split({n: params[n] for n in blk.param_names})
        new = []
        for (G, H), N in zip(pairs, Ns):
            A = scale * N.to(G.device)
            G64, H64 = G.double(), H.double()
            new.append(((G64 @ A).to(G.dtype), (H64 @ torch.linalg.inv(A).transpose(-1, -2)).to(H.dtype)))
        for name, value in blk.merge(new).items():
            params[name].copy_(value)
    return model


def _logits(model, x):
    out = model(**x) if isinstance(x, Mapping) else model(x)
    return out.logits if hasattr(out, "logits") else out


def orbit_ratios(model: nn.Module, batch: tuple[Any, Tensor], scales: Sequence[float],
                 rho: Mapping[str, float], *, measures: Mapping[str, hs.Measure] | None = None,
                 n_iters: int = 20, seed: int = 0, action_seeds: Sequence[int] = (0,),
                 progress: bool = False):
    """Sharpness of ``model`` on ``batch`` before and after the action ``A = a·N`` per head.

    Returns a DataFrame with one row per (action seed, scale, measure): ``value`` (after),
    ``before``, ``ratio`` = after / before, and ``max_logit_change`` (how far the action moved
    the logits: rounding only, the function is unchanged).
    """
    import pandas as pd

    measures = dict(measures or ORBIT_MEASURES)
    missing = set(measures) - set(rho)
    if missing:
        raise ValueError(f"rho has no radius for measures {sorted(missing)}")
    model = model.eval()
    x, y = batch
    logits0 = _logits(model, x).detach()

    def measure(m, k):
        return hs.sharpness(m, [(x, y)], measures[k], rho=float(rho[k]), n_iters=n_iters, seed=seed,
                            progress=False).value

    before = {k: measure(model, k) for k in measures}
    rows = []
    it = [(s, a) for s in action_seeds for a in scales]
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(it, desc="orbit")
    for aseed, a in it:
        Ns = draw_head_matrices(model, seed=aseed)
        moved = act_on_heads(copy.deepcopy(model), float(a), Ns)
        with torch.no_grad():
            change = float((_logits(moved, x) - logits0).abs().max() / logits0.abs().max())
        for k in measures:
            t0 = time.perf_counter()
            v = measure(moved, k)
            rows.append(dict(action_seed=aseed, scale=float(a), measure=k, value=v, before=before[k],
                             ratio=v / before[k] if before[k] else float("nan"), max_logit_change=change,
                             seconds=time.perf_counter() - t0))
    return pd.DataFrame(rows)


def summarise(frame) -> Any:
    """Per measure: the ratios' range and their largest distance from 1 (log scale)."""
    g = frame.assign(log_dev=np.abs(np.log(frame["ratio"]))).groupby("measure")
    return g.agg(ratio_min=("ratio", "min"), ratio_max=("ratio", "max"),
                 max_abs_log_ratio=("log_dev", "max"), max_logit_change=("max_logit_change", "max"))


def run_orbit(zoo_dir: str, name: str, batch: tuple[Any, Tensor], *, scales: Sequence[float],
              rho: Mapping[str, float], n_iters: int, seed: int, action_seeds: Sequence[int], dtype: str,
              device: str, progress: bool = False):
    """The figure's data for the member ``name`` of a trained language zoo on ``batch`` (the first
    sharpness batch); ``dtype`` ``"float64"`` separates the solver's invariance from float32
    rounding, which the conditioning of ``A`` amplifies (``"float32"``: the zoo's)."""
    from companion.experiments import language_zoo as lz

    dtypes = {"float32": torch.float32, "float64": torch.float64}
    if dtype not in dtypes:
        raise ValueError(f"orbit dtype must be 'float32' or 'float64', got {dtype!r}")
    model = lz.source(zoo_dir).loaders([name], device)[0][1]().to(dtypes[dtype])
    return orbit_ratios(model, batch, [float(a) for a in scales], rho, n_iters=n_iters, seed=seed,
                        action_seeds=[int(a) for a in action_seeds], progress=progress).assign(model=name, dtype=dtype)
