"""Smoke tests of the benchmark code path (benchmarks/bench_sharpness.py) on tiny models.

No timing is asserted anywhere: timings depend on the machine and its load.  What is checked
is that the benchmark measures the real thing (the same sharpness values as a direct call),
counts passes correctly, attributes time without double counting, leaves the library as it
found it, and that its scipy comparison of the projection is right.
"""
from __future__ import annotations

import importlib
import json
import math

import pytest
import torch

import hideseek as hs
from benchmarks import bench_sharpness as bench
from benchmarks.models import MODELS, build, make_batches


def _task(measure, model="tiny-bert", **kw):
    base = dict(batch_size=3, n_iters=2, seq_len=5, repeats=1, threads=1)
    base.update(kw)
    return bench.Task(model=model, measure=measure, **base)


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.slow
@pytest.mark.parametrize("measure", list(bench.MEASURES))
def test_run_task_in_process(measure):
    task = _task(measure, n_batches=2)
    r = bench.run_task(task)
    assert len(r.seconds) == 1 and all(math.isfinite(s) and s > 0 for s in r.seconds)
    if measure == "floor":
        assert r.n_evals == task.n_batches * task.n_iters
        assert r.value is None and r.syncs is None
        return
    # host syncs inside Auto-PGD's loops: ours one per iteration; the tiny HF BERT checks its
    # attention mask on the host in each forward pass (model's own)
    assert r.syncs["hideseek"] == task.n_batches * task.n_iters
    # Auto-PGD: n_iters + 1 gradient evaluations per batch, plus the set-up's gradient pass,
    # which is also the first batch's starting point (one evaluation less there)
    assert r.n_evals == task.n_batches * (task.n_iters + 1)
    assert 0 < r.loop_median <= r.median
    # the benchmark measures what a user gets from a direct call
    model = build(task.model, seed=task.seed)
    batches = make_batches(MODELS[task.model], task.batch_size, task.n_batches, task.seq_len,
                           seed=task.seed)
    direct = hs.sharpness(model, batches, bench.MEASURES[measure], rho=task.rho, n_iters=task.n_iters,
                          seed=task.seed, progress=False)
    assert r.value == pytest.approx(direct.value, rel=1e-6, abs=1e-9)
    assert r.value >= 0  # the start is a candidate, so worst-case sharpness is never negative
    # attribution: every component non-negative (no double counting), forward and backward seen
    assert set(r.attribution) == set(bench.ATTRIBUTION)
    assert all(v >= 0 for v in r.attribution.values()), r.attribution
    assert r.attribution["forward (model)"] > 0 and r.attribution["backward (autograd)"] > 0
    if measure.startswith("geodesic"):
        assert r.attribution["geodesic step + merge"] > 0


def test_attribution_patches_nothing_and_stops_its_profiler():
    from torch._C._autograd import _profiler_enabled

    from hideseek.geometry.space import ProductGeometry
    core = importlib.import_module("hideseek.engine.engine")     # the engine behind hs.sharpness
    problem = importlib.import_module("hideseek.engine.problem").SharpnessProblem
    inputs = importlib.import_module("hideseek.inputs")
    before = (torch.autograd.grad, core.apgd, inputs.functional_call, ProductGeometry.point,
              ProductGeometry.direction, ProductGeometry.ball, problem.run)
    with pytest.raises(RuntimeError, match="boom"):
        with bench.Attribution(torch.device("cpu")):
            assert _profiler_enabled()
            inside = (torch.autograd.grad, core.apgd, inputs.functional_call, ProductGeometry.point,
                      ProductGeometry.direction, ProductGeometry.ball, problem.run)
            raise RuntimeError("boom")
    assert not _profiler_enabled()
    assert all(a is b for a, b in zip(before, inside))


@pytest.mark.slow
def test_fresh_process_memory_and_image_model():
    r = bench.run_fresh(_task("floor", model="tiny-vit", attribute=False))
    assert r.peak_bytes > 0            # a fresh process must allocate activations and grads
    assert r.memory_method
    assert r.n_evals == 2


def test_projection_agrees_with_scipy_on_a_small_bert():
    cfg = dict(hidden_size=24, num_hidden_layers=2, num_attention_heads=3, intermediate_size=32,
               vocab_size=50, max_position_embeddings=16)
    p = bench.bench_projection("cpu", repeats=1, calls=1, scipy_repeats=1, bert_config=cfg)
    assert p["pairs"] == 2 * 3 and p["shape_G"] == [25, 8]
    assert p["max_rel_diff_vs_scipy_float64"] < 1e-9
    assert p["max_rel_diff_vs_scipy_float32"] < 1e-3
    assert p["scipy_residual_rel"] < 1e-9 and p["invariant_float64_residual_rel"] < 1e-9
    assert p["invariant_float32_residual_rel"] < 1e-3
    assert "projection" in bench.projection_table(p)


@pytest.mark.slow
def test_cli_in_process_writes_tables(tmp_path):
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    rc = bench.main(["--models", "tiny-bert", "--measures", "floor,adaptive,geodesic_mixed",
                     "--in-process", "--projection", "no", "--threads", "1", "--device", "cpu",
                     "--json", str(out), "--markdown", str(md)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert [r["task"]["measure"] for r in data["results"]] == ["floor", "adaptive", "geodesic_mixed"]
    assert data["machine"]["torch"] == torch.__version__
    text = md.read_text()
    assert text.count("| tiny-bert |") == 3 + 2   # results rows + attribution rows
    assert "geodesic_mixed" in text


@pytest.mark.parametrize("kw, msg", [(dict(model="nope"), "unknown model"),
                                     (dict(measure="nope"), "unknown measure"),
                                     (dict(batch_size=0), "batch_size"),
                                     (dict(rho=0.0), "rho")])
def test_task_validation(kw, msg):
    args = dict(model="tiny-bert", measure="floor", batch_size=2, n_iters=1)
    args.update(kw)
    with pytest.raises(ValueError, match=msg):
        bench.Task(**args)


def test_seq_len_beyond_positions_is_refused():
    with pytest.raises(ValueError, match="max_position_embeddings"):
        bench.run_task(_task("floor", seq_len=10_000))


@pytest.mark.slow
@pytest.mark.parametrize("measure", ["floor", "geodesic_invariant"])
def test_run_task_under_autocast(measure):
    r = bench.run_task(_task(measure, autocast="bfloat16"))
    full = bench.run_task(_task(measure))
    assert r.n_evals == full.n_evals
    if measure != "floor":
        assert r.value == pytest.approx(full.value, rel=0.1) and r.value != full.value
    assert "bfloat16" in bench.results_table([r])


def test_a_model_whose_package_is_missing_stops_the_run_before_any_measurement(monkeypatch, tmp_path):
    """An image without open_clip must fail in one line at the start, not after the first model's results."""
    import sys
    monkeypatch.setitem(sys.modules, "open_clip", None)       # import open_clip -> ModuleNotFoundError
    ran = []
    monkeypatch.setattr(bench, "run_task", lambda task: ran.append(task))
    with pytest.raises(SystemExit, match="'vit-b32' needs the package 'open_clip'"):
        bench.main(["--models", "tiny-bert,vit-b32", "--measures", "floor", "--in-process", "--projection", "no",
                    "--device", "cpu", "--json", str(tmp_path / "r.json")])
    assert ran == [] and not (tmp_path / "r.json").exists()
