"""Sharpness and SAM on two gloo ranks (issue 25, item 2): DDP and FSDP2 equal one process.

The tests spawn two processes on 127.0.0.1 (``benchmarks.bench_distributed.spawn``: a free
port, killed after a bounded time); each rank brings *its own* batches (rank 0 one, rank 1
three: the counts differ on purpose) and the reference is one process measuring all four
(or, for SAM, training on the concatenated batch), computed here, in the test's process.
Tiny Hugging Face BERT (``tests/models.py``), float64 unless said.

The four paths (DDP, the zoo under DDP, FSDP2, SAM under both) run in *one* pair of spawned
ranks (:func:`ranks`, once per test process: starting two processes that import torch and
transformers is most of the cost), each rank returning every path's results; each test then
checks its own path against its one-process reference.
"""
import functools
import warnings

import pytest

import torch

import hideseek as hs
from benchmarks.bench_distributed import spawn
from tests.models import bert_batch, tiny_bert

#: two spawned gloo ranks, once per test process: under ``make test`` (pytest-xdist, ``--dist loadfile``)
#: every test of this file runs in the same worker, so the ranks are spawned once
pytestmark = pytest.mark.slow

#: seconds after which the ranks are killed: a bound against a hang, not the expected time — on
#: an idle 2-core machine each test's ranks finish in well under a minute (most of it importing
#: torch and transformers in two fresh processes), but a machine shared by several jobs slows
#: two spawned processes down by an order of magnitude
TIMEOUT = 1200
MEASURES = [dict(measure="adaptive"), dict(metric="invariant"), dict(metric="mixed")]
KW = dict(rho=0.05, n_iters=3, seed=3, progress=False)
ZOO_RHOS = [0.05, 0.1]


def _batches():
    return [bert_batch(seed=s) for s in range(4)]


def _share(rank):
    b = _batches()
    return b[:1] if rank == 0 else b[1:]


def _plain(res):
    return dict(per_batch=res.per_batch, base=res.base_losses, value=res.value, parallel=res.parallel,
                world_size=res.world_size, combined=res.combined, batches_per_rank=res.batches_per_rank,
                collectives=res.collectives, n_perturbed=res.n_perturbed, pairs=len(res.pairs),
                restart_values=res.restart_values, norm_share=res.norm_share)


