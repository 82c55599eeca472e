"""Sharpness under FSDP2: memory per rank, in copies of the local shard (issue 25, item 2).

Spawns ``--world`` gloo processes on 127.0.0.1 (CPU), shards a model with
``torch.distributed.fsdp.fully_shard`` (each layer, then the root) and measures one
``hs.sharpness`` call per measure on each rank: the peak bytes of CPU tensors alive during
the call above those alive at its start (:class:`TensorPeak`: ``torch.profiler``'s allocation
records, the CPU allocator's running total), divided by the bytes of this rank's shard of the
parameters: **copies of the local shard**.  ``--world 1`` is one process without sharding.
The peak includes what FSDP2 itself gathers during a pass (a layer's weights; the root's —
embeddings, pooler, classifier — for the whole pass) and the activations; ``floor_copies``
is the same for one forward and backward pass (what training holds).  (Peak resident memory
was tried first: at this model size gloo's and FSDP2's fixed buffers and the allocator's
slack dominate it, tens of "copies" that say nothing about the search; so did summing the
operators' own memory, which FSDP2's annotations count twice.)

The GL(h) pairs' parameters are gathered whole on every rank
(:class:`hideseek.distributed.ShardedModel`), so their part does not shrink with the ranks:
:func:`copies_model` fits the measured peaks as copies of the shard plus copies of the
pairs, and :func:`per_rank_gib` turns the fit into GiB per rank for the Llama 3 family's
sizes and attention shares (the table of docs/distributed.md).

    python -m benchmarks.bench_distributed --world 2 --world 4          # writes the JSON
    python -m benchmarks.bench_distributed --readme                     # docs/distributed.md + report blocks

Also the launcher the tests use (:func:`spawn`: ``world`` gloo processes, a free port, a
bounded time).
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # ``python benchmarks/bench_distributed.py``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "distributed_memory.json"
#: the page whose generated block holds the memory table (the site's "Several ranks")
PAGE = ROOT / "docs" / "distributed.md"
REPORT = ROOT / "reports" / "benchmarks.md"
MEASURES = ("m_apgd_l2", "geodesic_mixed")


# ---------------------------------------------------------------------------- launcher
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world: int, port: int, out: str, args: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    with open(Path(out) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)


def spawn(fn: Callable, world: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes joined in one gloo group
    on 127.0.0.1 (a free port); their return values in rank order.  Processes still running
    after ``timeout`` seconds are killed and ``TimeoutError`` is raised."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_entry, args=(fn, world, free_port(), out, args), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{world} ranks did not finish within {timeout:g} s")
        results = []
        for r in range(world):
            with open(Path(out) / f"rank{r}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results


# ---------------------------------------------------------------------------- the model
def bench_model(seed: int = 0):
    """A small BERT (float32, 0.6 M parameters): 2 layers, width 128, 4 heads, a 2000-token
    vocabulary.  The accounting counts tensors exactly, so the size only sets the share of
    activations and of FSDP2's gathered units."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=2000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=256, max_position_embeddings=64, num_labels=3)
    return transformers.BertForSequenceClassification(cfg).eval()


def bench_batches(n: int = 1, rows: int = 4, length: int = 16):
    import torch

    out = []
    for s in range(n):
        g = torch.Generator().manual_seed(100 + s)
        out.append(({"input_ids": torch.randint(0, 2000, (rows, length), generator=g)},
                    torch.randint(0, 3, (rows,), generator=g)))
    return out


N_ITERS = 2


class TensorPeak:
    """Peak bytes of CPU tensors alive during a block above those alive when it starts:
    ``torch.profiler`` with ``profile_memory=True`` records every allocation and free of
    torch's CPU allocator with the allocator's running total (``total_allocated``); the peak
    is that total's maximum over the block less its value at the start.  Allocations outside
    torch (gloo's own buffers, Python objects) are not counted."""

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        from torch._C._profiler import _EventType

        self.prof.__exit__(*exc)
        rows, stack = [], list(self.prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
                rows.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.total_allocated))
            stack.extend(e.children)
        rows.sort(key=lambda r: r[0])
        base = rows[0][2] - rows[0][1] if rows else 0
        self.peak = max((t for _, _, t in rows), default=base) - base
        self.end = (rows[-1][2] - base) if rows else 0
        return False


