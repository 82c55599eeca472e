"""Issue 6: what the fast paths of a sharpness call must not change.

* Auto-PGD's start on the first batch reuses the set-up gradient pass (pulled back to the
  perturbation space); it must equal the gradient autograd gives through the model.
* The Auto-PGD loop synchronises with the host once per iteration (the step-size schedule
  compares objective values) and nowhere else.
* Mixed precision (``autocast``) keeps the geometry in float32 and moves the values by
  little (tolerances measured on these models, stated below).
"""
import ctypes
import os
import warnings

import pytest
import torch

import hideseek as hs
from hideseek.geometry.space import ProductGeometry
from hideseek.symmetries.discover import find_symmetries
from hideseek.utils import HostSyncCounter
from benchmarks.bench_sharpness import auto_pgd_syncs
from torch.func import functional_call

from tests.models import MHAClassifier, bert_batch, tiny_bert

MEASURES = [dict(measure="adaptive"), dict(metric="invariant"), dict(metric="mixed"),
            dict(metric="invariant", christoffel=False), dict(metric="mixed", norm="adaptive")]


def _mha_batch(seed=0, n=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, 12, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


@pytest.mark.parametrize("metric", ["invariant", "mixed"])
@pytest.mark.parametrize("norm,christoffel", [("riemannian", True), ("riemannian", False), ("adaptive", True)])
def test_pullback_is_the_gradient_at_zero(metric, norm, christoffel):
    model = tiny_bert(seed=3)
    x, y = bert_batch(seed=1)
    params = {n: p.detach() for n, p in model.named_parameters()}
    geom = ProductGeometry(params, find_symmetries(model), metric=metric, norm=norm, christoffel=christoffel)

    def loss(ps):
        return torch.nn.functional.cross_entropy(functional_call(model, ps, (), x).logits, y)

    # reference: autograd through the geodesic step and the model at xi = 0
    z = [t.requires_grad_(True) for t in geom.zeros()]
    ref = torch.autograd.grad(loss(geom.point(z)), z, allow_unused=True)
    leaves = {n: t.clone().requires_grad_(True) for n, t in params.items()}
    gp = torch.autograd.grad(loss(leaves), list(leaves.values()), allow_unused=True)
    got = geom.pullback({n: g for n, g in zip(leaves, gp) if g is not None})
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        b = torch.zeros_like(a) if b is None else b
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kw", MEASURES, ids=lambda kw: "-".join(map(str, kw.values())))
def test_first_batch_reuses_the_setup_pass(kw):
    """The same batch twice: the first search starts from the set-up pass, the second from
    its own gradient evaluation; both must find the same value with one evaluation less."""
    model = MHAClassifier()
    b = _mha_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = hs.sharpness(model, [b, b], rho=0.05, n_iters=8, progress=False, **kw)
    assert res.per_batch[0] == pytest.approx(res.per_batch[1], rel=1e-10, abs=1e-14)
    assert res.base_losses[0] == pytest.approx(res.base_losses[1], rel=1e-12)
    assert [s.n_evals for s in res.solver] == [8, 9]
    assert res.solver[0].history == pytest.approx(res.solver[1].history, rel=1e-10)


@pytest.mark.parametrize("kw", MEASURES, ids=lambda kw: "-".join(map(str, kw.values())))
def test_apgd_syncs_with_the_host_once_per_iteration(kw):
    # the model (nn.MultiheadAttention on float64, no masks) has no host syncs of its own
    n_iters = 9

    def run(callback):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            hs.sharpness(MHAClassifier(), [_mha_batch(0), _mha_batch(1)], rho=0.05, n_iters=n_iters,
                         progress=False, callback=callback, **kw)

    # one per iteration: the schedule compares values
    assert auto_pgd_syncs(run) == [{"hideseek": n_iters, "other": 0}] * 2


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_freed_heap_memory_is_given_back():
    """Blocks freed inside glibc's heap (below its mmap threshold, not at the top) stay
    resident until ``release_freed_memory`` (``malloc_trim``) hands them back."""
    from hideseek.utils import _malloc_trim, release_freed_memory
    if _malloc_trim() is None:
        assert release_freed_memory() is False
        pytest.skip("no glibc malloc_trim here")
    if not os.path.exists("/proc/self/statm"):
        pytest.skip("no /proc here to read the resident memory")
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, n = 64 << 10, 800                        # 50 MiB in 64 KiB blocks: all in the heap
    blocks = [libc.malloc(size) for _ in range(n)]
    for b in blocks:
        ctypes.memset(b, 1, size)
    keep = libc.malloc(size)                       # above them: the heap's top is not free
    for b in blocks:
        libc.free(b)
    before = _rss()
    assert release_freed_memory() is True
    after = _rss()
    libc.free(keep)
    assert before - after > 0.8 * size * n


def test_the_counter_sees_syncs_and_their_origin():
    with HostSyncCounter() as c:
        t = torch.ones(3)
        float(t.sum()), bool(t.any()), t.tolist(), t.sum().item(), int(t[0])
        t.sum(), t * 2                                          # no sync
    assert c.counts == {"hideseek": 0, "other": 5}
    from hideseek.geometry.space import _floor_scale            # one float() inside hideseek
    with HostSyncCounter() as c:
        _floor_scale(torch.rand(4))
    assert c.counts == {"hideseek": 1, "other": 0}


def test_a_model_with_syncs_is_seen_as_other():
    class Branchy(torch.nn.Module):      # a data-dependent branch: one host sync per forward
        def __init__(self):
            super().__init__()
            self.inner = MHAClassifier()

        def forward(self, x):
            return self.inner(x) if bool(x.sum() > -1e9) else -self.inner(x)

    model = Branchy().eval()
    n_iters = 4
    with HostSyncCounter() as c:
        res = hs.sharpness(model, [_mha_batch()], measure="adaptive", rho=0.01, n_iters=n_iters,
                           progress=False)
    n_forward = res.solver[0].n_evals + 2           # the search, the set-up pass and the check
    assert c.counts["other"] == n_forward
    assert c.counts["hideseek"] > n_iters


# Tolerances measured on this model (10 iterations, 2 batches of 16): bfloat16 moved the
# values by at most 4.2 %, float16 by at most 0.5 %.
@pytest.mark.parametrize("dtype,rtol", [("bfloat16", 0.10), ("float16", 0.02)])
@pytest.mark.parametrize("kw,rho", [(dict(measure="adaptive"), 0.5), (dict(metric="invariant"), 0.1),
                                    (dict(metric="mixed"), 0.1)])
def test_autocast_agrees_with_full_precision(dtype, rtol, kw, rho):
    model = tiny_bert().float().eval()
    batches = [bert_batch(seed=s, n=16) for s in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        full = hs.sharpness(model, batches, rho=rho, n_iters=10, progress=False, **kw)
        amp = hs.sharpness(model, batches, rho=rho, n_iters=10, progress=False, autocast=dtype, **kw)
    assert amp.config["autocast"] == dtype and full.config["autocast"] is None
    assert amp.value == pytest.approx(full.value, rel=rtol)
    assert amp.value != full.value          # autocast really ran in low precision
    assert all(t.dtype == torch.float32 for t in amp.solver[0].best)   # geometry stays float32


def test_autocast_errors():
    with pytest.raises(ValueError, match="autocast must be"):
        hs.sharpness(tiny_bert().float(), [bert_batch()], rho=0.1, autocast="int8", progress=False)
    with pytest.raises(ValueError, match="float32 model"):
        hs.sharpness(tiny_bert(), [bert_batch()], rho=0.1, autocast="bfloat16", progress=False)
