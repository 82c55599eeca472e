"""GPU checks (issue 17), run by ``make gpu-check``; skipped without CUDA.

* the zoo pass equals separate calls on the GPU;
* bfloat16 autocast stays close to full precision on the GPU;
* the memory of one call in parameter copies (``torch.cuda.max_memory_allocated``) stays
  within the issue's bound of 5 with ``low_memory=True``.
"""
import warnings

import pytest
import torch

import hideseek as hs
from benchmarks.models import MODELS, build, make_batches

from tests.models import bert_batch, tiny_bert

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make gpu-check)")]
CUDA = torch.device("cuda")


def _to(b):
    x, y = b
    return ({k: v.to(CUDA) for k, v in x.items()} if isinstance(x, dict) else x.to(CUDA)), y.to(CUDA)


def test_zoo_equals_separate_calls_on_cuda():
    models = [tiny_bert(seed=s).to(CUDA) for s in range(3)]
    batches = [_to(bert_batch(seed=s)) for s in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        rows = hs.sharpness_zoo(models, batches, metric="mixed", rho=[0.05, 0.2], n_iters=6)
        for m, row in zip(models, rows):
            for rho, res in zip([0.05, 0.2], row):
                ref = hs.sharpness(m, batches, metric="mixed", rho=rho, n_iters=6, progress=False)
                assert res.per_batch == pytest.approx(ref.per_batch, rel=1e-8, abs=1e-12)


@pytest.mark.parametrize("kw", [dict(measure="adaptive"), dict(metric="mixed")], ids=["adaptive", "mixed"])
def test_bfloat16_autocast_on_cuda(kw):
    model = build("small-bert").to(CUDA)
    batches = [_to(b) for b in make_batches(MODELS["small-bert"], 32, 2, seq_len=32)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        full = hs.sharpness(model, batches, rho=0.1, n_iters=10, progress=False, **kw)
        amp = hs.sharpness(model, batches, rho=0.1, n_iters=10, progress=False, autocast="bfloat16", **kw)
    assert amp.config["autocast"] == "bfloat16"
    assert amp.resolution is not None and amp.resolution > 0
    # The contract (README, "bf16 bases"): a bfloat16 value is either within tolerance of full precision
    # or flagged below the forward pass's resolution, with a warning naming it -- never a silent quantised
    # number. On an H200 the adaptive value (about 8e-4) lies below bf16's resolution (about 2e-3) and is
    # flagged; the mixed geodesic value (about 3e-2) is above it and within 2 % (benchmarks/results/h200_logs).
    if amp.below_resolution:
        assert abs(amp.value) < amp.resolution
        assert any("below the resolution" in str(w.message) for w in caught)
    else:
        assert abs(amp.value) >= amp.resolution
        assert amp.value == pytest.approx(full.value, rel=0.15)
    assert all(t.dtype == torch.float32 for t in amp.solver[0].best)


@pytest.mark.parametrize("measure", ["adaptive_l2", "geodesic_mixed"])
def test_memory_in_copies_on_cuda(measure):
    from benchmarks.bench_memory import run_one
    r = run_one("minilm-shape", measure, 4, 32, 5, device="cuda", low_memory=True)
    assert r.copies <= 5.0, f"{measure}: {r.copies:.2f} parameter copies"