def _fsdp(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model.bert.encoder.layer:
        fully_shard(layer)
    fully_shard(model)
    return model


def _reference(measures, dtype=torch.float64, **extra):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return [hs.sharpness(tiny_bert(seed=1).to(dtype), _batches(), **KW, **kw, **extra) for kw in measures]


def _close(got, ref, tol, of_loss=False):
    """Per batch, sharpness and base loss within ``tol`` relative; ``of_loss``: relative to the
    batch's loss (float32: a sharpness value is a difference of two float32 losses, so summing
    in another order moves it by an ulp of the loss, ~1e-7 of it, not of the value)."""
    assert len(got["per_batch"]) == len(ref.per_batch) == 4
    scale = ref.base_losses * 2 if of_loss else [abs(v) for v in ref.per_batch + ref.base_losses]
    for a, b, c in zip(got["per_batch"] + got["base"], ref.per_batch + ref.base_losses, scale):
        assert abs(a - b) <= tol * max(abs(c), 1e-12), (got["per_batch"], ref.per_batch)


def _all_worker(rank, world):
    """Every path's worker, one after another in the same process group."""
    return {"ddp": _ddp_worker(rank, world), "zoo": _zoo_worker(rank, world),
            "fsdp": _fsdp_worker(rank, world), "sam": _sam_worker(rank, world)}


@functools.lru_cache(maxsize=1)
def _spawned():
    return spawn(_all_worker, 2, timeout=TIMEOUT)


@pytest.fixture
def ranks():
    """The two ranks' results of every path: spawned once per test process (cached, not a
    module fixture, which pytest may tear down and set up again between the module's tests)."""
    return _spawned()


# ---------------------------------------------------------------------------- data parallel
def _ddp_worker(rank, world):
    warnings.simplefilter("ignore")
    out = {}
    ddp = torch.nn.parallel.DistributedDataParallel(tiny_bert(seed=1))
    out["ddp"] = [_plain(hs.sharpness(ddp, _share(rank), **KW, **kw)) for kw in MEASURES]
    out["restarts"] = _plain(hs.sharpness(ddp, _share(rank), **KW, metric="mixed", restarts=2))
    plain = tiny_bert(seed=1)          # unwrapped, the same weights on both ranks: combined too
    out["unwrapped"] = _plain(hs.sharpness(plain, _share(rank), **KW, measure="adaptive"))
    out["alone"] = _plain(hs.sharpness(plain, _share(rank), **KW, measure="adaptive", distributed=False))
    out["zoo_alone"] = hs.sharpness_zoo([plain], _share(rank), **KW, measure="adaptive",
                                        distributed=False)[0].per_batch
    try:                               # different weights per rank: refused, on every rank
        hs.sharpness(tiny_bert(seed=rank), _share(rank), **KW, measure="adaptive")
        out["differ"] = "no error"
    except hs.SharpnessInputError as err:
        out["differ"] = str(err)
    return out


def test_ddp_equals_one_process_over_every_rank_batches(ranks):
    ranks = [r["ddp"] for r in ranks]
    refs = _reference(MEASURES)
    (restart_ref,) = _reference([dict(metric="mixed")], restarts=2)
    for r, out in enumerate(ranks):
        for got, ref in zip(out["ddp"], refs):
            _close(got, ref, 1e-10)
            assert (got["parallel"], got["world_size"], got["combined"]) == ("data", 2, True)
            assert got["batches_per_rank"] == [1, 3] and got["n_perturbed"] == ref.n_perturbed
            assert got["norm_share"] == pytest.approx(ref.norm_share, rel=1e-8)
            assert set(got["collectives"]) == {"all_gather_object"}
        _close(out["restarts"], restart_ref, 1e-10)
        got = [v for s in out["restarts"]["restart_values"] for v in s]
        assert got == pytest.approx([v for s in restart_ref.restart_values for v in s], rel=1e-10)
        _close(out["unwrapped"], refs[0], 1e-10)
        assert out["unwrapped"]["combined"] and out["unwrapped"]["parallel"] == "data"
        # distributed=False: this rank's own batches, not combined
        assert (out["alone"]["combined"], out["alone"]["world_size"]) == (False, 1)
        assert out["alone"]["per_batch"] == pytest.approx(refs[0].per_batch[:1] if r == 0 else refs[0].per_batch[1:],
                                                          rel=1e-10)
        assert "rank 1 holds other weights than rank 0" in out["differ"] and "\n" not in out["differ"]
        assert out["zoo_alone"] == pytest.approx(out["alone"]["per_batch"], rel=1e-10)


def _zoo_reference(measures):
    """One process, every batch: the zoo of the two members and, as an independent reference
    for the first member, ``hs.sharpness`` per radius."""
    zoo_kw = {k: v for k, v in KW.items() if k != "rho"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        zoo = [hs.sharpness_zoo([tiny_bert(seed=1), tiny_bert(seed=2)], _batches(), rho=ZOO_RHOS, restarts=2,
                                **zoo_kw, **kw) for kw in measures]
        single = [[hs.sharpness(tiny_bert(seed=1), _batches(), rho=rho, restarts=2, **zoo_kw, **kw)
                   for rho in ZOO_RHOS] for kw in measures]
    return zoo, single


def _zoo_worker(rank, world):
    """The zoo combines the ranks as hs.sharpness does: a DDP-wrapped and an unwrapped member,
    two radii, two starts (the restart's draw seeded by the batch's place among all batches)."""
    warnings.simplefilter("ignore")
    ddp = torch.nn.parallel.DistributedDataParallel(tiny_bert(seed=1))
    zoo_kw = {k: v for k, v in KW.items() if k != "rho"}
    return [[[_plain(r) for r in per] for per in hs.sharpness_zoo([ddp, tiny_bert(seed=2)], _share(rank),
                                                                   rho=ZOO_RHOS, restarts=2, **zoo_kw, **kw)]
            for kw in MEASURES]


def test_zoo_under_ddp_equals_one_process_over_every_rank_batches(ranks):
    """``hs.sharpness_zoo`` in a process group: every rank returns, per member and radius, the
    result over both ranks' batches — the same as one process running the zoo (and
    ``hs.sharpness``) over all four batches, restart values included."""
    ranks = [r["zoo"] for r in ranks]
    zoo, single = _zoo_reference(MEASURES)
    for out in ranks:
        assert len(out) == len(MEASURES)
        for got_m, ref_m, one in zip(out, zoo, single):
            assert len(got_m) == len(ref_m) == 2 and all(len(g) == len(ZOO_RHOS) for g in got_m)
            for got_member, ref_member in zip(got_m, ref_m):
                for got, ref in zip(got_member, ref_member):
                    _close(got, ref, 1e-10)
                    assert (got["parallel"], got["world_size"], got["combined"]) == ("data", 2, True)
                    assert got["batches_per_rank"] == [1, 3]
                    assert [v for s in got["restart_values"] for v in s] == pytest.approx(
                        [v for s in ref.restart_values for v in s], rel=1e-10)
            for got, ref in zip(got_m[0], one):
                _close(got, ref, 1e-10)


# ---------------------------------------------------------------------------- FSDP2
def _fsdp_worker(rank, world):
    warnings.simplefilter("ignore")
    model = _fsdp(tiny_bert(seed=1))
    out = {"f64": [_plain(hs.sharpness(model, _share(rank), **KW, **kw)) for kw in MEASURES]}
    out["f32"] = _plain(hs.sharpness(_fsdp(tiny_bert(seed=1).float()), _share(rank), **KW, metric="mixed"))
    out["average"] = _plain(hs.sharpness(model, _share(rank), **KW, metric="invariant", kind="average",
                                         n_samples=3))
    # the call leaves the shards and the parameters' own gradients as they were
    out["theta"] = {n: p.full_tensor() for n, p in model.named_parameters()}
    out["grads"] = [p.grad is None for p in model.parameters()]
    # a rank may bring no batch under FSDP2 (rank 0 brings all four here)
    out["rank0"] = _plain(hs.sharpness(model, _batches() if rank == 0 else [], **KW, measure="adaptive"))
    try:
        hs.sharpness(model, _share(rank), **KW, distributed=False)
        out["alone"] = "no error"
    except hs.SharpnessInputError as err:
        out["alone"] = str(err)
    try:                               # the zoo's stacked pass needs whole weights: refused
        hs.sharpness_zoo([model], _share(rank), **KW, measure="adaptive")
        out["zoo"] = "no error"
    except ValueError as err:
        out["zoo"] = str(err)
    return out


def test_fsdp2_equals_one_process_over_every_rank_batches(ranks):
    ranks = [r["fsdp"] for r in ranks]
    refs = _reference(MEASURES)
    (f32,) = _reference([dict(metric="mixed")], dtype=torch.float32)
    (avg,) = _reference([dict(metric="invariant", kind="average")], n_samples=3)
    theta = dict(tiny_bert(seed=1).named_parameters())
    for out in ranks:
        for got, ref in zip(out["f64"], refs):
            _close(got, ref, 1e-10)
            assert (got["parallel"], got["world_size"], got["combined"]) == ("sharded", 2, True)
            assert got["n_perturbed"] == ref.n_perturbed and got["pairs"] == len(ref.pairs)
            assert got["collectives"]["all_gather_object"] == 1           # the batches
            assert got["collectives"]["all_reduce_sum"] > 0                 # the free shards' norms
        assert "all_gather" not in out["f64"][0]["collectives"]            # adaptive: no pair gathered
        assert out["f64"][1]["collectives"]["all_gather"] > 0 and out["f64"][1]["pairs"] > 0
        assert out["f64"][0]["norm_share"] == {}                          # adaptive: not on shards
        for got, ref in zip(out["f64"][1:], refs[1:]):                     # geodesic: the pairs' share
            assert got["norm_share"] == pytest.approx(ref.norm_share, rel=1e-8) and ref.norm_share
        _close(out["f32"], f32, 1e-5, of_loss=True)
        _close(out["average"], avg, 1e-10)
        _close(out["rank0"], refs[0], 1e-10)
        assert out["rank0"]["batches_per_rank"] == [4, 0]
        assert all(torch.equal(out["theta"][n], p.detach()) for n, p in theta.items())
        assert all(out["grads"])
        assert "FSDP2 shards" in out["alone"]
        assert "cannot measure FSDP2" in out["zoo"] and "hs.sharpness per model" in out["zoo"]
        assert "\n" not in out["zoo"]


# ---------------------------------------------------------------------------- SAM
SAM_MEASURES = [dict(geometry="euclidean"), dict(geometry="adaptive"), dict(metric="mixed")]


def _sam_data(batches):
    x = {k: torch.cat([b[0][k] for b in batches]) for k in batches[0][0]}
    return x, torch.cat([b[1] for b in batches])


def _train(model, module, data, measure, steps=2):
    sam = hs.optim.SAM(model, torch.optim.SGD, hs.Measure(**measure), rho=0.05, lr=0.1)
    x, y = data
    for _ in range(steps):
        # both passes synchronise (DDP's all-reduce, FSDP2's reduce-scatter): the ascent is
        # taken from the gradient over every rank's batch
        torch.nn.functional.cross_entropy(model(**x).logits, y).backward()
        sam.first_step(zero_grad=True)
        torch.nn.functional.cross_entropy(model(**x).logits, y).backward()
        sam.second_step(zero_grad=True)
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone())
            for n, p in module.named_parameters()}


