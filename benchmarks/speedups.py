"""Prototype of proposed speed-ups of the Auto-PGD loop, applied by monkeypatching (no core
file is edited), with the evidence: time per iteration of the search's geometry, and
end-to-end sharpness, before and after, and the sharpness values before and after.

The proposals (for ``hideseek/geometry/space.py`` and ``hideseek/solvers/apgd.py``):

1. ``ProductGeometry.__init__`` records, per free parameter, whether any ``c = |θ|`` is
   exactly zero (no tensor-sized state).  For the tensors without zeros (nearly all of a
   trained model's) ``sqnorm`` is one fused division and one fused norm instead of two
   ``where``, a division, a square and a sum; ``rgrad`` is ``(g ⊙ c) ⊙ c`` in place instead
   of allocating ``c²``; ``project`` skips ``torch.where``.
2. ``_foreach`` kernels over the lists (``_foreach_mul``, ``_foreach_norm``,
   ``_foreach_add``, ``_foreach_div``): one dispatch per list instead of one per tensor.
3. ``ball(x, rho, project=False)`` inside Auto-PGD: every vector ``ball`` receives there is a
   linear combination of allowed (horizontal) vectors, so the second and third horizontal
   projections per iteration are redundant.  (Already applied in the core by commit
   69b1c7d; the "current" timings below include it.)
4. The momentum update ``x + α(z − x) + (1 − α)(x − x_prev)`` as
   ``(2 − 2α) x + α z − (1 − α) x_prev``: three fused list operations instead of six
   element-wise passes.

5. ``PairGeometry.project`` (invariant) and ``PairGeometry.acceleration`` (both metrics)
   with their matrix chains re-associated so that every product with an ``n × h`` factor
   meets an ``h × h`` one (``A @ (B @ C)`` where ``B @ C`` is ``h × h``), and ``ξᵀG`` computed
   once for ``ξᵀG + Gᵀξ``: per head, 8 instead of 14 (invariant) or 12 (mixed) products of
   size ``n h²`` in the acceleration, 4 instead of 7 in the invariant projection.

``python -m benchmarks.speedups`` prints the tables quoted in ``reports/benchmarks.md``.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "benchmarks"

import torch  # noqa: E402

import hideseek as hs  # noqa: E402
from hideseek.geometry.gl import PairGeometry  # noqa: E402
from hideseek.geometry.space import ProductGeometry  # noqa: E402
from hideseek.solvers.apgd import SolverResult, apgd_checkpoints  # noqa: E402

from .models import MODELS, build, make_batches  # noqa: E402


# ----------------------------------------------------------------- patched geometry
def _init_extra(self) -> None:
    # which free parameters have exact zeros (their adaptive scale vanishes there); no
    # tensor-sized state is added
    self._has_zero = [bool((c == 0).any()) for c in self.c_free]
    self._nz = [i for i, z in enumerate(self._has_zero) if not z]
    self._z = [i for i, z in enumerate(self._has_zero) if z]


def _sqnorm(self, x):
    pair_x, free_x = self._split(x)
    parts = []
    for i, (pg, (xG, xH)) in enumerate(zip(self.pairs, pair_x)):
        if self.norm == "riemannian":
            parts.append(pg.sqnorm(xG, xH).sum())
        else:
            cG, cH = self.c_pairs[i]
            parts.append((xG / cG).square().sum() + (xH / cH).square().sum())
    if self._nz:   # no zeros: ‖ξ ⊘ c‖ with one fused division and one fused norm
        q = torch._foreach_div([free_x[i] for i in self._nz], [self.c_free[i] for i in self._nz])
        parts += [n.square() for n in torch._foreach_norm(q)]
    for i in self._z:
        c = self.c_free[i]
        parts.append(torch.where(c > 0, free_x[i] / torch.where(c > 0, c, 1), 0).square().sum())
    if not parts:
        return torch.zeros((), dtype=self.dtype, device=self.device)
    return torch.stack(parts).sum()


def _project(self, x):
    pair_x, free_x = self._split(x)
    out = []
    for pg, (xG, xH) in zip(self.pairs, pair_x):
        out += list(pg.project(xG, xH))
    return out + [torch.where(c > 0, xi, 0) if z else xi
                  for xi, c, z in zip(free_x, self.c_free, self._has_zero)]


def _rgrad(self, egrad):
    pair_g, free_g = self._split(egrad)
    out = []
    for i, (pg, (gG, gH)) in enumerate(zip(self.pairs, pair_g)):
        if self.norm == "riemannian":
            out += list(pg.egrad_to_rgrad(gG, gH))
        else:
            cG, cH = self.c_pairs[i]
            out += list(pg.project(cG.square() * gG, cH.square() * gH))
    if not free_g:
        return out
    r = list(torch._foreach_mul(free_g, self.c_free))
    torch._foreach_mul_(r, self.c_free)
    return out + r


def _make_direction(orig):
    def direction(self, egrad):
        if self.p == "linf":
            return orig(self, egrad)
        r = self.rgrad(egrad)
        n = self.sqnorm(r).sqrt()
        n = torch.where(n > 0, n, torch.ones_like(n))
        return list(torch._foreach_div(r, n))
    return direction


def _make_ball(orig):
    def ball(self, x, rho, project=True):
        if self.p == "linf":
            return orig(self, x, rho)
        if project:
            x = self.project(x)
        n = self.sqnorm(x).sqrt()
        scale = torch.where(n > rho, rho / n, torch.ones_like(n))
        return list(torch._foreach_mul(x, scale))
    return ball


# ------------------------------------------------------------- re-associated chains
def _t(x):
    return x.transpose(-1, -2)


def _make_pair_project(orig):
    def project(self, xG, xH):
        if self.metric != "invariant":
            return orig(self, xG, xH)
        Y = (self._VAi @ (_t(xG) @ self._Gp) - (_t(self._Hp) @ xH) @ self._VB) * self._inv_denom
        return xG - self._GVBit @ (_t(Y) @ self._VAt), xH + self._HVA @ (Y @ self._VBi)
    return project


def _pair_acceleration(self, xG, xH):
    G, H = self.G, self.H
    M, N = _t(xG) @ G, _t(xH) @ H          # h × h; Gᵀξ_G = Mᵀ
    if self.metric == "invariant":
        aG = xG @ (self.SGi @ (M + _t(M))) - G @ (self.SGi @ (_t(xG) @ xG))
        aH = xH @ (self.SHi @ (N + _t(N))) - H @ (self.SHi @ (_t(xH) @ xH))
        return aG, aH
    aG = G @ ((_t(xH) @ xH) @ self.SHi) - xG @ ((N + _t(N)) @ self.SHi)
    aH = H @ ((_t(xG) @ xG) @ self.SGi) - xH @ ((M + _t(M)) @ self.SGi)
    return aG, aH


# --------------------------------------------------------------------- patched apgd
def apgd_fast(objective, geometry, rho, n_iters=20, *, f0=None, x0=None, alpha=0.75, rho_frac=0.75):
    """``hideseek.solvers.apgd.apgd`` with proposals 3 and 4 (same schedule, same result up to
    rounding)."""
    t0 = time.perf_counter()
    x = geometry.zeros() if x0 is None else geometry.ball(x0, rho)
    f, g = objective(x)
    base = float(f) if x0 is None else (float(f0) if f0 is not None else None)
    if base is None:
        base = float(objective(geometry.zeros())[0])
    f_val = float(f)
    history = [f_val]
    best_val, best_x, best_g = f_val, x, g
    checkpoints = set(apgd_checkpoints(n_iters))
    eta = 2.0 * rho
    steps = [eta]
    x_prev = x
    increases, last_ckpt = 0, 0
    eta_last, best_last = eta, best_val
    for k in range(n_iters):
        d = geometry.direction(g)
        z = geometry.ball(list(torch._foreach_add(x, d, alpha=eta)), rho, project=False)
        if k == 0:
            x_new = z
        else:
            m = list(torch._foreach_mul(x, 2.0 - 2.0 * alpha))
            torch._foreach_add_(m, z, alpha=alpha)
            torch._foreach_add_(m, x_prev, alpha=-(1.0 - alpha))
            x_new = geometry.ball(m, rho, project=False)
        f_new, g_new = objective(x_new)
        fv = float(f_new)
        history.append(fv)
        if fv > f_val:
            increases += 1
        x_prev, x, f_val, g = x, x_new, fv, g_new
        if fv > best_val:
            best_val, best_x, best_g = fv, x_new, g_new
        if (k + 1) in checkpoints:
            n_steps = k + 1 - last_ckpt
            stalled = increases < rho_frac * n_steps
            unchanged = eta == eta_last and best_val == best_last
            if stalled or unchanged:
                eta /= 2.0
                x, x_prev, f_val, g = best_x, best_x, best_val, best_g
            increases, last_ckpt = 0, k + 1
            eta_last, best_last = eta, best_val
        steps.append(eta)
    return SolverResult(best_val - base, base, [t.detach() for t in best_x], history, steps,
                        n_iters + 1, time.perf_counter() - t0)


@contextlib.contextmanager
def patched():
    """All five proposals, applied to the library for the duration of the block."""
    core = sys.modules["hideseek.sharpness"]
    saved = {k: getattr(ProductGeometry, k) for k in ("__init__", "sqnorm", "project", "rgrad",
                                                       "direction", "ball")}
    saved_apgd = core.apgd
    saved_pair = {k: getattr(PairGeometry, k) for k in ("project", "acceleration")}
    orig_init = saved["__init__"]

    def __init__(self, *a, **kw):
        orig_init(self, *a, **kw)
        _init_extra(self)

    ProductGeometry.__init__ = __init__
    ProductGeometry.sqnorm = _sqnorm
    ProductGeometry.project = _project
    ProductGeometry.rgrad = _rgrad
    ProductGeometry.direction = _make_direction(saved["direction"])
    ProductGeometry.ball = _make_ball(saved["ball"])
    core.apgd = apgd_fast
    PairGeometry.project = _make_pair_project(saved_pair["project"])
    PairGeometry.acceleration = _pair_acceleration
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(ProductGeometry, k, v)
        for k, v in saved_pair.items():
            setattr(PairGeometry, k, v)
        core.apgd = saved_apgd


# ----------------------------------------------------------------------- evidence
def _geometry(model, metric):
    params = {n: p.detach() for n, p in model.named_parameters()}
    blocks = [] if metric is None else hs.find_symmetries(model)
    return ProductGeometry(params, blocks, metric=metric or "invariant")


def geometry_iteration_seconds(model, metric, repeats=5, rho=0.1, seed=0, fast=False):
    """Median wall time of the geometry of one Auto-PGD iteration (after the first): the
    direction, the step into the ball, the momentum combination and its ball — everything
    but the forward and backward pass.  ``metric=None`` for adaptive."""
    geom = _geometry(model, metric)
    g = torch.Generator().manual_seed(seed)
    egrad = [torch.randn(t.shape, generator=g) for t in geom.zeros()]
    x = geom.ball([rho * 0.5 * t for t in geom.random_direction(g)], rho)
    x_prev = geom.zeros()
    eta, alpha = 2 * rho, 0.75

    def once():
        d = geom.direction(egrad)
        if fast:
            z = geom.ball(list(torch._foreach_add(x, d, alpha=eta)), rho, project=False)
            m = list(torch._foreach_mul(x, 2.0 - 2.0 * alpha))
            torch._foreach_add_(m, z, alpha=alpha)
            torch._foreach_add_(m, x_prev, alpha=-(1.0 - alpha))
            return geom.ball(m, rho, project=False)
        # as hideseek.solvers.apgd does it now (it already skips the redundant projections)
        z = geom.ball([1.0 * a + eta * b for a, b in zip(x, d)], rho, project=False)
        return geom.ball([xi + alpha * (zi - xi) + (1 - alpha) * (xi - pi)
                          for xi, zi, pi in zip(x, z, x_prev)], rho, project=False)

    once()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        once()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def pair_ops_table(repeats: int = 5) -> str:
    """Projection and geodesic acceleration (forward, and forward + backward) on the 144
    query/key pairs of a BERT-base (769 × 64), current vs re-associated (proposal 5)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    bert = BertModel(BertConfig()).eval()
    params = {n: p.detach() for n, p in bert.named_parameters()}
    Gs, Hs = [], []
    for blk in hs.find_symmetries(bert):
        (G, H), _ = blk.split({n: params[n] for n in blk.param_names})
        Gs.append(G)
        Hs.append(H)
    G, H = torch.cat(Gs), torch.cat(Hs)
    del bert, params
    g = torch.Generator().manual_seed(1)
    xG, xH = torch.randn(G.shape, generator=g) * 0.02, torch.randn(H.shape, generator=g) * 0.02

    def med(fn):
        fn()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    def acc_fb(pg):
        a, b = xG.clone().requires_grad_(), xH.clone().requires_grad_()
        aG, aH = pg.acceleration(a, b)
        torch.autograd.grad((aG * G).sum() + (aH * H).sum(), [a, b])

    rows = ["| op (144 pairs 769×64, float32) | metric | current (s) | re-associated (s) | max rel. diff |",
            "|---|---|---|---|---|"]
    for metric in ("invariant", "mixed"):
        pg = PairGeometry(G, H, metric)
        ops = [("project", lambda: pg.project(xG, xH)),
               ("acceleration", lambda: pg.acceleration(xG, xH)),
               ("acceleration fwd+bwd", lambda: acc_fb(pg))]
        for name, fn in ops:
            cur = med(fn)
            ref = fn() if name != "acceleration fwd+bwd" else None
            with patched():
                new = med(fn)
                out = fn() if name != "acceleration fwd+bwd" else None
            diff = "–" if ref is None else f"{max(float((u - v).abs().max() / u.abs().max()) for u, v in zip(ref, out)):.1e}"
            rows.append(f"| {name} | {metric} | {cur:.3f} | {new:.3f} | {diff} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.speedups", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="small-bert,small-vit,bert-base")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--end-to-end", default="small-bert,small-vit",
                    help="models for the end-to-end comparison (20 iterations, cpu defaults)")
    ap.add_argument("--no-pair-ops", dest="pair_ops", action="store_false",
                    help="skip the BERT-base pair-operation table")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    measures = {"adaptive": None, "geodesic_invariant": "invariant", "geodesic_mixed": "mixed"}
    if args.pair_ops:
        print("Pair operations, seconds, median:\n")
        print(pair_ops_table(args.repeats) + "\n", flush=True)

    print("Geometry of one Auto-PGD iteration (direction + two balls + momentum), seconds, median:\n")
    print("| model | measure | current | proposed | saving |\n|---|---|---|---|---|")
    for name in [m for m in args.models.split(",") if m]:
        model = build(name)
        for meas, metric in measures.items():
            base = geometry_iteration_seconds(model, metric, args.repeats)
            with patched():
                fast = geometry_iteration_seconds(model, metric, args.repeats, fast=True)
            print(f"| {name} | {meas} | {base:.4f} | {fast:.4f} | {100 * (1 - fast / base):.0f} % |",
                  flush=True)
        del model

    print("\nEnd to end (hs.sharpness, 20 iterations, cpu default batches), seconds, median of "
          f"{args.repeats} interleaved runs, and the sharpness values:\n")
    print("| model | measure | current (s) | proposed (s) | saving | value current | value proposed |")
    print("|---|---|---|---|---|---|---|")
    kw = {"adaptive": dict(measure="m_apgd_l2"),
          "geodesic_invariant": dict(measure="geodesic", metric="invariant"),
          "geodesic_mixed": dict(measure="geodesic", metric="mixed")}
    for name in [m for m in args.end_to_end.split(",") if m]:
        spec = MODELS[name]
        d = spec.defaults["cpu"]
        model = build(name)
        batches = make_batches(spec, d["batch_size"], 1, d.get("seq_len", 128))
        for meas, k in kw.items():
            tb, tf = [], []
            run = lambda: hs.sharpness(model, batches, rho=0.1, n_iters=20, progress=False, **k)  # noqa: E731
            run()
            with patched():
                run()
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                vb = run().value
                tb.append(time.perf_counter() - t0)
                with patched():
                    t0 = time.perf_counter()
                    vf = run().value
                    tf.append(time.perf_counter() - t0)
            b, f = statistics.median(tb), statistics.median(tf)
            print(f"| {name} | {meas} | {b:.3f} | {f:.3f} | {100 * (1 - f / b):.0f} % | {vb:.6g} | {vf:.6g} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