def measure_rank(rank: int, world: int, n_iters: int = N_ITERS) -> dict:
    """On one rank (``world == 1``: one process, no sharding): the peak bytes of each
    measure's call above the model, in copies of this rank's shard of the perturbed
    parameters, and how much of those parameters the pairs hold."""
    import warnings

    import torch

    import hideseek as hs

    torch.set_num_threads(1)
    model = bench_model()
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.bert.encoder.layer:
            fully_shard(layer)
        fully_shard(model)
    blocks = hs.find_symmetries(model)
    in_pairs = {n for b in blocks for n in b.param_names}
    local = {n: (p.to_local() if hasattr(p, "to_local") else p) for n, p in model.named_parameters()}
    shard_elems = sum(t.numel() for t in local.values())
    pair_elems = sum(p.numel() for n, p in model.named_parameters() if n in in_pairs)      # whole
    total_elems = sum(p.numel() for p in model.parameters())
    batches = bench_batches()
    mine = batches if rank == 0 else []     # under FSDP2 rank 0 brings the batch, the others none
    out = dict(world=world, rank=rank, shard_elements=shard_elems, pair_elements=pair_elems,
               total_elements=total_elems, measures={})
    x, y = batches[0]
    with TensorPeak() as floor:            # what training holds: one forward and backward pass
        torch.nn.functional.cross_entropy(model(**x).logits, y).backward()
        model.zero_grad(set_to_none=True)
    out["floor_copies"] = floor.peak / (4 * shard_elems)
    for name in MEASURES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with TensorPeak() as probe:
                res = hs.sharpness(model, mine, name, rho=0.05, n_iters=n_iters, progress=False, checks=False)
        peak = probe.peak
        out["measures"][name] = dict(peak_bytes=peak, copies=peak / (4 * shard_elems),
                                     value=res.value, per_batch=res.per_batch, collectives=res.collectives,
                                     parallel=res.parallel)
    return out


def run(worlds: list[int], rows: dict | None = None) -> dict:
    """Measure each world size (added to ``rows``, the ones measured before, and written
    after each, so that a long run keeps what it has)."""
    rows = dict(rows or {})
    for w in worlds:
        t0 = time.perf_counter()
        ranks = [measure_rank(0, 1)] if w == 1 else spawn(measure_rank, w, timeout=1800)
        rows[str(w)] = ranks
        print(f"world {w}: {time.perf_counter() - t0:.0f} s", flush=True)
        _save(_document(rows))
    return _document(rows)


def _save(data: dict) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")


def _document(rows: dict) -> dict:
    return dict(model="BERT 2 layers, width 128, 4 heads, vocabulary 2000, float32 (0.6 M parameters)",
                batches="one batch of 4 x 16 tokens, brought by rank 0 (the other ranks bring none)",
                n_iters=N_ITERS, accounting="peak bytes of CPU tensors alive during the call above those alive at its "
                                      "start (torch.profiler allocation records: the CPU allocator's running total; "
                                      "gloo's own buffers not included), divided by 4 bytes x this rank's shard of "
                                      "the parameters; the batch's maximiser, which the result keeps "
                                      "(SharpnessResult.solver), included",
                worlds=dict(sorted(rows.items(), key=lambda kv: int(kv[0]))))


# ---------------------------------------------------------------------------- tables
SIZES = {"1 B": 1e9, "8 B": 8e9, "70 B": 70e9}
#: attention's share of the parameters of the Llama 3 family at these sizes, from their public
#: configurations (q, k, v, o per layer over all parameters; 1 B: Llama 3.2 1B, d 2048, 16
#: layers, 8 KV heads of 64; 8 B: Llama 3.1 8B, d 4096, 32 layers, 8 KV heads of 128; 70 B:
#: Llama 3.1 70B, d 8192, 80 layers, 8 KV heads of 128): the pairs gathered whole
ATTENTION_SHARE = {"1 B": 16 * (2 * 2048 * 2048 + 2 * 2048 * 512) / 1.236e9,
                   "8 B": 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024) / 8.03e9,
                   "70 B": 80 * (2 * 8192 * 8192 + 2 * 8192 * 1024) / 70.6e9}
RANKS = (1, 8, 64)


def copies_model(data: dict) -> dict[str, dict[str, float]]:
    """Per measure, copies of the free parameters' local shard (``a``) and of the whole
    pairs (``b``) that fit what the call holds beyond a training step's forward and backward
    pass (the measured peak less the floor's: FSDP2's gathered units and the activations are
    training's too), ``a · F + b · P`` with ``F`` this rank's
    elements outside pairs (its shard minus its share of the pairs) and ``P`` the pairs'
    elements, by least squares over every rank of every world size measured; the adaptive
    measure gathers no pair: ``peak = a · shard``."""
    import numpy as np

    out = {}
    for name in MEASURES:
        A, y = [], []
        for ranks in data["worlds"].values():
            for r in ranks:
                free = r["shard_elements"] - r["pair_elements"] / r["world"]
                A.append([r["shard_elements"], 0.0] if name == "m_apgd_l2" else [free, r["pair_elements"]])
                y.append(r["measures"][name]["peak_bytes"] / 4 - r["floor_copies"] * r["shard_elements"])
        A, y = np.array(A, dtype=float), np.array(y, dtype=float)
        if name == "m_apgd_l2":
            out[name] = dict(shard=float(np.linalg.lstsq(A[:, :1], y, rcond=None)[0][0]), pairs=0.0)
        else:
            a, b = np.linalg.lstsq(A, y, rcond=None)[0]
            out[name] = dict(shard=float(a), pairs=float(b))
    return out