def _sam_worker(rank, world):
    warnings.simplefilter("ignore")
    mine = _sam_data([bert_batch(seed=rank)])        # equal sizes: the mean of the ranks' means
    out = {}
    for i, m in enumerate(SAM_MEASURES):
        module = tiny_bert(seed=1)
        out["ddp", i] = _train(torch.nn.parallel.DistributedDataParallel(module), module, mine, m)
        module = _fsdp(tiny_bert(seed=1))
        out["fsdp", i] = _train(module, module, mine, m)
    # FSDP2 without the first pass's reduce-scatter: refused, saying why
    module = _fsdp(tiny_bert(seed=1))
    sam = hs.optim.SAM(module, torch.optim.SGD, "euclidean", rho=0.05, lr=0.1)
    module.set_requires_gradient_sync(False)
    torch.nn.functional.cross_entropy(module(**mine[0]).logits, mine[1]).backward()
    try:
        sam.first_step()
        out["unsynced"] = "no error"
    except RuntimeError as err:
        out["unsynced"] = str(err)
    return out


def test_sam_under_ddp_and_fsdp2_equals_one_process_on_all_the_data(ranks):
    ranks = [r["sam"] for r in ranks]
    start = {n: p.detach() for n, p in tiny_bert(seed=1).named_parameters()}
    data = _sam_data([bert_batch(seed=0), bert_batch(seed=1)])
    for i, m in enumerate(SAM_MEASURES):
        module = tiny_bert(seed=1)
        ref = _train(module, module, data, m)
        moved = max(float((ref[n] - p).abs().max()) for n, p in start.items())
        assert moved > 1e-3                  # the steps moved the weights
        for out in ranks:
            for mode in ("ddp", "fsdp"):
                got = out[mode, i]
                err = max(float((got[n] - ref[n]).abs().max()) for n in ref)
                assert err < 1e-12 * max(1.0, moved), (mode, m, err)
    for out in ranks:
        assert "set_requires_gradient_sync(False)" in out["unsynced"]
