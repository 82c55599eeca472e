"""hideseek.optim.SAM under DistributedDataParallel: 2 CPU processes on gloo.

First pass under ``no_sync`` (no all-reduce): each process ascends along its own shard's
gradient, the second pass all-reduces the gradients at the perturbed points — the same
weights as one process that does this per shard of the concatenated batch.  Without
``no_sync`` the ascent uses the all-reduced gradient: plain SAM on the concatenated batch."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import hideseek as hs
from tests.conftest import mha_batches
from tests.models import MHAClassifier

STEPS, LR, RHO = 2, 0.1, 0.05
MEASURES = ("euclidean", "geodesic_mixed")


def _data():
    x, y = mha_batches(1, size=8, seed=3)[0]
    return list(zip(x.chunk(2), y.chunk(2))), (x, y)


def _worker(rank, init_file, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        shards, _ = _data()
        x, y = shards[rank]
        result = {}
        for measure in MEASURES:
            for sync_first in (False, True):
                model = DDP(MHAClassifier())
                sam = hs.optim.SAM(model, torch.optim.SGD, measure, rho=RHO, lr=LR)
                for _ in range(STEPS):
                    if sync_first:
                        F.cross_entropy(model(x), y).backward()
                    else:
                        with model.no_sync():
                            F.cross_entropy(model(x), y).backward()
                    sam.first_step(zero_grad=True)
                    F.cross_entropy(model(x), y).backward()
                    sam.second_step(zero_grad=True)
                result[measure, sync_first] = [p.detach().clone() for p in model.module.parameters()]
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _per_shard_reference(measure, shards):
    model = MHAClassifier()
    sam = hs.optim.SAM(model, torch.optim.SGD, measure, rho=RHO, lr=LR)
    for _ in range(STEPS):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for x, y in shards:
            F.cross_entropy(model(x), y).backward()
            sam.first_step(zero_grad=True)
            F.cross_entropy(model(x), y).backward()
            sam.restore()
            for t, p in zip(total, model.parameters()):
                t += p.grad / len(shards)
            sam.zero_grad()
        for t, p in zip(total, model.parameters()):
            p.grad = t
        sam.base_optimizer.step()
        sam.zero_grad()
    return list(model.parameters())


def _full_batch_reference(measure, x, y):
    model = MHAClassifier()
    sam = hs.optim.SAM(model, torch.optim.SGD, measure, rho=RHO, lr=LR)
    for _ in range(STEPS):
        F.cross_entropy(model(x), y).backward()
        sam.step(lambda: F.cross_entropy(model(x), y).backward())
        sam.zero_grad()
    return list(model.parameters())


@pytest.mark.slow
def test_ddp_gloo_two_processes_equal_one_process(tmp_path):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path / "weights"
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(out)), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    shards, (x, y) = _data()
    for measure in MEASURES:
        refs = {False: _per_shard_reference(measure, shards), True: _full_batch_reference(measure, x, y)}
        for sync_first, ref in refs.items():
            for a, b, r in zip(ranks[0][measure, sync_first], ranks[1][measure, sync_first], ref):
                assert torch.equal(a, b)                                    # replicas agree
                assert torch.allclose(a, r.detach(), rtol=0, atol=1e-12)   # = one process
        # and the two recipes differ (the first pass's all-reduce matters)
        assert any(not torch.allclose(a, b) for a, b in zip(ranks[0][measure, False], ranks[0][measure, True]))