def per_rank_gib(name: str, size: str, ranks: int, fit: dict) -> float:
    """GiB per rank that a float32 model of ``size`` parameters holds during one call beyond a
    training step's pass, by :func:`copies_model`'s fit: the model's own shard (``N / ranks``), ``a`` copies of the
    free parameters' shard and ``b`` copies of the pairs, gathered whole (attention's share
    :data:`ATTENTION_SHARE`; the adaptive measure: ``a`` copies of the shard, no pairs)."""
    n = SIZES[size]
    if name == "m_apgd_l2":
        elems = n / ranks * (1 + fit[name]["shard"])
    else:
        pairs = n * ATTENTION_SHARE[size]
        elems = n / ranks + fit[name]["shard"] * (n - pairs) / ranks + fit[name]["pairs"] * pairs
    return 4 * elems / 2 ** 30


def _gib(v: float) -> str:
    return f"{v:.1f} GiB" if v < 10 else f"{v:.0f} GiB"


def measured_table(data: dict) -> str:
    lines = ["| ranks | measure | copies of the local shard (peak, per rank) | parallel | collectives (rank 0) |",
             "|---:|---|---:|---|---|"]
    for w, ranks in data["worlds"].items():
        fl = [r["floor_copies"] for r in ranks]
        lines.append(f"| {w} | floor (one forward + backward) | {min(fl):.2f}–{max(fl):.2f} | – | FSDP2's own |"
                     if len(fl) > 1 else f"| {w} | floor (one forward + backward) | {fl[0]:.2f} | – | – |")
        for name in MEASURES:
            cps = [r["measures"][name]["copies"] for r in ranks]
            m0 = ranks[0]["measures"][name]
            coll = ", ".join(f"{k} {v}" for k, v in sorted(m0["collectives"].items())) or "none"
            lines.append(f"| {w} | {name} | {min(cps):.2f}–{max(cps):.2f} | {m0['parallel']} | {coll} |"
                         if len(cps) > 1 else f"| {w} | {name} | {cps[0]:.2f} | {m0['parallel']} | {coll} |")
    return "\n".join(lines)


def scale_table(data: dict) -> str:
    fit = copies_model(data)
    head = "| measure | model | " + " | ".join(f"{r} rank{'s' if r > 1 else ''}" for r in RANKS) + " |"
    lines = [head, "|---|---|" + "---:|" * len(RANKS)]
    for name in MEASURES:
        for size in SIZES:
            cells = " | ".join(_gib(per_rank_gib(name, size, r, fit)) for r in RANKS)
            lines.append(f"| {name} | {size} | {cells} |")
    fits = "; ".join(f"{n}: {f['shard']:.2f} × the free shard + {f['pairs']:.2f} × the whole pairs" for n, f in fit.items())
    return "\n".join(lines) + (f"\n\nFitted copies beside the model's own shard, over what one forward and backward "
                                f"pass holds (least squares over every rank of 1, 2 and 4 ranks; one batch, whose maximiser "
                                f"the result keeps; each further batch keeps one more, `SharpnessResult.solver`): {fits}. The pairs are "
                                "gathered whole on every rank, so the geodesic measures' attention part does not "
                                "shrink with the ranks; FSDP2's own gathered units and the activations (the floor) "
                                "come on top, as for training.")


BEGIN, END = "<!-- distributed-memory:begin -->", "<!-- distributed-memory:end -->"


def _replace_block(path: Path, body: str) -> None:
    text = path.read_text()
    block = f"{BEGIN}\n{body}\n{END}"
    if BEGIN in text:
        a, b = text.index(BEGIN), text.index(END) + len(END)
        text = text[:a] + block + text[b:]
    else:
        raise SystemExit(f"{path}: no {BEGIN} … {END} block to fill")
    path.write_text(text)


def readme_blocks(data: dict) -> tuple[str, str]:
    src = "generated by `python -m benchmarks.bench_distributed --readme` from `benchmarks/results/distributed_memory.json`"
    readme = ("Memory per rank of one call under FSDP2, float32 weights, in GiB (" + src + "): the model's own "
              "shard plus the copies of the local shard and of the gathered attention pairs that the call holds "
              "beyond a training step's pass, measured on 1, 2 and 4 gloo ranks (tensor allocations, "
              "`reports/benchmarks.md`) and scaled to the Llama 3 family's sizes and attention shares; "
              "activations and FSDP2's gathered units come on top, as for training.\n\n" + scale_table(data))
    report = ("Measured on " + data["model"] + ", " + data["batches"] + ", " + str(data["n_iters"])
              + " iterations; " + data["accounting"] + " (" + src + ").\n\n" + measured_table(data)
              + "\n\n" + scale_table(data))
    return readme, report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, action="append", help="ranks (repeat; 1 = one process)")
    ap.add_argument("--readme", action="store_true", help="write the blocks of docs/distributed.md and reports/benchmarks.md from the JSON")
    args = ap.parse_args(argv)
    if args.world:
        before = json.loads(RESULTS.read_text())["worlds"] if RESULTS.is_file() else {}
        data = run(sorted(set(args.world)), before)
        print(measured_table(data))
    if args.readme:
        data = json.loads(RESULTS.read_text())
        readme, report = readme_blocks(data)
        _replace_block(PAGE, readme)
        _replace_block(REPORT, report)
        print(readme)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
